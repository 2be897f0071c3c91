"""Acceptance: the hardware the stack runs on (catalog area bios_hardware; roles/preflight, roles/bios).

Read on the host with the commands an admin runs on an R740 (dmidecode, lscpu, lspci, sysfs, nvidia-smi).
Checks that need the NVIDIA driver skip, saying so, until it is installed (roles/nvidia).
"""

from __future__ import annotations

from typing import Any

import pytest

from ironserve.profiles import HardwareSpec
from roles import StackConfig
from roles.preflight.checks import GEN_SPEED_GTS, gpus
from roles.preflight.facts import (
    PciDevice,
    parse_dmidecode_power_supplies,
    parse_lscpu_sockets,
    parse_lspci_verbose,
    parse_numa_nodes,
    parse_nvidia_topo,
)


def _spec(config: StackConfig) -> HardwareSpec:
    if config.profile.hardware is None:
        pytest.skip(f"profile {config.profile_name} states no hardware expectations")
    return config.profile.hardware


def _gpus(host: Any) -> list[PciDevice]:
    return gpus(parse_lspci_verbose(host.run("lspci -vvv -D").stdout.splitlines()))


def _serving(host: Any, spec: HardwareSpec) -> list[PciDevice]:
    full = [g for g in _gpus(host) if g.link_status and g.link_status.width >= spec.serving_width]
    return full[: spec.serving_gpus]


def _nvidia_smi(host: Any, args: str) -> str:
    if not host.exists("nvidia-smi"):
        pytest.skip("nvidia-smi is not installed yet (roles/nvidia brings it)")
    result = host.run(f"nvidia-smi {args}")
    assert result.succeeded, result.stderr
    return str(result.stdout)


@pytest.mark.invariant("hw-server-model")
def test_server_model(host: Any, config: StackConfig, observe: Any) -> None:
    product = host.run("dmidecode -s system-product-name").stdout.strip()
    observe(product)
    assert product == config.profile.server.model


@pytest.mark.invariant("hw-server-model")
def test_cpu_sockets(host: Any, config: StackConfig, observe: Any) -> None:
    sockets = parse_lscpu_sockets(host.run("lscpu").stdout.splitlines())
    observe(sockets)
    assert sockets == _spec(config).cpu_sockets


@pytest.mark.invariant("hw-server-model", "hw-no-tesla-p4")
def test_installed_gpus_are_the_profile_model(host: Any, config: StackConfig, observe: Any) -> None:
    spec = _spec(config)
    found = _gpus(host)
    observe([g.description for g in found])
    assert len(found) == spec.gpus_installed
    assert all(spec.gpu_pci_name in g.description and "Tesla P4" not in g.description for g in found)


@pytest.mark.invariant("hw-above-4g-decoding")
def test_every_gpu_bar_is_mapped(host: Any, observe: Any) -> None:
    unmapped = {g.address: g.unassigned_bars for g in _gpus(host) if g.unassigned_bars}
    observe(unmapped or "all mapped")
    assert not unmapped


@pytest.mark.invariant("hw-pcie-link-width-x16", "hw-active-gpus-two")
def test_serving_gpus_are_full_width(host: Any, config: StackConfig, observe: Any) -> None:
    spec = _spec(config)
    serving = _serving(host, spec)
    observe({g.address: g.link_status.width if g.link_status else None for g in serving})
    assert len(serving) == spec.serving_gpus


@pytest.mark.invariant("hw-pcie-link-gen", "hw-pcie-check-tool")
def test_serving_gpus_link_at_platform_speed(host: Any, config: StackConfig, observe: Any) -> None:
    # Corrected: the R740 is Gen3, so 8 GT/s is the truth (never the seed's 16 GT/s).
    want = GEN_SPEED_GTS[config.profile.server.pcie_gen]
    serving = _serving(host, _spec(config))
    speeds = {g.address: g.link_status.speed_gts if g.link_status else None for g in serving}
    observe(speeds)
    assert serving and all(speed == want for speed in speeds.values())


@pytest.mark.invariant("hw-gpu-same-socket", "hw-gpu-numa-matches-memory")
def test_serving_gpus_share_one_numa_node(host: Any, config: StackConfig, observe: Any) -> None:
    spec = _spec(config)
    sysfs = parse_numa_nodes(
        host.run('for d in /sys/bus/pci/devices/*; do echo "${d##*/} $(cat $d/numa_node)"; done').stdout.splitlines()
    )
    nodes = {g.address: sysfs.get(g.address, g.numa_node) for g in _serving(host, spec)}
    observe(nodes)
    assert nodes and all(n is not None and n >= 0 for n in nodes.values())
    if spec.same_socket:
        assert len(set(nodes.values())) == 1


@pytest.mark.invariant("hw-psu-2000w")
def test_psu_carries_the_gpus_and_platform(host: Any, config: StackConfig, observe: Any) -> None:
    # Corrected sizing: A10 board power is 150 W (not the seed's 250 W), plus the platform budget.
    spec = _spec(config)
    supplies = [p for p in parse_dmidecode_power_supplies(host.run("dmidecode -t 39").stdout.splitlines()) if p.present]
    capacities = [p.capacity_w for p in supplies if p.capacity_w]
    observe(capacities)
    need = spec.gpus_installed * config.profile.gpu.board_power_w + spec.platform_power_w
    assert capacities and min(capacities) >= need


@pytest.mark.invariant("hw-bios-sriov-disabled")
def test_no_gpu_exposes_virtual_functions(host: Any, observe: Any) -> None:
    counts = {
        g.address: host.run(f"cat /sys/bus/pci/devices/{g.address}/sriov_numvfs 2>/dev/null || echo 0").stdout.strip()
        for g in _gpus(host)
    }
    observe(counts)
    assert all(c == "0" for c in counts.values())


@pytest.mark.invariant("hw-bios-acs-enabled")
def test_acs_does_not_redirect_peer_to_peer(host: Any, observe: Any) -> None:
    # Corrected: ACS redirect breaks GPU P2P on bare metal; the state is recorded and must be off.
    devices = parse_lspci_verbose(host.run("lspci -vvv -D").stdout.splitlines())
    redirecting = [d.address for d in devices if d.acs_p2p_redirect]
    observe(redirecting or f"off on {sum(1 for d in devices if d.acs_control)} ACS functions")
    assert not redirecting


@pytest.mark.invariant("hw-gpu-arch-ampere")
def test_gpu_compute_capability(host: Any, config: StackConfig, observe: Any) -> None:
    caps = set(_nvidia_smi(host, "--query-gpu=compute_cap --format=csv,noheader").split())
    observe(caps)
    assert caps == {config.profile.gpu.compute_capability}


@pytest.mark.invariant("hw-gpu-memory-24gb")
def test_gpu_memory(host: Any, config: StackConfig, observe: Any) -> None:
    totals = [int(v) for v in _nvidia_smi(host, "--query-gpu=memory.total --format=csv,noheader,nounits").split()]
    observe(totals)
    # ~23028 MiB usable of an A10's 24 GB: within 10% of the profile's size.
    assert totals and all(t >= config.profile.gpu.memory_gib * 1024 * 0.9 for t in totals)


@pytest.mark.invariant("hw-gpu-power-limit")
def test_gpu_power_limit_is_the_board_default(host: Any, config: StackConfig, observe: Any) -> None:
    rows = _nvidia_smi(host, "--query-gpu=power.limit,power.default_limit --format=csv,noheader,nounits")
    pairs = [tuple(float(x) for x in line.split(",")) for line in rows.splitlines() if line.strip()]
    observe(pairs)
    # Corrected: the A10 default limit is 150 W (the seed's 250 W is wrong); no silent capping.
    assert pairs and all(limit == default == config.profile.gpu.board_power_w for limit, default in pairs)


@pytest.mark.invariant("hw-p2p-topology-check", "hw-nvlink-bridge")
def test_serving_gpus_reach_each_other_over_pcie(host: Any, observe: Any) -> None:
    # Corrected: the A10 has no NVLink; P2P goes over PCIe and must not cross the CPU interconnect (SYS).
    topology = parse_nvidia_topo(_nvidia_smi(host, "topo -m").splitlines())
    observe(topology.links)
    link = topology.links.get("GPU0", {}).get("GPU1")
    assert link is not None and link != "SYS"
