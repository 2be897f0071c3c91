"""Pure parsers of the custom facts on hand-made output; tests/facts holds the recorded cases (test_fact_data)."""

from __future__ import annotations

from ironserve.facts import ContainerKind, SysctlEntry, SysctlState, parse_os_release, sections
from roles.host_tuning.facts import GrubCmdlineLinux, KernelCmdline, missing_kernel_args, with_kernel_args


def test_sysctl_state_parses_values_writability_and_absence() -> None:
    output = [
        "net.core.rmem_max|ro|4194304",
        "net.ipv4.ip_local_port_range|rw|32768\t60999",
        "net.bogus.key|absent|-",
    ]
    assert SysctlState().process(output) == {
        "net.core.rmem_max": SysctlEntry("4194304", writable=False),
        "net.ipv4.ip_local_port_range": SysctlEntry("32768\t60999", writable=True),
        "net.bogus.key": SysctlEntry(None, writable=False),
    }


def test_grub_cmdline_last_assignment_wins_and_quotes_group() -> None:
    output = ['GRUB_CMDLINE_LINUX=""', 'GRUB_CMDLINE_LINUX="console=ttyS0,115200  systemd.unified_cgroup_hierarchy=0"']
    assert GrubCmdlineLinux().process(output) == ["console=ttyS0,115200", "systemd.unified_cgroup_hierarchy=0"]
    assert GrubCmdlineLinux().process(["ABSENT"]) is None
    assert GrubCmdlineLinux().process([]) == []


def test_kernel_args_replace_same_key_and_keep_others() -> None:
    current = ["quiet", "systemd.unified_cgroup_hierarchy=0", "systemd.unified_cgroup_hierarchy=0"]
    assert with_kernel_args(current, ["systemd.unified_cgroup_hierarchy=1"]) == [
        "quiet",
        "systemd.unified_cgroup_hierarchy=1",
    ]
    assert with_kernel_args(["quiet"], ["a=1"]) == ["quiet", "a=1"]
    assert with_kernel_args(["quiet", "a=1"], ["a=1"]) == ["quiet", "a=1"]


def test_running_cmdline_and_missing_args() -> None:
    running = KernelCmdline().process(["BOOT_IMAGE=/boot/vmlinuz-6.1.0-28-amd64 root=UUID=x ro quiet"])
    assert missing_kernel_args(running, ["quiet", "systemd.unified_cgroup_hierarchy=1"]) == [
        "systemd.unified_cgroup_hierarchy=1"
    ]


def test_container_kind() -> None:
    assert ContainerKind().process(["none"]) is None
    assert ContainerKind().process(["container-other"]) == "container-other"


def test_sections_split_marked_command_output_verbatim() -> None:
    output = ["ignored before any marker", "== version", "nvidia-installer:  version 525.85.02", "", "== log"]
    output += ["nvidia-installer command line:", "    --silent", "== empty", "== log", "appended"]
    assert sections(output) == {
        "version": ["nvidia-installer:  version 525.85.02", ""],
        "log": ["nvidia-installer command line:", "    --silent", "appended"],
        "empty": [],
    }
    assert sections(["== not a marker because of this", "=== nor this", "==x"]) == {}
    assert sections([]) == {}


def test_os_release_keys_name_nvidia_repository_directories() -> None:
    assert parse_os_release(["debian 12"]) == "debian12"
    assert parse_os_release(["ubuntu 22.04"]) == "ubuntu2204"
    assert parse_os_release(["rhel 9.6"]) == "rhel9"  # NVIDIA's repos/rhel9 serves every RHEL 9 minor
    assert parse_os_release(["debian"]) == "debian"  # testing and sid have no VERSION_ID
