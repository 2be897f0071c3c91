"""`ironserve rollout` against four real lab container hosts in batches of two (host_tuning alone: the cheapest
role whose change the gate proves; the traffic phases of a serving host are in tests/lab/test_inference_deploy.py).

The failure is real: a unit on the second host puts a sysctl back behind the deploy's back, so the deploy changes it
and the gate then finds it wrong. The first host of the same batch passes and returns; the rollout stops there, the
third and fourth hosts are compared byte for byte before and after, and `--resume` completes once the unit is
stopped: the second host alone, then the last batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve_lab import remote
from ironserve_lab.inventory import write_fleet_inventory
from ironserve_lab.state import LabHost
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
ROLES = "host_tuning"
# A drift the deploy repairs and that comes straight back: the gate, a few seconds later, sees it.
DRIFT_UNIT = "rollout-test-drift"
DRIFT = "while :; do sysctl -qw net.ipv4.tcp_slow_start_after_idle=1; sleep 0.2; done"
# What the role could touch on a host, byte for byte: every file under /etc with its mode and owner, the packages,
# and the sysctls in force.
SNAPSHOT = (
    "find /etc -xdev \\( -type f -o -type l \\) -printf '%p %m %u:%g %l\\n' | sort; "
    "find /etc -xdev -type f -print0 | sort -z | xargs -0 sha256sum; "
    "dpkg-query -W -f '${Package} ${Version} ${Status}\\n'; "
    "sysctl -a 2>/dev/null | grep -v -e random -e '^fs\\.\\(dentry\\|inode\\|file-nr\\)' "
    "-e '^kernel\\.ns_last_pid' | sort"
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[LabHost]]:
    with lab_containers(4) as hosts:
        yield hosts


def _rollout(inventory: Path, reports: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ironserve",
            "rollout",
            "--roles",
            ROLES,
            "--reports",
            str(reports),
            *args,
            str(inventory),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _record(reports: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((reports / "rollout.json").read_text())
    return document


def test_a_failure_on_the_second_host_stops_the_rollout_and_resume_completes_it(
    fleet: list[LabHost], tmp_path: Path
) -> None:
    first, second, third, fourth = fleet
    inventory = write_fleet_inventory(tmp_path / "fleet.py", [host.name for host in fleet])
    reports = tmp_path / "reports"
    remote.run(second, f"systemd-run --unit={DRIFT_UNIT} sh -c '{DRIFT}'")
    before = {host.name: remote.run(host, SNAPSHOT) for host in (third, fourth)}

    stopped = _rollout(inventory, reports, "--batch", "2", "--max-unavailable", "2")
    print(stopped.stdout)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    hosts = _record(reports)["hosts"]
    assert isinstance(hosts, dict)
    assert hosts[first.name]["result"] == "ok" and hosts[first.name]["changes"] > 0
    assert hosts[second.name]["result"] == "failed" and hosts[second.name]["phase"] == "prove"
    assert "test_sysctl_live" in hosts[second.name]["reason"]
    assert f"{second.name}: prove FAILED" in stopped.stdout
    for untouched in (third, fourth):
        assert hosts[untouched.name]["phase"] is None and hosts[untouched.name]["result"] == "pending"
        assert remote.run(untouched, SNAPSHOT) == before[untouched.name], f"{untouched.name} changed"

    # A new rollout is refused while this one has a host out of service; the fix, then --resume.
    refused = _rollout(inventory, reports)
    assert refused.returncode == 2 and "--resume" in refused.stderr, refused.stderr
    remote.run(second, f"systemctl stop {DRIFT_UNIT}")
    resumed = _rollout(inventory, reports, "--resume")
    print(resumed.stdout)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    record = _record(reports)
    assert record["status"] == "completed"
    hosts = record["hosts"]
    assert isinstance(hosts, dict)
    assert all(host["result"] == "ok" for host in hosts.values()), hosts
    assert f"batch 1/2: {second.name}\n" in resumed.stdout and f"{first.name}: drain" not in resumed.stdout
    assert f"batch 2/2: {third.name}, {fourth.name}" in resumed.stdout
    again = _rollout(inventory, reports, "--resume")
    assert again.returncode == 2 and "completed" in again.stderr
