"""The GPU guard: a serving GPU that meets a page rule's condition takes the host out of serving on its own, and the
host comes back once the GPUs are fit and the model answers again.

Pure layer: `unfit` names the serving GPUs that are unfit now, from a gpu_health reading, the XID counts and what the
guard remembers (`GuardMemory`: identities read before a GPU was lost, the ECC and XID counts already seen, since when
a held condition holds); `decide` says what that means for the host's traffic state. Each condition is one page rule
of slo.gpu_rules (`Unfit.rule` names it) with the same hold time; tests/test_gpu_guard.py runs the rules' promtool
cases through `unfit`. The loop (`GpuGuard`, a thread of `ironserve-service control`) reads NVML and etcd every
gpu_health.guard_interval_s and writes the traffic key, the reason and its own record in one etcd transaction.

By the host's traffic state (README "GPU guard"):
- serving, a serving GPU unfit: `draining` (out of the load balancer, requests still served), the reason beside it;
- draining by the guard, every serving GPU fit, the active colour answering a completion: `serving`;
- a state an admin wrote after the guard's (`traffic draining`, `drain`): the admin's, never undone;
- `serving` put by an admin over the guard's drain: what is unfit at that moment is acknowledged, and the guard
  drains again only for a condition that clears and recurs, or a new one.
It never reboots the host nor resets a GPU: either stops every engine on it, and which one a fault needs (NVIDIA's Xid
catalog names a GPU reset or a reboot per XID, gpu_health.FATAL_XIDS) is for the person who looks at the GPU.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ironserve_service.control import (
    Etcd,
    EtcdError,
    Snapshot,
    check_colour,
    desired,
    same_revision,
    traffic_state,
)
from ironserve_service.gpu_health import (
    GpuHealth,
    GpuIdentity,
    HealthSnapshot,
    XidState,
    XidWatcher,
    read_health,
    remember_identities,
)
from ironserve_service.health import ProbeResult
from ironserve_service.router import Traffic
from ironserve_service.settings import GpuHealthSettings, ServiceSettings, SwapSettings, duration_seconds
from ironserve_service.slo import MISSING_FOR

# The page rules of slo.gpu_rules the guard drains on, one condition each.
RULES = (
    "GpuLost",
    "GpuMissing",
    "GpuUncorrectableEccError",
    "GpuFatalXid",
    "GpuRowRemapFailure",
    "GpuRetiredPagesPending",
    "GpuPcieLinkDegraded",
)
# Events, not states: an uncorrectable ECC error or a fatal XID stays unfit after its page's window (a fatal XID until
# the host reboots, an ECC error until a GPU reset or driver reload zeroes the volatile count), or until an admin
# acknowledges it: NVIDIA's Xid catalog clears these only by a GPU reset or a reboot, and the window ending is neither.
LATCHED = frozenset({"GpuUncorrectableEccError", "GpuFatalXid"})
# Where the kernel says which boot this is: a drain recorded in an earlier boot says nothing about latched events now.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
REASON_PREFIX = "gpu-health: "


@dataclass(frozen=True)
class Unfit:
    index: int | None  # NVML index; None: a GPU NVML does not enumerate and the guard never named
    serial: str
    rule: str  # the page alert of slo.gpu_rules whose condition this is
    reason: str

    @property
    def device(self) -> str:
        return "unknown" if self.index is None else f"gpu{self.index}"

    @property
    def key(self) -> tuple[int | None, str]:
        return self.index, self.rule

    def text(self) -> str:
        return self.reason if self.index is None else f"{self.device} (serial {self.serial}) {self.reason}"


def drain_reason(gpus: Sequence[Unfit]) -> str:
    """The one line the traffic reason key, Envoy's /health header and `status` show."""
    return REASON_PREFIX + "; ".join(gpu.text() for gpu in gpus)


@dataclass(frozen=True)
class GuardMemory:
    identities: Mapping[int, GpuIdentity] = field(default_factory=dict)
    # The uncorrectable volatile ECC count per GPU that is not new: the first reading, lowered when a driver reload or
    # GPU reset zeroes the counter, raised to the count an admin's `traffic serving` acknowledged.
    ecc: Mapping[int, int] = field(default_factory=dict)
    xids: Mapping[tuple[int, int], int] = field(default_factory=dict)  # (GPU, XID) counts acknowledged
    since: Mapping[tuple[int | None, str], float] = field(default_factory=dict)  # a held condition: seen since
    acknowledged: frozenset[tuple[int | None, str]] = frozenset()  # what an admin's serving accepted
    carried: tuple[Unfit, ...] = ()  # latched conditions of this boot's drain, from before the guard started


def _uncorrected(gpu: GpuHealth) -> int | None:
    return None if gpu.ecc is None else gpu.ecc.get(("uncorrected", "volatile"))


def _holds(settings: GpuHealthSettings) -> dict[str, float]:
    """Seconds a condition must last before it counts: the `for:` of its rule."""
    return {"GpuPcieLinkDegraded": duration_seconds(settings.degraded_link_for),
            "GpuMissing": duration_seconds(MISSING_FOR)}  # fmt: skip


def _conditions(
    snapshot: HealthSnapshot, xids: XidState, settings: GpuHealthSettings, memory: GuardMemory
) -> list[Unfit]:
    """Every condition that holds in this reading, hold times not applied."""
    serving = settings.full_width_devices

    def serial(index: int, identity: GpuIdentity | None = None) -> str:
        who = identity or memory.identities.get(index)
        return "unknown" if who is None else who.serial

    found: list[Unfit] = []
    if snapshot.visible_count is not None and snapshot.visible_count < settings.expected_gpus:
        # NVML cannot name a card it no longer enumerates (GpuMissing has no device either).
        reason = f"NVML shows {snapshot.visible_count} of {settings.expected_gpus} expected GPUs"
        found.append(Unfit(None, "unknown", "GpuMissing", reason))
    for gpu in snapshot.gpus:
        if serving is not None and gpu.index not in serving:
            continue  # no request runs on it; its pages still fire
        who = serial(gpu.index, gpu.identity)
        if gpu.lost:
            found.append(Unfit(gpu.index, who, "GpuLost", "off the bus (NVML cannot reach it)"))
            continue
        count, seen = _uncorrected(gpu), memory.ecc.get(gpu.index)
        if count is not None and seen is not None and count > seen:
            found.append(Unfit(gpu.index, who, "GpuUncorrectableEccError", "new uncorrectable (double-bit) ECC error"))
        if gpu.remapped_rows is not None and gpu.remapped_rows.failure:
            found.append(Unfit(gpu.index, who, "GpuRowRemapFailure", "row remapping failed"))
        if gpu.retired_pages is not None and gpu.retired_pages.pending:
            found.append(Unfit(gpu.index, who, "GpuRetiredPagesPending", "retired pages pending (reboot to retire)"))
        width = None if gpu.pcie is None else gpu.pcie.current_width
        if width is not None and width < settings.expected_pcie_width:
            reason = f"PCIe link at x{width}, expected x{settings.expected_pcie_width}"
            found.append(Unfit(gpu.index, who, "GpuPcieLinkDegraded", reason))
    fatal: dict[int, list[int]] = {}
    for (index, xid), count in sorted(xids.counts.items()):
        new = xid in settings.fatal_xids and count > memory.xids.get((index, xid), 0)
        if new and (serving is None or index in serving):
            fatal.setdefault(index, []).append(xid)
    for index, codes in fatal.items():
        found.append(Unfit(index, serial(index), "GpuFatalXid", f"XID {', '.join(map(str, codes))}"))
    return found


def remember(
    memory: GuardMemory, snapshot: HealthSnapshot, xids: XidState, settings: GpuHealthSettings, now: float
) -> GuardMemory:
    """The memory after this reading (now: monotonic seconds): identities, ECC counts that are not new, since when
    each held condition holds (forgotten as soon as it does not), and the carried ECC errors not yet reset."""
    ecc = dict(memory.ecc)
    for gpu in snapshot.gpus:
        count = _uncorrected(gpu)
        if count is not None and (gpu.index not in ecc or count < ecc[gpu.index]):
            ecc[gpu.index] = count
    # A carried ECC error was counted when recorded, so a counter that reads 0 now has been zeroed by a reset since.
    zeroed = {gpu.index for gpu in snapshot.gpus if _uncorrected(gpu) == 0}
    carried = tuple(c for c in memory.carried if not (c.rule == "GpuUncorrectableEccError" and c.index in zeroed))
    identities = remember_identities(memory.identities, snapshot)
    updated = replace(memory, identities=identities, ecc=ecc, carried=carried)
    holds = _holds(settings)
    held = [gpu.key for gpu in _conditions(snapshot, xids, settings, updated) if gpu.rule in holds]
    return replace(updated, since={key: memory.since.get(key, now) for key in held})


def unfit(
    snapshot: HealthSnapshot, xids: XidState, settings: GpuHealthSettings, memory: GuardMemory, now: float
) -> list[Unfit]:
    """The serving GPUs (gpu_health.full_width_devices, or all) unfit now, by the page rules' conditions: lost, fewer
    GPUs than expected, a new uncorrectable volatile ECC error, a fatal XID, a failed row remap, retired pages pending,
    a link narrower than expected; plus the latched conditions carried over from this boot's drain."""
    holds = _holds(settings)
    found = [
        gpu for gpu in _conditions(snapshot, xids, settings, memory)
        if now - memory.since.get(gpu.key, now) >= holds.get(gpu.rule, 0.0)
    ]  # fmt: skip
    keys = {gpu.key for gpu in found}
    found += [gpu for gpu in memory.carried if gpu.key not in keys]
    return sorted(found, key=lambda gpu: (-1 if gpu.index is None else gpu.index, RULES.index(gpu.rule)))


def acknowledge(memory: GuardMemory, snapshot: HealthSnapshot, xids: XidState, found: Sequence[Unfit]) -> GuardMemory:
    """An admin put serving over the guard's drain: the counts of now are not new any more, and the conditions found
    now do not drain again until they clear."""
    ecc = {**memory.ecc, **{gpu.index: count for gpu in snapshot.gpus if (count := _uncorrected(gpu)) is not None}}
    acknowledged = frozenset(gpu.key for gpu in found)
    return replace(memory, ecc=ecc, xids=dict(xids.counts), acknowledged=acknowledged, carried=())


@dataclass(frozen=True)
class GuardRecord:
    """What the guard writes beside its drain (SwapSettings.gpu_guard_key): the GPUs it drained for and the boot."""

    boot_id: str
    gpus: tuple[Unfit, ...]

    def to_text(self) -> str:
        return json.dumps({"boot_id": self.boot_id, "gpus": [asdict(gpu) for gpu in self.gpus]})

    @classmethod
    def from_text(cls, text: str | None) -> GuardRecord | None:
        try:
            document = json.loads(text or "")
            boot_id = str(document["boot_id"])
            gpus = tuple(
                Unfit(None if gpu["index"] is None else int(gpu["index"]), str(gpu["serial"]), str(gpu["rule"]),
                      str(gpu["reason"]))
                for gpu in document["gpus"]
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None
        if any(gpu.rule not in RULES for gpu in gpus):
            return None  # not the guard's writing
        return cls(boot_id, gpus)


def restore(record: GuardRecord | None, boot_id: str) -> GuardMemory:
    """A guard that (re)starts during its own drain of this boot keeps what it drained for: the latched events (its
    new ECC baseline and XID counts could not see them; an ECC error until its counter reads 0) and the held
    conditions as already held. After a reboot the drivers start afresh and only what is read now counts."""
    if record is None or record.boot_id != boot_id:
        return GuardMemory()
    carried = tuple(gpu for gpu in record.gpus if gpu.rule in LATCHED)
    return GuardMemory(since={gpu.key: float("-inf") for gpu in record.gpus if gpu.rule not in LATCHED},
                       carried=carried)  # fmt: skip


@dataclass(frozen=True)
class HostView:
    traffic: Traffic
    record: GuardRecord | None  # the guard's record, when etcd has one
    owned: bool  # the traffic key was last written together with that record: the drain in force is the guard's


def host_view(swap: SwapSettings, state: Snapshot) -> HostView:
    record = GuardRecord.from_text(state.values.get(swap.gpu_guard_key))
    revisions = state.mod_revisions
    owned = record is not None and revisions.get(swap.traffic_key) == revisions.get(swap.gpu_guard_key)
    return HostView(traffic_state(swap, state.values), record, owned)


Action = Literal["drain", "update", "return", "acknowledge", "idle"]


def decide(view: HostView, pressing: Sequence[Unfit]) -> Action:
    """What the guard does with the host; `pressing`: the unfit GPUs not acknowledged by an admin.

    It drains and never closes: draining takes the host out of its load balancer as `drain`'s notice does, and keeps
    answering what still arrives, while closed would refuse it. A guard acting without a person may be wrong for
    every host at once (a driver that misreports, a setting rolled out to the fleet); draining every host still
    serves through a load balancer that fails open, closing every host would be an outage. Closing is the admin's
    `drain`.
    """
    if view.record is not None:
        if view.traffic == "serving":
            return "acknowledge"  # only an admin writes serving over the guard's record
        if not view.owned:
            return "idle"  # an admin's state since: theirs to end
        if not pressing:
            return "return"
        return "update" if tuple(pressing) != view.record.gpus else "idle"
    return "drain" if pressing and view.traffic == "serving" else "idle"


def drained_gpus(swap: SwapSettings, values: Mapping[str, str]) -> tuple[Unfit, ...]:
    """The GPUs of the guard's drain while the host is out of serving; none while it serves."""
    record = GuardRecord.from_text(values.get(swap.gpu_guard_key))
    if record is None or traffic_state(swap, dict(values)) == "serving":
        return ()
    return record.gpus


def read_boot_id() -> str:
    try:
        return BOOT_ID.read_text(encoding="utf-8").strip()
    except OSError:  # not Linux: every start counts as the same boot, so a drain is kept until an admin ends it
        return ""


class GpuGuard:
    """The guard's loop beside the control loop: a reading and a decision every gpu_health.guard_interval_s, from
    `start` until `stop`. `nvml` is pynvml (None: imported); `boot_id` names this boot (None: the kernel's)."""

    def __init__(
        self,
        settings: ServiceSettings,
        nvml: Any | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
        boot_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.swap = settings.swap
        self.health = settings.gpu_health
        self.nvml = nvml
        self.log = log
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.etcd = Etcd(self.swap.etcd_url, self.swap.etcd_timeout_s)
        self.xids = XidWatcher(settings.exporter.max_gpus, nvml=nvml)
        self.memory: GuardMemory | None = None
        self.shown: str | None = None  # the last standing note, logged once
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.xids.start()  # before the first reading: XIDs count from here
        self.thread = threading.Thread(target=self.run, name="gpu-guard", daemon=True)
        self.thread.start()
        serving = self.health.full_width_devices
        watched = "every GPU" if serving is None else f"GPUs {serving}"
        self.log(f"gpu-guard: watching {watched} every {self.health.guard_interval_s:g} s; it drains and returns this "
                 "host, never reboots it nor resets a GPU")  # fmt: skip

    def run(self) -> None:
        while not self.stopped.is_set():
            self.step()
            self.stopped.wait(self.health.guard_interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.xids.stop()

    def note(self, line: str | None) -> None:
        """A standing condition, logged when it begins; None: nothing standing."""
        if line is not None and line != self.shown:
            self.log(line)
        self.shown = line

    def step(self) -> None:
        """One reading and what it calls for."""
        snapshot = read_health(self.nvml, self.settings.exporter.max_gpus)
        if not snapshot.available:
            # Blind: a driver that stopped answering is no evidence that the GPUs are well, nor that they are not.
            self.note("gpu-guard: NVML unavailable: the guard neither drains nor returns this host")
            return
        self.xids.ensure_started()  # NVML answers now, perhaps for the first time since the guard started
        try:
            state = self.etcd.get_prefix(self.swap.key_prefix)
        except EtcdError as error:
            self.note(f"gpu-guard: etcd unreachable ({error}); the traffic state stays as it is")
            return
        xids, now = self.xids.snapshot(), time.monotonic()
        view = host_view(self.swap, state)
        memory = remember(self.memory or restore(view.record, self.boot_id), snapshot, xids, self.health, now)
        found = unfit(snapshot, xids, self.health, memory, now)
        pressing = [gpu for gpu in found if gpu.key not in memory.acknowledged]
        memory = replace(memory, acknowledged=memory.acknowledged & {gpu.key for gpu in found})
        action = decide(view, pressing)
        self.memory = acknowledge(memory, snapshot, xids, found) if action == "acknowledge" else memory
        self.note(self.act(action, view, state, pressing, found))

    def act(
        self, action: Action, view: HostView, state: Snapshot, pressing: list[Unfit], found: list[Unfit]
    ) -> str | None:
        """Carries the decision out; returns the standing note, if any."""
        swap = self.swap
        if action in ("drain", "update"):
            reason = drain_reason(pressing)
            record = GuardRecord(self.boot_id, tuple(pressing))
            puts = {swap.traffic_key: "draining", swap.traffic_reason_key: reason, swap.gpu_guard_key: record.to_text()}
            if self.write(state, puts):
                verb = "draining the host (out of its load balancer, requests still served)"
                self.log(f"gpu-guard: {verb if action == 'drain' else 'still draining, now'}: {reason}")
            return None
        if action == "return":
            colour, _ = desired(swap, state.values)
            # The full check, a completion answered: the model works on the GPUs again, not only its HTTP server.
            result = check_colour(self.settings, colour) if colour else ProbeResult(False, "no colour runs the version")
            if not result.ok:
                return f"gpu-guard: GPUs fit again; the host stays draining until the model answers: {result.reason}"
            if self.write(state, {swap.traffic_key: "serving"}, (swap.traffic_reason_key, swap.gpu_guard_key)):
                self.log(f"gpu-guard: serving again: every serving GPU fit and {colour} answered ({result.reason}); "
                         f"drained for {state.values.get(swap.traffic_reason_key)}")  # fmt: skip
            return None
        if action == "acknowledge":
            if self.write(state, {}, (swap.traffic_reason_key, swap.gpu_guard_key)):
                now = drain_reason(found) if found else "every serving GPU fit"
                self.log(f"gpu-guard: an admin put serving over the guard's drain; acknowledged ({now}): drained "
                         "again only for a condition that clears and recurs, or a new one")  # fmt: skip
            return None
        if view.record is not None and not view.owned:
            return f"gpu-guard: an admin's traffic {view.traffic} followed the guard's drain: the admin ends it"
        if view.record is not None:
            return None  # the guard's drain holds
        if pressing and view.traffic != "serving":
            return (f"gpu-guard: {drain_reason(pressing)}; the host is {view.traffic} by an admin, left so (drained "
                    "if serving is put back while unfit)")  # fmt: skip
        return None

    def write(self, state: Snapshot, puts: dict[str, str], deletes: tuple[str, ...] = ()) -> bool:
        """One transaction, only if neither the traffic key nor the guard's record changed since `state`."""
        keys = (self.swap.traffic_key, self.swap.gpu_guard_key)
        done, _ = self.etcd.txn([same_revision(key, state.mod_revisions.get(key, 0)) for key in keys], puts, deletes)
        if not done:
            self.log("gpu-guard: the traffic state changed while the guard decided; deciding again next reading")
        return done


class GuardCollector(Collector):
    """ironserve_gpu_guard_drained{device, serial, reason}: 1 per GPU while the guard's drain is in force, read from
    etcd at scrape time (the guard runs in the control loop's process, which serves no metrics)."""

    def __init__(self, swap: SwapSettings, timeout_s: float) -> None:
        self.swap = swap
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        drained = GaugeMetricFamily(
            "ironserve_gpu_guard_drained", "1 per GPU the GPU guard drained this host for, while it is out of serving",
            labels=["device", "serial", "reason"],
        )  # fmt: skip
        try:
            state = Etcd(self.swap.etcd_url, self.timeout_s).get_prefix(self.swap.key_prefix)
        except EtcdError:
            yield drained  # empty: with etcd down nobody can tell, and the guard waits for etcd too
            return
        for gpu in drained_gpus(self.swap, state.values):
            drained.add_metric([gpu.device, gpu.serial, gpu.reason], 1.0)
        yield drained
