"""host_tuning against real lab container hosts: converge, zero changes on re-run (drift: tests/lab/test_drift.py).

Container hosts are debootstrapped Debian 12 systems booted with systemd as PID 1 and reached
over real SSH; only the hardware is simulated (not used by this role).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost

pytestmark = pytest.mark.lab
# The role under test alone: its own convergence, zero-change re-run and gate (deploy.py runs them all).
HOST_TUNING = ("host_tuning",)
SYSCTL_FILE = "/etc/sysctl.d/90-ironserve.conf"


@pytest.fixture(scope="module")
def converged(container_hosts: list[LabHost]) -> list[LabHost]:
    first = deploy(container_hosts, roles=HOST_TUNING)
    assert first.returncode == 0, first.output
    assert first.changed > 0, first.output
    return container_hosts


@pytest.mark.invariant("sysctl-tcp-slow-start-after-idle", "net-ip-local-port-range")
def test_first_deploy_sets_live_values(converged: list[LabHost]) -> None:
    host = converged[0]
    assert remote.run(host, "cat /proc/sys/net/ipv4/tcp_slow_start_after_idle").strip() == "0"
    assert remote.run(host, "cat /proc/sys/net/ipv4/ip_local_port_range").split() == ["32768", "60999"]


@pytest.mark.invariant("sysctl-rmem-max", "sysctl-wmem-max")
def test_kernel_global_keys_are_persisted_not_forced_in_a_container(converged: list[LabHost]) -> None:
    host = converged[0]
    content = remote.run(host, f"cat {SYSCTL_FILE}")
    assert "net.core.rmem_max = 26214400" in content
    assert "net.core.wmem_max = 26214400" in content


def test_second_deploy_reports_zero_changes(converged: list[LabHost]) -> None:
    again = deploy(converged, roles=HOST_TUNING)
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


def _inventory(tmp_path: Path, host: LabHost, extra: str) -> str:
    path = tmp_path / "bad_inventory.py"
    path.write_text(
        textwrap.dedent(f"""
        from ironserve_lab.inventory import lab_groups

        lab_containers, _ = lab_groups()
        lab_containers = [(name, {{**data, {extra}}}) for name, data in lab_containers if name == {host.name!r}]
        """)
    )
    return str(path)


def test_invalid_inventory_stops_before_any_host_is_touched(converged: list[LabHost], tmp_path: Path) -> None:
    host = converged[0]
    remote.run(host, "sysctl -w net.ipv4.tcp_slow_start_after_idle=1")  # drift that a deploy would fix
    try:
        bad = deploy([host], _inventory(tmp_path, host, '"host_tuning_sysctls": {"net.core.rmem_max": "lots"}'))
        assert bad.returncode == 2
        assert (
            f"host {host.name}: host_tuning_sysctls: net.core.rmem_max: expected a non-negative integer" in bad.output
        )
        assert "no host was contacted" in bad.output
        assert remote.run(host, "cat /proc/sys/net/ipv4/tcp_slow_start_after_idle").strip() == "1"
    finally:
        assert deploy(converged, roles=HOST_TUNING).returncode == 0


def test_pyinfra_direct_run_with_bad_data_changes_nothing(converged: list[LabHost], tmp_path: Path) -> None:
    """`pyinfra inventory deploy.py` without the ironserve wrapper also stops before any change."""
    host = converged[0]
    remote.run(host, "sysctl -w net.ipv4.tcp_slow_start_after_idle=1")
    try:
        inventory = _inventory(tmp_path, host, '"ironserve_reboot_policy": "sometimes"')
        run = subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", inventory, "deploy.py"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode != 0
        assert "ironserve_reboot_policy" in run.stdout + run.stderr
        assert remote.run(host, "cat /proc/sys/net/ipv4/tcp_slow_start_after_idle").strip() == "1"
    finally:
        assert deploy(converged, roles=HOST_TUNING).returncode == 0
