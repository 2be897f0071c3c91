"""Run a command on a lab host over real SSH and get everything back, failures included."""

from __future__ import annotations

import subprocess

from ironserve_lab import remote
from ironserve_lab.state import LabHost


def ssh_run(host: LabHost, command: str, timeout: float = 120) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `command` run by the login shell on `host`."""
    result = subprocess.run(
        [*remote.ssh_argv(host), command],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return result.returncode, result.stdout, result.stderr
