"""The lab's state file: which hosts run, how to reach them, how to stop them.

The file lives under the cache directory, never in the repository, so that
`inventory/lab.py`, `ironserve lab status` and `ironserve lab down` all read
the same truth.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ironserve_lab.paths import lab_dir

HostKind = Literal["container", "vm"]


class LabHost(BaseModel):
    """One running lab host."""

    name: str
    kind: HostKind
    ssh_address: str  # where SSH answers, as seen from the machine running the lab
    ssh_port: int = 22
    ssh_user: str = "root"
    hardware_profile: str = "r740-a10x4"
    # Processes, links and files the lab made for this host and must remove at `lab down`.
    pids: list[int] = Field(default_factory=list)
    workdir: str = ""
    extra: dict[str, str] = Field(default_factory=dict)
    # The pid of the process that started it (`ironserve lab up`, a test session): after a failed start, a session
    # stops the hosts it recorded, never another session's. 0: not known (recorded before this field).
    started_by: int = 0


class LabState(BaseModel):
    hosts: list[LabHost] = Field(default_factory=list)
    # Machine settings the lab changed and restores at `lab down` (e.g. net.ipv4.ip_forward).
    restore_sysctls: dict[str, str] = Field(default_factory=dict)
    nat_rules: list[list[str]] = Field(default_factory=list)

    def host(self, name: str) -> LabHost:
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(h.name for h in self.hosts) or "none"
        raise KeyError(f"no lab host named {name!r} (running: {known})")


def state_path() -> Path:
    return lab_dir() / "state.json"


def ssh_key_path() -> Path:
    """Private key generated once for the lab; its public half goes into every host."""
    return lab_dir() / "id_ed25519"


def known_hosts_path() -> Path:
    return lab_dir() / "known_hosts"


def load() -> LabState:
    path = state_path()
    if not path.exists():
        return LabState()
    return LabState.model_validate_json(path.read_text())


def save(state: LabState) -> None:
    path = state_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.model_dump(), indent=2) + "\n")
    os.replace(tmp, path)


@contextmanager
def locked() -> Iterator[LabState]:
    """The state, loaded under an exclusive lock and saved when the block ends without error.

    `lab` commands and test sessions may run at once; each read-modify-write of the file goes
    through here, so none overwrites what another recorded meanwhile. Save inside the block
    too where a change must be on record before it is made.
    """
    with open(lab_dir() / "state.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = load()
        yield current
        save(current)


def free_name(proposed: str, taken: set[str]) -> str:
    """`proposed` (lab-c3), or the first name of its prefix (lab-c) that is not taken."""
    if proposed not in taken:
        return proposed
    prefix = proposed.rstrip("0123456789")
    return next(f"{prefix}{i}" for i in itertools.count(1) if f"{prefix}{i}" not in taken)


def started_here(prefix: str) -> set[str]:
    """The recorded hosts of `prefix` (lab-c, lab-vm) this process started, whether or not their start completed."""
    return {h.name for h in load().hosts if h.name.startswith(prefix) and h.started_by == os.getpid()}
