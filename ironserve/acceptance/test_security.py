"""Acceptance: roles/security (catalog area security, and the service slice of kernel_cgroup).

Settings are proven by behaviour where a host can show it: a transient unit started with the
installed drop-in's own settings, in the service slice, reports its user, capabilities and what
its syscall filter refuses.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from ironserve.dropins import dropin_dir_names
from ironserve.validators import CAPABILITY_BITS
from roles import StackConfig
from roles.security.render import (
    DROPIN_NAME,
    dropin_properties,
    read_seccomp_profile,
    render_service_dropin,
    render_slice,
    slice_cgroup,
    systemd_run_command,
)
from roles.security.settings import SecuritySettings, memory_bytes

PROFILE_NAME = "ai-service.json"
UNIT_DIR = "/etc/systemd/system"
# Groups that are root, or a step to it: sudoers, raw disks and kernel memory, password hashes, every log,
# container and VM daemons (a privileged container is root), networkd's, /usr/local (staff), other users' ttys.
PRIVILEGED_GROUPS = frozenset(
    {"root", "sudo", "wheel", "admin", "adm", "disk", "kmem", "shadow", "docker", "lxd", "incus", "incus-admin",
     "libvirt", "kvm", "systemd-journal", "systemd-network", "staff", "tty", "src", "operator"}
)  # fmt: skip
# Properties `systemctl show` prints as the drop-in writes them, and those it prints as a set in its own spelling
# (capabilities in lower case, address families sorted).
SHOWN_VERBATIM = ("Slice", "User", "Group", "NoNewPrivileges", "SystemCallArchitectures", "LockPersonality",
                  "RestrictNamespaces")  # fmt: skip
SHOWN_AS_SETS = ("AmbientCapabilities", "CapabilityBoundingSet", "RestrictAddressFamilies")
SLICE_SHOWN_VERBATIM = ("MemoryAccounting", "CPUAccounting", "CPUWeight", "DevicePolicy")
SERVICE_INVARIANTS = pytest.mark.invariant("sec-non-root-service", "sec-cap-sys-nice", "sec-seccomp-profile")
SLICE_INVARIANTS = pytest.mark.invariant("cgroup-ai-service-memory-max", "cgroup-ai-service-devices-deny")
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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One test per service unit any host manages (read from the gate's stack file); a host skips units it lacks.
    path = metafunc.config.getoption("--ironserve-stack", default=None)
    settings = (
        [StackConfig.model_validate(data).security for data in json.loads(Path(path).read_text()).values()]
        if path
        else [SecuritySettings()]  # collected without a stack (`ironserve coverage`): the default units
    )
    units = list(dict.fromkeys(unit for s in settings for unit in s.service_units))
    slices = list(dict.fromkeys(s.slice for s in settings))
    if "unit" in metafunc.fixturenames:
        metafunc.parametrize("unit", units)
    if "managed_unit" in metafunc.fixturenames:
        metafunc.parametrize(
            "managed_unit",
            [pytest.param(u, marks=SERVICE_INVARIANTS) for u in units]
            + [pytest.param(s, marks=SLICE_INVARIANTS) for s in slices],
        )


def _managed_units(config: StackConfig) -> tuple[str, ...]:
    return (*config.security.service_units, config.security.slice)


def _skip_unless_managed(config: StackConfig, unit: str) -> None:
    if unit not in _managed_units(config):
        pytest.skip(f"{unit} is not among this host's security_service_units")


def _shown_name(unit: str) -> str:
    """The unit systemctl shows for `unit`: an instance stands for a template (it loads the template's drop-ins)."""
    return unit.replace("@.", "@ironserve-probe.", 1)


def _slice_properties(text: str) -> list[tuple[str, str]]:
    """(property, value) pairs of a slice unit's [Slice] section (dropin_properties reads [Service] only)."""
    pairs: list[tuple[str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Slice]" and "=" in line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            pairs.append((key.strip(), value.strip()))
    return pairs


def _root_only(host: Any, path: str, mode: int, observe: Any) -> None:
    """`path` is a root:root file of `mode` in a directory only root can write (else it could be replaced)."""
    managed, directory = host.file(path), host.file(path.rsplit("/", 1)[0])
    assert managed.is_file, f"{path} is missing"
    observe(f"{managed.user}:{managed.group} {oct(managed.mode)}; directory {directory.user} {oct(directory.mode)}")
    assert (managed.user, managed.group, managed.mode) == ("root", "root", mode)
    assert directory.user == "root" and not directory.mode & 0o022


def _dropin(host: Any, config: StackConfig) -> str:
    unit = config.security.service_units[0]
    content: str = host.file(f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}").content_string
    return content


def _probe(host: Any, config: StackConfig, code: str) -> Any:
    return host.run(systemd_run_command(_dropin(host, config), "python3 -c " + shlex.quote(code)))


@pytest.mark.invariant("sec-ai-runner-user")
def test_service_account_has_no_sudo_rights(host: Any, config: StackConfig, observe: Any) -> None:
    # What sudo itself would allow, every sudoers file and alias included: any rule hands the service root.
    if not host.exists("sudo"):
        pytest.skip("sudo is not installed on this host")
    listed = host.run(f"sudo -l -U {shlex.quote(config.security.user)}")
    observe(listed.stdout.strip().splitlines()[-3:])
    assert listed.rc == 0 and "is not allowed to run sudo" in listed.stdout, listed.stdout + listed.stderr


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


@pytest.mark.invariant("sec-ai-runner-user", "sec-ai-runner-group")
def test_service_account_belongs_to_its_own_group_only(host: Any, config: StackConfig, observe: Any) -> None:
    groups = host.run(f"id -nG {config.security.user}").stdout.split()
    observe(groups)
    assert groups == [config.security.group]


@pytest.mark.invariant("sec-non-root-service")
def test_service_account_is_in_no_privileged_group(host: Any, config: StackConfig, observe: Any) -> None:
    groups = set(host.run(f"id -nG {config.security.user}").stdout.split())
    observe(sorted(groups & PRIVILEGED_GROUPS) or "none")
    assert groups and not groups & PRIVILEGED_GROUPS


@pytest.mark.parametrize(
    "which",
    [
        pytest.param("seccomp-profile", marks=pytest.mark.invariant("sec-seccomp-profile")),
        pytest.param("slice-unit", marks=SLICE_INVARIANTS),
    ],
)
def test_managed_file_is_root_only(host: Any, config: StackConfig, which: str, observe: Any) -> None:
    path = {
        "seccomp-profile": f"{config.security.kubelet_seccomp_dir}/{PROFILE_NAME}",
        "slice-unit": f"{UNIT_DIR}/{config.security.slice}",
    }[which]
    _root_only(host, path, 0o644, observe)


@SERVICE_INVARIANTS
def test_unit_drop_in_is_root_only(host: Any, config: StackConfig, unit: str, observe: Any) -> None:
    _skip_unless_managed(config, unit)
    _root_only(host, f"{UNIT_DIR}/{unit}.d/{DROPIN_NAME}", 0o644, observe)


@SERVICE_INVARIANTS
def test_unit_has_the_rendered_drop_in(host: Any, config: StackConfig, unit: str, observe: Any) -> None:
    _skip_unless_managed(config, unit)
    dropin = host.file(f"{UNIT_DIR}/{unit}.d/{DROPIN_NAME}")
    content = dropin.content_string if dropin.exists else None
    expected = render_service_dropin(config.security, read_seccomp_profile())
    observe("missing" if content is None else "as rendered" if content == expected else "differs from the rendering")
    assert content == expected


@SLICE_INVARIANTS
def test_slice_unit_is_the_rendered_one(host: Any, config: StackConfig, observe: Any) -> None:
    unit = host.file(f"{UNIT_DIR}/{config.security.slice}")
    content = unit.content_string if unit.exists else None
    expected = render_slice(config.security)
    observe("missing" if content is None else "as rendered" if content == expected else "differs from the rendering")
    assert content == expected


@SERVICE_INVARIANTS
@SLICE_INVARIANTS
def test_no_foreign_drop_in_overrides_a_managed_unit(
    host: Any, config: StackConfig, managed_unit: str, observe: Any
) -> None:
    # Drop-ins are read from every unit path (system.control holds `systemctl set-property`, /run `--runtime` and
    # transient ones) and apply by name across them all, so any file but ironserve's own can override the boundary.
    _skip_unless_managed(config, managed_unit)
    unit_paths = host.run("systemd-analyze unit-paths").stdout.split()
    assert unit_paths, "systemd-analyze unit-paths listed no unit directory"
    # Globs left unquoted: the unit paths are systemd's and the unit names validated (no blank, no quote).
    globs = [f"{root}/{name}/*.conf" for root in unit_paths for name in dropin_dir_names(managed_unit)]
    on_disk = host.run(f'for f in {" ".join(globs)}; do {{ [ -e "$f" ] || [ -L "$f" ]; }} && echo "$f"; done; true')
    shown = host.run(f"systemctl show {shlex.quote(_shown_name(managed_unit))} -p DropInPaths --value")
    dropins = sorted(set(on_disk.stdout.split()) | set(shown.stdout.split()))
    # ironserve writes its drop-ins into /etc/systemd/system only; the same name elsewhere would mask them.
    foreign = [p for p in dropins if not (p.startswith(f"{UNIT_DIR}/") and "ironserve" in p.rsplit("/", 1)[-1])]
    observe(foreign or "none")
    assert foreign == []


@SERVICE_INVARIANTS
def test_unit_in_force_has_the_drop_in_settings(host: Any, config: StackConfig, unit: str, observe: Any) -> None:
    _skip_unless_managed(config, unit)
    expected = dict(dropin_properties(render_service_dropin(config.security, read_seccomp_profile())))
    keys = [key for key in (*SHOWN_VERBATIM, *SHOWN_AS_SETS) if key in expected]
    out = host.run(f"systemctl show {shlex.quote(_shown_name(unit))} -p LoadState " + " ".join(f"-p {k}" for k in keys))
    shown = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if shown.get("LoadState") != "loaded":
        pytest.skip(
            f"{unit} is {shown.get('LoadState') or 'unknown'} here (no unit file yet: roles/inference installs it); "
            "its drop-ins are checked on disk"
        )

    def normal(key: str, value: str) -> str:
        return " ".join(sorted(value.lower().split())) if key in SHOWN_AS_SETS else value

    differs = {key: shown.get(key) for key in keys if normal(key, shown.get(key, "")) != normal(key, expected[key])}
    observe(differs or "as the drop-in")
    assert differs == {}


@SLICE_INVARIANTS
def test_slice_in_force_has_the_rendered_settings(host: Any, config: StackConfig, observe: Any) -> None:
    rendered = _slice_properties(render_slice(config.security))
    wanted: dict[str, object] = {key: value for key, value in rendered if key in SLICE_SHOWN_VERBATIM}
    wanted["MemoryMax"] = str(memory_bytes(dict(rendered)["MemoryMax"]))
    wanted["DeviceAllow"] = sorted(value for key, value in rendered if key == "DeviceAllow")
    props = " ".join(f"-p {key}" for key in wanted)
    lines = host.run(f"systemctl show {shlex.quote(config.security.slice)} -p LoadState {props}").stdout.splitlines()
    pairs = [line.split("=", 1) for line in lines if "=" in line]
    shown: dict[str, object] = {key: value for key, value in pairs if key != "DeviceAllow"}
    shown["DeviceAllow"] = sorted(value for key, value in pairs if key == "DeviceAllow")
    assert shown.pop("LoadState", None) == "loaded", f"{config.security.slice} is not loaded"
    observe({key: shown.get(key) for key in wanted if shown.get(key) != wanted[key]} or "as rendered")
    assert shown == wanted
