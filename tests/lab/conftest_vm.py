"""The `vm_host` fixture: one lab VM for the whole test session.

Loaded from tests/lab/conftest.py. The VM is registered in the lab state like any
`ironserve lab up --vm` host, so `ironserve lab down` removes it if a run is killed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ironserve.lab import manager, state, vm
from ironserve.lab.hardware import DEFAULT_PROFILE
from ironserve.lab.state import LabHost


def _unused_name(current: state.LabState) -> str:
    taken = {h.name for h in current.hosts}
    return next(f"pytest-vm{i}" for i in range(1, 100) if f"pytest-vm{i}" not in taken)


@pytest.fixture(scope="session")
def vm_host() -> Iterator[LabHost]:
    """A running VM lab host with the default hardware profile, stopped after the session.

    Skips, saying why, where VMs cannot start; IRONSERVE_REQUIRE_VM=1 (CI) turns that into a failure.
    Tests that change the VM must put it back (kernel command line, modules, sysctls).
    """
    missing = vm.missing_prerequisites()
    if missing:
        reason = "VM lab host cannot start: " + "; ".join(missing)
        if os.environ.get("IRONSERVE_REQUIRE_VM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    manager.ensure_ssh_key()
    current = state.load()
    [host] = vm.start([_unused_name(current)], DEFAULT_PROFILE, current)
    try:
        yield host
    finally:
        vm.stop(host, state.load())
