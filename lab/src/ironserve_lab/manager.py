"""`ironserve lab up|status|ssh|down`: one place that starts and stops lab hosts."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Collection

from ironserve_lab import container, edge, kubernetes_control_plane, remote, state, vm
from ironserve_lab.hardware import read_hardware_profile
from ironserve_lab.state import LabHost


def ensure_ssh_key() -> None:
    key = state.ssh_key_path()
    if not key.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ironserve-lab", "-f", str(key)],
            check=True,
        )


def up(hosts: int, use_vm: bool, hardware_profile: str) -> list[LabHost]:
    """Start `hosts` more hosts of one kind; hosts already running are kept."""
    read_hardware_profile(hardware_profile)  # fail on an unknown profile before starting anything
    ensure_ssh_key()
    current = state.load()
    prefix = "lab-vm" if use_vm else "lab-c"
    taken = {h.name for h in current.hosts}
    names = [f"{prefix}{i}" for i in range(1, 100) if f"{prefix}{i}" not in taken][:hosts]
    backend = vm if use_vm else container
    started: list[LabHost] = backend.start(names, hardware_profile, current)
    for host in started:
        edge.attach(host)  # simulated hardware: stand-in lspci/dmidecode/lscpu, a Redfish iDRAC
    return started


def down(names: Collection[str] | None = None) -> None:
    """Stop the named hosts (all when None), then what the hosts shared once none is left."""
    current = state.load()
    for host in [h for h in current.hosts if names is None or h.name in names]:
        kubernetes_control_plane.detach(host)  # a lab Kubernetes node's control plane, if it has one
        edge.detach(host)
        (vm if host.kind == "vm" else container).stop(host, current)
    container.teardown_shared(current)
    vm.teardown_shared(current)
    if names is None:
        state.save(state.LabState())


def ssh(name: str, command: list[str]) -> int:
    """Replace this process with an interactive SSH session (or one command) on a lab host."""
    ssh_argv = remote.ssh_argv(state.load().host(name))
    argv = [ssh_argv[0], *([] if command else ["-t"]), *ssh_argv[1:], *command]
    os.execvp(argv[0], argv)
