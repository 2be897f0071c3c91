"""roles/nvidia against a real lab container host and the lab's signed NVIDIA mirror (ironserve/lab/aptrepo.py).

The mirror offers the pinned set AND newer decoys (driver 535, cuda-toolkit-12-2, libcudnn8 8.9.7 for
CUDA 12.2, TensorRT for CUDA 12.0): the host must converge to exactly the lock, come back to it after
drift, and report zero changes on the next run. The packages are stand-ins; apt, dpkg, the signature
check, the pins, the holds and systemd are real.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.config import build_config
from ironserve.config_nvidia import pinned_packages
from ironserve.lab import remote
from ironserve.lab.deploying import deploy, verify
from ironserve.lab.state import LabHost
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
PINS = pinned_packages(build_config("lab", {}).profile.packages, "debian12")
DPKG = "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' "


def _installed(host: LabHost) -> dict[str, tuple[str, str]]:
    out = remote.run(host, DPKG + " ".join(PINS) + " 2>/dev/null || true")
    return {name: (version, status.strip()) for name, version, status in (ln.split(" ", 2) for ln in out.splitlines())}


@pytest.fixture(scope="module")
def converged() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        first = deploy(hosts)
        assert first.returncode == 0, first.output
        yield hosts[0]


@pytest.mark.invariant("drv-version", "cuda-version", "cudnn-version", "tensorrt-version")
def test_host_gets_exactly_the_lock_although_newer_versions_are_offered(converged: LabHost) -> None:
    host = converged
    # The mirror offers newer versions of every locked package: without the pins apt would pick them.
    policy = remote.run(host, "apt-cache policy libcudnn8 nvidia-driver")
    assert "8.9.7.29-1+cuda12.2" in policy and "535.129.03-1" in policy
    installed = _installed(host)
    assert {name: version for name, (version, _) in installed.items()} == PINS
    assert all(status.startswith("hi") for _, status in installed.values()), installed  # held
    smi = remote.run(host, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u")
    assert smi.split() == ["525.85.02"]
    assert "release 11.8" in remote.run(host, "/usr/local/cuda-11.8/bin/nvcc --version")
    assert remote.run(host, "readlink -f /usr/local/cuda").strip() == "/usr/local/cuda-11.8"


def test_stand_in_nvidia_smi_reports_the_hardware_profile(converged: LabHost) -> None:
    host = converged
    rows = remote.run(host, "nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv,noheader")
    assert rows.splitlines()[0] == "0, NVIDIA A10, 00000000:3B:00.0, 23028 MiB"
    assert len(rows.splitlines()) == 4
    assert "Driver Version                        : 525.85.02" in remote.run(host, "nvidia-smi -q")
    assert "GPU0\t X \tNODE\tSYS\tSYS" in remote.run(host, "nvidia-smi topo -m")
    # nvidia-persistenced runs, so persistence mode reads Enabled, as on a real host.
    assert remote.run(host, "nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").split()[0] == "Enabled"


def test_second_deploy_reports_zero_changes(converged: LabHost) -> None:
    again = deploy([converged])
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


def test_drift_is_restored_then_zero_changes_and_gate_passes(converged: LabHost) -> None:
    host = converged
    apt = "DEBIAN_FRONTEND=noninteractive apt-get -y -q --allow-change-held-packages --allow-downgrades install"
    # By hand: a decoy cuDNN for CUDA 12, a CUDA 12 toolkit beside 11.8, one hold dropped, the pin
    # file deleted, the persistence daemon disabled and stopped.
    remote.run(host, f"{apt} libcudnn8=8.9.7.29-1+cuda12.2 libcudnn8-dev=8.9.7.29-1+cuda12.2 cuda-toolkit-12-2")
    remote.run(host, "apt-mark unhold tensorrt")
    remote.run(host, "rm /etc/apt/preferences.d/ironserve-nvidia.pref")
    remote.run(host, "systemctl disable --now nvidia-persistenced")
    assert _installed(host)["libcudnn8"][0] == "8.9.7.29-1+cuda12.2"

    restored = deploy([host])
    assert restored.returncode == 0, restored.output
    installed = _installed(host)
    assert {name: version for name, (version, _) in installed.items()} == PINS
    assert all(status.startswith("hi") for _, status in installed.values()), installed
    assert "Pin: version 8.6.0.163-1+cuda11.8" in remote.run(host, "cat /etc/apt/preferences.d/ironserve-nvidia.pref")
    assert remote.run(host, "systemctl is-enabled nvidia-persistenced").strip() == "enabled"
    assert remote.run(host, "systemctl is-active nvidia-persistenced").strip() == "active"
    assert remote.run(host, "ls -d /usr/local/cuda-12* 2>/dev/null || true").strip() == ""
    assert "#define CUDNN_MINOR 6" in remote.run(host, "cat /usr/include/cudnn_version.h")

    again = deploy([host])
    assert (again.returncode, again.changed, again.errors) == (0, 0, 0), again.output

    gate = verify([host], roles=("nvidia",))
    assert gate.returncode == 0, gate.stdout + gate.stderr


def test_mismatched_lock_is_refused_before_the_host_is_touched(converged: LabHost, tmp_path: Path) -> None:
    """cuDNN built for CUDA 12 with CUDA 11.8: refused by the lock check, no host contacted."""
    host = converged
    remote.run(host, "apt-mark unhold libcudnn8")  # drift a deploy would fix
    try:
        inventory = tmp_path / "mismatched.py"
        inventory.write_text(
            textwrap.dedent(f"""
            from ironserve.lab.inventory import lab_groups

            lab_containers, _ = lab_groups()
            lab_containers = [
                (name, {{**data, "ironserve_lock": {{"cudnn": {{"version": "8.9.7", "cuda": "12.2"}}}}}})
                for name, data in lab_containers if name == {host.name!r}
            ]
            """)
        )
        refused = deploy([host], str(inventory))
        assert refused.returncode == 2, refused.output
        assert "rule cudnn-matches-cuda failed: cudnn 8.9.7 is built for CUDA 12.2" in refused.output
        assert "rule packages-match-lock failed" in refused.output
        assert "no host was contacted" in refused.output
        assert _installed(host)["libcudnn8"][1].startswith("ii")  # still unheld: nothing ran
    finally:
        assert deploy([host]).returncode == 0
