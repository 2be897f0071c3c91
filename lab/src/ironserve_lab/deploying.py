"""Run the real deploy and gate against lab hosts as an admin would (`ironserve deploy|verify`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ironserve.paths import REPO_ROOT
from ironserve.registry import registry
from ironserve.rollout import ANSI, GRAND_TOTAL
from ironserve_lab.state import LabHost

# Every role below the inference service: what the host-level lab tests and the convergence benchmark
# deploy. The service has its own lab test; an engine per host would not fit a 2-core machine.
HOST_ROLES = tuple(role for role in registry().default_names if role != "inference")


@dataclass(frozen=True)
class DeployResult:
    returncode: int
    changed: int  # operations that changed something, summed over hosts
    errors: int
    unchanged: int
    output: str


def _count(text: str) -> int:
    return 0 if text == "-" else int(text)


def _limits(hosts: list[LabHost]) -> list[str]:
    # Other lab hosts may run meanwhile (someone's `lab up`); touch only the test's own.
    return [arg for host in hosts for arg in ("--limit", host.name)]


def deploy(
    hosts: list[LabHost],
    inventory: str = "inventory/lab.py",
    roles: tuple[str, ...] = (),
    pyinfra_args: tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
    plain_pyinfra: bool = False,
) -> DeployResult:
    """`ironserve deploy` of `inventory` to `hosts` only; `roles` narrows the run (default all roles); `environ`
    adds to the deploy machine's environment (a token a role reads from it); `plain_pyinfra` runs it with pyinfra's
    own functions (`--plain-pyinfra`: none of ironserve.speed)."""
    only = ["--roles", ",".join(roles)] if roles else []
    only += ["--plain-pyinfra"] if plain_pyinfra else []
    result = subprocess.run(
        [sys.executable, "-m", "ironserve", "deploy", *_limits(hosts), *only, inventory, *pyinfra_args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **(environ or {})},
    )
    output = ANSI.sub("", result.stdout + result.stderr)
    match = GRAND_TOTAL.search(output)
    if not match:
        return DeployResult(result.returncode, -1, -1, -1, output)
    _, changed, errors, unchanged = (_count(g) for g in match.groups())
    return DeployResult(result.returncode, changed, errors, unchanged, output)


def verify(
    hosts: list[LabHost], *pytest_args: str, roles: tuple[str, ...] = (), inventory: str = "inventory/lab.py"
) -> subprocess.CompletedProcess[str]:
    """`ironserve verify` of `inventory`'s `hosts` only; `roles` narrows the gate to those roles' acceptance files."""
    only = ["--roles", ",".join(roles)] if roles else []
    return subprocess.run(
        [sys.executable, "-m", "ironserve", "verify", *_limits(hosts), *only, inventory, *pytest_args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
