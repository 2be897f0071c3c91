"""Kernel prerequisites and enforcement on a lab VM (real kernel): what a container host cannot show.

overlay and br_netfilter really load, the bridge sysctl appears and is set, an active swap area is
turned off and kept out of /etc/fstab, containerd answers, and the service slice's MemoryMax reaches
the kernel's cgroup files. One deploy of the security and container_runtime roles, then reads; kept short (TCG is slow).
"""

from __future__ import annotations

import pytest

from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost

# Only the two roles under test: their own convergence and zero-change re-run.
SECURITY_RUNTIME = ("security", "container_runtime")
pytestmark = pytest.mark.vm
SWAPFILE = "/ironserve-test.swap"


@pytest.fixture(scope="module")
def deployed_vm(vm_host: LabHost) -> LabHost:
    remote.run(
        vm_host,
        f"fallocate -l 32M {SWAPFILE} && chmod 600 {SWAPFILE} && mkswap {SWAPFILE} >/dev/null && swapon {SWAPFILE} "
        f"&& echo '{SWAPFILE} none swap sw 0 0' >> /etc/fstab",
    )
    assert SWAPFILE in remote.run(vm_host, "cat /proc/swaps")
    result = deploy([vm_host], roles=SECURITY_RUNTIME)
    assert result.returncode == 0, result.output
    return vm_host


def test_modules_loaded_and_persisted(deployed_vm: LabHost) -> None:
    loaded = remote.run(deployed_vm, "cat /proc/modules").split("\n")
    names = {line.split()[0] for line in loaded if line.strip()}
    builtin = remote.run(deployed_vm, "cat /lib/modules/$(uname -r)/modules.builtin || true")
    for module in ("overlay", "br_netfilter"):
        assert module in names or f"/{module}.ko" in builtin
    assert remote.run(deployed_vm, "cat /etc/modules-load.d/ironserve-containers.conf").split() == [
        "overlay",
        "br_netfilter",
    ]


def test_bridge_sysctls_live(deployed_vm: LabHost) -> None:
    values = remote.run(deployed_vm, "sysctl -n net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables").split()
    assert values == ["1", "1"]


def test_swap_off_and_kept_off(deployed_vm: LabHost) -> None:
    assert SWAPFILE not in remote.run(deployed_vm, "cat /proc/swaps")
    fstab = remote.run(deployed_vm, "cat /etc/fstab")
    assert f"# ironserve: swap off for the kubelet # {SWAPFILE}" in fstab
    assert remote.run(deployed_vm, "swapon --show --noheadings").strip() == ""


def test_containerd_answers_and_memory_max_reaches_the_kernel(deployed_vm: LabHost) -> None:
    assert "Server:" in remote.run(deployed_vm, "ctr version")
    remote.run(deployed_vm, "systemctl start ai-service.slice")
    fs = remote.run(deployed_vm, "stat -fc %T /sys/fs/cgroup").strip()
    if fs == "cgroup2fs":
        path = "/sys/fs/cgroup/ai.slice/ai-service.slice/memory.max"
    else:  # the image boots cgroup v1 until host_tuning switches it; systemd maps MemoryMax to the v1 limit
        path = "/sys/fs/cgroup/memory/ai.slice/ai-service.slice/memory.limit_in_bytes"
    assert remote.run(deployed_vm, f"cat {path}").strip() == "25769803776"


def test_second_run_changes_nothing(deployed_vm: LabHost) -> None:
    again = deploy([deployed_vm], roles=SECURITY_RUNTIME)
    assert (again.returncode, again.changed) == (0, 0), again.output


THIN_POOL = "ironserve-test-pool"
THIN_POOL_FILES = "/var/lib/ironserve-test-thinpool"


def test_devmapper_on_a_loop_backed_thin_pool_is_ok_then_overlayfs_again(deployed_vm: LabHost) -> None:
    """cri-devmapper-snapshotter: with a thin-pool on the host (here two loop devices under device-mapper's
    thin-pool target, as containerd's devmapper docs set one up; an LVM thin LV is the same target),
    container_runtime_snapshotter devmapper makes containerd's devmapper plugin load (`ctr plugins ls`: ok)."""
    # 512 MiB data, 64 MiB metadata: thin-pool <metadata> <data> <block size: 128 sectors> <low water mark>.
    remote.run(
        deployed_vm,
        f"mkdir -p {THIN_POOL_FILES} && cd {THIN_POOL_FILES} && truncate -s 512M data && truncate -s 64M meta && "
        "modprobe dm_thin_pool && data=$(losetup --find --show data) && meta=$(losetup --find --show meta) && "
        f'dmsetup create {THIN_POOL} --table "0 $(blockdev --getsz $data) thin-pool $meta $data 128 32768 1 '
        'skip_block_zeroing"',
    )
    devmapper = (
        "--data",
        "container_runtime_snapshotter=devmapper",
        "--data",
        f"container_runtime_devmapper_pool_name={THIN_POOL}",
    )
    try:
        result = deploy([deployed_vm], roles=SECURITY_RUNTIME, pyinfra_args=devmapper)
        assert result.returncode == 0, result.output
        plugins = remote.run(deployed_vm, "ctr plugins ls")
        status = [
            row.split()[-1]
            for row in plugins.splitlines()
            if "io.containerd.snapshotter.v1" in row and " devmapper " in row
        ]
        assert status == ["ok"], plugins
        assert 'snapshotter = "devmapper"' in remote.run(deployed_vm, "containerd config dump")
    finally:
        back = deploy([deployed_vm], roles=SECURITY_RUNTIME)
        remote.run(
            deployed_vm,
            f"dmsetup remove {THIN_POOL}; for f in data meta; do losetup -j {THIN_POOL_FILES}/$f | cut -d: -f1 | "
            f"xargs -r losetup -d; done; rm -rf {THIN_POOL_FILES}",
        )
    assert back.returncode == 0, back.output
    assert 'snapshotter = "overlayfs"' in remote.run(deployed_vm, "containerd config dump")
