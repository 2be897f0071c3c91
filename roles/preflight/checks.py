"""Hardware preflight: compare what a host is (facts, Redfish) with what its profile needs; report it.

Pure code: the role gathers the observations, this module decides. Each check has a stable name an
operator can override in the inventory (`preflight_overrides: ["psu-capacity"]`), an expected and an
observed value, and a sentence saying what to do when it fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from ironserve.run import BmcObservation, PowerSupplyInfo
from roles.preflight.facts import IommuState, PciDevice

if TYPE_CHECKING:
    from ironserve.profiles import HardwareSpec, Profile

Status = Literal["pass", "fail", "skip", "info"]

# Every check the preflight can report, in report order. Overrides must name one of these.
CHECK_NAMES: tuple[str, ...] = (
    "system-model",
    "redfish-system-model",
    "cpu-sockets",
    "gpu-count",
    "gpu-model",
    "gpu-bars-assigned",
    "pcie-link-width",
    "pcie-link-speed",
    "gpu-same-socket",
    "gpu-numa-node",
    "acs-p2p-redirect",
    "iommu",
    "psu-capacity",
    "bios-attributes",
    "bios-pending",
)
# PCIe generation -> per-lane transfer rate lspci prints (GT/s).
GEN_SPEED_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


@dataclass(frozen=True)
class HostObservation:
    """What the host says about itself over SSH (see roles.preflight.facts)."""

    product: str | None  # dmidecode -s system-product-name
    bios_version: str | None
    cpu_sockets: int | None
    devices: list[PciDevice]  # lspci -vvv -D, every function
    sysfs_numa: dict[str, int] = field(default_factory=dict)  # /sys/bus/pci/devices/*/numa_node
    power_supplies: list[PowerSupplyInfo] = field(default_factory=list)  # dmidecode -t 39
    iommu: IommuState | None = None


@dataclass(frozen=True)
class CheckResult:
    name: str
    expected: str
    observed: str
    status: Status
    advice: str = ""  # what to do, when it fails
    overridden: bool = False  # failed, but the inventory names it in preflight_overrides

    @property
    def blocking(self) -> bool:
        return self.status == "fail" and not self.overridden


@dataclass(frozen=True)
class PreflightReport:
    host: str
    profile: str
    checks: list[CheckResult]
    serving_gpus: list[str]  # PCI addresses the service may use (full width, lowest slots first)
    excluded_gpus: dict[str, str]  # address -> why it does not serve

    @property
    def passed(self) -> bool:
        return not any(c.blocking for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.blocking]

    def to_json(self) -> str:
        data = {
            "host": self.host,
            "profile": self.profile,
            "passed": self.passed,
            "serving_gpus": self.serving_gpus,
            "excluded_gpus": self.excluded_gpus,
            "checks": [asdict(c) for c in self.checks],
        }
        return json.dumps(data, indent=2) + "\n"

    def to_text(self) -> str:
        """One table per host (check, result, expected, observed); what to do under each failed row."""
        header = ("check", "result", "expected", "observed")
        rows = [(c.name, "FAIL*" if c.overridden else c.status.upper(), c.expected, c.observed) for c in self.checks]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(2)] + [
            min(max(len(r[2]) for r in [header, *rows]), 48)
        ]
        lines = [f"preflight {self.host} (profile {self.profile}): {'PASS' if self.passed else 'FAIL'}"]
        for check, row in zip([None, *self.checks], [header, *rows], strict=True):
            lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
            if check is not None and check.status == "fail":
                lines.append(" " * (widths[0] + 2) + "what to do: " + check.advice)
        if any(c.overridden for c in self.checks):
            lines.append("FAIL* = failed, allowed by preflight_overrides")
        if self.serving_gpus:
            lines.append("serving GPUs: " + ", ".join(self.serving_gpus))
        for address, why in self.excluded_gpus.items():
            lines.append(f"not serving: {address}: {why}")
        return "\n".join(line.rstrip() for line in lines) + "\n"


def gpus(devices: Iterable[PciDevice]) -> list[PciDevice]:
    """NVIDIA GPUs (3D/VGA controllers), in slot order (then address) as the riser numbers them."""
    found = [d for d in devices if d.is_gpu]
    return sorted(
        found, key=lambda d: (int(d.physical_slot or "99") if (d.physical_slot or "").isdigit() else 99, d.address)
    )


def _slot(gpu: PciDevice) -> str:
    return f"slot {gpu.physical_slot} ({gpu.address})" if gpu.physical_slot else gpu.address


def _numa(gpu: PciDevice, sysfs: dict[str, int]) -> int | None:
    # sysfs is the kernel's own view; lspci prints the same number when sysfs has the device.
    node = sysfs.get(gpu.address, gpu.numa_node)
    return None if node is None or node < 0 else node


def _speed(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}GT/s"


class _Checks:
    def __init__(self, overrides: Iterable[str]) -> None:
        self.overrides = set(overrides)
        self.results: list[CheckResult] = []

    def add(self, name: str, expected: str, observed: str, ok: bool | None, advice: str = "") -> None:
        status: Status = "skip" if ok is None else ("pass" if ok else "fail")
        self.results.append(
            CheckResult(name, expected, observed, status, advice, status == "fail" and name in self.overrides)
        )

    def info(self, name: str, expected: str, observed: str) -> None:
        self.results.append(CheckResult(name, expected, observed, "info"))


def evaluate(
    host: str,
    profile: Profile,
    observed: HostObservation,
    bios: BmcObservation | None,
    overrides: Iterable[str] = (),
) -> PreflightReport:
    """Run every check of `profile.hardware` against what the host and its iDRAC report."""
    spec = profile.hardware
    checks = _Checks(overrides)
    if spec is None:
        checks.add("system-model", "profile states no preflight", "-", None)
        return PreflightReport(host, profile.name, checks.results, [], {})
    model = profile.server.model
    checks.add(
        "system-model",
        model,
        observed.product or "unknown (dmidecode printed nothing)",
        None if observed.product is None else observed.product.strip() == model,
        f"this host is not a {model}: choose the ironserve_profile that matches {observed.product!r}, "
        "or run on the hardware this profile describes",
    )
    _cpu(checks, spec, observed)
    serving, excluded = _gpus(checks, spec, profile, observed)
    _acs(checks, observed)
    _psu(checks, spec, profile, observed, bios)
    _bios(checks, spec, profile, bios)
    order = {name: i for i, name in enumerate(CHECK_NAMES)}
    checks.results.sort(key=lambda c: order[c.name])
    return PreflightReport(host, profile.name, checks.results, serving, excluded)


def _cpu(checks: _Checks, spec: HardwareSpec, observed: HostObservation) -> None:
    checks.add(
        "cpu-sockets",
        str(spec.cpu_sockets),
        str(observed.cpu_sockets) if observed.cpu_sockets is not None else "unknown",
        None if observed.cpu_sockets is None else observed.cpu_sockets == spec.cpu_sockets,
        f"the profile expects {spec.cpu_sockets} populated CPU sockets; check the CPUs (lscpu) "
        "or choose a profile for this machine",
    )


def _gpus(
    checks: _Checks, spec: HardwareSpec, profile: Profile, observed: HostObservation
) -> tuple[list[str], dict[str, str]]:
    found = gpus(observed.devices)
    checks.add(
        "gpu-count",
        f"{spec.gpus_installed} NVIDIA GPUs",
        f"{len(found)}: " + ", ".join(_slot(g) for g in found) if found else "0",
        len(found) == spec.gpus_installed,
        "reseat the missing cards and their riser; a GPU the firmware does not enumerate never reaches the driver",
    )
    wrong = [g for g in found if spec.gpu_pci_name not in g.description]
    checks.add(
        "gpu-model",
        f"{profile.gpu.model} (lspci {spec.gpu_pci_name})",
        "; ".join(f"{_slot(g)}: {g.description}" for g in wrong) if wrong else f"all {len(found)} match",
        not wrong if found else None,
        f"replace the listed cards with {profile.gpu.model} (the old Tesla P4 is too slow for a 7B model), "
        "or choose the profile for these GPUs",
    )
    unmapped = [g for g in found if g.unassigned_bars]
    checks.add(
        "gpu-bars-assigned",
        "every GPU BAR has an address",
        "; ".join(f"{_slot(g)}: BAR {','.join(map(str, g.unassigned_bars))} unassigned" for g in unmapped)
        or "all assigned",
        not unmapped,
        "enable 'Memory Mapped I/O above 4GB' (Redfish MmioAbove4Gb=Enabled; bios_mode: apply sets it) and reboot: "
        "an A10's 32 GB BAR cannot be placed below 4 GB",
    )
    # Serving: full-width GPUs with mapped BARs, lowest slots first, up to the profile's count.
    excluded: dict[str, str] = {}
    candidates = []
    for gpu in found:
        status = gpu.link_status
        if gpu.unassigned_bars:
            excluded[gpu.address] = "BARs not mapped (MMIO above 4 GB)"
        elif status is None:
            excluded[gpu.address] = "no PCIe link status (lspci printed no LnkSta)"
        elif status.width < spec.serving_width:
            excluded[gpu.address] = f"trained at x{status.width}, serving needs x{spec.serving_width}"
        else:
            candidates.append(gpu)
    serving = candidates[: spec.serving_gpus]
    for gpu in candidates[spec.serving_gpus :]:
        excluded[gpu.address] = f"spare: the profile serves on {spec.serving_gpus} GPUs"
    widths = ", ".join(
        f"{_slot(g)} x{g.link_status.width if g.link_status else '?'}"
        + (" (excluded)" if g.address in excluded and "trained" in excluded[g.address] else "")
        for g in found
    )
    checks.add(
        "pcie-link-width",
        f"{spec.serving_gpus} GPUs at x{spec.serving_width}",
        widths or "no GPUs",
        len(serving) >= spec.serving_gpus,
        f"only {len(serving)} GPUs train at x{spec.serving_width}: move cards to full-width slots "
        "(R740: slots 3-4 share lanes and train at x8), check the riser, or lower preflight serving_gpus",
    )
    platform = GEN_SPEED_GTS[profile.server.pcie_gen]
    slow = []
    for gpu in serving:
        cap = gpu.link_capability.speed_gts if gpu.link_capability and gpu.link_capability.speed_gts else platform
        want = min(platform, cap)
        got = gpu.link_status.speed_gts if gpu.link_status else None
        if got is None or got < want:
            slow.append(f"{_slot(gpu)}: {_speed(got)} (want {_speed(want)})")
    checks.add(
        "pcie-link-speed",
        f"{_speed(platform)} (PCIe Gen{profile.server.pcie_gen}) on serving GPUs",
        "; ".join(slow) or (f"all {len(serving)} at {_speed(platform)}" if serving else "no serving GPU"),
        not slow if serving else None,
        "a GPU trained below the slot's speed: reseat it, check the riser cable, and check BIOS 'PCIe link speed' "
        "is not capped (the R740 is Gen3: 8 GT/s is the maximum, never 16)",
    )
    nodes = {g.address: _numa(g, observed.sysfs_numa) for g in serving}
    unknown = [a for a, n in nodes.items() if n is None]
    checks.add(
        "gpu-numa-node",
        "each serving GPU reports its NUMA node",
        ", ".join(f"{a}: node {n}" for a, n in nodes.items()) or "no serving GPU",
        not unknown if serving else None,
        "the firmware reports numa_node -1: enable NUMA (BIOS 'Node Interleaving' Disabled) so the service "
        "can bind its memory to the GPUs' socket",
    )
    distinct = {n for n in nodes.values() if n is not None}
    checks.add(
        "gpu-same-socket",
        "serving GPUs on one NUMA node" if spec.same_socket else "not required by the profile",
        ", ".join(f"{a}: node {n}" for a, n in nodes.items()) or "no serving GPU",
        (len(distinct) <= 1) if spec.same_socket and serving and not unknown else None,
        "the serving GPUs sit under different CPU sockets (P2P over UPI ran at 37% in the seed): move them "
        "to riser slots wired to one CPU; the BIOS cannot rebind a slot",
    )
    return [g.address for g in serving], excluded


def _acs(checks: _Checks, observed: HostObservation) -> None:
    redirecting = [d for d in observed.devices if d.acs_p2p_redirect]
    with_acs = [d for d in observed.devices if d.acs_control]
    checks.add(
        "acs-p2p-redirect",
        "ACS P2P redirect off on PCIe bridges (ReqRedir-, CmpltRedir-)",
        "; ".join(f"{d.address} ReqRedir/CmpltRedir on" for d in redirecting)
        or f"off on {len(with_acs)} ACS-capable functions",
        not redirecting,
        "ACS redirects GPU peer-to-peer traffic through the root complex: disable PCIe ACS in the BIOS or clear "
        "it per bridge (setpci -s BDF ECAP_ACS+0x6.w=0000); keep it only where VFIO isolation is needed",
    )
    if observed.iommu is not None:
        args = " ".join(observed.iommu.kernel_args) or "no iommu kernel arguments"
        checks.info("iommu", "recorded (bare metal needs no isolation)", f"{observed.iommu.groups} groups; {args}")


def _psu(
    checks: _Checks, spec: HardwareSpec, profile: Profile, observed: HostObservation, bios: BmcObservation | None
) -> None:
    # A10 board power is 150 W (NVIDIA datasheet); the seed sized the PSU for 250 W, which is wrong.
    gpu_count = max(spec.gpus_installed, len(gpus(observed.devices)))
    need = gpu_count * profile.gpu.board_power_w + spec.platform_power_w
    supplies = [p for p in observed.power_supplies if p.present]
    source = "dmidecode"
    if not supplies and bios is not None:
        supplies, source = [p for p in bios.power_supplies if p.present], "Redfish"
    capacities = [p.capacity_w for p in supplies if p.capacity_w]
    # Redundant (1+1) supplies: one unit alone must carry the load, so the smallest one counts.
    have = min(capacities) if capacities else None
    checks.add(
        "psu-capacity",
        f">= {need} W per PSU ({gpu_count} x {profile.gpu.board_power_w} W GPUs + {spec.platform_power_w} W platform)",
        f"{len(capacities)} PSUs: " + ", ".join(f"{c} W" for c in capacities) + f" ({source})"
        if capacities
        else "no PSU reported",
        None if have is None else have >= need,
        f"install PSUs rated >= {need} W each (the seed's build uses 2000 W Titanium modules) or remove GPUs; "
        "override with preflight_overrides: [psu-capacity] only with a measured power budget",
    )


def _bios(checks: _Checks, spec: HardwareSpec, profile: Profile, bios: BmcObservation | None) -> None:
    if bios is None or bios.address is None:
        why = "not checked: set bios_redfish_address to the iDRAC's Redfish URL"
        checks.add("redfish-system-model", profile.server.model, why, None)
        checks.add("bios-attributes", _attrs(spec.bios_attributes), why, None)
        return
    if bios.error:
        advice = f"Redfish at {bios.address} failed: check the address, credentials and that Redfish is enabled"
        checks.add("redfish-system-model", profile.server.model, bios.error, False, advice)
        checks.add("bios-attributes", _attrs(spec.bios_attributes), bios.error, False, advice)
        return
    checks.add(
        "redfish-system-model",
        profile.server.model,
        bios.model or "unknown",
        (bios.model or "").strip() == profile.server.model,
        f"the iDRAC reports {bios.model!r}: this is not a {profile.server.model}; choose the matching "
        "ironserve_profile or check that bios_redfish_address points at this host's iDRAC",
    )
    diffs = {k: v for k, v in spec.bios_attributes.items() if bios.attributes.get(k) != v}
    unknown = [k for k in spec.bios_attributes if k not in bios.attributes]
    observed = (
        "; ".join(f"{k}={bios.attributes.get(k, 'absent')}" for k in diffs)
        if diffs
        else f"all {len(spec.bios_attributes)} as required"
    )
    if bios.note:
        observed += f" ({bios.note})"
    advice = (
        f"set {_attrs(diffs)} in the BIOS: run with bios_mode: apply and bios_reboot_policy: auto, "
        "or change them in iDRAC (System Setup > System BIOS) and reboot"
    )
    if unknown:
        advice += f"; this BIOS has no attribute {', '.join(unknown)}: check the iDRAC firmware"
    checks.add("bios-attributes", _attrs(spec.bios_attributes), observed, not diffs, advice)
    if bios.stuck or bios.pending:
        stuck = bios.stuck or bios.pending
        checks.add(
            "bios-pending",
            "no pending BIOS settings",
            "still pending after reset: " + _attrs(stuck) if bios.stuck else "pending: " + _attrs(stuck),
            False,
            "the BIOS did not take " + _attrs(stuck) + ": check the iDRAC job queue (Lifecycle Log) for the failed "
            "configuration job, clear it, update the BIOS firmware, then apply again"
            if bios.stuck
            else "settings wait for a reboot: allow it (bios_reboot_policy: auto) or reboot through iDRAC",
        )


def _attrs(values: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "none"
