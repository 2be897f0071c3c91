"""Run the real deploy and gate as an admin would (`ironserve deploy|verify`), and read pyinfra's results."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from ironserve.paths import REPO_ROOT

ANSI = re.compile(r"\x1b\[[0-9;]*m")
GRAND_TOTAL = re.compile(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)")


@dataclass(frozen=True)
class DeployResult:
    returncode: int
    changed: int  # operations that changed something, summed over hosts
    errors: int
    unchanged: int
    output: str


def _count(text: str) -> int:
    return 0 if text == "-" else int(text)


def deploy(inventory: str = "inventory/lab.py", *pyinfra_args: str) -> DeployResult:
    result = subprocess.run(
        ["ironserve", "deploy", inventory, *pyinfra_args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800
    )
    output = ANSI.sub("", result.stdout + result.stderr)
    match = GRAND_TOTAL.search(output)
    if not match:
        return DeployResult(result.returncode, -1, -1, -1, output)
    _, changed, errors, unchanged = (_count(g) for g in match.groups())
    return DeployResult(result.returncode, changed, errors, unchanged, output)


def verify(inventory: str = "inventory/lab.py", *pytest_args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ironserve", "verify", inventory, *pytest_args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )
