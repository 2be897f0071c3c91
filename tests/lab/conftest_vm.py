"""The `vm_host` fixture: one lab VM for the whole test session.

Started with `manager.up` like `ironserve lab up --vm` (so it has the simulated hardware
edge and is in the lab state: `ironserve lab down` removes it if a run is killed), and
stopped with `manager.down` by name, leaving other lab hosts on this machine alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ironserve_lab import manager, state, vm
from ironserve_lab.hardware import DEFAULT_PROFILE
from ironserve_lab.state import LabHost


def require_vm() -> None:
    """Skip, saying why, where VMs cannot start; IRONSERVE_REQUIRE_VM=1 (CI) turns that into a failure."""
    missing = vm.missing_prerequisites()
    if missing:
        reason = "VM lab host cannot start: " + "; ".join(missing)
        if os.environ.get("IRONSERVE_REQUIRE_VM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def vm_host() -> Iterator[LabHost]:
    """A running VM lab host with the default hardware profile, stopped after the session.

    Skips, saying why, where VMs cannot start; IRONSERVE_REQUIRE_VM=1 (CI) turns that into a failure.
    Tests share this VM: whatever a test changes and later tests do not expect, it puts back.
    """
    require_vm()
    names_before = {h.name for h in state.load().hosts}
    hosts: list[LabHost] = []
    try:
        hosts = manager.up(1, use_vm=True, hardware_profile=DEFAULT_PROFILE)
        yield hosts[0]
    finally:
        # After a failed start, the lab-vm hosts this session recorded since.
        mine = {h.name for h in hosts} or state.started_here("lab-vm") - names_before
        manager.down(mine)
