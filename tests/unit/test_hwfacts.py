"""Parsers of the hardware preflight facts, on outputs in the formats real tools print."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_fact_data import real_sample

from ironserve_lab import hardware, standins
from roles.preflight.facts import (
    IommuFacts,
    NvidiaTopology,
    PcieLinkState,
    parse_dmidecode_power_supplies,
    parse_dmidecode_string,
    parse_dmidecode_system,
    parse_iommu,
    parse_lscpu_sockets,
    parse_lspci_verbose,
    parse_numa_nodes,
    parse_nvidia_topo,
)

SAMPLES = Path(__file__).parent / "samples"


def lines(name: str) -> list[str]:
    return (SAMPLES / name).read_text().splitlines()


def test_dmidecode_string_skips_comments() -> None:
    assert parse_dmidecode_string(["PowerEdge R740"]) == "PowerEdge R740"
    assert parse_dmidecode_string(["# SMBIOS implementations newer than version 3.2.0 are not", "2.19.1"]) == "2.19.1"
    assert parse_dmidecode_string([]) is None


def test_dmidecode_system_block() -> None:
    fields = parse_dmidecode_system(lines("dmidecode-t-system-r740.txt"))
    assert fields["Manufacturer"] == "Dell Inc."
    assert fields["Product Name"] == "PowerEdge R740"
    assert fields["SKU Number"] == "SKU=NotProvided;ModelName=PowerEdge R740"
    assert "Option 1" not in fields  # the next block is not part of System Information


@pytest.mark.parametrize(
    ("name", "product", "sku"),
    [
        ("dmidecode_system/r740-dmidecode30-linuxhw.txt", "PowerEdge R740", "SKU=NotProvided;ModelName=PowerEdge R740"),
        ("dmidecode_system/r740-dmidecode34-linuxhw.txt", "PowerEdge R740", "SKU=0715;ModelName=PowerEdge R740"),
        ("dmidecode_system/r750-dmidecode34-linuxhw.txt", "PowerEdge R750", "SKU=090E;ModelName=PowerEdge R750"),
    ],
)
def test_dmidecode_system_block_of_real_dumps(name: str, product: str, sku: str) -> None:
    """Full `dmidecode` of real PowerEdge servers (linuxhw/DMI): the System Information block alone."""
    fields = parse_dmidecode_system(real_sample(name).read_text().splitlines())
    assert (fields["Manufacturer"], fields["Product Name"], fields["Family"]) == ("Dell Inc.", product, "PowerEdge")
    assert fields["SKU Number"] == sku


def _lab_profile() -> dict[str, Any]:
    profile: dict[str, Any] = json.loads(hardware.read_hardware_profile("r740-a10x4").model_dump_json())
    return profile


def _record_keys(text: str, title: str) -> list[str]:
    """The field names of the first record titled `title`, in order (values left out: serials differ)."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    keys = []
    for line in lines[start:]:
        if not line.startswith("\t"):
            break
        if not line.startswith("\t\t"):
            keys.append(line.strip().partition(":")[0])
    return keys


def test_lab_dmidecode_prints_the_records_of_a_real_r740() -> None:
    """The stand-in's System Information and System Power Supply records carry a real R740's fields, in order."""
    real = real_sample("dmidecode_system/r740-dmidecode34-linuxhw.txt").read_text()
    lab = standins.dmidecode(_lab_profile(), [])
    for title in ("System Information", "System Power Supply"):
        assert _record_keys(lab, title) == _record_keys(real, title), title
    assert lab.splitlines()[:4] == real.splitlines()[:4]  # dmidecode 3.4's banner on SMBIOS 3.2.0


def test_dmidecode_power_supplies() -> None:
    psus = parse_dmidecode_power_supplies(lines("dmidecode-t-39-r740.txt"))
    assert [(p.capacity_w, p.present) for p in psus] == [(2000, True), (None, False)]
    assert psus[0].name == "PWR SPLY,2000W,RDNT,DELTA"


def test_lscpu_sockets() -> None:
    assert parse_lscpu_sockets(lines("lscpu-r740.txt")) == 2
    assert parse_lscpu_sockets(["Socket(s):             1"]) == 1  # util-linux < 2.37 layout
    assert parse_lscpu_sockets(["Socket(s):  -"]) is None


def test_lspci_link_capability_and_status_new_format() -> None:
    devices = {d.address: d for d in parse_lspci_verbose(lines("lspci-r740-a10.txt"))}
    gpu = devices["0000:3b:00.0"]
    assert gpu.is_gpu and gpu.physical_slot == "1" and gpu.numa_node == 0 and gpu.iommu_group == 30
    # An A10 is Gen4-capable; in the R740's Gen3 slot it trains at 8 GT/s and lspci says "(downgraded)".
    assert gpu.link_capability == PcieLinkState(speed_gts=16.0, width=16, downgraded=False)
    assert gpu.link_status == PcieLinkState(speed_gts=8.0, width=16, downgraded=True)
    assert gpu.unassigned_bars == ()
    slot3 = devices["0000:af:00.0"]
    assert slot3.link_status == PcieLinkState(speed_gts=8.0, width=8, downgraded=True)
    assert slot3.unassigned_bars == (1, 3)  # MMIO above 4 GB off: the 32 GB BAR has nowhere to go


def test_lspci_acs_control_on_bridges() -> None:
    devices = {d.address: d for d in parse_lspci_verbose(lines("lspci-r740-a10.txt"))}
    port = devices["0000:3a:00.0"]
    assert not port.is_gpu
    assert port.acs_control["SrcValid"] is True
    assert port.acs_p2p_redirect is False
    redirected = parse_lspci_verbose(
        ["0000:00:01.0 PCI bridge: Intel Corporation Device", "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+"]
    )[0]
    assert redirected.acs_p2p_redirect is True


def test_lspci_old_format_without_markers() -> None:
    devices = parse_lspci_verbose(lines("lspci-old-format.txt"))
    gpu, audio = devices
    assert gpu.is_gpu and not audio.is_gpu
    assert gpu.link_status == PcieLinkState(speed_gts=2.5, width=8, downgraded=False)
    assert audio.link_status == PcieLinkState(speed_gts=None, width=8, downgraded=False)
    assert gpu.numa_node is None and gpu.physical_slot is None


def test_numa_nodes_from_sysfs() -> None:
    assert parse_numa_nodes(["0000:3B:00.0 0", "0000:af:00.0 1", "0000:00:00.0 -1", "garbage"]) == {
        "0000:3b:00.0": 0,
        "0000:af:00.0": 1,
        "0000:00:00.0": -1,
    }


def test_iommu_state() -> None:
    state = parse_iommu(["groups 146", "cmdline BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on iommu=pt quiet"])
    assert state.groups == 146
    assert state.kernel_args == ("intel_iommu=on", "iommu=pt")
    assert parse_iommu(["groups 0", "cmdline ro"]).groups == 0
    assert IommuFacts().process(["groups 3", "cmdline x"]).groups == 3


def test_nvidia_topo_a10_pair() -> None:
    topo = parse_nvidia_topo(lines("nvidia-smi-topo-a10x2.txt"))
    assert topo.links == {"GPU0": {"GPU1": "NODE"}, "GPU1": {"GPU0": "NODE"}}
    assert topo.numa_affinity == {"GPU0": "0", "GPU1": "0"}


def test_nvidia_topo_nvlink_and_nic() -> None:
    topo = parse_nvidia_topo(lines("nvidia-smi-topo-a100-nic.txt"))
    assert topo.links["GPU0"] == {"GPU1": "NV12"}
    assert topo.numa_affinity == {"GPU0": "0", "GPU1": "1"}
    assert NvidiaTopology().process(["ABSENT"]) is None


def test_lspci_domains_of_every_width_start_a_device() -> None:
    """lspci prints the domain with "%04x": four hex digits or more (Intel VMD: 10000, 10001, ...)."""
    lines = [
        "0000:d8:00.0 3D controller: NVIDIA Corporation GA102GL [A10] (rev a1)",
        "\t\tLnkSta:\tSpeed 8GT/s (ok), Width x16 (ok)",
        "10000:01:00.0 Non-Volatile memory controller: Intel Corporation NVMe Datacenter SSD",
        "\t\tLnkSta:\tSpeed 8GT/s (ok), Width x4 (ok)",
        "10001:02:00.0 Non-Volatile memory controller: Intel Corporation PCIe Data Center SSD (rev 01)",
    ]
    devices = parse_lspci_verbose(lines)
    assert [d.address for d in devices] == ["0000:d8:00.0", "10000:01:00.0", "10001:02:00.0"]
    assert devices[0].link_status == PcieLinkState(speed_gts=8.0, width=16, downgraded=False)
    without_domains = parse_lspci_verbose(["3b:00.0 3D controller: NVIDIA Corporation GA102GL [A10]"])
    assert [d.address for d in without_domains] == ["0000:3b:00.0"]  # without -D lspci leaves out domain 0 only


def test_lab_lspci_vmd_drive_after_the_last_gpu_keeps_the_gpus_link() -> None:
    """The lab's R740 has its NVMe drive behind VMD (domain 10000), listed right after the slot-4 GPU."""
    devices = parse_lspci_verbose(standins.lspci(_lab_profile(), ["-vvv", "-D"]).splitlines())
    addresses = [d.address for d in devices]
    assert addresses.index("10000:01:00.0") == addresses.index("0000:d8:00.0") + 2  # after the VMD root port
    by_address = {d.address: d for d in devices}
    assert by_address["0000:d8:00.0"].link_status == PcieLinkState(speed_gts=8.0, width=8, downgraded=True)
    assert by_address["10000:01:00.0"].link_status == PcieLinkState(speed_gts=8.0, width=4, downgraded=False)
    assert not by_address["10000:01:00.0"].is_gpu


def test_lspci_nn_class_codes_still_name_a_gpu() -> None:
    """`lspci -vvnn` adds [0302] after the class: still a GPU. An A100's header line as pasted in
    https://github.com/open-mpi/hwloc/issues/653."""
    gpu = parse_lspci_verbose(
        ["da:00.0 3D controller [0302]: NVIDIA Corporation GA100 [A100 SXM4 40GB] [10de:20b0] (rev a1)"]
    )
    assert gpu[0].is_gpu and gpu[0].address == "0000:da:00.0"
