"""Stand-in `lspci`, `dmidecode` and `lscpu` for lab hosts: the real output formats, for the profile's devices.

Lab edge only. Installed into a lab host as /usr/local/lib/ironserve-lab/standins.py with small wrappers
in /usr/local/bin (which comes first in PATH), so product code runs exactly the commands it runs on an
R740. Standard library only: it runs on the lab host's own python3. It reads the hardware profile from
/etc/ironserve-lab/hardware.json and the BIOS attributes the simulated iDRAC last applied from
/etc/ironserve-lab/bios.json (written after a Redfish reset), so a BIOS change shows on the host.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HARDWARE = Path(os.environ.get("IRONSERVE_LAB_HARDWARE", "/etc/ironserve-lab/hardware.json"))
BIOS = Path(os.environ.get("IRONSERVE_LAB_BIOS", "/etc/ironserve-lab/bios.json"))
NAMES = ("lspci", "dmidecode", "lscpu")
# lspci's names for the cards a profile may hold: (device id, name).
PCI_NAMES = {
    "NVIDIA A10": ("2236", "GA102GL [A10]"),
    "NVIDIA A100": ("20f1", "GA100 [A100 PCIe 40GB]"),
    "Tesla P4": ("1bb3", "GP104GL [Tesla P4]"),
}
DMI_HEADER = "# dmidecode 3.4\nGetting SMBIOS data from sysfs.\nSMBIOS 3.2.0 present.\nTable at 0x68D2F000.\n"


def load(hardware: Path = HARDWARE, bios: Path = BIOS) -> dict[str, Any]:
    profile: dict[str, Any] = json.loads(hardware.read_text())
    if bios.exists():
        profile["bios_attributes"] = {**profile.get("bios_attributes", {}), **json.loads(bios.read_text())}
    return profile


# ---- lspci -----------------------------------------------------------------------------------------------


def _bus(address: str) -> int:
    return int(address.split(":")[1], 16)


def _sort_key(address: str) -> tuple[int, ...]:
    """lspci's order: domain, bus, device, function as numbers (domain 10000 after 0000, not by text)."""
    domain, bus, slot = address.split(":")
    device, function = slot.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function)


# Skylake-SP's Intel VMD (Volume Management Device, 8086:201d at 05.5 of each CPU's PCIe stack) owns the NVMe
# drives behind it: Linux's vmd driver puts them in a PCI domain of its own, 10000 and up
# (drivers/pci/controller/vmd.c), which lspci prints with five digits, after every domain-0 device: right after
# the last GPU.
VMD_DEVICES: list[tuple[str, str, list[str]]] = [
    (
        "0000:5d:05.5",
        "RAID bus controller: Intel Corporation Volume Management Device NVMe RAID Controller (rev 07)",
        ["NUMA node: 0", "Kernel driver in use: vmd"],
    ),
    (
        "10000:00:02.0",
        "PCI bridge: Intel Corporation Sky Lake-E PCI Express Root Port C (rev 07) (prog-if 00 [Normal decode])",
        [
            "Bus: primary=00, secondary=01, subordinate=01, sec-latency=0",
            "Capabilities: [40] Express (v2) Root Port (Slot+), MSI 00",
            "\tLnkCap:\tPort #11, Speed 8GT/s, Width x4, ASPM not supported",
            "\tLnkSta:\tSpeed 8GT/s (ok), Width x4 (ok)",
            "\t\tTrErr- Train- SlotClk+ DLActive+ BWMgmt- ABWMgmt-",
            "Kernel driver in use: pcieport",
        ],
    ),
    (
        "10000:01:00.0",
        "Non-Volatile memory controller: Intel Corporation NVMe Datacenter SSD [3DNAND, Beta Rock Controller] "
        "(prog-if 02 [NVM Express])",
        [
            "Region 0: Memory at e4010000 (64-bit, non-prefetchable) [size=16K]",
            "Capabilities: [60] Express (v2) Endpoint, MSI 00",
            "\tLnkCap:\tPort #0, Speed 8GT/s, Width x4, ASPM not supported",
            "\tLnkSta:\tSpeed 8GT/s (ok), Width x4 (ok)",
            "Kernel driver in use: nvme",
        ],
    ),
]


def _link(speed: float, width: int, cap: dict[str, Any] | None) -> str:
    if cap is None:
        return f"Speed {speed:g}GT/s, Width x{width}"
    speed_note = "downgraded" if speed < cap["speed_gts"] else "ok"
    width_note = "downgraded" if width < cap["width"] else "ok"
    return f"Speed {speed:g}GT/s ({speed_note}), Width x{width} ({width_note})"


def _devices(profile: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(address, description, detail lines) for a host bridge, a root port plus a GPU per slot, and the NVMe
    drive behind the VMD controller, in lspci's order."""
    above_4g = profile.get("bios_attributes", {}).get("MmioAbove4Gb", "Enabled") == "Enabled"
    devices: list[tuple[str, str, list[str]]] = [
        ("0000:00:00.0", "Host bridge: Intel Corporation Sky Lake-E DMI3 Registers (rev 07)", [])
    ]
    for index, gpu in enumerate(profile["gpus"]):
        address = gpu["pci_address"].lower()
        domain, bus = address.split(":")[:2]
        port = f"{domain}:{_bus(address) - 1:02x}:00.0"
        cap, status = gpu["link_capability"], gpu["link_status"]
        acs = "+" if profile.get("pcie_acs_redirect") else "-"
        devices.append(
            (
                port,
                "PCI bridge: Intel Corporation Sky Lake-E PCI Express Root Port A (rev 07) "
                "(prog-if 00 [Normal decode])",
                [
                    f"Physical Slot: {gpu['slot']}",
                    "Control: I/O+ Mem+ BusMaster+ SpecCycle- MemWINV- VGASnoop- ParErr- Stepping- SERR- "
                    "FastB2B- DisINTx-",
                    f"NUMA node: {gpu['numa_node']}",
                    f"Bus: primary={_bus(port):02x}, secondary={bus}, subordinate={bus}, sec-latency=0",
                    "Capabilities: [90] Express (v2) Root Port (Slot+), MSI 00",
                    f"\tLnkCap:\tPort #{index + 1}, Speed {cap['speed_gts']:g}GT/s, Width x{cap['width']}, "
                    "ASPM not supported",
                    f"\tLnkSta:\t{_link(status['speed_gts'], status['width'], cap)}",
                    "\t\tTrErr- Train- SlotClk+ DLActive+ BWMgmt+ ABWMgmt-",
                    "Capabilities: [110 v1] Access Control Services",
                    "\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-",
                    f"\tACSCtl:\tSrcValid+ TransBlk- ReqRedir{acs} CmpltRedir{acs} UpstreamFwd- EgressCtrl- "
                    "DirectTrans-",
                    "Kernel driver in use: pcieport",
                ],
            )
        )
        _, name = PCI_NAMES.get(gpu["model"], ("1fff", f"Device [{gpu['model']}]"))
        # Without MMIO above 4 GB the firmware places the first card's 32 GB BAR and runs out of space after.
        mapped = above_4g or index == 0
        high = f"{0x38BFE0000000 + index * 0x1000000000:x}" if mapped else "<unassigned>"
        devices.append(
            (
                address,
                f"3D controller: NVIDIA Corporation {name} (rev a1)",
                [
                    f"Subsystem: NVIDIA Corporation {name}",
                    f"Physical Slot: {gpu['slot']}",
                    "Control: I/O- Mem+ BusMaster+ SpecCycle- MemWINV- VGASnoop- ParErr- Stepping- SERR- "
                    "FastB2B- DisINTx+",
                    f"NUMA node: {gpu['numa_node']}",
                    f"IOMMU group: {30 + index}",
                    f"Region 0: Memory at {0xAB000000 + index * 0x2000000:x} (32-bit, non-prefetchable) [size=16M]",
                    f"Region 1: Memory at {high} (64-bit, prefetchable) [size=32G]",
                    f"Region 3: Memory at {high if not mapped else f'{int(high, 16) + 0x800000000:x}'} "
                    "(64-bit, prefetchable) [size=32M]",
                    "Capabilities: [78] Express (v2) Endpoint, MSI 00",
                    "\tDevCap:\tMaxPayload 256 bytes, PhantFunc 0, Latency L0s unlimited, L1 <64us",
                    f"\tLnkCap:\tPort #0, Speed {cap['speed_gts']:g}GT/s, Width x{cap['width']}, ASPM not supported",
                    "\tLnkCtl:\tASPM Disabled; RCB 64 bytes, Disabled- CommClk+",
                    f"\tLnkSta:\t{_link(status['speed_gts'], status['width'], cap)}",
                    "\t\tTrErr- Train- SlotClk+ DLActive- BWMgmt- ABWMgmt-",
                    "Kernel modules: nouveau",
                ],
            )
        )
    return sorted(devices + VMD_DEVICES, key=lambda d: _sort_key(d[0]))


def lspci(profile: dict[str, Any], argv: Sequence[str]) -> str:
    verbose = sum(a.count("v") for a in argv if a.startswith("-") and set(a[1:]) <= {"v", "D", "n"})
    domains = any("D" in a for a in argv if a.startswith("-") and not a.startswith("--"))
    vendor = slot = None
    for flag, value in itertools.pairwise(argv):
        if flag == "-d":
            vendor = value.split(":")[0].lower()
        elif flag == "-s":
            slot = value.lower()
    devices = _devices(profile)
    # Without -D lspci still prints every domain once any device is outside domain 0 (pciutils lspci.c).
    domains = domains or any(not address.startswith("0000:") for address, _, _ in devices)
    out = []
    for address, description, details in devices:
        if vendor and (vendor != "10de" or "NVIDIA" not in description):
            continue
        if slot and not (address == slot or address.endswith(slot)):
            continue
        out.append(f"{address if domains else address.split(':', 1)[1]} {description}")
        if verbose:
            out.extend("\t" + line for line in details)
            out.append("")
    return "\n".join(out) + "\n" if out else ""


# ---- dmidecode -------------------------------------------------------------------------------------------


def _system_block(profile: dict[str, Any]) -> str:
    system = profile["system"]
    return (
        "Handle 0x0100, DMI type 1, 27 bytes\nSystem Information\n"
        f"\tManufacturer: {system['manufacturer']}\n\tProduct Name: {system['model']}\n\tVersion: Not Specified\n"
        f"\tSerial Number: {system['serial']}\n\tUUID: 4c4c4544-0058-5110-8037-b8c04f4e4d32\n"
        f"\tWake-up Type: Power Switch\n\tSKU Number: SKU=NotProvided;ModelName={system['model']}\n"
        "\tFamily: PowerEdge\n"
    )


def _psu_blocks(profile: dict[str, Any]) -> str:
    """Type-39 records as a real R740's firmware fills them (dmidecode 3.4): the name padded with spaces to its
    field width, no Power Unit Group, status and type Unknown."""
    blocks = []
    for index, psu in enumerate(profile["power_supplies"]):
        name = f"PWR SPLY,{psu['capacity_w']}W,RDNT,DELTA".ljust(30)
        blocks.append(
            f"Handle 0x{0x2700 + index:04X}, DMI type 39, 22 bytes\nSystem Power Supply\n"
            f"\tLocation: Not Specified\n\tName: {name}\n\tManufacturer: DELL\n\tSerial Number: --\n"
            "\tAsset Tag: --\n\tModel Part Number: 0Y26KXA00\n\tRevision: Not Specified\n"
            f"\tMax Power Capacity: {psu['capacity_w']} W\n\tStatus: Present, Unknown\n\tType: Unknown\n"
            "\tInput Voltage Range Switching: Unknown\n\tPlugged: Yes\n\tHot Replaceable: Yes\n"
        )
    return "\n".join(blocks)


def dmidecode(profile: dict[str, Any], argv: Sequence[str]) -> str:
    system = profile["system"]
    strings = {
        "system-manufacturer": system["manufacturer"],
        "system-product-name": system["model"],
        "system-serial-number": system["serial"],
        "bios-vendor": system["manufacturer"],
        "bios-version": system["bios_version"],
        "processor-version": profile["cpu"]["model"],
    }
    args = list(argv)
    if "-s" in args:
        keyword = args[args.index("-s") + 1]
        if keyword not in strings:
            raise SystemExit(f"Invalid string keyword: {keyword}")
        return str(strings[keyword]) + "\n"
    if "-t" in args:
        kind = args[args.index("-t") + 1]
        if kind in {"system", "1"}:
            return DMI_HEADER + "\n" + _system_block(profile)
        if kind == "39":
            return DMI_HEADER + "\n" + _psu_blocks(profile)
        if kind in {"bios", "0"}:
            return (
                DMI_HEADER + "\nHandle 0x0000, DMI type 0, 26 bytes\nBIOS Information\n"
                f"\tVendor: {system['manufacturer']}\n\tVersion: {system['bios_version']}\n"
            )
        return DMI_HEADER
    return DMI_HEADER + "\n" + _system_block(profile) + "\n" + _psu_blocks(profile)


# ---- lscpu -----------------------------------------------------------------------------------------------


# Per-CPU listings (`-e`, `-p`, `-J`) come from the real lscpu: software that runs on the lab host (vLLM's
# CPU backend binds its threads from `lscpu -J -e`) must see the CPUs it actually runs on. The simulated
# R740 answers the summary view that the preflight reads.
REAL_LSCPU = "/usr/bin/lscpu"
LISTING_FLAGS = ("-e", "--extended", "-p", "--parse", "-J", "--json")


def lscpu(profile: dict[str, Any], argv: Sequence[str]) -> str:
    if any(arg.startswith(LISTING_FLAGS) for arg in argv):
        return subprocess.run([REAL_LSCPU, *argv], capture_output=True, text=True, check=False).stdout
    cpu = profile["cpu"]
    sockets, cores = cpu["sockets"], cpu["cores_per_socket"]
    threads = sockets * cores * 2
    nodes = [
        f"  NUMA node{n} CPU(s):     {n * cores}-{(n + 1) * cores - 1},{sockets * cores + n * cores}-"
        f"{sockets * cores + (n + 1) * cores - 1}"
        for n in range(sockets)
    ]
    return (
        "Architecture:            x86_64\n  CPU op-mode(s):        32-bit, 64-bit\n"
        f"CPU(s):                  {threads}\n  On-line CPU(s) list:   0-{threads - 1}\n"
        f"Vendor ID:               GenuineIntel\n  Model name:            {cpu['model']}\n"
        f"    Thread(s) per core:  2\n    Core(s) per socket:  {cores}\n    Socket(s):           {sockets}\n"
        f"NUMA:\n  NUMA node(s):          {sockets}\n" + "\n".join(nodes) + "\n"
    )


def main(argv: Sequence[str]) -> int:
    tool = argv[1] if len(argv) > 1 and argv[1] in NAMES else Path(argv[0]).name
    if tool not in NAMES:
        print(f"standins: unknown tool {tool!r}; one of {', '.join(NAMES)}", file=sys.stderr)
        return 2
    args = argv[2:] if len(argv) > 1 and argv[1] == tool else argv[1:]
    profile = load()
    if tool == "lspci":
        text = lspci(profile, args)
    elif tool == "dmidecode":
        text = dmidecode(profile, args)
    else:
        text = lscpu(profile, args)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
