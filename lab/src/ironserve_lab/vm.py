"""VM lab hosts: qemu (software emulation) booting the base image through its own GRUB.

Each VM runs a copy-on-write overlay of the cached base image (`vmimage.py`), so
kernel command line changes, cgroup v1/v2 switches, module loading and kernel
sysctls are real. SSH is forwarded from 127.0.0.1:<port> by qemu's user-mode
network, which changes nothing on this machine. A reboot inside the guest resets
the same qemu process, so SSH comes back on the same port.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import yaml

from ironserve_lab import remote, servers, state, vmimage
from ironserve_lab.hardware import read_hardware_profile
from ironserve_lab.paths import lab_dir
from ironserve_lab.state import LabHost, LabState

BOOT_TIMEOUT_S = 300  # measured 40-50 s on 2 cores shared with other work; generous for CI
POWEROFF_TIMEOUT_S = 60
MEMORY_MIB = 1024
CPUS = 2
QEMU = "qemu-system-x86_64"
FW_CFG_PREFIX = "opt/ironserve"
HOST_KEY_TYPES = ("ed25519", "ecdsa", "rsa")  # what a stock Debian sshd offers


def missing_prerequisites() -> list[str]:
    """Why VM hosts cannot start here; empty when they can."""
    tools = [QEMU, "qemu-img", "ssh", "ssh-keygen"]
    missing = [f"{tool} not found on PATH" for tool in tools if shutil.which(tool) is None]
    if not vmimage.cached_image().exists():
        missing += [
            f"{tool} not found on PATH (needed once, to build the base image)"
            for tool in ("debootstrap", "mkfs.ext4", "chroot")
            if shutil.which(tool) is None
        ]
        if os.geteuid() != 0:
            missing.append("building the base image needs root (debootstrap, chroot)")
    return missing


def start(names: list[str], hardware_profile: str, current: LabState) -> list[LabHost]:
    """Boot one VM per name, one after another, and wait until each answers SSH.

    Each host is recorded in the lab state as soon as its qemu runs, so `lab down` can stop
    it even when a later step fails. State changes go through `state.locked()` (other lab
    commands and test sessions may run at once) and are copied back into `current`.
    """
    base = vmimage.base_image()
    started: list[LabHost] = []
    for proposed in names:
        with state.locked() as fresh:
            # Another session may have taken the name since `up` read the state: the next free one instead.
            name = state.free_name(proposed, {h.name for h in fresh.hosts})
            host = _launch(name, hardware_profile, base, _taken_ports(fresh))
            fresh.hosts.append(host)
        _sync(current, fresh)
        try:
            remote.wait_for_ssh(host, BOOT_TIMEOUT_S, still_running=partial(is_running, host))
        except (TimeoutError, RuntimeError) as failure:
            if is_running(host):
                os.kill(host.pids[0], signal.SIGKILL)
                _wait_for_exit(host.pids[0], 10)
            stop(host, current)
            raise RuntimeError(f"{failure}; console log: {console_log(host)}") from failure
        started.append(host)
    return started


def stop(host: LabHost, current: LabState) -> None:
    """Power the VM off (kill it when it does not go), remove its overlay and forget its host keys."""
    if is_running(host):
        # The connection drops as the guest shuts down; the process exit is what counts.
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            remote.run(host, "systemctl poweroff", timeout=20)
        pid = host.pids[0]
        if not _wait_for_exit(pid, POWEROFF_TIMEOUT_S):
            print(f"lab: {host.name} still runs {POWEROFF_TIMEOUT_S} s after poweroff; killing qemu", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
            _wait_for_exit(pid, 10)
    _forget_host_keys(host.ssh_port)
    # The console log stays for post-mortems; the next start of this name replaces it.
    if host.workdir:
        for leftover in Path(host.workdir).glob("*"):
            if leftover.name != "console.log":
                leftover.unlink()
    with state.locked() as fresh:
        fresh.hosts = [h for h in fresh.hosts if h.name != host.name]
    _sync(current, fresh)


def teardown_shared(current: LabState) -> None:
    """VM hosts share only the cached base image, which stays; nothing to undo."""


def is_running(host: LabHost) -> bool:
    """Whether this host's qemu still runs (and the pid was not reused by another process)."""
    if not host.pids:
        return False
    try:
        cmdline = Path(f"/proc/{host.pids[0]}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    return f"{host.workdir}/overlay.qcow2".encode() in cmdline


def reboot(host: LabHost, timeout: float = BOOT_TIMEOUT_S) -> str:
    """Reboot the VM from inside and wait until SSH answers with a new boot id; return it."""
    return remote.reboot(host, timeout, still_running=partial(is_running, host))


def console_log(host: LabHost) -> Path:
    return Path(host.workdir) / "console.log"


def _launch(name: str, hardware_profile: str, base: Path, taken_ports: set[int]) -> LabHost:
    workdir = lab_dir() / "vm" / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    overlay = workdir / "overlay.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base), str(overlay)], check=True
    )
    host_keys = [workdir / f"ssh_host_{key_type}_key" for key_type in HOST_KEY_TYPES]
    for key_type, key in zip(HOST_KEY_TYPES, host_keys, strict=True):
        subprocess.run(["ssh-keygen", "-q", "-t", key_type, "-N", "", "-C", name, "-f", str(key)], check=True)
    hardware = workdir / "hardware.yaml"
    hardware.write_text(yaml.safe_dump(read_hardware_profile(hardware_profile).model_dump(), sort_keys=False))
    fw_cfg = {
        "hostname": f"string={name}",
        "authorized_keys": f"file={state.ssh_key_path()}.pub",
        "hardware.yaml": f"file={hardware}",
        **{key.name: f"file={key}" for key in host_keys},
    }

    print(f"lab: starting {name} (qemu, software emulation)", file=sys.stderr)
    for attempt in range(3):
        port = _free_port(taken_ports)
        argv = [
            QEMU,
            "-name",
            f"ironserve-{name}",
            "-machine",
            "q35",
            *vmimage.QEMU_ACCEL,
            "-smp",
            str(CPUS),
            "-m",
            str(MEMORY_MIB),
            "-drive",
            f"file={overlay},format=qcow2,if=virtio,cache=unsafe,discard=unmap",
            "-nic",
            f"user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:22",
            "-device",
            "virtio-rng-pci",
            *[arg for key, value in fw_cfg.items() for arg in ("-fw_cfg", f"name={FW_CFG_PREFIX}/{key},{value}")],
            "-display",
            "none",
            "-monitor",
            "none",
            "-serial",
            f"file:{workdir / 'console.log'}",
            "-daemonize",
            "-pidfile",
            str(workdir / "qemu.pid"),
        ]
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode == 0:
            break
        # Another process can take the port between our probe and qemu's bind.
        if "host forwarding" not in result.stderr or attempt == 2:
            raise RuntimeError(f"qemu failed to start {name}: {result.stderr.strip()}")
    pid = int((workdir / "qemu.pid").read_text())
    _remember_host_keys(port, [Path(f"{key}.pub") for key in host_keys])
    return LabHost(
        name=name,
        kind="vm",
        ssh_address="127.0.0.1",
        ssh_port=port,
        hardware_profile=hardware_profile,
        pids=[pid],
        workdir=str(workdir),
        extra={"console_log": str(workdir / "console.log")},
        started_by=os.getpid(),
    )


def _sync(current: LabState, fresh: LabState) -> None:
    """Show the caller's state object what the state file says now."""
    for field in LabState.model_fields:
        setattr(current, field, getattr(fresh, field))


def _taken_ports(current: LabState) -> set[int]:
    return {h.ssh_port for h in current.hosts if h.ssh_address == "127.0.0.1"}


def _free_port(taken: set[int]) -> int:
    # A stopped VM's recorded port may look free while its qemu still holds the forward: skip recorded ones.
    while (port := servers.free_port()) in taken:
        pass
    return port


def _wait_for_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.5)
    return not Path(f"/proc/{pid}").exists()


def _known_hosts_pattern(port: int) -> str:
    return f"[127.0.0.1]:{port} "


def _edit_known_hosts(port: int, new_lines: list[str]) -> None:
    """Replace this port's entries (ports are reused) under a lock shared with other lab code."""
    path = state.known_hosts_path()
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        kept = [line for line in lines if not line.startswith(_known_hosts_pattern(port))]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept + new_lines))
        os.replace(tmp, path)


def _remember_host_keys(port: int, public_keys: list[Path]) -> None:
    lines = []
    for public_key in public_keys:
        key_type, key = public_key.read_text().split()[:2]
        lines.append(f"{_known_hosts_pattern(port)}{key_type} {key}\n")
    _edit_known_hosts(port, lines)


def _forget_host_keys(port: int) -> None:
    _edit_known_hosts(port, [])
