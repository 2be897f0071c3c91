"""GPU health through NVML: identity, XID events, ECC, retired pages and remapped rows, clock event reasons, power,
temperature, the PCIe link and GPUs off the bus, as Prometheus metrics (registered by exporter.build_registry).

Two layers. The NVML layer (`read_health`, `XidWatcher`) is the only code here that calls pynvml: it turns each answer
into the typed readings below one GPU and one field at a time, so a field a GPU does not support costs that field and
a GPU off the bus costs that GPU, never the others' readings nor the exporter. The pure layer (`throttle_reasons`,
`record_xid`, `remember_identities`, `health_families`) turns readings into metric families; the tests drive it with
values of real `nvidia-smi -q` captures. Readings are taken at scrape time like exporter.HardwareCollector's; only XID
events need a thread, because NVML delivers them as events, not as a value to read.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ironserve_service.settings import GpuHealthSettings

log = logging.getLogger(__name__)

# nvmlReturn_t codes (NVML API reference, nvmlReturn_t in "Device Enums"); pynvml raises NVMLError carrying it in
# `.value`.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
# nvmlEnableState_t NVML_FEATURE_ENABLED, nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU, nvmlMemoryErrorType_t,
# nvmlEccCounterType_t and nvmlPageRetirementCause_t (NVML API reference, "Device Enums" and nvml.h).
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
ECC_ERROR_TYPES = {"corrected": 0, "uncorrected": 1}
ECC_COUNTERS = {"volatile": 0, "aggregate": 1}
RETIREMENT_CAUSES = {"multiple_single_bit_ecc": 0, "double_bit_ecc": 1}
# nvmlEventTypeXidCriticalError (NVML API reference, "Event Types"): the event set delivers each XID with its code in
# eventData.
XID_CRITICAL_EVENT = 0x8
# The clock event (formerly "throttle") reason bits, NVML API reference NvmlClocksEventReasons
# (https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html; the same bits as the R525 reference's
# nvmlClocksThrottleReasons). Each is exported as one 0/1 series, named as nvidia-smi -q's "Clocks Event Reasons".
THROTTLE_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
# PCIe link widths a link can train at (PCI Express Base Specification, Link Capabilities "Maximum Link Width").
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)
# XIDs that page: those whose immediate action in NVIDIA's Xid catalog for Ampere and newer GPUs (PCIe form factors
# included, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) is a GPU reset (RESET_GPU) or a node
# reboot (RESTART_BM), or whose workflow says "A GPU reset or node reboot is needed to clear this error":
#   46 ROBUST_CHANNEL_GPU_TIMEOUT_ERROR, GPU stopped processing (RESET_GPU)
#   48 ROBUST_CHANNEL_GPU_ECC_DBE, double bit ECC error (WORKFLOW_XID_48: reset or reboot needed)
#   62 PMU_HALT_ERROR, internal micro-controller halt (RESET_GPU)
#   64 INFOROM_DRAM_RETIREMENT_FAILURE, row remapping / page retirement failure (RESET_GPU)
#   74 NVLINK_ERROR (WORKFLOW_NVLINK_ERR: reset or reboot needed; the A10 has no NVLink, kept for other profiles)
#   79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)
#   95 ROBUST_CHANNEL_UNCONTAINED_ERROR, uncontained memory error (RESET_GPU)
#   119 GSP_RPC_TIMEOUT and 120 GSP_ERROR (RESET_GPU)
#   140 UNRECOVERABLE_ECC_ERROR_ESCAPE (RESET_GPU)
#   158 GPU_FATAL_TIMEOUT (RESET_GPU)
# Not paging, by the same catalog: 63 (row remap recorded: IGNORE; the pending remap is gpu_remapped_rows_pending's
# ticket), 92 (high single-bit ECC rate: IGNORE), 94 (contained error: RESTART_APP, reset "when convenient"; the
# engine restarting pages as ServingEngineDown). 109 (context switch timeout, RESET_GPU) is left out because NVIDIA's
# own device plugin treats it as an application error (k8s-device-plugin internal/rm/health.go skips 13, 31, 43, 45,
# 68 and 109); add it to gpu_health.fatal_xids to page on it.
FATAL_XIDS = (46, 48, 62, 64, 74, 79, 95, 119, 120, 140, 158)
UNKNOWN = "N/A"  # what nvidia-smi prints for a value the GPU does not report


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    serial: str
    name: str
    pci_bus_id: str

    @property
    def device(self) -> str:
        return f"gpu{self.index}"


@dataclass(frozen=True)
class RetiredPages:
    """Pre-Ampere dynamic page retirement; Ampere GPUs such as the A10 answer NOT_SUPPORTED and remap rows instead."""

    multiple_single_bit_ecc: int | None
    double_bit_ecc: int | None
    pending: bool | None


@dataclass(frozen=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class PcieLink:
    current_generation: int | None
    max_generation: int | None
    current_width: int | None
    max_width: int | None


@dataclass(frozen=True)
class GpuHealth:
    index: int
    identity: GpuIdentity | None = None
    lost: bool = False
    # (error_type, counter) -> count; None when ECC is off or not supported (no series rather than zeros).
    ecc: Mapping[tuple[str, str], int] | None = None
    retired_pages: RetiredPages | None = None
    remapped_rows: RemappedRows | None = None
    throttle_mask: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    power_default_limit_mw: int | None = None
    temperature_c: int | None = None
    pcie: PcieLink | None = None

    @property
    def device(self) -> str:
        return f"gpu{self.index}"


@dataclass(frozen=True)
class HealthSnapshot:
    available: bool  # NVML initialised: False on a host without a driver or GPU
    visible_count: int | None  # nvmlDeviceGetCount, not capped by max_gpus
    gpus: tuple[GpuHealth, ...] = ()


@dataclass(frozen=True)
class XidState:
    counts: Mapping[tuple[int, int], int] = field(default_factory=dict)  # (GPU index, XID) -> events since start
    last: Mapping[int, int] = field(default_factory=dict)  # GPU index -> the last XID seen
    supported: Mapping[int, bool] = field(default_factory=dict)  # GPU index -> XID events registered


# --- pure layer ---------------------------------------------------------------------------------------------------


def throttle_reasons(mask: int) -> dict[str, bool]:
    return {reason: bool(mask & bit) for reason, bit in THROTTLE_REASONS.items()}


def watts(milliwatts: int) -> float:
    return milliwatts / 1000.0


def record_xid(state: XidState, index: int, xid: int) -> XidState:
    counts = dict(state.counts)
    counts[(index, xid)] = counts.get((index, xid), 0) + 1
    return replace(state, counts=counts, last={**state.last, index: xid})


def remember_identities(known: Mapping[int, GpuIdentity], snapshot: HealthSnapshot) -> dict[int, GpuIdentity]:
    """Identities read so far by index: a GPU that is lost can no longer say its serial, and alerts must name it."""
    return {**known, **{gpu.index: gpu.identity for gpu in snapshot.gpus if gpu.identity is not None}}


def _gauge(name: str, documentation: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


def health_families(
    snapshot: HealthSnapshot,
    xids: XidState | None,
    identities: Mapping[int, GpuIdentity],
    expected_gpus: int,
    fatal_xids: Sequence[int],
) -> list[Metric]:
    expected = _gauge("gpu_expected_count", "GPUs this host should show (gpu_health.expected_gpus)")
    expected.add_metric([], expected_gpus)
    families: list[Metric] = [expected]
    if not snapshot.available:
        return families  # a host without NVML says so through gpu_nvml_available; nothing here to report
    info = _gauge("gpu_info", "GPU identity, 1", ["device", "uuid", "serial", "name", "pci_bus_id"])
    lost = _gauge("gpu_lost", "1 when NVML cannot reach the GPU (off the bus: NVML_ERROR_GPU_IS_LOST)", ["device"])
    ecc = _gauge(
        "gpu_ecc_errors", "ECC errors; volatile since the driver loaded, aggregate over the board's life",
        ["device", "error_type", "counter"],
    )  # fmt: skip
    retired = _gauge("gpu_retired_pages", "Pages retired by cause (pre-Ampere)", ["device", "cause"])
    retired_pending = _gauge("gpu_retired_pages_pending", "1 while pages wait for retirement (reboot)", ["device"])
    remapped = _gauge("gpu_remapped_rows", "Rows remapped by cause (Ampere and newer)", ["device", "kind"])
    remap_pending = _gauge("gpu_remapped_rows_pending", "1 while a remap waits for a GPU reset", ["device"])
    remap_failure = _gauge("gpu_remapped_rows_failure", "1 once a row remapping has failed", ["device"])
    throttle = _gauge("gpu_throttle_reason_active", "1 while the clock event reason holds", ["device", "reason"])
    power = _gauge("gpu_power_watts", "Power draw", ["device"])
    limit = _gauge("gpu_power_limit_watts", "Enforced power limit", ["device"])
    default_limit = _gauge("gpu_power_default_limit_watts", "The board's default power limit", ["device"])
    temperature = _gauge("gpu_temperature_celsius", "GPU core temperature", ["device"])
    generation = _gauge("gpu_pcie_link_generation", "PCIe generation; max: device and slot allow", ["device", "bound"])
    width = _gauge("gpu_pcie_link_width", "PCIe lanes; max: what device and slot allow", ["device", "bound"])
    if snapshot.visible_count is not None:
        visible = _gauge("gpu_visible_count", "GPUs NVML enumerates")
        visible.add_metric([], snapshot.visible_count)
        families.append(visible)
    for gpu in snapshot.gpus:
        device = gpu.device
        who = gpu.identity or identities.get(gpu.index)
        if who is None:
            info.add_metric([device, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN], 1.0)
        else:
            info.add_metric([device, who.uuid, who.serial, who.name, who.pci_bus_id], 1.0)
        lost.add_metric([device], 1.0 if gpu.lost else 0.0)
        for (error_type, counter), count in sorted((gpu.ecc or {}).items()):
            ecc.add_metric([device, error_type, counter], count)
        if gpu.retired_pages is not None:
            pages = gpu.retired_pages
            for cause, retired_count in (("multiple_single_bit_ecc", pages.multiple_single_bit_ecc),
                                         ("double_bit_ecc", pages.double_bit_ecc)):  # fmt: skip
                if retired_count is not None:
                    retired.add_metric([device, cause], retired_count)
            if pages.pending is not None:
                retired_pending.add_metric([device], 1.0 if pages.pending else 0.0)
        if gpu.remapped_rows is not None:
            rows = gpu.remapped_rows
            remapped.add_metric([device, "correctable"], rows.correctable)
            remapped.add_metric([device, "uncorrectable"], rows.uncorrectable)
            remap_pending.add_metric([device], 1.0 if rows.pending else 0.0)
            remap_failure.add_metric([device], 1.0 if rows.failure else 0.0)
        if gpu.throttle_mask is not None:
            for reason, active in throttle_reasons(gpu.throttle_mask).items():
                throttle.add_metric([device, reason], 1.0 if active else 0.0)
        for family, milliwatts in ((power, gpu.power_mw), (limit, gpu.power_limit_mw),
                                   (default_limit, gpu.power_default_limit_mw)):  # fmt: skip
            if milliwatts is not None:
                family.add_metric([device], watts(milliwatts))
        if gpu.temperature_c is not None:
            temperature.add_metric([device], gpu.temperature_c)
        if gpu.pcie is not None:
            link = gpu.pcie
            bounds = (
                (generation, "current", link.current_generation), (generation, "max", link.max_generation),
                (width, "current", link.current_width), (width, "max", link.max_width),
            )  # fmt: skip
            for family, bound, value in bounds:
                if value is not None:
                    family.add_metric([device, bound], value)
    families += [info, lost, ecc, retired, retired_pending, remapped, remap_pending, remap_failure, throttle]
    families += [power, limit, default_limit, temperature, generation, width]
    if xids is not None:
        families += xid_families(xids, fatal_xids)
    return families


def xid_families(xids: XidState, fatal_xids: Sequence[int]) -> list[Metric]:
    supported = _gauge("gpu_xid_events_supported", "1 when NVML delivers this GPU's XID events", ["device"])
    errors = CounterMetricFamily(
        "gpu_xid_errors_total", "XID events since the exporter started", labels=["device", "xid"]
    )
    last = _gauge("gpu_xid_last", "The last XID this GPU reported since the exporter started", ["device"])
    for index, registered in sorted(xids.supported.items()):
        supported.add_metric([f"gpu{index}"], 1.0 if registered else 0.0)
    counts = dict(xids.counts)
    for index, registered in xids.supported.items():
        if registered:
            # Zeros for the paging XIDs: a counter that appears already at 1 has no increase() to alert on.
            for xid in fatal_xids:
                counts.setdefault((index, xid), 0)
    for (index, xid), count in sorted(counts.items()):
        errors.add_metric([f"gpu{index}", str(xid)], count)
    for index, xid in sorted(xids.last.items()):
        last.add_metric([f"gpu{index}"], xid)
    return [supported, errors, last]


# --- NVML layer ---------------------------------------------------------------------------------------------------


class _Lost(Exception):
    """The GPU answered NVML_ERROR_GPU_IS_LOST: nothing more can be read from it."""


def nvml_code(error: BaseException) -> int | None:
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def load_nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:  # the package is a dependency; its absence means a broken install, reported as no NVML
        return None
    return pynvml


def _ask(call: Callable[..., Any], *args: Any) -> Any | None:
    """One NVML answer; None when the GPU does not support it or NVML fails on this field alone."""
    try:
        return call(*args)
    except Exception as error:  # NVMLError, or an AttributeError for a function an old binding lacks
        if nvml_code(error) == NVML_ERROR_GPU_IS_LOST:
            raise _Lost from error
        if nvml_code(error) != NVML_ERROR_NOT_SUPPORTED:
            log.debug("NVML %s failed: %s", getattr(call, "__name__", call), error)
        return None


def _text(value: object) -> str:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value) if value not in (None, "") else UNKNOWN


def _clock_event_reasons(nvml: Any, handle: object) -> int:
    # Drivers before R535 (the R740 profile's 525) have only the older name for the same bitmask.
    try:
        return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except AttributeError:
        pass
    except Exception as error:
        if nvml_code(error) != NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _read_identity(nvml: Any, handle: object, index: int) -> GpuIdentity:
    pci = _ask(nvml.nvmlDeviceGetPciInfo, handle)
    return GpuIdentity(
        index=index,
        uuid=_text(_ask(nvml.nvmlDeviceGetUUID, handle)),
        serial=_text(_ask(nvml.nvmlDeviceGetSerial, handle)),  # pynvml returns the serial as bytes
        name=_text(_ask(nvml.nvmlDeviceGetName, handle)),
        pci_bus_id=_text(getattr(pci, "busId", None)),
    )


def _read_ecc(nvml: Any, handle: object) -> dict[tuple[str, str], int] | None:
    mode = _ask(nvml.nvmlDeviceGetEccMode, handle)  # [current, pending]
    if not mode or mode[0] != NVML_FEATURE_ENABLED:
        return None  # ECC off: the counters would read as zeros that mean nothing
    counts = {}
    for error_type, type_value in ECC_ERROR_TYPES.items():
        for counter, counter_value in ECC_COUNTERS.items():
            count = _ask(nvml.nvmlDeviceGetTotalEccErrors, handle, type_value, counter_value)
            if count is not None:
                counts[(error_type, counter)] = int(count)
    return counts


def _read_retired_pages(nvml: Any, handle: object) -> RetiredPages | None:
    pages = {cause: _ask(nvml.nvmlDeviceGetRetiredPages, handle, value) for cause, value in RETIREMENT_CAUSES.items()}
    pending = _ask(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if pending is None and all(found is None for found in pages.values()):
        return None
    single, double = pages["multiple_single_bit_ecc"], pages["double_bit_ecc"]
    return RetiredPages(
        multiple_single_bit_ecc=None if single is None else len(single),
        double_bit_ecc=None if double is None else len(double),
        pending=None if pending is None else bool(pending),
    )


def _read_remapped_rows(nvml: Any, handle: object) -> RemappedRows | None:
    rows = _ask(nvml.nvmlDeviceGetRemappedRows, handle)  # (correctable, uncorrectable, pending, failure)
    if rows is None:
        return None
    correctable, uncorrectable, pending, failure = rows
    return RemappedRows(int(correctable), int(uncorrectable), bool(pending), bool(failure))


def read_gpu(nvml: Any, index: int) -> GpuHealth:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as error:
        # No handle means nothing on this GPU can be watched or served; NVML has answered GPU_IS_LOST or, for a card
        # gone from the bus, "Unknown Error" here (NVIDIA/dcgm-exporter#604).
        log.warning("gpu%d: no NVML handle: %s", index, error)
        return GpuHealth(index=index, lost=True)
    identity = None
    try:
        identity = _read_identity(nvml, handle, index)
        generation = _ask(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
        return GpuHealth(
            index=index,
            identity=identity,
            ecc=_read_ecc(nvml, handle),
            retired_pages=_read_retired_pages(nvml, handle),
            remapped_rows=_read_remapped_rows(nvml, handle),
            throttle_mask=_ask(_clock_event_reasons, nvml, handle),
            power_mw=_ask(nvml.nvmlDeviceGetPowerUsage, handle),
            power_limit_mw=_ask(nvml.nvmlDeviceGetEnforcedPowerLimit, handle),
            power_default_limit_mw=_ask(nvml.nvmlDeviceGetPowerManagementDefaultLimit, handle),
            temperature_c=_ask(nvml.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU),
            pcie=PcieLink(
                current_generation=generation,
                max_generation=_ask(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                current_width=_ask(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
                max_width=_ask(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
            ),
        )
    except _Lost:
        log.warning("gpu%d: NVML_ERROR_GPU_IS_LOST", index)
        return GpuHealth(index=index, identity=identity, lost=True)


def read_health(nvml: Any | None, max_gpus: int) -> HealthSnapshot:
    """One reading of every GPU (up to max_gpus); unavailable when NVML cannot start (no driver, no GPU)."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return HealthSnapshot(available=False, visible_count=None)
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError (library or driver missing): a host without a GPU
        return HealthSnapshot(available=False, visible_count=None)
    try:
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as error:
            log.warning("NVML initialised but cannot count GPUs: %s", error)
            return HealthSnapshot(available=False, visible_count=None)
        return HealthSnapshot(
            available=True, visible_count=count, gpus=tuple(read_gpu(nvml, i) for i in range(min(count, max_gpus)))
        )
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as error:  # a failed shutdown must not lose the reading
            log.debug("nvmlShutdown: %s", error)


def _handle_key(handle: object) -> int:
    # NVML's event data carries the same device pointer nvmlDeviceGetHandleByIndex returned, so the address names it.
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)  # type: ignore[arg-type]
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class XidWatcher:
    """Counts XID events per GPU from an NVML event set, on its own thread from `start` until `stop`.

    nvmlEventSetWait_v2 blocks for at most `wait_ms` (it answers NVML_ERROR_TIMEOUT when nothing came), so `stop`
    returns within that and an idle watcher costs nothing. NVML counts nvmlInit calls, so the scrape-time readings'
    own init and shutdown do not end the watcher's session.
    """

    def __init__(self, max_gpus: int, nvml: Any | None = None, wait_ms: int = 1000) -> None:
        self.max_gpus = max_gpus
        self.wait_ms = wait_ms
        self._nvml = nvml
        self._lock = threading.Lock()
        self._state = XidState()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False  # NVML answered a start; until then each reading's ensure_started tries again
        self._starting = threading.Lock()  # scrapes run on concurrent threads
        self._event_set: object | None = None
        self._indices: dict[int, int] = {}  # handle address -> GPU index
        self._uuids: dict[str, int] = {}  # UUID -> GPU index

    def snapshot(self) -> XidState:
        with self._lock:
            return self._state

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """False when NVML is unusable; True once the GPUs that support XID events are registered."""
        with self._starting:
            self._started = self._started or self._start()
            return self._started

    def ensure_started(self) -> None:
        """Starts the watch once NVML answers, for a driver that loaded after the service started (a driver installed
        or reloaded under a running service); called with each reading that found NVML available."""
        if not self._started and not self._stop.is_set():
            self.start()

    def _start(self) -> bool:
        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            return False
        try:
            nvml.nvmlInit()
        except Exception:
            return False
        self._nvml = nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as error:
            log.warning("XID events unavailable: %s", error)
            self._release()
            return True
        supported = {index: self._register(nvml, index) for index in range(min(count, self.max_gpus))}
        with self._lock:
            self._state = replace(self._state, supported=supported)
        if not any(supported.values()):
            self._release()  # nothing to wait on; gpu_xid_events_supported says why the XID alert is blind
            return True
        self._thread = threading.Thread(target=self._run, args=(nvml, self._event_set), name="xid-watch", daemon=True)
        self._thread.start()
        return True

    def _register(self, nvml: Any, index: int) -> bool:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_EVENT, self._event_set)
        except Exception as error:
            level = logging.INFO if nvml_code(error) == NVML_ERROR_NOT_SUPPORTED else logging.WARNING
            log.log(level, "gpu%d: XID events not registered: %s", index, error)
            return False
        self._indices[_handle_key(handle)] = index
        try:
            uuid = _ask(nvml.nvmlDeviceGetUUID, handle)
        except _Lost:
            uuid = None
        if uuid is not None:
            self._uuids[_text(uuid)] = index
        return True

    def _run(self, nvml: Any, event_set: object) -> None:
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
            except Exception as error:
                if nvml_code(error) != NVML_ERROR_TIMEOUT:
                    # GPU_IS_LOST or an unexpected error: wait before asking again instead of spinning on it.
                    log.warning("XID event wait: %s", error)
                    self._stop.wait(self.wait_ms / 1000.0)
                continue
            self.process(data)

    def process(self, data: Any) -> None:
        """One nvmlEventData_t: counted when it is an XID of a registered GPU."""
        if not int(data.eventType) & XID_CRITICAL_EVENT:
            return
        index = self._indices.get(_handle_key(data.device))
        if index is None and self._nvml is not None:
            # NVIDIA's device plugin names the event's GPU by UUID (k8s-device-plugin internal/rm/health.go).
            try:
                index = self._uuids.get(_text(self._nvml.nvmlDeviceGetUUID(data.device)))
            except Exception as error:
                log.warning("XID %s on a GPU NVML cannot name: %s", data.eventData, error)
        if index is None:
            return
        xid = int(data.eventData)
        log.warning("gpu%d: XID %d", index, xid)
        with self._lock:
            self._state = record_xid(self._state, index, xid)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("XID watcher still in NVML after %.1f s; its event set is left to the process", timeout_s)
                return
        self._release()

    def _release(self) -> None:
        nvml, event_set = self._nvml, self._event_set
        self._event_set = None
        if nvml is None:
            return
        if event_set is not None:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception as error:
                log.debug("nvmlEventSetFree: %s", error)
        try:
            nvml.nvmlShutdown()
        except Exception as error:
            log.debug("nvmlShutdown: %s", error)
        self._nvml = None


class GpuHealthCollector(Collector):
    """The health families at every scrape; XID counts come from the watcher, when the exporter runs one."""

    def __init__(
        self, settings: GpuHealthSettings, max_gpus: int, xids: XidWatcher | None = None, nvml: Any | None = None
    ) -> None:
        self.settings = settings
        self.max_gpus = max_gpus
        self.xids = xids
        self.nvml = nvml
        self._lock = threading.Lock()
        self._identities: dict[int, GpuIdentity] = {}

    def collect(self) -> Iterator[Metric]:
        snapshot = read_health(self.nvml, self.max_gpus)
        if self.xids is not None and snapshot.available:
            self.xids.ensure_started()
        with self._lock:  # scrapes may run concurrently (the HTTP server is threaded)
            self._identities = remember_identities(self._identities, snapshot)
            identities = dict(self._identities)
        xids = self.xids.snapshot() if self.xids is not None else None
        yield from health_families(snapshot, xids, identities, self.settings.expected_gpus, self.settings.fatal_xids)
