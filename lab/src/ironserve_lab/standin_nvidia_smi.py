"""Stand-in `nvidia-smi` for lab hosts, installed by the stand-in NVIDIA driver package.

Runs inside a lab host with the system python3 (standard library only). It reports the GPUs of the
host's hardware profile (/etc/ironserve-lab/hardware.json, written by edge.py) and the
driver version of the package that installed it (IRONSERVE_STANDIN_DRIVER / IRONSERVE_STANDIN_CUDA,
set by the /usr/bin/nvidia-smi wrapper), in the real tool's output formats:
`--query-gpu=FIELDS --format=csv[,noheader][,nounits]`, `-L`, `-q`, `topo -m` and the default table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

HARDWARE_JSON = "/etc/ironserve-lab/hardware.json"
PERSISTENCED_PID = "/run/nvidia-persistenced/nvidia-persistenced.pid"


def _gpus() -> list[dict[str, Any]]:
    try:
        with open(HARDWARE_JSON) as f:
            return list(json.load(f)["gpus"])
    except (OSError, KeyError, ValueError):
        return []


def _driver() -> str:
    return os.environ.get("IRONSERVE_STANDIN_DRIVER", "0.0.0")


def _cuda() -> str:
    return os.environ.get("IRONSERVE_STANDIN_CUDA", "0.0")


def _bus_id(gpu: dict[str, Any]) -> str:
    """`0000:3b:00.0` (lspci -D) as nvidia-smi prints it: `00000000:3B:00.0`."""
    domain, rest = gpu["pci_address"].split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def _persistence() -> str:
    try:
        with open(PERSISTENCED_PID) as f:
            os.kill(int(f.read().strip()), 0)
        return "Enabled"
    except (OSError, ValueError):
        return "Disabled"


def _gen(speed_gts: float) -> int:
    return {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5}.get(float(speed_gts), 3)


# field -> (unit, value function); the unit is printed after the value unless `nounits`.
FIELDS: dict[str, tuple[str, Any]] = {
    "index": ("", lambda i, g: str(i)),
    "count": ("", lambda i, g: str(len(_gpus()))),
    "name": ("", lambda i, g: g["model"]),
    "uuid": ("", lambda i, g: g["uuid"]),
    "serial": ("", lambda i, g: f"13223{i:08d}"),
    "pci.bus_id": ("", lambda i, g: _bus_id(g)),
    "driver_version": ("", lambda i, g: _driver()),
    "vbios_version": ("", lambda i, g: g["vbios"]),
    "compute_cap": ("", lambda i, g: g["compute_cap"]),
    "memory.total": ("MiB", lambda i, g: str(g["memory_mib"])),
    "memory.used": ("MiB", lambda i, g: "0"),
    "memory.free": ("MiB", lambda i, g: str(g["memory_mib"])),
    "power.limit": ("W", lambda i, g: f"{g['board_power_w']:.2f}"),
    "power.default_limit": ("W", lambda i, g: f"{g['board_power_w']:.2f}"),
    "power.draw": ("W", lambda i, g: "15.00"),
    "temperature.gpu": ("", lambda i, g: "31"),
    "utilization.gpu": ("%", lambda i, g: "0"),
    "persistence_mode": ("", lambda i, g: _persistence()),
    "pcie.link.gen.current": ("", lambda i, g: str(_gen(g["link_status"]["speed_gts"]))),
    "pcie.link.gen.max": ("", lambda i, g: str(_gen(g["link_capability"]["speed_gts"]))),
    "pcie.link.width.current": ("", lambda i, g: str(g["link_status"]["width"])),
    "pcie.link.width.max": ("", lambda i, g: str(g["link_capability"]["width"])),
}
ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "vbios": "vbios_version"}


def query_gpu(fields_arg: str, fmt: str) -> int:
    options = set(fmt.split(",")[1:])
    if not fmt.startswith("csv"):
        print(f'"{fmt}" is not a valid format.', file=sys.stderr)
        return 2
    names = [f.strip() for f in fields_arg.split(",") if f.strip()]
    for name in names:
        if ALIASES.get(name, name) not in FIELDS:
            print(f'Field "{name}" is not a valid field to query.', file=sys.stderr)
            return 2
    if "noheader" not in options:
        header = []
        for name in names:
            unit = FIELDS[ALIASES.get(name, name)][0]
            header.append(f"{name} [{unit}]" if unit else name)
        print(", ".join(header))
    for index, gpu in enumerate(_gpus()):
        values = []
        for name in names:
            unit, value = FIELDS[ALIASES.get(name, name)]
            text = value(index, gpu)
            values.append(f"{text} {unit}" if unit and "nounits" not in options else text)
        print(", ".join(values))
    return 0


def list_gpus() -> int:
    for index, gpu in enumerate(_gpus()):
        print(f"GPU {index}: {gpu['model']} (UUID: {gpu['uuid']})")
    return 0


def query_all() -> int:
    gpus = _gpus()
    print()
    print("==============NVSMI LOG==============")
    print()
    print(f"{'Timestamp':<38}: {time.strftime('%a %b %d %H:%M:%S %Y')}")
    print(f"{'Driver Version':<38}: {_driver()}")
    print(f"{'CUDA Version':<38}: {_cuda()}")
    print()
    print(f"{'Attached GPUs':<38}: {len(gpus)}")
    for index, gpu in enumerate(gpus):
        print(f"GPU {_bus_id(gpu)}")
        rows = [
            ("Product Name", gpu["model"]),
            ("Product Brand", "NVIDIA"),
            ("Product Architecture", "Ampere"),
            ("Persistence Mode", _persistence()),
            ("Serial Number", FIELDS["serial"][1](index, gpu)),
            ("GPU UUID", gpu["uuid"]),
            ("Minor Number", str(index)),
            ("VBIOS Version", gpu["vbios"]),
        ]
        for key, value in rows:
            print(f"    {key:<34}: {value}")
        print("    PCI")
        print(f"        {'Bus Id':<30}: {_bus_id(gpu)}")
        print("        GPU Link Info")
        print("            PCIe Generation")
        print(f"                {'Max':<22}: {_gen(gpu['link_capability']['speed_gts'])}")
        print(f"                {'Current':<22}: {_gen(gpu['link_status']['speed_gts'])}")
        print("            Link Width")
        print(f"                {'Max':<22}: {gpu['link_capability']['width']}x")
        print(f"                {'Current':<22}: {gpu['link_status']['width']}x")
        print("    FB Memory Usage")
        print(f"        {'Total':<30}: {gpu['memory_mib']} MiB")
        print(f"        {'Used':<30}: 0 MiB")
        print(f"        {'Free':<30}: {gpu['memory_mib']} MiB")
        print("    Power Readings")
        print(f"        {'Power Limit':<30}: {gpu['board_power_w']:.2f} W")
        print()
    return 0


def topo() -> int:
    gpus = _gpus()
    names = [f"GPU{i}" for i in range(len(gpus))]
    print("\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity")
    for i, gpu in enumerate(gpus):
        cells = []
        for j, other in enumerate(gpus):
            if i == j:
                cells.append(" X ")
            else:
                cells.append("NODE" if gpu["numa_node"] == other["numa_node"] else "SYS")
        node = gpu["numa_node"]
        print(f"{names[i]}\t" + "\t".join(cells) + f"\t{node * 24}-{node * 24 + 23}\t{node}")
    print()
    print("Legend:")
    print()
    print("  X    = Self")
    print("  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)")
    print(
        "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"
    )
    print("  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)")
    print("  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)")
    print("  PIX  = Connection traversing at most a single PCIe bridge")
    print("  NV#  = Connection traversing a bonded set of # NVLinks")
    return 0


def table() -> int:
    gpus = _gpus()
    print(time.strftime("%a %b %d %H:%M:%S %Y"))
    print("+" + "-" * 85 + "+")
    head = f"| NVIDIA-SMI {_driver():<17}Driver Version: {_driver():<13}CUDA Version: {_cuda():<8}|"
    print(head)
    print("|" + "-" * 85 + "|")
    for index, gpu in enumerate(gpus):
        print(
            f"| {index:>3}  {gpu['model']:<24}{_persistence()[:3]:>4} | {_bus_id(gpu):>16} Off |"
            f" {gpu['memory_mib']:>8}MiB |"
        )
    print("+" + "-" * 85 + "+")
    return 0


def main(argv: list[str]) -> int:
    if not _gpus():
        print("No devices were found", file=sys.stderr)
        return 6
    if argv[:2] == ["topo", "-m"]:
        return topo()
    if argv[:1] in (["-L"], ["--list-gpus"]):
        return list_gpus()
    if argv[:1] in (["-q"], ["--query"]):
        return query_all()
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is not None:
        fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
        if not fmt:
            print("--query-gpu requires --format", file=sys.stderr)
            return 2
        return query_gpu(query, fmt)
    if argv and argv[0] not in ("-a",):
        print(f"Invalid combination of input arguments: {' '.join(argv)}", file=sys.stderr)
        return 2
    return table()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
