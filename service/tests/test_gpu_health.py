"""GPU health (gpu_health.py) against a stand-in pynvml answering what NVML answers for real captured GPUs.

Simulated: there is no GPU here. The stand-in's answers come from real `nvidia-smi -q` captures in
tests/data/gpu_health (each with a .source note): nvidia-smi prints what NVML returns, so a capture gives the values
and the unsupported fields (N/A) a GPU of that kind answers. The NVML constants the stand-in checks its arguments
against are pynvml's own (NVIDIA's binding), not gpu_health's, so a wrong bit or enum value in gpu_health fails here.
The real-NVML check of the same fields is tests/test_gpu.py (GPU hosts only).
"""

from __future__ import annotations

import queue
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from ironserve_service import gpu_health, slo
from ironserve_service.gpu_health import GpuHealthCollector, XidWatcher, read_health
from ironserve_service.settings import (
    EngineSettings,
    ExporterSettings,
    GpuHealthSettings,
    QualitySettings,
    ServiceSettings,
    SloSettings,
)

DATA = Path(__file__).parent / "data" / "gpu_health"
SETTINGS = GpuHealthSettings()

# --- nvidia-smi -q captures -> the answers NVML gives ----------------------------------------------------------------


def parse_smi(text: str) -> dict[tuple[str, ...], str]:
    """`nvidia-smi -q` as {section path + key: value}; sections nest by indentation, "[...]" marks omitted lines.

    Paths start below the "GPU <bus id>" line, so an excerpt of a section overlays the same section of a full capture;
    "Clocks Throttle Reasons" is read as the section's name since R535, "Clocks Event Reasons".
    """
    values: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith("=") or stripped == "[...]" or re.match(r"GPU [0-9A-F]{8}:", stripped):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        match = re.match(r"(.+?)\s+:\s?(.*)$", stripped)
        path = tuple(name for _, name in stack)
        if match:
            values[(*path, match.group(1))] = match.group(2)
        else:
            stack.append((indent, "Clocks Event Reasons" if stripped == "Clocks Throttle Reasons" else stripped))
    return values


def find(values: dict[tuple[str, ...], str], *suffix: str) -> str | None:
    found = [value for path, value in values.items() if path[-len(suffix) :] == suffix]
    assert len(found) <= 1, f"{suffix} is ambiguous"
    return found[0] if found else None


def number(text: str | None) -> float | None:
    if text is None or text in {"N/A", "Unknown Error"}:
        return None
    return float(re.match(r"[0-9.]+", text).group())  # type: ignore[union-attr]


# pynvml's names for the bits nvidia-smi -q prints under "Clocks Event Reasons" ("Clocks Throttle Reasons" before
# R535).
SMI_REASONS = {
    "Idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "Applications Clocks Setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "SW Power Cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "HW Slowdown": pynvml.nvmlClocksThrottleReasonHwSlowdown,
    "HW Thermal Slowdown": pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
    "HW Power Brake Slowdown": pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
    "Sync Boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "SW Thermal Slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "Display Clock Setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
UNSUPPORTED = object()  # NVML answers NVML_ERROR_NOT_SUPPORTED


@dataclass
class GpuAnswers:
    """What NVML returns for one GPU, keyed by pynvml function (UNSUPPORTED where nvidia-smi shows N/A)."""

    values: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.values.get(name, UNSUPPORTED)


def ecc_totals(smi: dict[tuple[str, ...], str], counter: str) -> dict[int, Any]:
    """(error type -> total) of one counter, as nvmlDeviceGetTotalEccErrors sums the memory systems."""

    def total(*names: str) -> Any:
        found = [number(find(smi, counter, name)) for name in names if find(smi, counter, name) is not None]
        if not found or any(value is None for value in found):
            return UNSUPPORTED
        return int(sum(value for value in found if value is not None))

    if find(smi, counter, "Single Bit", "Total") is not None:  # pre-Ampere: per bit class, with a total each
        single = number(find(smi, counter, "Single Bit", "Total"))
        double = number(find(smi, counter, "Double Bit", "Total"))
        return {
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: UNSUPPORTED if single is None else int(single),
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: UNSUPPORTED if double is None else int(double),
        }
    return {
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: total("SRAM Correctable", "DRAM Correctable"),
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: total(
            "SRAM Uncorrectable", "SRAM Uncorrectable Parity", "SRAM Uncorrectable SEC-DED", "DRAM Uncorrectable"
        ),
    }


def answers(*files: str) -> GpuAnswers:
    """NVML's answers for the captures, later files' sections over earlier ones'."""
    smi: dict[tuple[str, ...], str] = {}
    for name in files:
        smi.update(parse_smi((DATA / name).read_text()))
    out: dict[str, Any] = {}

    def put(name: str, value: Any) -> None:
        out[name] = UNSUPPORTED if value is None else value

    put("nvmlDeviceGetName", find(smi, "Product Name"))
    put("nvmlDeviceGetUUID", find(smi, "GPU UUID"))
    serial = find(smi, "Serial Number")
    put("nvmlDeviceGetSerial", None if serial is None else serial.encode())  # pynvml returns bytes
    bus = find(smi, "PCI", "Bus Id")
    put("nvmlDeviceGetPciInfo", None if bus is None else SimpleNamespace(busId=bus.encode()))
    mode = find(smi, "ECC Mode", "Current")
    enabled = mode == "Enabled" or (mode is None and find(smi, "ECC Errors", "Volatile", "SRAM Correctable"))
    state = pynvml.NVML_FEATURE_ENABLED if enabled else pynvml.NVML_FEATURE_DISABLED
    put("nvmlDeviceGetEccMode", [state, state] if mode is not None or enabled else None)
    out["ecc"] = {
        counter_value: ecc_totals(smi, counter)
        for counter, counter_value in (("Volatile", pynvml.NVML_VOLATILE_ECC), ("Aggregate", pynvml.NVML_AGGREGATE_ECC))
    }
    single, double = find(smi, "Retired Pages", "Single Bit ECC"), find(smi, "Retired Pages", "Double Bit ECC")
    pending = find(smi, "Retired Pages", "Pending Page Blacklist")
    out["retired"] = {
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: single,
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: double,
    }
    put("nvmlDeviceGetRetiredPagesPendingStatus", None if pending in (None, "N/A") else int(pending == "Yes"))
    rows = [find(smi, "Remapped Rows", key) for key in ("Correctable Error", "Uncorrectable Error")]
    flags = [find(smi, "Remapped Rows", key) for key in ("Pending", "Remapping Failure Occurred")]
    if None in rows or None in flags:
        put("nvmlDeviceGetRemappedRows", None)  # "Remapped Rows : N/A" (pre-Ampere) or not in the capture
    else:
        put("nvmlDeviceGetRemappedRows", (*(int(r) for r in rows), *(int(f == "Yes") for f in flags)))  # type: ignore[arg-type]
    reasons = {name: find(smi, name) for name in SMI_REASONS}
    if any(value is not None for value in reasons.values()):
        mask = sum(bit for name, bit in SMI_REASONS.items() if reasons[name] == "Active")
        put("nvmlDeviceGetCurrentClocksEventReasons", mask)
        put("nvmlDeviceGetCurrentClocksThrottleReasons", mask)
    for function, path in (
        ("nvmlDeviceGetPowerUsage", ("GPU Power Readings", "Power Draw")),
        ("nvmlDeviceGetEnforcedPowerLimit", ("GPU Power Readings", "Current Power Limit")),
        ("nvmlDeviceGetPowerManagementDefaultLimit", ("GPU Power Readings", "Default Power Limit")),
    ):
        watts = number(find(smi, *path))
        put(function, None if watts is None else round(watts * 1000))  # NVML gives milliwatts
    temperature = number(find(smi, "Temperature", "GPU Current Temp"))
    put("nvmlDeviceGetTemperature", None if temperature is None else int(temperature))
    for function, path in (
        ("nvmlDeviceGetCurrPcieLinkGeneration", ("PCIe Generation", "Current")),
        ("nvmlDeviceGetMaxPcieLinkGeneration", ("PCIe Generation", "Max")),
        ("nvmlDeviceGetCurrPcieLinkWidth", ("Link Width", "Current")),
        ("nvmlDeviceGetMaxPcieLinkWidth", ("Link Width", "Max")),
    ):
        value = number(find(smi, *path))
        put(function, None if value is None else int(value))
    return GpuAnswers(out)


# --- the stand-in pynvml --------------------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    """pynvml.NVMLError's shape: the nvmlReturn_t code in `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """A pynvml stand-in for one host: module-level functions answering from GpuAnswers, and an event set."""

    def __init__(self, gpus: list[GpuAnswers], init_error: int | None = None, events: set[int] | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.handles = [SimpleNamespace(index=i) for i in range(len(gpus))]
        self.lost: set[int] = set()  # GPUs answering NVML_ERROR_GPU_IS_LOST from now on
        self.no_handle: set[int] = set()  # GPUs nvmlDeviceGetHandleByIndex fails for
        self.events_supported = set(range(len(gpus))) if events is None else events
        self.event_queue: queue.Queue[SimpleNamespace] = queue.Queue()
        self.wait_error: int | None = None
        self.waits = 0
        self.inits = self.shutdowns = 0
        self.freed: list[object] = []
        self.old_driver = False  # before R535: no nvmlDeviceGetCurrentClocksEventReasons

    def _gpu(self, handle: SimpleNamespace) -> GpuAnswers:
        if handle.index in self.lost:
            raise FakeNVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[int(handle.index)]

    def _answer(self, handle: SimpleNamespace, name: str) -> Any:
        value = self._gpu(handle).get(name)
        if value is UNSUPPORTED:
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimpleNamespace:
        if index in self.no_handle:
            raise FakeNVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return self.handles[index]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # The one-argument queries (name, UUID, power, PCIe link, ...) answer from the capture.
        if not name.startswith("nvmlDevice"):
            raise AttributeError(name)
        if name == "nvmlDeviceGetCurrentClocksEventReasons" and self.old_driver:
            return self._missing_function
        return lambda handle: self._answer(handle, name)

    def _missing_function(self, handle: SimpleNamespace) -> Any:
        raise FakeNVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetTotalEccErrors(self, handle: SimpleNamespace, error_type: int, counter: int) -> int:
        self._answer(handle, "nvmlDeviceGetEccMode")
        value = self._gpu(handle).values["ecc"][counter][error_type]
        if value is UNSUPPORTED:
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(value)

    def nvmlDeviceGetRetiredPages(self, handle: SimpleNamespace, cause: int) -> list[int]:
        count = self._gpu(handle).values["retired"][cause]
        if count in (None, "N/A"):
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [0x7FDD60000 + 0x1000 * page for page in range(int(count))]  # addresses; only the count is used

    def nvmlDeviceGetTemperature(self, handle: SimpleNamespace, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._answer(handle, "nvmlDeviceGetTemperature"))

    def nvmlEventSetCreate(self) -> object:
        return SimpleNamespace(kind="event set")

    def nvmlDeviceRegisterEvents(self, handle: SimpleNamespace, types: int, event_set: object) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError
        if handle.index not in self.events_supported:
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self.waits += 1
        if self.wait_error is not None:
            raise FakeNVMLError(self.wait_error)
        try:
            return self.event_queue.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise FakeNVMLError(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.freed.append(event_set)

    def deliver(self, index: int, event_type: int, data: int, same_handle: bool = True) -> None:
        """An nvmlEventData_t as NVIDIA's device plugin logs one (tests/data/gpu_health/xid-kernel-log.txt).

        `same_handle` False: the event names the GPU by another handle object than the registered one."""
        self.event_queue.put(
            SimpleNamespace(
                device=self.handles[index] if same_handle else SimpleNamespace(index=index),
                eventType=event_type, eventData=data,
                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF,
            )
        )  # fmt: skip


def two_a10s() -> FakeNvml:
    return FakeNvml([answers("a10-nvidia-smi-q.txt"), answers("a10-second-nvidia-smi-q.txt")])


def scrape(nvml: Any, xids: XidWatcher | None = None, settings: GpuHealthSettings = SETTINGS) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuHealthCollector(settings, 8, xids, nvml=nvml))
    return registry


def value(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def series(registry: CollectorRegistry, name: str) -> list[dict[str, str]]:
    text = generate_latest(registry).decode()
    return [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in re.findall(rf"^{name}\{{(.*)\}} ", text, re.M)]


# --- the NVML layer on real shapes ----------------------------------------------------------------------------------


@pytest.mark.invariant("obs-hardware-exporter")
def test_simulated_a10_host_reads_every_field() -> None:
    nvml = two_a10s()
    snapshot = read_health(nvml, 8)
    assert snapshot.available and snapshot.visible_count == 2
    gpu0, gpu1 = snapshot.gpus
    assert gpu0.identity == gpu_health.GpuIdentity(
        0, "GPU-14705cc6-2e5b-ae28-e00a-0f87622e4299", "1325221009692", "NVIDIA A10", "00000000:08:00.0"
    )
    assert gpu0.ecc == {(t, c): 0 for t in ("corrected", "uncorrected") for c in ("volatile", "aggregate")}
    assert gpu0.retired_pages is None  # Ampere: N/A, NOT_SUPPORTED
    assert gpu0.remapped_rows == gpu_health.RemappedRows(0, 0, pending=False, failure=False)
    assert gpu0.pcie == gpu_health.PcieLink(current_generation=1, max_generation=4, current_width=16, max_width=16)
    assert (gpu0.power_mw, gpu0.power_limit_mw, gpu0.power_default_limit_mw, gpu0.temperature_c) == (
        15650, 150000, 150000, 33,
    )  # fmt: skip
    assert gpu1.identity is not None and gpu1.identity.serial == "1324722021038"
    assert nvml.inits == nvml.shutdowns == 1  # each scrape opens and closes its NVML session

    registry = scrape(two_a10s())
    assert value(registry, "gpu_power_watts", device="gpu0") == 15.65
    assert value(registry, "gpu_power_limit_watts", device="gpu1") == 150.0
    assert value(registry, "gpu_temperature_celsius", device="gpu0") == 33.0
    assert value(registry, "gpu_pcie_link_generation", device="gpu0", bound="current") == 1.0
    assert value(registry, "gpu_pcie_link_width", device="gpu0", bound="max") == 16.0
    assert value(registry, "gpu_ecc_errors", device="gpu0", error_type="uncorrected", counter="volatile") == 0.0
    assert value(registry, "gpu_remapped_rows_pending", device="gpu1") == 0.0
    assert value(registry, "gpu_lost", device="gpu0") == 0.0
    assert (value(registry, "gpu_visible_count"), value(registry, "gpu_expected_count")) == (2.0, 2.0)
    # The idle A10 reports the SW power cap at 15 W: the reason is exported as is; GpuPowerCapped asks for the draw.
    active = {s["reason"] for s in series(registry, "gpu_throttle_reason_active") if s["device"] == "gpu0"}
    assert len(active) == 9
    assert value(registry, "gpu_throttle_reason_active", device="gpu0", reason="sw_power_cap") == 1.0
    assert value(registry, "gpu_throttle_reason_active", device="gpu1", reason="gpu_idle") == 1.0
    assert value(registry, "gpu_throttle_reason_active", device="gpu1", reason="sw_power_cap") == 0.0
    assert series(registry, "gpu_retired_pages") == [] and series(registry, "gpu_retired_pages_pending") == []
    info = {s["device"]: s for s in series(registry, "gpu_info")}
    assert info["gpu1"] == {
        "device": "gpu1", "uuid": "GPU-51ae0086-e1ac-4a20-f062-9caa44e4df6d", "serial": "1324722021038",
        "name": "NVIDIA A10", "pci_bus_id": "00000000:06:00.0",
    }  # fmt: skip


@pytest.mark.invariant("hw-pcie-link-width-x16")
def test_simulated_a10g_link_at_x8_is_reported_as_trained() -> None:
    registry = scrape(FakeNvml([answers("a10g-x8-nvidia-smi-q.txt")]))
    assert value(registry, "gpu_pcie_link_width", device="gpu0", bound="current") == 8.0
    assert value(registry, "gpu_pcie_link_width", device="gpu0", bound="max") == 16.0
    assert value(registry, "gpu_pcie_link_generation", device="gpu0", bound="current") == 4.0
    assert value(registry, "gpu_ecc_errors", device="gpu0", error_type="corrected", counter="aggregate") == 1.0
    assert value(registry, "gpu_ecc_errors", device="gpu0", error_type="corrected", counter="volatile") == 0.0


def test_simulated_ecc_disabled_publishes_no_ecc_series() -> None:
    registry = scrape(FakeNvml([answers("rtx-a6000-ecc-disabled.txt")]))
    assert series(registry, "gpu_ecc_errors") == []  # not zeros: the counters do not run
    assert value(registry, "gpu_remapped_rows", device="gpu0", kind="correctable") == 0.0
    assert value(registry, "gpu_info", device="gpu0", uuid="GPU-43be1050-5a2d-47f9-bf95-a0e7d429b953",
                 serial="1651022017098", name="NVIDIA RTX A6000", pci_bus_id="N/A") == 1.0  # fmt: skip


def test_simulated_pre_ampere_retires_pages_and_has_no_remapped_rows() -> None:
    registry = scrape(FakeNvml([answers("v100-retired-pages.txt")]))
    assert value(registry, "gpu_retired_pages", device="gpu0", cause="multiple_single_bit_ecc") == 0.0
    assert value(registry, "gpu_retired_pages", device="gpu0", cause="double_bit_ecc") == 0.0
    assert value(registry, "gpu_retired_pages_pending", device="gpu0") == 0.0
    assert series(registry, "gpu_remapped_rows") == [] and series(registry, "gpu_remapped_rows_failure") == []
    assert value(registry, "gpu_ecc_errors", device="gpu0", error_type="uncorrected", counter="aggregate") == 0.0
    assert value(registry, "gpu_pcie_link_generation", device="gpu0", bound="max") == 3.0


def test_simulated_a100_remap_pending_and_uncorrectable_counts() -> None:
    registry = scrape(FakeNvml([answers("a100-remapped-rows-pending.txt")]))
    assert value(registry, "gpu_remapped_rows", device="gpu0", kind="correctable") == 1.0
    assert value(registry, "gpu_remapped_rows_pending", device="gpu0") == 1.0
    assert value(registry, "gpu_remapped_rows_failure", device="gpu0") == 0.0
    assert value(registry, "gpu_ecc_errors", device="gpu0", error_type="corrected", counter="volatile") == 177.0
    # Fields the capture does not show answer NOT_SUPPORTED: absent, and gpu_info still names the device.
    assert series(registry, "gpu_power_watts") == []
    assert series(registry, "gpu_info") == [
        {"device": "gpu0", "uuid": "N/A", "serial": "N/A", "name": "NVIDIA A100-SXM4-80GB", "pci_bus_id": "N/A"}
    ]
    broken = scrape(FakeNvml([answers("a10-nvidia-smi-q.txt", "a100-sram-uncorrectable.txt")]))
    assert value(broken, "gpu_ecc_errors", device="gpu0", error_type="uncorrected", counter="volatile") == 1.0
    assert value(broken, "gpu_ecc_errors", device="gpu0", error_type="uncorrected", counter="aggregate") == 5.0


@pytest.mark.parametrize("old_driver", [False, True], ids=["clocks-event-reasons", "r525-throttle-reasons"])
def test_simulated_dell_power_brake_sets_both_slowdown_bits(old_driver: bool) -> None:
    nvml = FakeNvml([answers("a10-nvidia-smi-q.txt", "c4130-hw-power-brake.txt")])
    nvml.old_driver = old_driver  # driver 525 (the R740 profile) has only nvmlDeviceGetCurrentClocksThrottleReasons
    registry = scrape(nvml)
    active = {s["reason"] for s in series(registry, "gpu_throttle_reason_active")
              if value(registry, "gpu_throttle_reason_active", **s) == 1.0}  # fmt: skip
    assert active == {"hw_slowdown", "hw_power_brake_slowdown"}
    assert gpu_health.throttle_reasons(0x88) == {reason: reason in active for reason in gpu_health.THROTTLE_REASONS}


def test_simulated_gpu_lost_on_one_of_two_keeps_the_other() -> None:
    nvml = two_a10s()
    collector = GpuHealthCollector(SETTINGS, 8, nvml=nvml)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert value(registry, "gpu_lost", device="gpu1") == 0.0
    nvml.lost.add(1)  # gpu1 falls off the bus: every NVML call on it answers NVML_ERROR_GPU_IS_LOST
    assert value(registry, "gpu_lost", device="gpu1") == 1.0
    assert value(registry, "gpu_lost", device="gpu0") == 0.0
    assert value(registry, "gpu_power_watts", device="gpu0") == 15.65  # the other GPU's readings stay
    assert value(registry, "gpu_visible_count") == 2.0  # the driver still enumerates a lost GPU
    assert series(registry, "gpu_power_watts") == [{"device": "gpu0"}]
    # The lost GPU cannot say its serial any more: the one read before names it, for the alert's join.
    info = {s["device"]: s["serial"] for s in series(registry, "gpu_info")}
    assert info == {"gpu0": "1325221009692", "gpu1": "1324722021038"}


def test_simulated_gpu_lost_before_any_reading_and_without_a_handle() -> None:
    nvml = two_a10s()
    nvml.lost.add(0)
    nvml.no_handle.add(1)  # "Unable to determine the device handle ...: Unknown Error" (NVIDIA/dcgm-exporter#604)
    registry = scrape(nvml)
    assert value(registry, "gpu_lost", device="gpu0") == value(registry, "gpu_lost", device="gpu1") == 1.0
    assert {s["serial"] for s in series(registry, "gpu_info")} == {"N/A"}  # still one gpu_info each, for the join
    assert series(registry, "gpu_temperature_celsius") == []


@pytest.mark.parametrize("init_error", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_simulated_no_nvml_reports_only_the_expectation(init_error: int) -> None:
    nvml = FakeNvml([], init_error=init_error)
    assert read_health(nvml, 8) == gpu_health.HealthSnapshot(available=False, visible_count=None)
    registry = scrape(nvml)
    assert value(registry, "gpu_expected_count") == 2.0
    assert value(registry, "gpu_visible_count") is None and series(registry, "gpu_lost") == []
    watcher = XidWatcher(8, nvml=nvml)
    assert not watcher.start() and not watcher.running
    watcher.stop()  # safe without a start


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has a GPU: tests/test_gpu.py reads it")
def test_real_pynvml_without_a_gpu_reports_nvml_unavailable() -> None:
    # This host: the real pynvml, no libnvidia-ml.so.1 (NVML_ERROR_LIBRARY_NOT_FOUND).
    assert read_health(None, 8).available is False
    assert XidWatcher(8).start() is False


# --- XID events -----------------------------------------------------------------------------------------------------


def logged_xids() -> list[int]:
    """The XID codes of the captured kernel log lines: 48, 63 and 79."""
    log = (DATA / "xid-kernel-log.txt").read_text()
    return [int(code) for code in re.findall(r"NVRM: Xid \(PCI:[0-9a-fA-F:.]+\): (\d+),", log)]


def logged_non_xid_event() -> tuple[int, int]:
    fields = re.search(r"EventType:(\d+) EventData:(\d+)", (DATA / "xid-kernel-log.txt").read_text())
    assert fields is not None
    return int(fields.group(1)), int(fields.group(2))


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_simulated_xid_events_counted_per_gpu_and_code() -> None:
    nvml = FakeNvml([answers("a10-nvidia-smi-q.txt"), answers("a10-second-nvidia-smi-q.txt")], events={0})
    watcher = XidWatcher(8, nvml=nvml, wait_ms=20)
    assert watcher.start() and watcher.running
    assert logged_xids() == [48, 63, 79]
    event_type, data = logged_non_xid_event()  # EventType 2 (a single-bit ECC event), not an XID: not counted
    nvml.deliver(0, event_type, data)
    for xid in logged_xids():
        nvml.deliver(0, pynvml.nvmlEventTypeXidCriticalError, xid)
    nvml.deliver(0, pynvml.nvmlEventTypeXidCriticalError, 48, same_handle=False)  # resolved by its UUID
    nvml.deliver(1, pynvml.nvmlEventTypeXidCriticalError, 79)  # gpu1 never registered: not counted
    wait_until(lambda: sum(watcher.snapshot().counts.values()) == 4 and nvml.event_queue.empty())
    time.sleep(0.05)  # the last event processed
    state = watcher.snapshot()
    assert state.counts == {(0, 48): 2, (0, 63): 1, (0, 79): 1}
    assert state.last == {0: 48} and state.supported == {0: True, 1: False}

    registry = scrape(nvml, watcher)
    assert value(registry, "gpu_xid_errors_total", device="gpu0", xid="48") == 2.0
    assert value(registry, "gpu_xid_errors_total", device="gpu0", xid="63") == 1.0
    assert value(registry, "gpu_xid_errors_total", device="gpu0", xid="119") == 0.0  # paging XIDs start at 0
    assert value(registry, "gpu_xid_last", device="gpu0") == 48.0
    assert value(registry, "gpu_xid_events_supported", device="gpu1") == 0.0
    assert not [s for s in series(registry, "gpu_xid_errors_total") if s["device"] == "gpu1"]

    started = time.monotonic()
    watcher.stop()
    assert not watcher.running and time.monotonic() - started < 2.0
    assert len(nvml.freed) == 1 and nvml.inits == nvml.shutdowns  # the event set freed, every NVML session closed


def test_simulated_xid_wait_errors_back_off_and_stop_cleanly() -> None:
    nvml = two_a10s()
    nvml.wait_error = pynvml.NVML_ERROR_GPU_IS_LOST  # nvmlEventSetWait_v2 answers GPU_IS_LOST for a GPU off the bus
    watcher = XidWatcher(8, nvml=nvml, wait_ms=50)
    assert watcher.start()
    time.sleep(0.5)
    assert 1 <= nvml.waits <= 20  # waits wait_ms between tries instead of spinning
    watcher.stop()
    assert not watcher.running and nvml.inits == nvml.shutdowns


def test_simulated_no_gpu_supports_xid_events() -> None:
    nvml = FakeNvml([answers("a10-nvidia-smi-q.txt")], events=set())
    watcher = XidWatcher(8, nvml=nvml, wait_ms=20)
    assert watcher.start() and not watcher.running  # nothing to wait on
    assert watcher.snapshot().supported == {0: False} and nvml.inits == nvml.shutdowns
    registry = scrape(nvml, watcher)
    assert value(registry, "gpu_xid_events_supported", device="gpu0") == 0.0
    assert series(registry, "gpu_xid_errors_total") == []


def test_simulated_driver_loaded_after_the_exporter_started_the_next_scrape_starts_the_xid_watch() -> None:
    nvml = FakeNvml([answers("a10-nvidia-smi-q.txt")], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED, events={0})
    watcher = XidWatcher(8, nvml=nvml, wait_ms=20)
    assert not watcher.start()
    registry = scrape(nvml, watcher)
    generate_latest(registry)  # a scrape while the driver is still missing: nothing to watch yet
    assert not watcher.running
    nvml.init_error = None  # the kernel module loaded, the service untouched
    assert value(registry, "gpu_xid_events_supported", device="gpu0") == 1.0  # this scrape started the watch
    assert watcher.running
    nvml.deliver(0, pynvml.nvmlEventTypeXidCriticalError, 79)
    wait_until(lambda: watcher.snapshot().counts == {(0, 79): 1})
    assert value(registry, "gpu_xid_errors_total", device="gpu0", xid="79") == 1.0
    watcher.stop()
    assert not watcher.running and nvml.inits == nvml.shutdowns


def test_record_xid_is_pure() -> None:
    before = gpu_health.XidState()
    after = gpu_health.record_xid(gpu_health.record_xid(before, 1, 79), 1, 79)
    assert before.counts == {} and after.counts == {(1, 79): 2} and after.last == {1: 79}


# --- settings and rules ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"expected_pcie_width": 10}, "is not a PCIe link width; accepted: 1, 2, 4, 8, 12, 16, 32"),
        ({"fatal_xids": []}, "fatal_xids must be one or more distinct XID codes"),
        ({"fatal_xids": [48, 48]}, "fatal_xids must be one or more distinct XID codes"),
        ({"full_width_devices": [0, -1]}, "full_width_devices must be distinct NVML indices"),
        ({"degraded_link_for": "5 minutes"}, "is not a Prometheus duration"),
        ({"power_limit_ratio": 1.5}, "less than or equal to 1"),
        ({"expected_gpus": True}, "a boolean is not a number"),
        ({"expected_gpu": 2}, "Extra inputs are not permitted"),
    ],
)
def test_gpu_health_settings_refuse_with_a_reason(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        GpuHealthSettings.model_validate(values)


def test_expected_gpus_must_be_watched() -> None:
    engine = EngineSettings(model_dir=Path("/m"))
    with pytest.raises(ValidationError, match=re.escape("gpu_health.expected_gpus (4) exceeds exporter.max_gpus (2)")):
        ServiceSettings(
            engine=engine, exporter=ExporterSettings(max_gpus=2), gpu_health=GpuHealthSettings(expected_gpus=4)
        )
    with pytest.raises(ValidationError, match=re.escape("gpu_health.full_width_devices [8] are not below")):
        ServiceSettings(engine=engine, gpu_health=GpuHealthSettings(full_width_devices=[0, 8]))


@pytest.mark.invariant("hw-pcie-link-width-x16")
def test_rules_follow_the_gpu_health_settings() -> None:
    default = {rule["alert"]: rule for rule in slo.gpu_rules(GpuHealthSettings())}
    assert 'gpu_pcie_link_width{bound="current"} < 16' in default["GpuPcieLinkDegraded"]["expr"]
    assert 'xid=~"46|48|62|64|74|79|95|119|120|140|158"' in default["GpuFatalXid"]["expr"]
    assert {rule["labels"]["severity"] for name, rule in default.items() if name != "GpuMissing"} == {"page", "ticket"}
    custom = GpuHealthSettings(
        expected_pcie_width=8, full_width_devices=[0, 1], fatal_xids=[48, 79], degraded_link_for="2m"
    )
    text = slo.render_rules(SloSettings(), QualitySettings(), custom)
    assert 'gpu_pcie_link_width{bound="current", device=~"gpu0|gpu1"} < 8' in text
    assert 'xid=~"48|79"' in text and "for: 2m" in text
    for rule in slo.gpu_rules(custom):
        assert "{{ $labels.instance }}" in rule["annotations"]["summary"]
        if rule["alert"] != "GpuMissing":  # NVML cannot name a GPU it no longer enumerates
            assert "{{ $labels.device }}" in rule["annotations"]["summary"]
        if rule["alert"] not in ("GpuMissing", "GpuGuardDrained"):  # the guard's series carries the serial it read
            assert "group_left (serial) gpu_info" in rule["expr"]
