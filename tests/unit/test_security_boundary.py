"""Pure code of the security role: settings validation, seccomp profile, slice and drop-in text, facts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ironserve.config import ConfigError
from roles import stack_config
from roles.container_runtime.facts import KernelModules, SwapState
from roles.security.facts import SUDOERS, SUDOERS_DIR, PasswordState, SudoGrants
from roles.security.render import (
    FORBIDDEN_SYSCALLS,
    SECCOMP_PROFILE,
    dropin_properties,
    read_seccomp_profile,
    render_service_dropin,
    render_slice,
    service_properties,
    slice_cgroup,
    systemd_run_command,
)

SETTINGS = stack_config("h", {}).security


def test_defaults_follow_the_catalog() -> None:
    assert (SETTINGS.user, SETTINGS.group, SETTINGS.shell) == ("ai-runner", "ai-runner", "/bin/false")
    assert SETTINGS.memory_max_bytes == 25769803776  # cgroup-ai-service-memory-max
    assert SETTINGS.capabilities == ("CAP_SYS_NICE",)
    assert all(node.startswith("/dev/nvidia") for node in SETTINGS.device_allow)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("security_memory_max", "24 gigs", "is not a size such as 24G"),
        ("security_shell", "/bin/bash", "security_shell"),
        ("security_capabilities", ["CAP_SYS_NICE", "CAP_SYS_ADMIN"], "as good as root"),
        ("security_device_allow", ["/dev/sda"], "security_device_allow"),
        ("security_slice", "ai service", "security_slice"),
        ("security_sheel", "/bin/false", "security_sheel"),
    ],
)
def test_bad_security_settings_name_host_and_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        stack_config("r740-01", {key: value})
    assert "host r740-01" in str(raised.value)


def test_profile_is_default_deny_with_ioctl_unfiltered() -> None:
    raw = json.loads(SECCOMP_PROFILE.read_text())
    profile = read_seccomp_profile()
    assert raw["defaultAction"] == "SCMP_ACT_ERRNO" and profile.defaultErrnoRet == 1
    ioctl = [rule for rule in profile.syscalls if "ioctl" in rule.names]
    assert len(ioctl) == 1 and ioctl[0].args == () and ioctl[0].action == "SCMP_ACT_ALLOW"
    # Enough for Python to start (the seed's five syscalls were not).
    assert {"execve", "brk", "close", "fstat", "futex", "clone", "mprotect", "munmap", "rt_sigaction"} <= (
        profile.allowed()
    )
    assert not profile.allowed() & FORBIDDEN_SYSCALLS


def test_profile_refusing_a_forbidden_syscall_does_not_load(tmp_path: Path) -> None:
    raw = json.loads(SECCOMP_PROFILE.read_text())
    raw["syscalls"][0]["names"].append("mount")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="allows mount"):
        read_seccomp_profile(path)


def test_profile_with_unknown_key_is_refused(tmp_path: Path) -> None:
    raw = json.loads(SECCOMP_PROFILE.read_text())
    raw["defaultActoin"] = "SCMP_ACT_ALLOW"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="defaultActoin"):
        read_seccomp_profile(path)


def test_systemd_filter_is_the_profile_list() -> None:
    profile = read_seccomp_profile()
    props = service_properties(SETTINGS, profile)
    filters = [value for key, value in props if key == "SystemCallFilter"]
    assert set(filters[0].split()) == profile.allowed() - {"clone3"}
    assert filters[1:] == ["~clone3:ENOSYS"]  # as the profile: glibc falls back to clone
    as_dict = dict(props)
    assert as_dict["SystemCallErrorNumber"] == "EPERM"
    assert as_dict["RestrictNamespaces"] == "yes"  # the profile's clone flag filter
    assert as_dict["LockPersonality"] == "yes"


def test_dropin_round_trips_and_carries_the_boundary() -> None:
    text = render_service_dropin(SETTINGS, read_seccomp_profile())
    props = dict(dropin_properties(text))
    assert props["User"] == "ai-runner"
    assert props["AmbientCapabilities"] == props["CapabilityBoundingSet"] == "CAP_SYS_NICE"
    assert props["NoNewPrivileges"] == "yes"
    assert props["Slice"] == "ai-service.slice"
    command = systemd_run_command(text, "true")
    assert command.startswith("systemd-run --quiet --wait --pipe --collect -p Slice=ai-service.slice")
    assert "'-p'" not in command and command.endswith(" true")


def test_slice_text() -> None:
    text = render_slice(SETTINGS)
    assert "MemoryMax=24G\n" in text and "CPUWeight=1000\n" in text and "DevicePolicy=closed\n" in text
    assert text.count("DeviceAllow=") == len(SETTINGS.device_allow)
    assert "devices.deny" in text  # the comment explains the cgroup v2 correction
    assert slice_cgroup("ai-service.slice") == "/ai.slice/ai-service.slice"
    assert slice_cgroup("system.slice") == "/system.slice"


@pytest.mark.parametrize(
    ("field", "state"), [("!", "locked"), ("!$6$abc", "locked"), ("*", "locked"), ("$6$x$y", "set"), ("", "empty")]
)
def test_password_state(field: str, state: str) -> None:
    assert PasswordState().process([field]) == state


def test_password_state_of_a_missing_account() -> None:
    assert PasswordState().process([]) is None


def test_kernel_modules_and_swap_and_holds() -> None:
    assert KernelModules().process(["overlay loaded", "br_netfilter absent"]) == {
        "overlay": "loaded",
        "br_netfilter": "absent",
    }
    assert SwapState().process(["active /dev/sda3", "fstab UUID=1234", "unit swapfile.swap"]) == {
        "active": ["/dev/sda3"],
        "fstab": ["UUID=1234"],
        "unit": ["swapfile.swap"],
    }
    assert SwapState.default() == {"active": [], "fstab": [], "unit": []}


def test_sudo_grants_names_every_file_that_names_the_account(tmp_path: Path) -> None:
    """The fact's real command (sh, grep) over sudoers files made for it: a rule, a User_Alias, the group; a
    Defaults line, a comment and longer names that contain the account's are not grants; files sudo skips (a dot
    or a trailing ~ in the name, sudoers(5)) are not read."""
    sudoers, folder = tmp_path / "sudoers", tmp_path / "sudoers.d"
    folder.mkdir()
    sudoers.write_text("root ALL=(ALL:ALL) ALL\n%sudo ALL=(ALL:ALL) ALL\n@includedir /etc/sudoers.d\n")
    files = {
        "90-runner": "ai-runner ALL=(ALL) NOPASSWD: ALL\n",
        "runners": "# ai-runner's team\nDefaults:ai-runner !requiretty\nUser_Alias RUNNERS = deploy,ai-runner\n"
        "RUNNERS ALL=(ALL) ALL\n",
        "group": "%ai-runner ALL=(ALL) ALL\n",
        "others": "ai-runner2 ALL=(ALL) ALL\nxai-runner ALL=ALL\n%ai-runners ALL=ALL\n",
        "kept.bak": "ai-runner ALL=(ALL) ALL\n",
        "kept~": "ai-runner ALL=(ALL) ALL\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    command = SudoGrants().command(user="ai-runner", group="ai-runner")
    command = command.replace(SUDOERS_DIR, str(folder)).replace(SUDOERS, str(sudoers))
    printed = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    assert printed.stderr == ""
    assert SudoGrants().process(printed.stdout.splitlines()) == {
        f"{folder}/90-runner": ["ai-runner ALL=(ALL) NOPASSWD: ALL"],
        f"{folder}/group": ["%ai-runner ALL=(ALL) ALL"],
        f"{folder}/runners": ["User_Alias RUNNERS = deploy,ai-runner"],
    }
