"""Print how long `ironserve rollout` takes on lab container hosts, and the controller's own CPU per host.

For each fleet size and batch size: a rollout that changes every host (fresh hosts: host_tuning's first deploy),
then a rollout that changes nothing, each run in this process through the real command line (`ironserve.cli.main`)
so that this process's own CPU time is the controller's (plan, SSH for boot ids, threads, the record) and its
children's are the deploys, the gates and SSH. One host is the baseline: one no-op `ironserve deploy` of it (a
rollout never takes a whole fleet out, so a one-host fleet is refused). The target of issue 34: a no-change
rollout of 16 hosts in batches of 4 within 5x one host's no-op deploy.

The role is host_tuning alone (no traffic to drain: drain and return are no-ops here, prove is the gate); the
inference service's drain is measured by tests/lab/test_inference_deploy.py.

Usage: python benchmarks/rollout.py [--sizes 1 4 16] [--batches 1 4]
Starts and stops its own lab hosts. Figures only; no assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from ironserve import cli
from ironserve.paths import REPO_ROOT
from ironserve_lab import manager
from ironserve_lab.deploying import deploy
from ironserve_lab.hardware import DEFAULT_PROFILE
from ironserve_lab.inventory import write_fleet_inventory

ROLES = "host_tuning"


def cpu() -> tuple[float, float]:
    """(this process's CPU seconds, its finished children's), user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def rollout(path: Path, reports: Path, batch: int) -> dict[str, float]:
    """One rollout in this process; wall seconds, controller CPU and children's CPU, and the changes it made."""
    own_before, children_before = cpu()
    started = time.monotonic()
    args = ["rollout", "--roles", ROLES, "--batch", str(batch), "--max-unavailable", str(batch)]
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main([*args, "--canary-pause", "0", "--reports", str(reports), str(path)])
    seconds = time.monotonic() - started
    own_after, children_after = cpu()
    if code != 0:
        raise SystemExit(f"rollout failed ({code}): see {reports / 'rollout.json'}")
    record = json.loads((reports / "rollout.json").read_text())
    (reports / "rollout.json").unlink()  # the next rollout is a new one
    return {
        "seconds": seconds,
        "controller_cpu_s": own_after - own_before,
        "children_cpu_s": children_after - children_before,
        "changes": sum(host["changes"] or 0 for host in record["hosts"].values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    print(f"{'hosts':>5} {'batch':>5} {'run':<9} {'wall s':>7} {'changes':>7} {'ctl cpu s/host':>14} "
          f"{'children cpu s/host':>19}")  # fmt: skip
    baseline = None
    for size in args.sizes:
        hosts = manager.up(size, use_vm=False, hardware_profile=DEFAULT_PROFILE)
        try:
            with tempfile.TemporaryDirectory(prefix="ironserve-bench-rollout-") as tmp:
                path = write_fleet_inventory(Path(tmp) / "fleet.py", [host.name for host in hosts])
                if size == 1:
                    first = deploy(hosts, inventory=str(path), roles=(ROLES,))
                    started = time.monotonic()
                    again = deploy(hosts, inventory=str(path), roles=(ROLES,))
                    baseline = time.monotonic() - started
                    assert first.returncode == 0 and again.returncode == 0 and again.changed == 0, again.output
                    print(f"{size:>5} {'-':>5} {'deploy':<9} {baseline:>7.1f} {again.changed:>7} (one host's no-op "
                          "deploy, the baseline)")  # fmt: skip
                    continue
                for number, wanted in enumerate(args.batches):
                    batch = min(wanted, size - 1)  # the most a rollout may take out of service at once
                    # The hosts are fresh only once per size: later batch sizes start from converged hosts.
                    for run in ("change", "no-change") if number == 0 else ("no-change",):
                        figures = rollout(path, Path(tmp) / "reports", batch)
                        ratio = f"  ({figures['seconds'] / baseline:.1f}x the baseline)" if baseline else ""
                        print(f"{size:>5} {batch:>5} {run:<9} {figures['seconds']:>7.1f} {figures['changes']:>7.0f} "
                              f"{figures['controller_cpu_s'] / size:>14.2f} {figures['children_cpu_s'] / size:>19.2f}"
                              f"{ratio}")  # fmt: skip
        finally:
            manager.down({host.name for host in hosts})
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    raise SystemExit(main())
