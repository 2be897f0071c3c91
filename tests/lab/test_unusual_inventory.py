"""A valid but unusual inventory on a real lab container host: a non-default service account and group, their
own directories and slice, a second allowed capability, sysctl values written as an admin types them
(a port pair with two spaces between), NTP servers by name and by address. It converges, the next run makes
zero changes, the gate passes with the same inventory, and what is in force is what was asked for.

Roles: security, host_tuning and container_runtime (the host layers whose keys take these values); engine
environment values with spaces and quotes are proven by the inference lab test, which runs the engines.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost
from tests.lab.conftest import inventory_with, lab_containers

pytestmark = pytest.mark.lab
ROLES = ("security", "host_tuning", "container_runtime")
UNUSUAL = {
    "security_user": "llm-svc",
    "security_group": "llm-ops",
    "security_model_dir": "/srv/llm/models",
    "security_state_dir": "/var/lib/llm-svc",
    "security_log_dir": "/var/log/llm-svc",
    "security_slice": "llm-serving.slice",
    "security_memory_max": "20G",
    "security_cpu_weight": 500,
    "security_capabilities": ["CAP_SYS_NICE", "CAP_IPC_LOCK"],
    "host_tuning_sysctls": {
        "net.core.rmem_max": "33554432",
        "net.core.wmem_max": 33554432,
        "net.ipv4.tcp_slow_start_after_idle": 0,
        "net.ipv4.ip_local_port_range": "40000  60999",
    },
    "host_tuning_ntp_servers": ["ntp1.example.internal", "192.0.2.10"],
}


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHost, Path]]:
    with lab_containers(1) as hosts:
        inventory = inventory_with(tmp_path_factory.mktemp("unusual"), hosts[0], UNUSUAL)
        first = deploy(hosts, str(inventory), roles=ROLES)
        assert first.returncode == 0, first.output[-6000:]
        assert first.changed > 0
        yield hosts[0], inventory


def test_the_next_deploy_changes_nothing(converged: tuple[LabHost, Path]) -> None:
    host, inventory = converged
    again = deploy([host], str(inventory), roles=ROLES)
    assert (again.returncode, again.changed, again.errors) == (0, 0, 0), again.output[-6000:]


def test_the_gate_passes_with_the_same_inventory(converged: tuple[LabHost, Path]) -> None:
    host, inventory = converged
    result = subprocess.run(
        [sys.executable, "-m", "ironserve", "verify", "--limit", host.name, "--roles", ",".join(ROLES), str(inventory)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_account_and_its_directories_are_the_ones_asked_for(converged: tuple[LabHost, Path]) -> None:
    host, _ = converged
    assert remote.run(host, "id -gn llm-svc; id -Gn llm-svc").split() == ["llm-ops", "llm-ops"]
    owners = remote.run(host, "stat -c '%n %U:%G %a' /srv/llm/models /var/lib/llm-svc /var/log/llm-svc").splitlines()
    assert owners == [
        "/srv/llm/models root:llm-ops 750",
        "/var/lib/llm-svc llm-svc:llm-ops 700",
        "/var/log/llm-svc llm-svc:llm-ops 750",
    ]
    assert remote.run(host, "getent passwd ai-runner; true") == "", "the default account is not created"


def test_what_systemd_enforces_is_what_was_asked_for(converged: tuple[LabHost, Path]) -> None:
    host, _ = converged
    shown = remote.run(host, "systemctl show -p MemoryMax -p CPUWeight llm-serving.slice").splitlines()
    assert sorted(shown) == ["CPUWeight=500", f"MemoryMax={20 * 1024**3}"]
    dropin = remote.run(host, "cat /etc/systemd/system/ai-service.service.d/10-ironserve-security.conf")
    for line in ("User=llm-svc", "Group=llm-ops", "Slice=llm-serving.slice"):
        assert line in dropin.splitlines(), dropin
    assert "CAP_IPC_LOCK" in dropin and "CAP_SYS_NICE" in dropin


def test_sysctl_values_as_typed_are_persisted_in_canonical_form(converged: tuple[LabHost, Path]) -> None:
    host, _ = converged
    persisted = remote.run(host, "cat /etc/sysctl.d/90-ironserve.conf")
    assert "net.ipv4.ip_local_port_range = 40000 60999" in persisted
    assert "net.core.wmem_max = 33554432" in persisted
    live = remote.run(host, "cat /proc/sys/net/ipv4/ip_local_port_range").split()
    assert live == ["40000", "60999"]  # per network namespace: writable in a container
