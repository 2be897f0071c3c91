"""The GPU guard (gpu_guard.py): `unfit` on simulated readings, its agreement with the page rules, `decide`, the
reason in Envoy's route, and the guard against a real etcd, Envoy and control loop.

Simulated: there is no GPU here. Readings come from the stand-in pynvml of tests/test_gpu_health.py, answering from
the real `nvidia-smi -q` captures in tests/data/gpu_health; the agreement test reads the input series of
tests/test_slo.py's GPU cases (the same captures' shapes) as readings. The engine is tests/test_traffic.py's stand-in
(Envoy's routing, the control loop and the guard are under test, not vLLM).
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml
from hotswap_stack import free_port
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from test_gpu_health import FakeNvml, answers, logged_xids, two_a10s
from test_slo import CASES
from test_traffic import KEY, TrafficStack, stack  # noqa: F401 (the fixture, used by name)

from ironserve_service import gpu_guard, router, slo, traffic
from ironserve_service.control import Controller, Etcd, Snapshot, wait_for
from ironserve_service.gpu_guard import (
    GpuGuard,
    GuardCollector,
    GuardMemory,
    GuardRecord,
    HostView,
    Unfit,
    acknowledge,
    decide,
    drain_reason,
    host_view,
    remember,
    restore,
    unfit,
)
from ironserve_service.gpu_health import (
    GpuHealth,
    GpuIdentity,
    HealthSnapshot,
    PcieLink,
    RemappedRows,
    RetiredPages,
    XidState,
    read_health,
)
from ironserve_service.health import ProbeResult
from ironserve_service.settings import (
    EngineSettings,
    GpuHealthSettings,
    ServiceSettings,
    SwapSettings,
    duration_seconds,
    load_settings,
)

SETTINGS = GpuHealthSettings()
ONE_GPU = GpuHealthSettings(expected_gpus=1)  # the single-capture stand-ins
A10, A10_SECOND, SRAM_UNCORRECTABLE = (
    "a10-nvidia-smi-q.txt",
    "a10-second-nvidia-smi-q.txt",
    "a100-sram-uncorrectable.txt",
)
SECOND_SERIAL = "1324722021038"


class Guarded:
    """Readings of a stand-in host, one per call, through the guard's memory (as GpuGuard.step reads them)."""

    def __init__(self, nvml: FakeNvml, settings: GpuHealthSettings = SETTINGS) -> None:
        self.nvml, self.settings, self.memory = nvml, settings, GuardMemory()

    def read(self, now: float = 0.0, xids: XidState | None = None) -> list[Unfit]:
        snapshot, counts = read_health(self.nvml, 8), xids or XidState()
        self.memory = remember(self.memory, snapshot, counts, self.settings, now)
        return unfit(snapshot, counts, self.settings, self.memory, now)


# --- unfit on the captures --------------------------------------------------------------------------------------------


def test_simulated_two_idle_a10s_are_fit() -> None:
    assert Guarded(two_a10s()).read() == []


def test_simulated_new_uncorrectable_ecc_error_stays_unfit_until_the_counter_is_zeroed() -> None:
    nvml = two_a10s()
    guarded = Guarded(nvml)
    assert guarded.read() == []
    nvml.gpus[1] = answers(A10_SECOND, SRAM_UNCORRECTABLE)  # the volatile uncorrectable count goes 0 -> 1
    sick = [Unfit(1, SECOND_SERIAL, "GpuUncorrectableEccError", "new uncorrectable (double-bit) ECC error")]
    assert guarded.read(60) == sick
    assert drain_reason(sick) == f"gpu-health: gpu1 (serial {SECOND_SERIAL}) new uncorrectable (double-bit) ECC error"
    assert guarded.read(3600) == sick  # latched past the page's 10 m window: no reset happened
    nvml.gpus[1] = answers(A10_SECOND)  # a GPU reset or driver reload zeroes the volatile count
    assert guarded.read(3660) == []
    nvml.gpus[1] = answers(A10_SECOND, SRAM_UNCORRECTABLE)
    assert guarded.read(3720) == sick  # it recurs


def test_simulated_errors_counted_before_the_guard_started_are_not_new() -> None:
    nvml = two_a10s()
    nvml.gpus[1] = answers(A10_SECOND, SRAM_UNCORRECTABLE)
    guarded = Guarded(nvml)
    assert guarded.read() == [] and guarded.read(60) == []


def test_simulated_a_lost_gpu_is_named_by_the_serial_read_before() -> None:
    nvml = two_a10s()
    guarded = Guarded(nvml)
    assert guarded.read() == []
    nvml.lost.add(1)  # every NVML call on gpu1 answers NVML_ERROR_GPU_IS_LOST
    assert guarded.read(5) == [Unfit(1, SECOND_SERIAL, "GpuLost", "off the bus (NVML cannot reach it)")]
    fresh = two_a10s()
    fresh.lost.add(0)
    fresh.no_handle.add(1)
    assert [(gpu.device, gpu.serial, gpu.rule) for gpu in Guarded(fresh).read()] == [
        ("gpu0", "unknown", "GpuLost"), ("gpu1", "unknown", "GpuLost"),
    ]  # fmt: skip


def test_simulated_only_the_serving_gpus_drain() -> None:
    nvml = two_a10s()
    nvml.lost.add(1)
    assert Guarded(nvml, GpuHealthSettings(full_width_devices=[0])).read() == []
    assert [gpu.device for gpu in Guarded(nvml, GpuHealthSettings(full_width_devices=[1])).read()] == ["gpu1"]


@pytest.mark.invariant("hw-pcie-link-width-x16")
def test_simulated_a_link_at_x8_is_unfit_once_it_lasted_degraded_link_for() -> None:
    nvml = FakeNvml([answers("a10g-x8-nvidia-smi-q.txt")])  # Max 16x, Current 8x
    guarded = Guarded(nvml, ONE_GPU)
    held = duration_seconds(ONE_GPU.degraded_link_for)
    assert held == 300
    assert guarded.read(0) == [] and guarded.read(held - 1) == []
    assert guarded.read(held) == [Unfit(0, "1654321021062", "GpuPcieLinkDegraded", "PCIe link at x8, expected x16")]
    assert Guarded(nvml, GpuHealthSettings(expected_gpus=1, expected_pcie_width=8)).read(held) == []


def test_simulated_fewer_gpus_than_expected_is_unfit_after_a_minute() -> None:
    guarded = Guarded(FakeNvml([answers(A10)]))  # two expected
    assert guarded.read(0) == [] and guarded.read(59) == []
    missing = guarded.read(60)
    assert missing == [Unfit(None, "unknown", "GpuMissing", "NVML shows 1 of 2 expected GPUs")]
    assert drain_reason(missing) == "gpu-health: NVML shows 1 of 2 expected GPUs"


def test_simulated_fatal_xids_of_the_kernel_log_are_unfit_and_xid_63_is_not() -> None:
    assert logged_xids() == [48, 63, 79]
    guarded = Guarded(two_a10s())
    assert guarded.read(0, XidState(counts={(1, 63): 1})) == []  # a row remap recorded: IGNORE in the catalog
    fatal = guarded.read(5, XidState(counts={(1, 48): 1, (1, 63): 1, (1, 79): 1}))
    assert fatal == [Unfit(1, SECOND_SERIAL, "GpuFatalXid", "XID 48, 79")]


def test_simulated_row_remap_failure_and_pending_retired_pages_are_unfit() -> None:
    pending_remap = answers("a100-remapped-rows-pending.txt")
    assert Guarded(FakeNvml([pending_remap]), ONE_GPU).read() == []  # a pending remap is a ticket
    correctable, uncorrectable, pending, _ = pending_remap.values["nvmlDeviceGetRemappedRows"]
    pending_remap.values["nvmlDeviceGetRemappedRows"] = (correctable, uncorrectable, pending, 1)
    assert [gpu.rule for gpu in Guarded(FakeNvml([pending_remap]), ONE_GPU).read()] == ["GpuRowRemapFailure"]
    retired = answers("v100-retired-pages.txt")  # "Pending Page Blacklist : No"
    assert Guarded(FakeNvml([retired]), ONE_GPU).read() == []
    retired.values["nvmlDeviceGetRetiredPagesPendingStatus"] = 1  # stas00's "Pending Page Blacklist : Yes"
    assert [gpu.reason for gpu in Guarded(FakeNvml([retired]), ONE_GPU).read()] == [
        "retired pages pending (reboot to retire)"
    ]


@pytest.mark.parametrize(
    "captures",
    [(A10, "c4130-hw-power-brake.txt"), ("rtx-a6000-ecc-disabled.txt",), ("a100-remapped-rows-pending.txt",)],
    ids=["power-brake", "ecc-disabled", "remap-pending"],
)
def test_simulated_ticket_conditions_never_drain(captures: tuple[str, ...]) -> None:
    guarded = Guarded(FakeNvml([answers(*captures)]), ONE_GPU)
    assert guarded.read(0) == [] and guarded.read(86400) == []


def test_simulated_an_acknowledgement_holds_until_the_condition_clears_and_recurs() -> None:
    nvml = two_a10s()
    guarded = Guarded(nvml)
    guarded.read()
    nvml.lost.add(1)
    nvml.gpus[0] = answers(A10, SRAM_UNCORRECTABLE)
    found = guarded.read(5)
    assert [gpu.rule for gpu in found] == ["GpuUncorrectableEccError", "GpuLost"]
    memory = acknowledge(guarded.memory, read_health(nvml, 8), XidState(), found)
    assert memory.acknowledged == {(1, "GpuLost"), (0, "GpuUncorrectableEccError")}
    guarded.memory = memory
    assert guarded.read(10) == [Unfit(1, SECOND_SERIAL, "GpuLost", "off the bus (NVML cannot reach it)")]
    # ...which GpuGuard.step does not count as pressing: it is acknowledged until it clears.


def test_prometheus_durations_in_seconds() -> None:
    assert [duration_seconds(d) for d in ("5m", "1h30m", "500ms", "1m", "2d")] == [300, 5400, 0.5, 60, 172800]


@pytest.mark.parametrize(("values", "message"), [({"guard_interval_s": 0}, "greater than 0"),
                                                 ({"guard": "sometimes"}, "valid boolean")])  # fmt: skip
def test_guard_settings_refuse_with_a_reason(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GpuHealthSettings.model_validate(values)


# --- the same conditions as the page rules ------------------------------------------------------------------------

GPU_ALERTS = {rule["alert"]: rule for rule in slo.gpu_rules(SETTINGS)}
PAGES = {name for name, rule in GPU_ALERTS.items() if rule["labels"]["severity"] == "page"}


def test_the_guard_drains_on_every_page_rule_and_on_nothing_else() -> None:
    assert set(gpu_guard.RULES) == PAGES


def expand(values: str) -> list[float]:
    """promtool's expanding notation (`a+bxn`: n+1 values from a in steps of b; `axn`: a, n+1 times)."""
    out: list[float] = []
    for token in values.split():
        match = re.fullmatch(r"(-?[0-9.]+)(?:([+-][0-9.]+)?x([0-9]+))?", token)
        assert match, f"{token!r}: not used by the GPU cases"
        start, step, times = float(match[1]), float(match[2] or 0), int(match[3] or 0)
        out += [start + step * i for i in range(times + 1)]
    return out


def readings(inputs: list[dict[str, str]], minute: int) -> tuple[HealthSnapshot, XidState]:
    """What NVML and the XID watcher would have said at `minute` for the case's series (the fields the guard reads)."""
    fields: dict[int, dict[str, Any]] = {}
    visible, counts = None, {}
    for entry in inputs:
        name, labels = re.fullmatch(r"(\w+)\{(.*)\}", entry["series"]).groups()  # type: ignore[union-attr]
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        values = expand(entry["values"])
        if minute >= len(values):
            continue
        value = values[minute]
        index = int(label["device"].removeprefix("gpu")) if "device" in label else -1
        gpu = fields.setdefault(index, {})
        if name == "gpu_visible_count":
            visible = int(value)
        elif name == "gpu_expected_count":
            assert value == SETTINGS.expected_gpus
        elif name == "gpu_info":
            gpu["identity"] = GpuIdentity(index, label["uuid"], label["serial"], label["name"], label["pci_bus_id"])
        elif name == "gpu_lost":
            gpu["lost"] = value == 1
        elif name == "gpu_ecc_errors":
            gpu.setdefault("ecc", {})[(label["error_type"], label["counter"])] = int(value)
        elif name == "gpu_retired_pages_pending":
            gpu["retired_pages"] = RetiredPages(None, None, value == 1)
        elif name in ("gpu_remapped_rows_pending", "gpu_remapped_rows_failure"):
            gpu[name] = value == 1
        elif name == "gpu_pcie_link_width":
            gpu[f"width_{label['bound']}"] = int(value)
        elif name == "gpu_xid_errors_total":
            counts[(index, int(label["xid"]))] = int(value)
    gpus = []
    for index, found in sorted(fields.items()):
        if index < 0:
            continue
        rows = {
            key: found.pop(key) for key in ("gpu_remapped_rows_pending", "gpu_remapped_rows_failure") if key in found
        }
        if rows:
            found["remapped_rows"] = RemappedRows(0, 0, rows.get("gpu_remapped_rows_pending", False),
                                                  rows.get("gpu_remapped_rows_failure", False))  # fmt: skip
        widths = {key: found.pop(key) for key in ("width_current", "width_max") if key in found}
        if widths:
            found["pcie"] = PcieLink(None, None, widths.get("width_current"), widths.get("width_max"))
        gpus.append(GpuHealth(index=index, **found))
    supported = {index: True for index, _ in counts}
    return HealthSnapshot(True, visible, tuple(gpus)), XidState(counts=counts, supported=supported)


def guard_at(inputs: list[dict[str, str]], minute: int) -> set[tuple[str, str | None, str]]:
    """(rule, device, serial) the guard finds at `minute`, having read every minute from the first."""
    memory = GuardMemory()
    found: list[Unfit] = []
    for now in range(minute + 1):
        snapshot, xids = readings(inputs, now)
        memory = remember(memory, snapshot, xids, SETTINGS, now * 60.0)
        found = unfit(snapshot, xids, SETTINGS, memory, now * 60.0)
    return {(gpu.rule, None if gpu.index is None else gpu.device, gpu.serial) for gpu in found}


GPU_CASES = [
    pytest.param(test_case, id=name)
    for name, _, test_case in CASES
    if any(alert_test["alertname"] in GPU_ALERTS for alert_test in test_case["alert_rule_test"])
]


@pytest.mark.parametrize("test_case", GPU_CASES)
def test_simulated_each_gpu_rule_case_is_unfit_exactly_where_a_page_fires(test_case: dict[str, Any]) -> None:
    """tests/test_slo.py proves every GPU rule's firing and silent case with promtool; the guard reads the same series
    (one reading a minute, the cases' interval) and finds the firing pages' GPUs unfit, with their serials, and
    nothing where no page fires: every silent case and every ticket case is fit."""
    assert test_case["interval"] == "1m"
    for alert_test in test_case["alert_rule_test"]:
        minute = int(duration_seconds(alert_test["eval_time"]) // 60)
        pages = {
            (alert_test["alertname"], alert["exp_labels"].get("device"), alert["exp_labels"].get("serial", "unknown"))
            for alert in alert_test["exp_alerts"]
            if alert_test["alertname"] in PAGES
        }
        assert guard_at(test_case["input_series"], minute) == pages, alert_test


def test_every_page_rule_has_a_firing_case_the_guard_agrees_with() -> None:
    fired = {t["alertname"] for p in GPU_CASES for t in p.values[0]["alert_rule_test"] if t["exp_alerts"]}  # type: ignore[index]
    assert fired >= PAGES


# --- decide, and the record -----------------------------------------------------------------------------------------

LOST = Unfit(1, SECOND_SERIAL, "GpuLost", "off the bus (NVML cannot reach it)")
ECC = Unfit(0, "1325221009692", "GpuUncorrectableEccError", "new uncorrectable (double-bit) ECC error")


@pytest.mark.parametrize(
    ("traffic", "record", "owned", "pressing", "action"),
    [
        ("serving", None, False, [], "idle"),
        ("serving", None, False, [LOST], "drain"),
        ("draining", None, False, [LOST], "idle"),  # an admin's drain: not the guard's to record or end
        ("closed", None, False, [LOST], "idle"),
        ("draining", (LOST,), True, [LOST], "idle"),
        ("draining", (LOST,), True, [LOST, ECC], "update"),
        ("draining", (LOST,), True, [], "return"),  # once the model answers
        ("draining", (LOST,), False, [], "idle"),  # `traffic draining` after the guard's: the admin ends it
        ("closed", (LOST,), False, [], "idle"),  # `drain` after the guard's
        ("serving", (LOST,), False, [LOST], "acknowledge"),  # `traffic serving` over the guard's drain
    ],
)
def test_decide(
    traffic: router.Traffic, record: tuple[Unfit, ...] | None, owned: bool, pressing: list[Unfit], action: str
) -> None:
    view = HostView(traffic, None if record is None else GuardRecord("boot", record), owned)
    assert decide(view, pressing) == action


def test_the_record_says_who_drained_and_what_a_restart_keeps() -> None:
    swap = SwapSettings(model_name="m")
    assert (swap.traffic_reason_key, swap.gpu_guard_key) == ("/models/m/traffic/reason", "/models/m/traffic/gpu-guard")
    link = Unfit(0, "1654321021062", "GpuPcieLinkDegraded", "PCIe link at x8, expected x16")
    record = GuardRecord("boot-1", (ECC, link))
    assert GuardRecord.from_text(record.to_text()) == record
    assert GuardRecord.from_text("draining by hand") is None
    assert GuardRecord.from_text(json.dumps({"boot_id": "b", "gpus": [{**vars(LOST), "rule": "Reboot"}]})) is None
    written = {swap.traffic_key: "draining", swap.gpu_guard_key: record.to_text()}
    same = Snapshot(9, written, {swap.traffic_key: 7, swap.gpu_guard_key: 7})
    assert host_view(swap, same) == HostView("draining", record, True)
    later = Snapshot(9, written, {swap.traffic_key: 8, swap.gpu_guard_key: 7})  # `traffic draining` since
    assert host_view(swap, later) == HostView("draining", record, False)
    # Restarted in the same boot: the ECC error stays (a new baseline could not see it), the link counts as held.
    memory = restore(record, "boot-1")
    assert memory.carried == (ECC,) and memory.since == {link.key: float("-inf")}
    assert restore(record, "boot-2") == GuardMemory()  # a reboot zeroed the volatile counts
    assert unfit(read_health(two_a10s(), 8), XidState(), SETTINGS, memory, 0.0) == [ECC]
    sick = two_a10s()
    sick.gpus[0] = answers(A10, SRAM_UNCORRECTABLE)  # gpu0's volatile count still 1: not reset
    assert remember(memory, read_health(sick, 8), XidState(), SETTINGS, 0.0).carried == (ECC,)
    zeroed = remember(memory, read_health(two_a10s(), 8), XidState(), SETTINGS, 0.0)  # it reads 0: reset since
    assert zeroed.carried == ()


# --- the reason in Envoy's route and in the control loop ------------------------------------------------------------


def test_the_reason_rides_on_envoys_own_503s_only(tmp_path: Path) -> None:
    swap = SwapSettings(router_dir=tmp_path, api_keys_file=tmp_path / "keys")
    reason = f"gpu-health: gpu1 (serial {SECOND_SERIAL}) new uncorrectable (double-bit) ECC error"
    for state in router.TRAFFIC_STATES:
        plain = router.routes(swap, "blue", "v1", 3, api_keys=[("alice", KEY)], traffic=state)
        told = router.routes(swap, "blue", "v1", 3, api_keys=[("alice", KEY)], traffic=state, traffic_reason=reason)
        routes = told["resources"][0]["virtual_hosts"][0]["routes"]
        refused = [route for route in routes if route.get("direct_response") == router.DRAINING]
        assert all(route["response_headers_to_add"] == router.drain_reason_headers(reason) for route in refused)
        assert [r for r in routes if r not in refused] == [
            r
            for r in plain["resources"][0]["virtual_hosts"][0]["routes"]
            if r.get("direct_response") != router.DRAINING
        ]
        assert len(refused) == {"serving": 0, "draining": 1, "closed": 4}[state]
        assert router.route_traffic(told["resources"][0]) == state
    assert router.drain_reason_headers("50% \x07slower\n")[0]["header"] == {
        "key": "x-ironserve-drain-reason", "value": "50%% ?slower?",
    }  # fmt: skip


def test_the_control_loop_renders_the_reason_while_the_host_is_out(tmp_path: Path) -> None:
    swap = SwapSettings(router_dir=tmp_path / "envoy")
    path = swap.router_dir / router.RDS_FILE
    router.write_route(path, router.routes(swap, "blue", "v1", 3))
    settings = ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap)
    controller = Controller(settings, check=lambda colour: ProbeResult(False, "not consulted"), log=lambda line: None)

    def health_headers() -> list[Any]:
        routes = json.loads(path.read_text())["resources"][0]["virtual_hosts"][0]["routes"]
        health = [r for r in routes if r["match"] == {"path": router.HEALTH_PATH}]
        return [header["header"]["value"] for r in health for header in r.get("response_headers_to_add", [])]

    active = {swap.active_key: "v1", swap.colour_key("blue"): "v1"}
    controller.values = {**active, swap.traffic_key: "draining", swap.traffic_reason_key: "gpu-health: gpu0 (x)"}
    controller.apply(4)
    assert health_headers() == ["gpu-health: gpu0 (x)"]
    controller.values[swap.traffic_key] = "serving"  # an admin's `traffic serving`, the reason not yet removed
    controller.apply(5)
    assert health_headers() == []


# --- the guard against a real etcd, Envoy and control loop -----------------------------------------------------------


def health_answer(swap: SwapSettings) -> tuple[int, str, str | None]:
    """GET /health on the listener: status, body and the drain reason header."""
    connection = http.client.HTTPConnection("127.0.0.1", swap.listen_port, timeout=5)
    try:
        connection.request("GET", router.HEALTH_PATH)
        response = connection.getresponse()
        return response.status, response.read().decode(), response.getheader(router.DRAIN_REASON_HEADER)
    finally:
        connection.close()


def drained_metric(swap: SwapSettings) -> dict[tuple[str, str, str], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GuardCollector(swap, 2.0))
    return {
        (sample.labels["device"], sample.labels["serial"], sample.labels["reason"]): sample.value
        for family in registry.collect() for sample in family.samples
    }  # fmt: skip


def logged(lines: list[str], text: str) -> Callable[[], bool]:
    """Whether a line with `text` is logged from now on."""
    start = len(lines)
    return lambda: any(text in line for line in lines[start:])


def guard_record(swap: SwapSettings) -> str | None:
    return Etcd(swap.etcd_url).get_prefix(swap.key_prefix).values.get(swap.gpu_guard_key)


@pytest.mark.parametrize("stack", [{"gpu_health": {"guard": False}}], indirect=True)
def test_simulated_sick_gpu_drains_the_host_until_fit_and_answering_and_an_admin_has_the_last_word(
    stack: TrafficStack,  # noqa: F811 (test_traffic's fixture)
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The control loop's own guard is off here: on a GPU host it would read the real GPUs beside this one's."""
    loaded = load_settings(stack.config)
    quick = loaded.gpu_health.model_copy(update={"guard_interval_s": 0.1})
    settings = loaded.model_copy(update={"gpu_health": quick})
    swap, nvml, lines = stack.swap, two_a10s(), list[str]()
    guard = GpuGuard(settings, nvml=nvml, log=lines.append, boot_id="boot-1")
    guard.start()
    try:
        assert lines[0].startswith("gpu-guard: watching every GPU every 0.1 s; it drains and returns this host, never")
        time.sleep(0.5)
        assert stack.traffic_in_etcd() is None and health_answer(swap) == (200, "", None)

        # gpu1's volatile uncorrectable ECC count goes 0 -> 1: out of the load balancer, requests still served.
        reason = f"gpu-health: gpu1 (serial {SECOND_SERIAL}) new uncorrectable (double-bit) ECC error"
        nvml.gpus[1] = answers(A10_SECOND, SRAM_UNCORRECTABLE)
        assert wait_for(lambda: health_answer(swap) == (503, "draining", reason), 10, 0.05), lines
        assert f"gpu-guard: draining the host (out of its load balancer, requests still served): {reason}" in lines
        assert stack.chat()[0] == 200
        assert stack.traffic_in_etcd() == "draining"
        assert stack.status(capsys)["traffic_reason"] == reason
        assert drained_metric(swap) == {("gpu1", SECOND_SERIAL, "new uncorrectable (double-bit) ECC error"): 1.0}
        assert [line for line in lines if line.startswith("gpu-guard: ")][1:] == [
            f"gpu-guard: draining the host (out of its load balancer, requests still served): {reason}"
        ]  # the drain holding says nothing more

        # The GPU reset zeroes the count, but the engine does not answer yet: still draining.
        stack.engine.answering.clear()
        try:
            waiting = logged(lines, "GPUs fit again; the host stays draining until the model answers")
            nvml.gpus[1] = answers(A10_SECOND)
            assert wait_for(waiting, 15)
            assert stack.traffic_in_etcd() == "draining" and health_answer(swap)[:2] == (503, "draining")
        finally:
            stack.engine.answering.set()
        assert wait_for(lambda: health_answer(swap) == (200, "", None), 15, 0.05), lines
        assert stack.traffic_in_etcd() == "serving" and stack.status(capsys)["traffic_reason"] is None
        assert drained_metric(swap) == {}
        assert any(
            line.startswith("gpu-guard: serving again: every serving GPU fit and blue answered") for line in lines
        )

        # gpu1 falls off the bus: drained again; an admin's `traffic draining` after that is the admin's to end.
        lost = f"gpu-health: gpu1 (serial {SECOND_SERIAL}) off the bus (NVML cannot reach it)"
        nvml.lost.add(1)
        assert wait_for(lambda: health_answer(swap) == (503, "draining", lost), 10, 0.05), lines
        taken_over = logged(lines, "an admin's traffic draining followed the guard's drain: the admin ends it")
        assert stack.cli("traffic", "draining").returncode == 0
        nvml.lost.discard(1)
        assert wait_for(taken_over, 5)
        time.sleep(0.5)
        assert stack.traffic_in_etcd() == "draining" and health_answer(swap) == (503, "draining", lost)
        acknowledged = logged(
            lines, "an admin put serving over the guard's drain; acknowledged (every serving GPU fit)"
        )
        assert stack.cli("traffic", "serving").returncode == 0
        assert wait_for(acknowledged, 5) and guard_record(swap) is None
        assert wait_for(lambda: stack.status(capsys)["traffic_reason"] is None, 5)

        # `traffic serving` while gpu1 is still lost acknowledges it: no drain for it until it clears and recurs.
        nvml.lost.add(1)
        assert wait_for(lambda: health_answer(swap) == (503, "draining", lost), 10, 0.05), lines
        acknowledged = logged(lines, f"acknowledged ({lost})")
        assert stack.cli("traffic", "serving").returncode == 0
        assert wait_for(acknowledged, 5)
        time.sleep(0.5)
        assert stack.traffic_in_etcd() == "serving" and health_answer(swap) == (200, "", None)
        nvml.lost.discard(1)
        assert wait_for(lambda: guard.memory is not None and not guard.memory.acknowledged, 5)
        nvml.lost.add(1)
        assert wait_for(lambda: health_answer(swap) == (503, "draining", lost), 10, 0.05), lines

        # An admin's drain first: the guard writes nothing while it lasts, and drains as soon as serving is put back.
        assert stack.cli("traffic", "serving").returncode == 0
        assert wait_for(lambda: guard_record(swap) is None, 5)  # acknowledged
        nvml.lost.discard(1)
        assert wait_for(lambda: guard.memory is not None and not guard.memory.acknowledged, 5)
        assert stack.cli("traffic", "draining").returncode == 0
        left = logged(lines, f"{lost}; the host is draining by an admin, left so")
        nvml.lost.add(1)
        assert wait_for(left, 5)
        assert health_answer(swap) == (503, "draining", None) and drained_metric(swap) == {}
        put_back = stack.cli("traffic", "serving")  # in force for a moment at most: the guard drains at once
        assert wait_for(lambda: health_answer(swap) == (503, "draining", lost), 10, 0.05), lines
        again = f"{swap.traffic_key} was written again since: draining ({lost})"
        assert put_back.returncode == 0 or put_back.stderr.strip().endswith(f"serving not in force: {again}"), put_back

        # An XID through the guard's own watcher (the kernel log's 79, fallen off the bus), acknowledged by an admin.
        assert stack.cli("traffic", "serving").returncode == 0
        assert wait_for(lambda: guard_record(swap) is None, 5)
        nvml.lost.discard(1)
        nvml.deliver(0, pynvml.nvmlEventTypeXidCriticalError, 79)
        xid = "gpu-health: gpu0 (serial 1325221009692) XID 79"
        assert wait_for(lambda: health_answer(swap) == (503, "draining", xid), 10, 0.05), lines
        # What `traffic STATE` says when the key is written again while it waits (the put back above, when quick).
        etcd = Etcd(swap.etcd_url)
        drained_at = etcd.get_prefix(swap.key_prefix).mod_revisions[swap.traffic_key]
        assert traffic.overwritten(swap, etcd, drained_at) is None
        assert (
            traffic.overwritten(swap, etcd, drained_at - 1) == f"{swap.traffic_key} was written again since: "
            f"draining ({xid})"
        )
    finally:
        guard.stop()


def test_the_control_command_runs_the_guard_and_stops_it_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "service.yaml"
    swap = {"etcd_url": f"http://127.0.0.1:{free_port()}", "router_dir": str(tmp_path / "envoy")}
    config.write_text(yaml.safe_dump({"engine": {"model_dir": str(tmp_path)}, "swap": swap}))
    log = tmp_path / "control.log"
    with log.open("wb") as output:
        control = subprocess.Popen([sys.executable, "-m", "ironserve_service", "control", "--config", str(config)],
                                   stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert wait_for(lambda: "gpu-guard: watching every GPU every 5 s" in log.read_text(), 30, 0.1)
    finally:
        control.send_signal(signal.SIGTERM)
        code = control.wait(timeout=20)
    assert code == 0, log.read_text()
