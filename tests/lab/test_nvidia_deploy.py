"""roles/nvidia against a real lab container host and the lab's signed NVIDIA mirror (lab/src/ironserve_lab/aptrepo.py).

The mirror offers the pinned set AND newer decoys (driver 535, cuda-toolkit-12-2, libcudnn8 8.9.7 for
CUDA 12.2, TensorRT for CUDA 12.0): the host must converge to exactly the lock, come back to it after
drift, and report zero changes on the next run. The packages are stand-ins; apt, dpkg, the signature
check, the pins, the holds and systemd are real.

Two things a container host lacks are stood in for by the tests that need them, and named so: a kernel of
its own (`stand-in kernel tree`: /boot/vmlinuz-<k> and /lib/modules/<k>[/build] made by the test, built for by
the lab's stand-in dkms) and a loaded nvidia module (`simulated loaded module`: a tmpfs over /sys/module in the
host's own mount namespace holding nvidia/version, because the real module does not load without a GPU).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.aptindex import Index, exact_closure
from ironserve.packages import pinned_packages
from ironserve.paths import REPO_ROOT
from ironserve_lab import aptrepo, remote
from ironserve_lab.deploying import deploy, verify
from ironserve_lab.state import LabHost
from roles import stack_config
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
DPKG = "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' "
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
DRIVER = "525.85.12"
STANDIN_KERNELS = ("6.1.0-901-standin", "6.1.0-902-standin")
REBOOT_FILES = "/run/reboot-required /run/ironserve/reboot-required"
# The NVIDIA role and the one that edits its container toolkit's config; other roles have their own lab tests.
STACK = ("nvidia", "container_runtime")
NVIDIA = ("nvidia",)  # the tests that change only what the NVIDIA role reads deploy it alone


def _inventory(tmp_path: Path, host: LabHost, **extra: object) -> str:
    """The lab inventory for `host` alone, with `extra` inventory keys (as a site would set them)."""
    inventory = tmp_path / f"{host.name}-{len(list(tmp_path.iterdir()))}.py"
    inventory.write_text(
        textwrap.dedent(f"""
        from ironserve_lab.inventory import lab_groups

        lab_containers, _ = lab_groups()
        lab_containers = [(name, {{**data, **{extra!r}}}) for name, data in lab_containers if name == {host.name!r}]
        """)
    )
    return str(inventory)


def _gate(host: LabHost, inventory: str, roles: str) -> subprocess.CompletedProcess[str]:
    """`ironserve verify -v` (each test's outcome printed) of `host` with `inventory`."""
    argv = [sys.executable, "-m", "ironserve", "verify", "--limit", host.name, "--roles", roles, inventory, "-vv"]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


def _outcome(gate: subprocess.CompletedProcess[str], test: str) -> str:
    """PASSED / FAILED / SKIPPED of one acceptance test in a verbose gate run."""
    found = re.search(rf"::{test}\[[^\]]*\] (PASSED|FAILED|SKIPPED|ERROR)", gate.stdout)
    return found.group(1) if found else f"not run: {gate.stdout[-3000:]}"


@functools.cache
def pins() -> dict[str, str]:
    """The lock's packages for a Debian 12 host and every package their relations pin, derived from the lab mirror's
    own index as the host's apt derives them (ironserve/aptindex.py)."""
    profile = stack_config("lab", {}).profile
    directory = profile.repository_for("debian12")
    index = Index.parse((aptrepo.ensure_built() / directory / "x86_64" / "Packages").read_text())
    return exact_closure(pinned_packages(profile.packages, directory), lambda wanted, required: index).pins


def _installed(host: LabHost) -> dict[str, tuple[str, str]]:
    out = remote.run(host, DPKG + " ".join(pins()) + " 2>/dev/null || true")
    return {name: (version, status.strip()) for name, version, status in (ln.split(" ", 2) for ln in out.splitlines())}


@pytest.fixture(scope="module")
def converged() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        first = deploy(hosts, roles=STACK)
        assert first.returncode == 0, first.output
        yield hosts[0]


@pytest.mark.invariant("drv-version", "cuda-version", "cudnn-version", "tensorrt-version")
def test_host_gets_exactly_the_lock_although_newer_versions_are_offered(converged: LabHost) -> None:
    host = converged
    # The mirror offers newer versions of every locked package: without the pins apt would pick them.
    policy = remote.run(host, "apt-cache policy libcudnn8 nvidia-driver")
    assert "8.9.7.29-1+cuda12.2" in policy and "535.129.03-1" in policy
    installed = _installed(host)
    assert {name: version for name, (version, _) in installed.items()} == pins()
    assert all(status.startswith("hi") for _, status in installed.values()), installed  # held
    smi = remote.run(host, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u")
    assert smi.split() == ["525.85.12"]
    assert "release 11.8" in remote.run(host, "/usr/local/cuda-11.8/bin/nvcc --version")
    assert remote.run(host, "readlink -f /usr/local/cuda").strip() == "/usr/local/cuda-11.8"


def test_stand_in_nvidia_smi_reports_the_hardware_profile(converged: LabHost) -> None:
    host = converged
    rows = remote.run(host, "nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv,noheader")
    assert rows.splitlines()[0] == "0, NVIDIA A10, 00000000:3B:00.0, 23028 MiB"
    assert len(rows.splitlines()) == 4
    assert "Driver Version                        : 525.85.12" in remote.run(host, "nvidia-smi -q")
    assert "GPU0\t X \tNODE\tSYS\tSYS" in remote.run(host, "nvidia-smi topo -m")
    # nvidia-persistenced runs, so persistence mode reads Enabled, as on a real host.
    assert remote.run(host, "nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").split()[0] == "Enabled"


def test_second_deploy_reports_zero_changes(converged: LabHost) -> None:
    again = deploy([converged], roles=STACK)
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


def test_drift_is_restored_then_zero_changes_and_gate_passes(converged: LabHost) -> None:
    host = converged
    apt = "DEBIAN_FRONTEND=noninteractive apt-get -y -q --allow-change-held-packages --allow-downgrades install"
    # By hand: a decoy cuDNN for CUDA 12, a CUDA 12 toolkit beside 11.8, one hold dropped, the pin
    # file deleted, the persistence daemon disabled and stopped.
    remote.run(host, f"{apt} libcudnn8=8.9.7.29-1+cuda12.2 libcudnn8-dev=8.9.7.29-1+cuda12.2 cuda-toolkit-12-2")
    toolkit = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools")
    remote.run(host, f"{apt} " + " ".join(f"{name}=1.17.8-1" for name in (*toolkit, "libnvidia-container1")))
    remote.run(host, f"sed -i 's/^no-cgroups = false/no-cgroups = true/' {TOOLKIT_CONFIG}")
    remote.run(host, "apt-mark unhold tensorrt")
    remote.run(host, "rm /etc/apt/preferences.d/ironserve-nvidia.pref")
    remote.run(host, "systemctl disable --now nvidia-persistenced")
    assert _installed(host)["libcudnn8"][0] == "8.9.7.29-1+cuda12.2"

    restored = deploy([host], roles=STACK)
    assert restored.returncode == 0, restored.output
    installed = _installed(host)
    assert {name: version for name, (version, _) in installed.items()} == pins()
    assert all(status.startswith("hi") for _, status in installed.values()), installed
    assert "Pin: version 8.6.0.163-1+cuda11.8" in remote.run(host, "cat /etc/apt/preferences.d/ironserve-nvidia.pref")
    assert remote.run(host, "systemctl is-enabled nvidia-persistenced").strip() == "enabled"
    assert remote.run(host, "systemctl is-active nvidia-persistenced").strip() == "active"
    assert remote.run(host, "ls -d /usr/local/cuda-12* 2>/dev/null || true").strip() == ""
    assert "#define CUDNN_MINOR 6" in remote.run(host, "cat /usr/include/cudnn_version.h")
    assert "version 1.13.5" in remote.run(host, "nvidia-ctk --version")
    assert tomllib.loads(remote.run(host, f"cat {TOOLKIT_CONFIG}"))["nvidia-container-cli"]["no-cgroups"] is False

    again = deploy([host], roles=STACK)
    assert (again.returncode, again.changed, again.errors) == (0, 0, 0), again.output

    gate = verify([host], roles=STACK)
    assert gate.returncode == 0, gate.stdout + gate.stderr


def test_mismatched_lock_is_refused_before_the_host_is_touched(converged: LabHost, tmp_path: Path) -> None:
    """cuDNN built for CUDA 12 with CUDA 11.8: refused by the lock check, no host contacted."""
    host = converged
    remote.run(host, "apt-mark unhold libcudnn8")  # drift a deploy would fix
    try:
        inventory = tmp_path / "mismatched.py"
        inventory.write_text(
            textwrap.dedent(f"""
            from ironserve_lab.inventory import lab_groups

            lab_containers, _ = lab_groups()
            lab_containers = [
                (name, {{**data, "ironserve_lock": {{"cudnn": {{"version": "8.9.7", "cuda": "12.2"}}}}}})
                for name, data in lab_containers if name == {host.name!r}
            ]
            """)
        )
        refused = deploy([host], str(inventory), roles=STACK)
        assert refused.returncode == 2, refused.output
        assert "rule cudnn-matches-cuda failed: cudnn 8.9.7 is built for CUDA 12.2" in refused.output
        assert "rule packages-match-lock failed" in refused.output
        assert "no host was contacted" in refused.output
        assert _installed(host)["libcudnn8"][1].startswith("ii")  # still unheld: nothing ran
    finally:
        assert deploy([host], roles=STACK).returncode == 0


@pytest.mark.invariant("cri-nvidia-container-cli-cgroups", "cri-nvidia-runtime")
def test_container_toolkit_pinned_and_no_cgroups_false_under_its_table(converged: LabHost, tmp_path: Path) -> None:
    """The full deploy (nvidia, then container_runtime) leaves the toolkit's own config.toml with one edit."""
    host = converged
    assert "1.17.8-1" in remote.run(host, "apt-cache policy nvidia-container-toolkit")  # the decoy is offered
    assert remote.run(host, "nvidia-ctk --version").splitlines()[0] == "NVIDIA Container Toolkit CLI version 1.13.5"
    text = remote.run(host, f"cat {TOOLKIT_CONFIG}")
    parsed = tomllib.loads(text)
    assert parsed["nvidia-container-cli"]["no-cgroups"] is False
    assert parsed["nvidia-container-runtime"]["runtimes"] == ["docker-runc", "runc"]  # the rest as shipped
    shipped = aptrepo.CONTAINER_TOOLKIT_CONFIG.splitlines()
    assert [(a, b) for a, b in zip(shipped, text.splitlines(), strict=True) if a != b] == [
        ("#no-cgroups = false", "no-cgroups = false")
    ]
    gate = _gate(host, _inventory(tmp_path, host), "nvidia,container_runtime")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert _outcome(gate, "test_nvidia_container_cli_keeps_cgroups") == "PASSED"
    assert _outcome(gate, "test_container_toolkit_is_the_locked_release") == "PASSED"


def test_dkms_builds_for_every_kernel_of_a_stand_in_kernel_tree(converged: LabHost, tmp_path: Path) -> None:
    """Stand-in kernel tree on a container host: two kernel images in /boot, only one with headers at first.

    The role runs `dkms autoinstall -k K` per kernel lacking the module, as on an R740; the lab's stand-in dkms
    (in the stand-in nvidia-kernel-dkms package) keeps dkms's rule that a kernel without headers cannot be built.
    """
    host = converged
    first, second = STANDIN_KERNELS
    make = " ".join(
        f"echo 'ironserve lab stand-in kernel image' > /boot/vmlinuz-{k}; mkdir -p /lib/modules/{k};"
        for k in STANDIN_KERNELS
    )
    remote.run(host, f"{make} mkdir -p /lib/modules/{first}/build")
    try:
        refused = deploy([host], roles=NVIDIA)
        assert refused.returncode != 0
        assert f"Your kernel headers for kernel {second} cannot be found" in refused.output

        remote.run(host, f"mkdir -p /lib/modules/{second}/build")  # what linux-headers-<k> provides on a real host
        built = deploy([host], roles=NVIDIA)
        assert built.returncode == 0, built.output
        status = remote.run(host, "dkms status").splitlines()
        assert [line for line in status if "installed" in line] == [
            f"nvidia-current/{DRIVER}, {k}, x86_64: installed" for k in STANDIN_KERNELS
        ]
        assert remote.run(host, f"ls /lib/modules/{second}/updates/dkms/").split()[0] == "nvidia-current-drm.ko"
        again = deploy([host], roles=NVIDIA)
        assert (again.returncode, again.changed) == (0, 0), again.output

        remote.run(host, f"rm /lib/modules/{first}/updates/dkms/nvidia-current.ko")  # drift: a module gone
        restored = deploy([host], roles=NVIDIA)
        assert (restored.returncode, restored.changed) == (0, 1), restored.output
        assert remote.run(host, f"ls /lib/modules/{first}/updates/dkms/nvidia-current.ko").strip()

        gate = _gate(host, _inventory(tmp_path, host), "nvidia")
        assert gate.returncode == 0, gate.stdout + gate.stderr
        assert _outcome(gate, "test_module_is_dkms_built_for_every_installed_kernel") == "PASSED"
    finally:
        for k in STANDIN_KERNELS:
            remote.run(host, f"dkms remove -m nvidia-current -v {DRIVER} -k {k} >/dev/null 2>&1; true")
            remote.run(host, f"rm -rf /boot/vmlinuz-{k} /lib/modules/{k}")


def test_driver_change_through_the_reboot_policy_with_a_simulated_loaded_module(
    converged: LabHost, tmp_path: Path
) -> None:
    """Simulated loaded module: /sys/module/nvidia/version says 515.86.01 while the userland is 525.85.12.

    defer (the lab containers' policy) writes the marker and the reason, and a re-run changes nothing; never only
    reports; auto on a container host defers too (its kernel is the machine's). The gate fails meanwhile.
    A real reboot with `auto` needs a host whose nvidia module can load: see roles/nvidia/README.md.
    """
    host = converged
    remote.run(host, f"rm -f {REBOOT_FILES}")
    remote.run(
        host,
        "mount -t tmpfs -o size=64k,mode=755 ironserve-simulated-module /sys/module && mkdir /sys/module/nvidia "
        "&& echo 515.86.01 > /sys/module/nvidia/version",
    )
    try:
        never = deploy([host], _inventory(tmp_path, host, ironserve_reboot_policy="never"), roles=NVIDIA)
        assert (never.returncode, never.changed) == (0, 0), never.output
        assert remote.run(host, f"ls {REBOOT_FILES} 2>/dev/null || true").strip() == ""

        deferred = deploy([host], roles=NVIDIA)
        assert (deferred.returncode, deferred.changed) == (0, 1), deferred.output
        reason = remote.run(host, "cat /run/ironserve/reboot-required")
        assert f"the loaded nvidia kernel module is 515.86.01, the installed driver {DRIVER}: reboot needed" in reason
        assert remote.run(host, "cat /run/reboot-required").strip() == "*** System restart required ***"
        again = deploy([host], roles=NVIDIA)
        assert (again.returncode, again.changed) == (0, 0), again.output

        remote.run(host, f"rm -f {REBOOT_FILES}")
        auto = deploy([host], _inventory(tmp_path, host, ironserve_reboot_policy="auto"), roles=NVIDIA)
        assert (auto.returncode, auto.changed) == (0, 1), auto.output
        assert "the machine that runs it reboots" in remote.run(host, "cat /run/ironserve/reboot-required")

        gate = _gate(host, _inventory(tmp_path, host), "nvidia")
        assert gate.returncode != 0
        assert _outcome(gate, "test_loaded_module_is_the_installed_driver") == "FAILED"
    finally:
        remote.run(host, f"umount /sys/module; rm -f {REBOOT_FILES}")
    assert remote.run(host, "ls /sys/module/nvidia 2>/dev/null || true").strip() == ""


def test_cuda_samples_source_staged_from_the_mirror_checksum_checked(converged: LabHost, tmp_path: Path) -> None:
    """The mirror serves a stand-in of GitHub's cuda-samples v11.8 archive (real layout, stand-in contents).
    The lab inventory stages it already; removed here, a wrong checksum stages nothing, the right one restores it."""
    host = converged
    url = f"{host.extra['aptrepo_url']}/{aptrepo.cuda_samples_path('v11.8')}"
    sha = aptrepo.cuda_samples_sha256("v11.8")
    remote.run(host, "rm -rf /opt/cuda-samples-11.8")
    bad_sum = _inventory(tmp_path, host, nvidia_cuda_samples_url=url, nvidia_cuda_samples_sha256="0" * 64)
    wrong = deploy([host], bad_sum, roles=NVIDIA)
    assert wrong.returncode != 0
    assert remote.run(host, "ls -d /opt/cuda-samples-11.8 2>/dev/null || true").strip() == ""

    inventory = _inventory(tmp_path, host, nvidia_cuda_samples_url=url, nvidia_cuda_samples_sha256=sha)
    staged = deploy([host], inventory, roles=NVIDIA)
    assert staged.returncode == 0, staged.output
    assert remote.run(host, "cat /opt/cuda-samples-11.8/.ironserve-source-sha256").strip() == sha
    assert "deviceQuery.cpp" in remote.run(host, "ls /opt/cuda-samples-11.8/Samples/1_Utilities/deviceQuery")
    again = deploy([host], inventory, roles=NVIDIA)
    assert (again.returncode, again.changed) == (0, 0), again.output
    gate = _gate(host, inventory, "nvidia")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert _outcome(gate, "test_cuda_samples_source_is_staged") == "PASSED"
    assert _outcome(gate, "test_device_query_passes") == "SKIPPED"  # no GPU here: skipped, saying why


@pytest.mark.invariant("drv-install-runfile-flags", "drv-no-distro-driver")
def test_runfile_method_replaces_the_apt_driver_and_back(converged: LabHost, tmp_path: Path) -> None:
    """nvidia_driver_method runfile: the mirror's stand-in NVIDIA-Linux-x86_64-525.85.12.run, SHA-256 checked.

    On a container host the role passes --no-kernel-module instead of --dkms (the kernel is the machine's).
    Switching back to apt runs nvidia-uninstall and reinstalls the pinned packages.
    """
    host = converged
    inventory = _inventory(
        tmp_path,
        host,
        nvidia_driver_method="runfile",
        nvidia_runfile_base_url=host.extra["aptrepo_url"],
        nvidia_runfile_sha256=aptrepo.runfile_sha256(DRIVER),
    )
    try:
        first = deploy([host], inventory, roles=NVIDIA)
        assert first.returncode == 0, first.output
        assert remote.run(host, "dpkg-query -W 'nvidia-driver*' 2>/dev/null || true").strip() == ""
        log = remote.run(host, "cat /var/log/nvidia-installer.log")
        assert "    --silent\n    --no-kernel-module\n    --no-opengl-files\n    --no-x-check\n" in log
        assert remote.run(host, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u").split() == [
            DRIVER
        ]
        assert remote.run(host, "systemctl is-active nvidia-persistenced").strip() == "active"
        again = deploy([host], inventory, roles=NVIDIA)
        assert (again.returncode, again.changed) == (0, 0), again.output
        gate = _gate(host, inventory, "nvidia")
        assert gate.returncode == 0, gate.stdout + gate.stderr
        assert _outcome(gate, "test_runfile_installed_without_opengl_files_and_x_check") == "PASSED"
    finally:
        back = deploy([host], roles=NVIDIA)
        assert back.returncode == 0, back.output
    assert remote.run(host, "ls /usr/bin/nvidia-uninstall 2>/dev/null || true").strip() == ""
    assert {name: version for name, (version, _) in _installed(host).items()} == pins()
    again = deploy([host], roles=NVIDIA)
    assert (again.returncode, again.changed) == (0, 0), again.output
