"""Print how long convergence takes on lab container hosts, and the SSH round trips behind it, per role.

For each fleet size: lab up (boot-to-SSH), the first deploy, then `--runs` no-op re-runs (median, min, max),
each through benchmarks/counted_deploy.py (the real `ironserve deploy`, every SSH command counted and timed by
the role whose operation ran it, "prepare" while operations are queued), plus the wrapper's own imports and
validation. The deploy runs every role below the inference service (HOST_ROLES); the service's own deploy is
measured by tests/lab/test_inference_deploy.py.

Usage: python benchmarks/converge.py [--sizes 1 4 16] [--runs 5]
Starts and stops its own lab hosts (others keep running); 16 container hosts need about 20 MiB each. The lab
hosts share this machine's cores with the controller: a fleet's figures here include that contention, so each run
also prints the CPU time the whole machine spent on it (controller, SSH and the hosts' commands, from /proc/stat)
and the floor that sets: that time over the machine's cores, the least wall time the same work can take here; of
that time, the controller's own (the deploy process and its children: pyinfra, paramiko's SSH) is what a real fleet
would still run on one machine.
Figures only; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ironserve.paths import REPO_ROOT
from ironserve_lab import manager
from ironserve_lab.deploying import ANSI, GRAND_TOTAL, HOST_ROLES
from ironserve_lab.hardware import DEFAULT_PROFILE
from ironserve_lab.state import LabHost

COUNTED = Path(__file__).with_name("counted_deploy.py")


@dataclass(frozen=True)
class Run:
    seconds: float
    changed: int
    figures: dict[str, Any]
    cpu_seconds: float  # the whole machine's busy CPU time during the run, all cores added up
    controller_cpu_seconds: float  # of which the deploy process's and its children's


def busy_cpu_seconds(proc_stat: str) -> float:
    """Pure: the busy time of all CPUs from /proc/stat's first line (user nice system idle iowait irq softirq
    steal ..., in USER_HZ ticks: proc(5)); idle and iowait are not busy."""
    ticks = [int(field) for field in proc_stat.splitlines()[0].split()[1:]]
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    return busy_cpu_seconds(Path("/proc/stat").read_text())


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def counted_deploy(hosts: list[LabHost]) -> Run:
    limits = [arg for host in hosts for arg in ("--limit", host.name)]
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        started, busy, controller = time.monotonic(), machine_busy(), children_cpu()
        result = subprocess.run(
            [sys.executable, str(COUNTED), report.name, *limits, "--roles", ",".join(HOST_ROLES), "inventory/lab.py"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        seconds, cpu_seconds = time.monotonic() - started, machine_busy() - busy
        controller_cpu = children_cpu() - controller
        output = ANSI.sub("", result.stdout + result.stderr)
        match = GRAND_TOTAL.search(output)
        if result.returncode or not match:
            raise SystemExit(output)
        changed = 0 if match.group(2) == "-" else int(match.group(2))
        return Run(seconds, changed, json.loads(Path(report.name).read_text()), cpu_seconds, controller_cpu)


def role_table(title: str, run: Run, hosts: int) -> str:
    commands = run.figures["commands"]
    lines = [f"  {title}: SSH commands per host by role (count, seconds)"]
    for role, entry in sorted(commands.items(), key=lambda item: -item[1]["seconds"]):
        lines.append(f"    {role:<28} {entry['count'] / hosts:>7.1f} {entry['seconds'] / hosts:>8.2f}")
    total = sum(e["count"] for e in commands.values()) / hosts
    seconds = sum(e["seconds"] for e in commands.values()) / hosts
    lines.append(f"    {'total':<28} {total:>7.1f} {seconds:>8.2f}")
    lines.append(
        f"    wrapper: imports {run.figures['imports_s']:.2f} s, validation {run.figures['validation_s']:.2f} s"
    )
    return "\n".join(lines)


def measure(size: int, runs: int) -> str:
    started = time.monotonic()
    hosts = manager.up(size, use_vm=False, hardware_profile=DEFAULT_PROFILE)
    lab_up = time.monotonic() - started
    try:
        first = counted_deploy(hosts)
        again = [counted_deploy(hosts) for _ in range(runs)]
        noop = [run.seconds for run in again]
        median_run = sorted(again, key=lambda run: run.seconds)[len(again) // 2]
        cores = os.cpu_count() or 1
        head = (
            f"{size:>5} {lab_up:>9.1f} {first.seconds:>15.1f} {first.cpu_seconds:>10.1f} "
            f"{first.cpu_seconds / cores:>8.1f} {statistics.median(noop):>11.2f} {min(noop):>6.2f} {max(noop):>6.2f} "
            f"{median_run.cpu_seconds:>10.2f} {median_run.cpu_seconds / cores:>8.2f} "
            f"{median_run.controller_cpu_seconds:>16.2f} "
            f"{sum(run.changed for run in again):>13}"
        )
        return "\n".join(
            [head, role_table("first deploy", first, size), role_table("no-op (median)", median_run, size)]
        )
    finally:
        manager.down({h.name for h in hosts})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--runs", type=int, default=5, help="no-op re-runs per size (their median is printed)")
    options = parser.parse_args()
    columns = (
        ("hosts", 5), ("lab up s", 9), ("first deploy s", 15), ("cpu s", 10), ("floor s", 8),
        ("no-op med s", 11), ("min", 6), ("max", 6), ("cpu s", 10), ("floor s", 8), ("controller cpu s", 16),
        ("no-op changes", 13),
    )  # fmt: skip
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    print(
        f"(cpu s: the machine's busy CPU time during the run; floor s: cpu s over its {os.cpu_count()} cores; "
        "controller cpu s: the deploy process's own, no-op)"
    )
    for size in options.sizes:
        print(measure(size, options.runs), flush=True)


if __name__ == "__main__":
    main()
