"""Run the issue 5 roles (tests/lab/deploy_security_runtime.py) against lab hosts and read pyinfra's totals."""

from __future__ import annotations

import subprocess
import sys

from ironserve.lab.deploying import ANSI, GRAND_TOTAL, DeployResult
from ironserve.lab.state import LabHost
from ironserve.paths import REPO_ROOT

DEPLOY_FILE = "tests/lab/deploy_security_runtime.py"


def deploy_roles(hosts: list[LabHost]) -> DeployResult:
    limits = [arg for host in hosts for arg in ("--limit", host.name)]
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", *limits, "inventory/lab.py", DEPLOY_FILE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = ANSI.sub("", result.stdout + result.stderr)
    match = GRAND_TOTAL.search(output)
    if not match:
        return DeployResult(result.returncode, -1, -1, -1, output)
    _, changed, errors, unchanged = (0 if g == "-" else int(g) for g in match.groups())
    return DeployResult(result.returncode, changed, errors, unchanged, output)
