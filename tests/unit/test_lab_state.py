"""The lab state's naming: two test sessions start hosts at once (make test's two lanes)."""

from __future__ import annotations

import os
from pathlib import Path

from pytest import MonkeyPatch

from ironserve_lab import state
from ironserve_lab.state import LabHost, free_name


def test_a_name_another_session_took_meanwhile_becomes_the_first_free_one_of_its_prefix() -> None:
    assert free_name("lab-c3", {"lab-c1"}) == "lab-c3"
    assert free_name("lab-c3", {"lab-c1", "lab-c3"}) == "lab-c2"
    assert free_name("lab-vm1", {"lab-vm1", "lab-vm2", "lab-c3"}) == "lab-vm3"


def test_after_a_failed_start_a_session_stops_only_the_hosts_it_recorded(
    tmp_path: Path, monkeypatch: MonkeyPatch
) -> None:
    monkeypatch.setenv("IRONSERVE_CACHE", str(tmp_path))
    with state.locked() as current:
        current.hosts += [
            LabHost(name="lab-c1", kind="container", ssh_address="10.0.0.1", started_by=os.getpid()),
            LabHost(name="lab-c2", kind="container", ssh_address="10.0.0.2", started_by=os.getpid() + 1),
            LabHost(name="lab-c3", kind="container", ssh_address="10.0.0.3"),  # recorded before started_by
            LabHost(name="lab-vm1", kind="vm", ssh_address="127.0.0.1", started_by=os.getpid()),
        ]
    assert state.started_here("lab-c") == {"lab-c1"}
    assert state.started_here("lab-vm") == {"lab-vm1"}
