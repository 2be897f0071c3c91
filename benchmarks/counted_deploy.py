"""`ironserve deploy ARGS`, counting every command pyinfra runs over SSH: per role, how many and how long.

Usage: python benchmarks/counted_deploy.py REPORT.json ARGS...   (ARGS as for `ironserve deploy`)
Measurement only (benchmarks/converge.py runs it): pyinfra's SSH connector is wrapped in this process to time
each command and name the operation it ran for; commands run while operations are queued count as "prepare".
The report also gives the process's own start-up (imports) and validation times.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any

STARTED = time.monotonic()

from pyinfra.connectors.ssh import SSHConnector  # noqa: E402

from ironserve import cli  # noqa: E402

IMPORTED = time.monotonic()
COUNTS: dict[str, list[float]] = defaultdict(list)
VALIDATION: list[float] = []


def role_of(connector: Any) -> str:
    host = connector.host
    if host.current_op_hash is None:
        return "prepare"
    names = host.state.get_op_meta(host.current_op_hash).names
    name = next(iter(names), "?")
    return name.split(" | ")[0] if " | " in name else "deploy (checks, reboot)"


def counted(original: Any) -> Any:
    def run_shell_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            COUNTS[role_of(self)].append(time.monotonic() - started)

    return run_shell_command


def timed(original: Any) -> Any:
    def validated(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            VALIDATION.append(time.monotonic() - started)

    return validated


def main() -> int:
    report, args = sys.argv[1], sys.argv[2:]
    SSHConnector.run_shell_command = counted(SSHConnector.run_shell_command)  # type: ignore[method-assign]
    cli._validated = timed(cli._validated)
    try:
        code = cli.main(["deploy", *args])
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    figures = {
        "imports_s": IMPORTED - STARTED,
        "validation_s": sum(VALIDATION),
        "commands": {role: {"count": len(times), "seconds": sum(times)} for role, times in COUNTS.items()},
    }
    with open(report, "w") as out:
        json.dump(figures, out)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
