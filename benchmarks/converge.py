"""Print how long convergence takes on lab container hosts: lab up (boot-to-SSH), first deploy, no-op re-run.

The deploy runs every role below the inference service (HOST_ROLES); the service's own deploy is
measured by tests/lab/test_inference_deploy.py (it prints its first-deploy time).

Usage: python benchmarks/converge.py [--sizes 1 4]
Starts and stops its own lab hosts (others keep running). Figures only; no assertions.
"""

from __future__ import annotations

import argparse
import time

from ironserve.lab import manager
from ironserve.lab.deploying import HOST_ROLES, deploy
from ironserve.lab.hardware import DEFAULT_PROFILE


def measure(size: int) -> str:
    started = time.monotonic()
    hosts = manager.up(size, use_vm=False, hardware_profile=DEFAULT_PROFILE)
    lab_up = time.monotonic() - started
    try:
        started = time.monotonic()
        first = deploy(hosts, roles=HOST_ROLES)
        first_s = time.monotonic() - started
        started = time.monotonic()
        again = deploy(hosts, roles=HOST_ROLES)
        again_s = time.monotonic() - started
        if first.returncode or again.returncode:
            raise SystemExit(first.output + again.output)
        return f"{size:>5} {lab_up:>10.1f} {first_s:>15.1f} {again_s:>15.1f} {again.changed:>15}"
    finally:
        manager.down({h.name for h in hosts})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4])
    sizes = parser.parse_args().sizes
    print(f"{'hosts':>5} {'lab up s':>10} {'first deploy s':>15} {'no-op re-run s':>15} {'re-run changes':>15}")
    for size in sizes:
        print(measure(size), flush=True)


if __name__ == "__main__":
    main()
