"""The lock meets the repository it is installed from, on a fresh lab container host (issue: a lock that names a
version the repository never published, or pins a meta-package without its exact-version siblings, must stop the
host before any package moves, as it would against NVIDIA's real repository).

The lab mirror serves, beside its debian11 directory, variants of it under `variants/<name>/` (lab/src/ironserve_lab/
aptrepo.py, VARIANTS): the same signed index less one package version. A site whose mirror lacks a version looks
exactly like this to the host's apt. The host's OS check is tried by rewriting the host's /etc/os-release.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve.profiles import read_profile
from ironserve.repocheck import check_repository
from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
NVIDIA = ("nvidia",)
# What a deploy that stops before any package moves leaves uninstalled: every package of the NVIDIA families.
FAMILIES = "'nvidia-*' 'libnvidia-*' 'libcuda*' 'cuda-*' 'libcudnn*' 'libnvinfer*' 'tensorrt' 'dkms'"
INSTALLED = "dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' " + FAMILIES + " 2>/dev/null | grep ' ii' || true"


@pytest.fixture(scope="module")
def fresh() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        yield hosts[0]


def _inventory(tmp_path: Path, host: LabHost, variant: str) -> str:
    """The lab inventory for `host` alone, its NVIDIA repository the mirror's variant `variant`."""
    inventory = tmp_path / f"{variant}.py"
    inventory.write_text(
        textwrap.dedent(f"""
        from ironserve_lab.inventory import lab_groups

        lab_containers, _ = lab_groups()
        variant = "/variants/{variant}"
        lab_containers = [
            (name, {{
                **data,
                "nvidia_repo_url": data["nvidia_repo_url"] + variant,
                # The lab mirror is plain http, each URL allowed by name (nvidia_allow_plain_http).
                "nvidia_allow_plain_http": [*data["nvidia_allow_plain_http"], data["nvidia_repo_url"] + variant],
            }})
            for name, data in lab_containers if name == {host.name!r}
        ]
        """)
    )
    return str(inventory)


def _stopped_before_any_package(host: LabHost, inventory: str) -> str:
    result = deploy([host], inventory, roles=NVIDIA)
    assert result.returncode != 0, result.output  # the only host stopped: pyinfra says "No hosts remaining"
    assert remote.run(host, INSTALLED).strip() == ""  # no package of the lock, nor dkms, was installed
    return result.output


@pytest.mark.invariant("drv-version")
def test_a_repository_without_the_pinned_driver_stops_the_host_before_any_package_moves(
    fresh: LabHost, tmp_path: Path
) -> None:
    """The mirror's variant lacks nvidia-driver 525.85.12-1, as NVIDIA's repositories lack the seed's 525.85.02."""
    output = _stopped_before_any_package(fresh, _inventory(tmp_path, fresh, "without-pinned-driver"))
    assert "the lock cannot be installed from" in output and "so no package was changed" in output
    assert "nvidia-driver 525.85.12-1 (pinned) is not offered" in output
    assert "apt: E: Version '525.85.12-1' for 'nvidia-driver' was not found" in output  # apt's own reason
    assert "The repositories offer nvidia-driver: 535.129.03-1" in output  # what the repository does carry


@pytest.mark.invariant("tensorrt-version")
def test_a_repository_without_an_exact_version_sibling_stops_the_host_before_any_package_moves(
    fresh: LabHost, tmp_path: Path
) -> None:
    """tensorrt 8.6.1.6-1+cuda11.8 needs libnvinfer-bin (= 8.6.1.6-1+cuda11.8); the variant lacks that build."""
    output = _stopped_before_any_package(fresh, _inventory(tmp_path, fresh, "without-tensorrt-sibling"))
    assert "libnvinfer-bin 8.6.1.6-1+cuda11.8 (required by tensorrt (= 8.6.1.6-1+cuda11.8)) is not offered" in output
    assert "libnvinfer-bin: " in output and "8.6.1.6-1+cuda12.0" in output  # the build it does offer


@pytest.mark.invariant("os-ubuntu-2204")
def test_an_os_outside_the_profile_stops_the_host_and_fails_the_gate(fresh: LabHost, tmp_path: Path) -> None:
    """The host says it is Ubuntu 20.04, which the r740-a10 lock is not published for."""
    host = fresh
    remote.run(host, "cp /etc/os-release /root/os-release.ironserve-test")
    remote.run(host, "rm -f /etc/apt/sources.list.d/ironserve-nvidia.list")  # left by the tests above
    try:
        remote.run(host, "printf 'ID=ubuntu\\nVERSION_ID=\"20.04\"\\n' > /etc/os-release")
        result = deploy([host], roles=NVIDIA)
        assert result.returncode != 0, result.output  # the only host stopped: pyinfra says "No hosts remaining"
        assert (
            "the OS ubuntu2004 is not one profile r740-a10's lock is published for; supported: ubuntu2204 "
            "(from ubuntu2204), debian12 (from debian11); nothing was changed"
        ) in result.output
        assert remote.run(host, "ls /etc/apt/sources.list.d/ironserve-nvidia.list 2>/dev/null || true").strip() == ""
        assert remote.run(host, INSTALLED).strip() == ""
        argv = [sys.executable, "-m", "ironserve", "verify", "--limit", host.name, "--roles", "host_tuning"]
        gate = subprocess.run(
            [*argv, "inventory/lab.py", "-vv", "-k", "test_supported_os"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert gate.returncode != 0, gate.stdout
        assert "test_supported_os" in gate.stdout and "FAILED" in gate.stdout, gate.stdout[-3000:]
    finally:
        remote.run(host, "mv /root/os-release.ironserve-test /etc/os-release")


def test_check_repo_from_the_admin_machine_against_the_mirror_and_its_variants(fresh: LabHost) -> None:
    """`ironserve lock --check-repo URL` on this machine against the lab mirror (a site mirror's layout): the lock
    resolves for Debian 12 from debian11, the mirror has no ubuntu2204 directory, a variant lacks a sibling."""
    base = fresh.extra["aptrepo_url"]

    def check(url: str, *more: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "ironserve", "lock", "--check-repo", url, *more]
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    good = check(base, "--os", "debian12")
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"debian12 (debian11, {base}/debian11/x86_64/Packages.gz): ok" in good.stdout
    assert "+ libnvinfer-bin 8.6.1.6-1+cuda11.8" in good.stdout  # reached from tensorrt by `=`
    assert "+ nvidia-kernel-support 525.85.12-1" in good.stdout  # reached through the virtual name it provides
    every = check(base)
    assert every.returncode == 1 and "ubuntu2204 (ubuntu2204, " in every.stdout
    assert "no index could be read" in every.stdout
    lacking = check(f"{base}/variants/without-tensorrt-sibling", "--os", "debian12")
    assert lacking.returncode == 1, lacking.stdout
    assert (
        "! libnvinfer-bin 8.6.1.6-1+cuda11.8 (required by tensorrt (= 8.6.1.6-1+cuda11.8)) is not in the repository; "
        "it offers libnvinfer-bin 10.0.0.6-1+cuda12.4, 8.6.1.6-1+cuda12.0"
    ) in lacking.stdout


def test_the_seed_s_debian12_mapping_fails_against_a_debian12_directory_like_nvidia_s(fresh: LabHost) -> None:
    """The profile as the seed had it, Debian 12 hosts on the debian12 directory: that directory (like NVIDIA's)
    starts at CUDA 12.3 and driver 545, so the check names the CUDA 11.8 toolkit and the R525 driver as missing."""
    profile = read_profile("r740-a10")
    seed = profile.model_copy(
        update={"platforms": {"debian12": "debian12"}, "packages": {"debian12": (profile.packages or {})["debian11"]}}
    )
    (check,) = check_repository(seed, fresh.extra["aptrepo_url"], ["debian12"])
    missing = "(pinned by the lock) is not in the repository; it offers"
    assert any(p.startswith(f"cuda-toolkit-11-8 11.8.0-1 {missing}") for p in check.problems), check.problems
    offered = f"nvidia-driver 525.85.12-1 {missing} nvidia-driver 550.54.14-1, 545.23.06-1"
    assert offered in check.problems, check.problems
