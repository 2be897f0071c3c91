"""Lab fixtures: `container_hosts`, `kubernetes_api_host` and `kubernetes_api` (here), `vm_host` (conftest_vm.py).

Both register their hosts in the lab state like `ironserve lab up`, so `ironserve lab down`
removes them if a run is killed; each stops only the hosts it started.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ironserve_lab import kubernetes_control_plane, manager, state
from ironserve_lab.hardware import DEFAULT_PROFILE
from ironserve_lab.kubernetes_control_plane import ControlPlane
from ironserve_lab.state import LabHost
from tests.lab.conftest_vm import vm_host
from tests.lab.machine_snapshot import differences, snapshot

__all__ = ["ClusterHost", "container_hosts", "inventory_with", "kubernetes_api", "kubernetes_api_host", "vm_host"]

CONTAINER_HOSTS = 2
CONTAINER_TOOLS = ["debootstrap", "unshare", "nsenter", "ip", "nft", "ssh", "ssh-keygen"]


def container_lab_unavailable() -> str | None:
    """Why container lab hosts cannot start here, or None."""
    if os.geteuid() != 0:
        return "container lab hosts need root (namespaces, mounts, veth, NAT)"
    missing = [tool for tool in CONTAINER_TOOLS if not shutil.which(tool)]
    if missing:
        return f"container lab hosts need {', '.join(missing)} (apt-get install debootstrap nftables ...)"
    return None


def skip_without_container_lab() -> None:
    """Skip, saying why; IRONSERVE_REQUIRE_LAB=1 (CI) turns that into a failure."""
    reason = container_lab_unavailable()
    if reason:
        if os.environ.get("IRONSERVE_REQUIRE_LAB") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def inventory_with(folder: Path, host: LabHost, keys: dict[str, object]) -> Path:
    """The lab inventory of the container `host` alone with `keys` on top, as a site's inventory sets them."""
    path = folder / "site_with_keys.py"
    path.write_text(
        textwrap.dedent(f"""
        from ironserve.inventory import site
        from ironserve_lab.inventory import lab_groups

        _containers, _ = lab_groups()
        lab_containers = site([(n, {{**d, **{keys!r}}}) for n, d in _containers if n == {host.name!r}])
        """)
    )
    return path


@contextmanager
def lab_containers(count: int) -> Iterator[list[LabHost]]:
    """`count` hosts from `manager.up`, stopped with `manager.down` afterwards, and only those.

    The machine may run other lab hosts meanwhile (someone's `lab up`, other test sessions).
    After a failed start, the lab-c hosts this session recorded since are stopped (state.started_here).
    """
    skip_without_container_lab()
    names_before = {h.name for h in state.load().hosts}
    hosts: list[LabHost] = []
    try:
        hosts = manager.up(count, use_vm=False, hardware_profile=DEFAULT_PROFILE)
        yield hosts
    finally:
        mine = {h.name for h in hosts} or state.started_here("lab-c") - names_before
        manager.down(mine)


@pytest.fixture(scope="session", autouse=True)
def machine_left_as_it_was() -> Iterator[None]:
    """After every lab test has stopped its hosts, the machine must be as it was before the first one.

    Hosts that others run meanwhile (someone's `lab up`) are left out of the comparison.
    """
    before = snapshot()
    names_before = {h.name for h in state.load().hosts}
    yield
    others = names_before | {h.name for h in state.load().hosts}
    assert differences(before, snapshot(), others) == []


@pytest.fixture(scope="session")
def container_hosts() -> Iterator[list[LabHost]]:
    """CONTAINER_HOSTS running container lab hosts (default hardware profile), stopped after the session.

    Tests that change a host must put it back, or change only what later tests do not read.
    """
    with lab_containers(CONTAINER_HOSTS) as hosts:
        yield hosts


@dataclass(frozen=True)
class ClusterHost:
    """A container lab host and the control plane whose lifetime it is."""

    host: LabHost
    plane: ControlPlane


@pytest.fixture(scope="module")
def kubernetes_api_host() -> Iterator[ClusterHost]:
    """A real Kubernetes 1.20.2 API server, controller manager and scheduler with no node, for one module.

    Its lifetime is a container lab host of the module's own (the control plane stops with it; `lab down`
    stops both); the API is on the lab bridge's address (ControlPlane.api_url), which this machine and the host
    reach, called as the admin or as a ServiceAccount's token. Objects persist across the module's tests. See
    docs/lab-kubernetes-node.md.
    """
    skip_without_container_lab()
    kubernetes_control_plane.ensure_built()  # once per machine (about 10 minutes); nothing when cached
    with lab_containers(1) as hosts:
        started = time.monotonic()
        plane = kubernetes_control_plane.attach(hosts[0])
        elapsed = time.monotonic() - started
        print(f"kubernetes_api: control plane on {hosts[0].name} ready after {elapsed:.1f} s", file=sys.stderr)
        try:
            yield ClusterHost(hosts[0], plane)
        finally:
            kubernetes_control_plane.detach(hosts[0])  # lab_containers' `lab down` would too


@pytest.fixture(scope="module")
def kubernetes_api(kubernetes_api_host: ClusterHost) -> ControlPlane:
    """kubernetes_api_host's control plane, for tests that call the API only."""
    return kubernetes_api_host.plane
