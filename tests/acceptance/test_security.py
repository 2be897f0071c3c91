"""Acceptance: roles/security (catalog area security, and the service slice of kernel_cgroup).

Settings are proven by behaviour where a host can show it: a transient unit started with the
installed drop-in's own settings, in the service slice, reports its user, capabilities and what
its syscall filter refuses.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from ironserve.validators import CAPABILITY_BITS
from roles import StackConfig
from roles.security.seccomp import DROPIN_NAME, dropin_properties, slice_cgroup, systemd_run_command

PROFILE_NAME = "ai-service.json"
# Runs under the filter: imports a Python service needs, threads, a subprocess, ctypes into libc.
WORKLOAD = (
    "import json, ssl, hashlib, threading, sqlite3, subprocess, ctypes, os; "
    "t = [threading.Thread(target=hashlib.sha256, args=(b'x',)) for _ in range(4)]; [x.start() for x in t]; "
    "[x.join() for x in t]; assert subprocess.run(['true']).returncode == 0; ctypes.CDLL(None).getpid(); "
    "status = dict(line.split(':', 1) for line in open('/proc/self/status')); "
    "print(os.geteuid(), status['CapEff'].strip(), open('/proc/self/cgroup').read().split('::')[-1].strip())"
)
# unshare(CLONE_NEWUSER) needs no privilege, so only the filter can refuse it.
UNSHARE = (
    "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"
)


def _dropin(host: Any, config: StackConfig) -> str:
    unit = config.security.service_units[0]
    return host.file(f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}").content_string


def _probe(host: Any, config: StackConfig, code: str) -> Any:
    return host.run(systemd_run_command(_dropin(host, config), "python3 -c " + shlex.quote(code)))


@pytest.mark.invariant("sec-ai-runner-user")
def test_service_user_is_a_system_account_without_login(host: Any, config: StackConfig, observe: Any) -> None:
    entry = host.run(f"getent passwd {config.security.user}").stdout.strip()
    observe(entry)
    fields = entry.split(":")
    assert len(fields) == 7, entry
    assert int(fields[2]) < 1000
    assert fields[6] == config.security.shell


@pytest.mark.invariant("sec-ai-runner-user")
def test_service_user_password_is_locked(host: Any, config: StackConfig, observe: Any) -> None:
    field = host.run(f"getent shadow {config.security.user} | cut -d: -f2").stdout.strip()
    observe(field[:1] or "(empty)")
    assert field.startswith(("!", "*"))


@pytest.mark.invariant("sec-ai-runner-group")
def test_exactly_one_service_group(host: Any, config: StackConfig, observe: Any) -> None:
    lines = host.run(f"getent group {config.security.group}").stdout.strip().splitlines()
    observe(lines)
    assert len(lines) == 1


@pytest.mark.parametrize("which", ["model", "state", "log"])
@pytest.mark.invariant("sec-non-root-service")
def test_service_directories_least_privilege(host: Any, config: StackConfig, which: str, observe: Any) -> None:
    settings = config.security
    path, user, mode = {
        "model": (settings.model_dir, "root", 0o750),
        "state": (settings.state_dir, settings.user, 0o700),
        "log": (settings.log_dir, settings.user, 0o750),
    }[which]
    directory = host.file(path)
    observe(f"{directory.user}:{directory.group} {oct(directory.mode)}")
    assert directory.is_directory
    assert (directory.user, directory.group, directory.mode) == (user, settings.group, mode)


@pytest.mark.invariant("sec-non-root-service", "sec-cap-sys-nice")
def test_service_drop_in_runs_as_service_user_with_cap_sys_nice_only(
    host: Any, config: StackConfig, observe: Any
) -> None:
    probe = _probe(host, config, WORKLOAD)
    observe(probe.stdout.strip() or probe.stderr.strip())
    assert probe.succeeded, probe.stderr
    uid, cap_eff, cgroup = probe.stdout.split()
    assert uid == host.run(f"id -u {config.security.user}").stdout.strip() != "0"
    assert cap_eff == f"{sum(1 << CAPABILITY_BITS[c] for c in config.security.capabilities):016x}"
    assert cgroup.startswith(slice_cgroup(config.security.slice) + "/")


@pytest.mark.invariant("sec-cap-sys-nice")
def test_system_python_has_no_file_capabilities(host: Any, observe: Any) -> None:
    # The seed's setcap on the interpreter would give CAP_SYS_NICE to every Python program on the host.
    probe = host.run(
        "python3 -c 'import glob, os\n"
        'for p in sorted(set(map(os.path.realpath, glob.glob("/usr/bin/python3*")))):\n'
        '    try: os.getxattr(p, "security.capability"); print(p)\n'
        "    except OSError: pass'"
    )
    observe(probe.stdout.strip() or "none")
    assert probe.succeeded and probe.stdout.strip() == ""


@pytest.mark.invariant("sec-seccomp-profile")
def test_seccomp_filter_refuses_a_forbidden_syscall(host: Any, config: StackConfig, observe: Any) -> None:
    probe = _probe(host, config, UNSHARE)
    observe(probe.stdout.strip() or probe.stderr.strip())
    assert probe.stdout.strip() == "-1 Operation not permitted"


@pytest.mark.invariant("sec-seccomp-profile", "sec-seccomp-ioctl-filter")
def test_kubelet_localhost_profile(host: Any, config: StackConfig, observe: Any) -> None:
    text = host.file(f"{config.security.kubelet_seccomp_dir}/{PROFILE_NAME}").content_string
    profile = json.loads(text)
    allowed = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}
    ioctl_rules = [rule for rule in profile["syscalls"] if "ioctl" in rule["names"]]
    observe(f"defaultAction={profile['defaultAction']} allowed={len(allowed)} ioctl args={ioctl_rules[0].get('args')}")
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"read", "write", "openat", "mmap", "ioctl", "execve", "futex", "clone"} <= allowed
    assert not {"mount", "kexec_load", "unshare", "setns", "bpf", "ptrace"} & allowed
    # Correction of the seed's filter on 21537 (FIONBIO): NVIDIA ioctls need ioctl unfiltered.
    assert len(ioctl_rules) == 1 and not ioctl_rules[0].get("args")


@pytest.mark.invariant("cgroup-ai-service-memory-max")
def test_service_slice_memory_ceiling(host: Any, config: StackConfig, observe: Any) -> None:
    shown = host.run(f"systemctl show {config.security.slice} -p MemoryMax --value").stdout.strip()
    observe(shown)
    assert shown == str(config.security.memory_max_bytes)


@pytest.mark.invariant("cgroup-ai-service-memory-max")
def test_service_slice_memory_ceiling_enforced_by_the_kernel(
    host: Any, config: StackConfig, container_kind: str | None, observe: Any
) -> None:
    fs_type = host.run("stat -fc %T /sys/fs/cgroup").stdout.strip()
    assert fs_type == "cgroup2fs", (
        f"/sys/fs/cgroup is {fs_type}: the host still runs cgroup v1 (host_tuning reboot pending)"
    )
    host.run(f"systemctl start {config.security.slice}")
    path = f"/sys/fs/cgroup{slice_cgroup(config.security.slice)}/memory.max"
    if not host.file(path).exists:
        controllers = host.file("/sys/fs/cgroup/cgroup.controllers").content_string.strip() or "none"
        if container_kind and "memory" not in controllers:
            pytest.skip(
                f"{container_kind} container without a delegated memory controller (controllers: {controllers}); "
                "systemd holds MemoryMax, the kernel enforces it on VM hosts and metal"
            )
    value = host.file(path).content_string.strip()
    observe(value)
    assert value == str(config.security.memory_max_bytes)


@pytest.mark.invariant("cgroup-ai-service-devices-deny")
def test_service_slice_allows_only_nvidia_devices(host: Any, config: StackConfig, observe: Any) -> None:
    shown = host.run(f"systemctl show {config.security.slice} -p DevicePolicy -p DeviceAllow").stdout
    observe(" ".join(shown.split()))
    lines = shown.splitlines()
    assert "DevicePolicy=closed" in lines
    allowed = sorted(line.removeprefix("DeviceAllow=").split()[0] for line in lines if line.startswith("DeviceAllow="))
    assert allowed == sorted(config.security.device_allow)
    assert all(node.startswith("/dev/nvidia") for node in allowed)


@pytest.mark.invariant("sec-non-root-service", "sec-cap-sys-nice")
def test_drop_in_carries_the_boundary(host: Any, config: StackConfig, observe: Any) -> None:
    props = dict(dropin_properties(_dropin(host, config)))
    observe({k: props.get(k) for k in ("User", "CapabilityBoundingSet", "NoNewPrivileges", "Slice")})
    assert props["User"] == config.security.user != "root"
    assert props["AmbientCapabilities"] == props["CapabilityBoundingSet"] == " ".join(config.security.capabilities)
    assert props["NoNewPrivileges"] == "yes"
    assert props["Slice"] == config.security.slice
