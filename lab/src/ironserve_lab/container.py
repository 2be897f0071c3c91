"""Container lab hosts: Debian 12 booted with systemd as PID 1 in namespaces of its own.

A host is an overlay (lower: the cached root file system, shared read-only by all hosts; upper:
cache_dir()/lab/<name>/upper) kept by a supervisor process (files/container-supervisor.sh) that
lives in the host's own mount and network namespaces. Everything the host mounts or configures
lives in those namespaces and dies with them; the machine itself only sees the lab bridge, one
veth per host and a cgroup subtree per host (see network.py and `_cgroup_cleanup`).

Changes to the lab state go through `state.locked()` and are copied back into the caller's
`current`, because other `lab` commands or test sessions may start and stop hosts at the same time.

The supervisor boots the host as PID 1 of a fresh PID namespace (files/container-boot.sh), boots
it again after `reboot` and exits after `poweroff`. `stop` powers the host off like a power
button (SIGRTMIN+4 to its systemd) and kills whatever is left through the host's cgroup.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from ironserve_lab import network, remote, state
from ironserve_lab.hardware import read_hardware_profile
from ironserve_lab.paths import lab_dir
from ironserve_lab.rootfs import cached_rootfs
from ironserve_lab.state import LabHost, LabState

ROOTFS_PACKAGES = [
    "ca-certificates",
    "dbus",
    "iproute2",
    "kmod",
    "libpam-systemd",
    "openssh-server",
    "procps",
    "python3",
    "sudo",  # as on most servers: the security role's grants and the gate's `sudo -l` run against the real one
    "systemd",
    "systemd-sysv",
]
FILES = Path(__file__).resolve().parent / "files"
SUPERVISOR = FILES / "container-supervisor.sh"
# The rootfs holds no SSH host keys; each host gets its own. RSA is left out: generating one
# takes longer than booting the host, and clients use ed25519.
HOST_KEY_TYPES = ["ed25519", "ecdsa"]
HARDWARE_FILE = "etc/ironserve-lab/hardware.yaml"
SSH_TIMEOUT_S = 60.0
POWEROFF_TIMEOUT_S = 20.0
ROOTFS_READY = ".ironserve-container-ready"


def container_rootfs() -> Path:
    """The cached root file system, made fit to be shared by many hosts (done once)."""
    root = cached_rootfs("container", ROOTFS_PACKAGES)
    if (root / ROOTFS_READY).exists():
        return root
    # Identities every host must have its own of: SSH host keys and the machine ID. An empty
    # machine-id would mean "first boot" to systemd, so each host gets one written before boot.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink(missing_ok=True)  # another `lab up` may be doing this too
    (root / "etc/machine-id").write_text("")
    # /proc/sys is read-only in a container except /proc/sys/net, which systemd-sysctl can still apply.
    dropin = root / "usr/lib/systemd/system/systemd-sysctl.service.d/ironserve-lab.conf"
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text("[Unit]\nConditionPathIsReadWrite=\nConditionPathIsReadWrite=/proc/sys/net/\n")
    (root / ROOTFS_READY).touch()
    return root


def _upper_dir(lower: Path, upper: Path, relative: str) -> Path:
    """Create upper/relative with the owner and mode of the same directory in the lower layer.

    Overlayfs shows a merged directory with the upper directory's attributes, so a plain mkdir
    would turn /root from 0700 into 0755.
    """
    path = upper
    for part in Path(relative).parts:
        path = path / part
        if not path.exists():
            path.mkdir()
            source = lower / path.relative_to(upper)
            if source.is_dir():
                info = source.stat()
                os.chown(path, info.st_uid, info.st_gid)
                path.chmod(info.st_mode & 0o7777)
    return path


def _resolv_conf() -> Path:
    """The machine's resolver configuration as a host can use it.

    systemd-resolved's stub (127.0.0.53) cannot be reached from a host's network namespace;
    resolved keeps the upstream servers in a file of their own.
    """
    machine = Path("/etc/resolv.conf").resolve()
    upstream = Path("/run/systemd/resolve/resolv.conf")
    if "nameserver 127." in machine.read_text() and upstream.exists():
        return upstream
    return machine


def _prepare_upper(host: LabHost, lower: Path) -> list[str]:
    """Write the host's own files into its upper layer; return its known_hosts lines."""
    workdir = Path(host.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    for part in ("upper", "work", "root", "cgroup"):
        (workdir / part).mkdir(parents=True)
    upper = workdir / "upper"
    etc = _upper_dir(lower, upper, "etc")
    (etc / "hostname").write_text(f"{host.name}\n")
    (etc / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    shutil.copyfile(_resolv_conf(), etc / "resolv.conf")

    known_hosts = []
    ssh_dir = _upper_dir(lower, upper, "etc/ssh")
    for key_type in HOST_KEY_TYPES:
        key = ssh_dir / f"ssh_host_{key_type}_key"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", key_type, "-N", "", "-C", f"root@{host.name}", "-f", str(key)],
            check=True,
        )
        key_type_name, blob = key.with_suffix(".pub").read_text().split()[:2]
        known_hosts.append(f"{host.ssh_address} {key_type_name} {blob}")

    root_ssh = _upper_dir(lower, upper, "root/.ssh")
    root_ssh.chmod(0o700)
    authorized = root_ssh / "authorized_keys"
    shutil.copyfile(f"{state.ssh_key_path()}.pub", authorized)
    authorized.chmod(0o600)

    hardware = _upper_dir(lower, upper, str(Path(HARDWARE_FILE).parent)) / Path(HARDWARE_FILE).name
    profile = read_hardware_profile(host.hardware_profile)
    hardware.write_text(yaml.safe_dump(profile.model_dump(), sort_keys=False))
    return known_hosts


def _update_known_hosts(address: str, lines: list[str]) -> None:
    """Replace what the lab's known_hosts says about `address` (addresses are reused).

    Same lock and atomic replace as vm.py's edits, so hosts of both kinds can start at once.
    """
    path = state.known_hosts_path()
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = [
            line
            for line in (path.read_text().splitlines() if path.exists() else [])
            if line.split(" ", 1)[0] != address
        ]
        tmp = path.with_suffix(".container-tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept + lines))
        os.replace(tmp, path)


def _spawn_supervisor(host: LabHost, lower: Path) -> None:
    """Start the host's supervisor detached from us, wire its network namespace, let it boot."""
    workdir = Path(host.workdir)
    with open(workdir / "console.log", "ab") as log:
        handshake = subprocess.Popen(
            [
                "setsid",
                "-f",
                "unshare",
                "--mount",
                "--net",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                str(SUPERVISOR),
                host.name,
                str(lower),
                str(workdir),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    assert handshake.stdin is not None and handshake.stdout is not None
    with handshake.stdin, handshake.stdout:
        line = handshake.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"{host.name}: supervisor failed to start; see {workdir / 'console.log'}")
        host.pids = [int(line)]
        network.attach(host, host.pids[0])
        handshake.stdin.write(b"go\n")
    handshake.wait()


def _ssh_answers(host: LabHost) -> bool:
    argv = [*remote.ssh_argv(host), "true"]
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True).returncode == 0


def _wait_for_ssh(host: LabHost, timeout_s: float = SSH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _ssh_answers(host):
        if not is_running(host):
            raise RuntimeError(f"{host.name} stopped while booting; see {Path(host.workdir) / 'console.log'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{host.name}: no SSH at {host.ssh_address} after {timeout_s:.0f} s")
        time.sleep(0.1)


def _sync(current: LabState, fresh: LabState) -> None:
    """Show the caller's state object what the state file says now."""
    for field in LabState.model_fields:
        setattr(current, field, getattr(fresh, field))


def _record_host(host: LabHost, current: LabState) -> None:
    with state.locked() as fresh:
        fresh.hosts = [host if h.name == host.name else h for h in fresh.hosts]
    _sync(current, fresh)


def start(names: list[str], hardware_profile: str, current: LabState) -> list[LabHost]:
    """Boot one host per name, all at once, and return when each answers SSH.

    Every host is recorded in the state before anything of it exists, so that `lab down`
    can undo a start that failed half-way.
    """
    lower = container_rootfs()
    started: list[LabHost] = []
    for proposed in names:
        with state.locked() as fresh:
            # Another session (make test runs two beside each other) may have taken the name since `up` read the
            # state: the next free one of the same prefix instead.
            name = state.free_name(proposed, {h.name for h in fresh.hosts})
            network.ensure_shared(fresh)
            host = LabHost(
                name=name,
                kind="container",
                ssh_address=network.free_address(fresh),
                hardware_profile=hardware_profile,
                workdir=str(lab_dir() / name),
                started_by=os.getpid(),
            )
            fresh.hosts.append(host)
        _sync(current, fresh)
        _update_known_hosts(host.ssh_address, _prepare_upper(host, lower))
        _spawn_supervisor(host, lower)
        _record_host(host, current)
        started.append(host)
    for host in started:
        _wait_for_ssh(host)
    return started


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for the machine's init to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def is_running(host: LabHost) -> bool:
    """Whether the host's supervisor runs (checked by its command line: PIDs are reused)."""
    if not host.pids or not _alive(host.pids[0]):
        return False
    try:
        argv = Path(f"/proc/{host.pids[0]}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    return str(SUPERVISOR).encode() in argv and host.name.encode() in argv


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _init_pid(supervisor: int) -> int | None:
    """The host's systemd, as the machine numbers it: supervisor -> unshare -> init."""
    for unshare in _children(supervisor):
        for init in _children(unshare):
            return init
    return None


def _cgroup_cleanup(host: LabHost) -> None:
    """Kill every process left in the host's cgroup subtree, then remove the subtree.

    The machine has no cgroup2 mount of its own, so one is made in a throwaway mount namespace.
    """
    script = r"""
set -eu
mount -t cgroup2 cgroup2 "$1"
tree=$1/ironserve-lab/$2
if [ -d "$tree" ]; then
    echo 1 >"$tree/cgroup.kill"
    for _ in $(seq 100); do
        grep -q '^populated 0' "$tree/cgroup.events" && break
        sleep 0.05
    done
    # Quiet: another `lab down` may be removing the same tree; what counts is that it is gone.
    find "$tree" -depth -type d -exec rmdir {} + 2>/dev/null || true
    [ ! -d "$tree" ]
fi
rmdir "$1/ironserve-lab" 2>/dev/null || true
"""
    mountpoint = Path(host.workdir) / "cgroup"
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "-", str(mountpoint), host.name],
        check=True,
    )


def stop(host: LabHost, current: LabState) -> None:
    """Power the host off (SIGKILL for all of it after a timeout) and remove all trace of it."""
    if is_running(host):
        init = _init_pid(host.pids[0])
        if init:
            os.kill(init, signal.SIGRTMIN + 4)  # systemd's "power button": poweroff.target
        deadline = time.monotonic() + POWEROFF_TIMEOUT_S
        while is_running(host) and time.monotonic() < deadline:
            time.sleep(0.1)
        if is_running(host):
            print(f"lab: {host.name} did not power off in {POWEROFF_TIMEOUT_S:.0f} s; killing it", file=sys.stderr)
    _cgroup_cleanup(host)
    network.detach(host)
    _update_known_hosts(host.ssh_address, [])
    shutil.rmtree(host.workdir, ignore_errors=True)
    with state.locked() as fresh:
        fresh.hosts = [h for h in fresh.hosts if h.name != host.name]
    _sync(current, fresh)


def teardown_shared(current: LabState) -> None:
    """Undo what all container hosts shared (bridge, NAT, forwarding); a no-op while any is left.

    Decided on the state file, not on `current`: someone else may have started a host meanwhile.
    """
    with state.locked() as fresh:
        if not any(h.kind == "container" for h in fresh.hosts):
            network.teardown_shared(fresh)
    _sync(current, fresh)
