"""Hardware preflight facts: what the host says about itself, each parsed by a pure, unit-tested function.

The commands are the ones an admin runs on a real R740 (`dmidecode`, `lspci -vvv`, `lscpu`, sysfs,
`nvidia-smi topo -m`); in the lab, stand-ins under /usr/local/bin print the same formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyinfra.api.facts import FactBase

from ironserve.run import PowerSupplyInfo

NVIDIA_VENDOR = "10de"


# ---- dmidecode -------------------------------------------------------------------------------------------


def parse_dmidecode_string(output: Iterable[str]) -> str | None:
    """`dmidecode -s KEYWORD`: one value line; comments (`# ...`) appear when run without root or on odd DMI."""
    values = [line.strip() for line in output if line.strip() and not line.lstrip().startswith("#")]
    return values[0] if values else None


def parse_dmidecode_system(output: Iterable[str]) -> dict[str, str]:
    """`dmidecode -t system`: the fields of the first "System Information" block."""
    fields: dict[str, str] = {}
    inside = False
    for raw in output:
        line = raw.rstrip()
        if line == "System Information":
            inside = True
            continue
        if inside:
            if not line.startswith("\t"):
                if fields:
                    break
                continue
            key, sep, value = line.strip().partition(":")
            if sep and not line.startswith("\t\t"):
                fields[key.strip()] = value.strip()
    return fields


POWER_CAPACITY = re.compile(r"^Max Power Capacity:\s*(?P<watts>\d+)\s*W", re.IGNORECASE)


def parse_dmidecode_power_supplies(output: Iterable[str]) -> list[PowerSupplyInfo]:
    """`dmidecode -t 39` (System Power Supply): name, max capacity, presence of each unit."""
    supplies: list[PowerSupplyInfo] = []
    current: dict[str, str] | None = None

    def close() -> None:
        if current is not None:
            match = POWER_CAPACITY.match("Max Power Capacity: " + current.get("Max Power Capacity", ""))
            status = current.get("Status", "")
            supplies.append(
                PowerSupplyInfo(
                    name=current.get("Name") or current.get("Location") or f"PSU{len(supplies) + 1}",
                    capacity_w=int(match["watts"]) if match else None,
                    present=not status.lower().startswith("not present"),
                )
            )

    for raw in output:
        line = raw.rstrip()
        if line == "System Power Supply":
            close()
            current = {}
        elif current is not None and line.startswith("\t") and not line.startswith("\t\t"):
            key, _, value = line.strip().partition(":")
            current[key.strip()] = value.strip()
        elif current is not None and not line.startswith("\t") and line:
            close()
            current = None
    close()
    return supplies


# ---- lscpu ------------------------------------------------------------------------------------------------


def parse_lscpu_sockets(output: Iterable[str]) -> int | None:
    """`lscpu`: the `Socket(s):` count (None when lscpu does not say, e.g. some VMs print `-`)."""
    for line in output:
        key, _, value = line.partition(":")
        if key.strip() == "Socket(s)" and value.strip().isdigit():
            return int(value.strip())
    return None


# ---- lspci -vvv -D ---------------------------------------------------------------------------------------

# A device's first line: [domain:]bus:device.function. lspci prints the domain with "%04x" (pciutils lspci.c), so
# it has four hex digits or more: Intel VMD puts its NVMe devices in domains 10000 and up. Without -D, lspci
# leaves the domain out only when every device is in domain 0.
HEADER = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<slot>[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+(?P<rest>\S.*)$"
)
LINK = re.compile(
    r"Speed\s+(?:(?P<speed>[\d.]+)\s*GT/s|unknown)(?:\s*\((?P<speed_note>[a-z]+)\))?,\s*"
    r"Width\s+x(?P<width>\d+)(?:\s*\((?P<width_note>[a-z]+)\))?"
)
BAR = re.compile(r"^Region (?P<index>\d+): (?:Memory|I/O ports) at (?P<where>\S+)(?P<rest>.*)$")
ACS_FLAGS = re.compile(r"(\w+)([+-])")
CLASS_CODE = re.compile(r"\s*\[[0-9a-f]{4}\]$")


@dataclass(frozen=True)
class PcieLinkState:
    speed_gts: float | None  # None when lspci prints "Speed unknown"
    width: int
    downgraded: bool  # newer lspci marks speed or width "(downgraded)" against the capability


@dataclass(frozen=True)
class PciDevice:
    address: str  # 0000:3b:00.0, 10000:01:00.0 behind an Intel VMD controller
    description: str  # "3D controller: NVIDIA Corporation GA102GL [A10] (rev a1)"
    physical_slot: str | None
    numa_node: int | None
    iommu_group: int | None
    link_capability: PcieLinkState | None
    link_status: PcieLinkState | None
    unassigned_bars: tuple[int, ...]  # BAR indexes the firmware left without an address (MMIO space exhausted)
    acs_control: dict[str, bool] = field(default_factory=dict)  # ACSCtl flags, e.g. {"ReqRedir": False}

    @property
    def is_gpu(self) -> bool:
        kind = CLASS_CODE.sub("", self.description.split(":", 1)[0])  # `3D controller [0302]` with lspci -nn
        return kind in {"3D controller", "VGA compatible controller"} and "NVIDIA" in self.description

    @property
    def acs_p2p_redirect(self) -> bool:
        """ACS redirects peer-to-peer requests or completions to the root complex (breaks GPU P2P)."""
        return self.acs_control.get("ReqRedir", False) or self.acs_control.get("CmpltRedir", False)


def _link(text: str) -> PcieLinkState | None:
    match = LINK.search(text)
    if not match:
        return None
    speed = float(match["speed"]) if match["speed"] else None
    downgraded = "downgraded" in {match["speed_note"], match["width_note"]}
    return PcieLinkState(speed_gts=speed, width=int(match["width"]), downgraded=downgraded)


def parse_lspci_verbose(output: Iterable[str]) -> list[PciDevice]:
    """`lspci -vvv -D` (optionally `-d 10de:`, `-nn`): address, slot, NUMA node, link capability/status, BARs,
    ACSCtl. Output without -D (domain 0 only) reads as domain 0000."""
    devices: list[PciDevice] = []
    block: list[str] = []

    def close() -> None:
        if block:
            devices.append(_device(block))

    for raw in output:
        line = raw.rstrip("\n")
        if HEADER.match(line):
            close()
            block = [line]
        elif block and line.strip():
            block.append(line)
    close()
    return devices


def _device(block: list[str]) -> PciDevice:
    header = HEADER.match(block[0])
    assert header is not None
    slot = numa = group = None
    cap = status = None
    unassigned: list[int] = []
    acs: dict[str, bool] = {}
    for line in block[1:]:
        text = line.strip()
        key, _, value = text.partition(":")
        if key == "Physical Slot":
            slot = value.strip()
        elif key == "NUMA node":
            numa = int(value.strip())
        elif key == "IOMMU group":
            group = int(value.strip())
        elif key == "LnkCap":
            cap = _link(value)
        elif key == "LnkSta":
            status = _link(value)
        elif key == "ACSCtl":
            acs = {name: sign == "+" for name, sign in ACS_FLAGS.findall(value)}
        else:
            bar = BAR.match(text)
            if bar and bar["where"] in {"<unassigned>", "<ignored>"}:
                unassigned.append(int(bar["index"]))
    return PciDevice(
        address=f"{header['domain'] or '0000'}:{header['slot']}".lower(),
        description=header["rest"],
        physical_slot=slot,
        numa_node=numa,
        iommu_group=group,
        link_capability=cap,
        link_status=status,
        unassigned_bars=tuple(unassigned),
        acs_control=acs,
    )


# ---- sysfs -----------------------------------------------------------------------------------------------


def parse_numa_nodes(output: Iterable[str]) -> dict[str, int]:
    """Lines `<bdf> <numa_node>` from /sys/bus/pci/devices/*/numa_node; -1 means the firmware did not say."""
    nodes: dict[str, int] = {}
    for line in output:
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"-?\d+", parts[1]):
            nodes[parts[0].lower()] = int(parts[1])
    return nodes


@dataclass(frozen=True)
class IommuState:
    groups: int  # entries in /sys/kernel/iommu_groups (0: IOMMU off or not exposed)
    kernel_args: tuple[str, ...]  # intel_iommu=/amd_iommu=/iommu= arguments the kernel booted with


def parse_iommu(output: Iterable[str]) -> IommuState:
    """Lines `groups <n>` and `cmdline <...>` (see IommuFacts.command)."""
    groups = 0
    args: tuple[str, ...] = ()
    for line in output:
        key, _, value = line.partition(" ")
        if key == "groups" and value.strip().isdigit():
            groups = int(value.strip())
        elif key == "cmdline":
            args = tuple(a for a in value.split() if a.split("=", 1)[0] in {"intel_iommu", "amd_iommu", "iommu"})
    return IommuState(groups=groups, kernel_args=args)


# ---- nvidia-smi topo -m ----------------------------------------------------------------------------------

TOPO_LINKS = {"X", "SYS", "NODE", "PHB", "PXB", "PIX"}


@dataclass(frozen=True)
class GpuTopology:
    links: dict[str, dict[str, str]]  # "GPU0" -> {"GPU1": "PIX", ...}
    numa_affinity: dict[str, str]  # "GPU0" -> "0" ("N/A" when unknown)


def parse_nvidia_topo(output: Iterable[str]) -> GpuTopology:
    """`nvidia-smi topo -m`: the GPU-to-GPU link matrix (X, SYS, NODE, PHB, PXB, PIX, NV#) and NUMA affinity."""
    lines = [line.rstrip() for line in output if line.strip()]
    if not lines:
        return GpuTopology(links={}, numa_affinity={})
    columns = lines[0].split("\t") if "\t" in lines[0] else lines[0].split()
    columns = [c.strip() for c in columns if c.strip()]
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    links: dict[str, dict[str, str]] = {}
    affinity: dict[str, str] = {}
    for line in lines[1:]:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        name, values = cells[0], cells[1:]
        links[name] = {
            gpu: values[i] for i, gpu in enumerate(gpus) if i < len(values) and gpu != name and values[i] != "X"
        }
        if "NUMA Affinity" in lines[0]:
            # Columns after the GPUs/NICs: CPU Affinity, NUMA Affinity(, GPU NUMA ID). CPU affinity is one token.
            rest = values[len(columns) - _affinity_columns(lines[0]) :]
            if len(rest) >= 2:
                affinity[name] = rest[1]
    return GpuTopology(links=links, numa_affinity=affinity)


def _affinity_columns(header: str) -> int:
    return sum(1 for label in ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID") if label in header)


# ---- pyinfra facts ---------------------------------------------------------------------------------------


class DmiString(FactBase[str | None]):
    """`dmidecode -s KEYWORD` (system-product-name, bios-version, ...); None when dmidecode is missing."""

    def command(self, keyword: str) -> str:
        return f"dmidecode -s {keyword} 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> str | None:
        return parse_dmidecode_string(output)


class PowerSupplies(FactBase[list[PowerSupplyInfo]]):
    """The power supplies DMI type 39 describes (Dell PowerEdge fills it in)."""

    def command(self) -> str:
        return "dmidecode -t 39 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> list[PowerSupplyInfo]:
        return parse_dmidecode_power_supplies(output)


class CpuSockets(FactBase[int | None]):
    def command(self) -> str:
        return "lscpu 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> int | None:
        return parse_lscpu_sockets(output)


class PciDevices(FactBase[list[PciDevice]]):
    """Every PCI function with `lspci -vvv -D` (bridges too: their ACSCtl sits on the GPUs' paths)."""

    def command(self) -> str:
        return "lspci -vvv -D 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> list[PciDevice]:
        return parse_lspci_verbose(output)


class PciNumaNodes(FactBase[dict[str, int]]):
    def command(self) -> str:
        return (
            'for d in /sys/bus/pci/devices/*; do [ -r "$d/numa_node" ] && '
            'echo "${d##*/} $(cat "$d/numa_node")"; done 2>/dev/null; true'
        )

    def process(self, output: Iterable[str]) -> dict[str, int]:
        return parse_numa_nodes(output)


class IommuFacts(FactBase[IommuState]):
    def command(self) -> str:
        return 'echo "groups $(ls /sys/kernel/iommu_groups 2>/dev/null | wc -l)"; echo "cmdline $(cat /proc/cmdline)"'

    def process(self, output: Iterable[str]) -> IommuState:
        return parse_iommu(output)


class NvidiaTopology(FactBase[GpuTopology | None]):
    """`nvidia-smi topo -m`, or None before the driver exists."""

    def command(self) -> str:
        return "if command -v nvidia-smi >/dev/null; then nvidia-smi topo -m; else echo ABSENT; fi"

    def process(self, output: Iterable[str]) -> GpuTopology | None:
        lines = list(output)
        return None if lines == ["ABSENT"] else parse_nvidia_topo(lines)
