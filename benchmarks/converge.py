"""Print how long convergence takes on lab container hosts: boot-to-SSH, first deploy, no-op re-run.

Usage: python benchmarks/converge.py [--sizes 1 4]
Starts and stops its own lab hosts (others keep running). Figures only; no assertions.
"""

from __future__ import annotations

import argparse
import time

from ironserve.lab import manager
from ironserve.lab.hardware import DEFAULT_PROFILE
from tests.lab.deploying import deploy


def timed(action):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = action()
    return result, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4])
    sizes = parser.parse_args().sizes
    print(f"{'hosts':>5} {'lab up s':>14} {'first deploy s':>15} {'no-op re-run s':>15} {'re-run changes':>15}")
    for size in sizes:
        hosts, boot = timed(lambda: manager.up(size, use_vm=False, hardware_profile=DEFAULT_PROFILE))  # noqa: B023
        try:
            first, first_s = timed(lambda: deploy(hosts))
            again, again_s = timed(lambda: deploy(hosts))
            if first.returncode or again.returncode:
                raise SystemExit(first.output + again.output)
            print(f"{size:>5} {boot:>14.1f} {first_s:>15.1f} {again_s:>15.1f} {again.changed:>15}")
        finally:
            manager.down({h.name for h in hosts})


if __name__ == "__main__":
    main()
