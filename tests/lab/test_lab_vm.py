"""VM lab hosts boot through their own GRUB, so kernel-level changes are real.

The VM is shared by the session and other modules may have tuned it (host_tuning
switches it to cgroup v2), so these tests read its state first instead of assuming the base's.
That a GRUB change applies at the next boot and not before is proven by the product's own tests on this VM
(test_host_tuning_vm: cgroup v1 to v2 through a reboot, `defer` leaving the running kernel as it was;
test_reboot_vm: a probe argument through one reboot), so the lab does not spend two more reboots on it; those
reboots also show that a guest reboot resets the same qemu process and the lab reaches the VM again after it.
"""

from __future__ import annotations

import pytest
import yaml

from ironserve_lab import remote
from ironserve_lab.state import LabHost

pytestmark = pytest.mark.vm

CGROUP_V1 = "systemd.unified_cgroup_hierarchy=0"
CGROUP_V2 = "systemd.unified_cgroup_hierarchy=1"


def cmdline(host: LabHost) -> list[str]:
    return remote.run(host, "cat /proc/cmdline").split()


def cgroup_fs(host: LabHost) -> str:
    return remote.run(host, "stat -fc %T /sys/fs/cgroup").strip()


def expected_cgroup_fs(args: list[str]) -> str:
    # systemd 252 mounts the v1 hierarchy (tmpfs with controllers below) only when asked for it.
    return "tmpfs" if CGROUP_V1 in args else "cgroup2fs"


def test_kernel_is_booted_by_grub_with_the_configured_cmdline(vm_host: LabHost) -> None:
    args = cmdline(vm_host)
    # BOOT_IMAGE is set by GRUB only: qemu did not load the kernel directly.
    assert any(arg.startswith("BOOT_IMAGE=/boot/vmlinuz-") for arg in args), args
    configured = remote.run(vm_host, ". /etc/default/grub && echo $GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT")
    assert set(configured.split()) <= set(args)
    assert cgroup_fs(vm_host) == expected_cgroup_fs(args)


def test_hardware_profile_is_in_the_vm(vm_host: LabHost) -> None:
    profile = yaml.safe_load(remote.run(vm_host, "cat /etc/ironserve-lab/hardware.yaml"))
    assert profile["name"] == vm_host.hardware_profile


def test_modprobe_br_netfilter(vm_host: LabHost) -> None:
    try:
        remote.run(vm_host, "modprobe br_netfilter")
        assert "br_netfilter" in remote.run(vm_host, "lsmod").split()
        assert remote.run(vm_host, "sysctl -n net.bridge.bridge-nf-call-iptables").strip() in {"0", "1"}
    finally:
        remote.run(vm_host, "modprobe -r br_netfilter")


def test_kernel_sysctl_can_be_set(vm_host: LabHost) -> None:
    original = remote.run(vm_host, "sysctl -n net.core.rmem_max").strip()
    try:
        remote.run(vm_host, "sysctl -w net.core.rmem_max=26214400")
        assert remote.run(vm_host, "sysctl -n net.core.rmem_max").strip() == "26214400"
    finally:
        remote.run(vm_host, f"sysctl -w net.core.rmem_max={original}")
