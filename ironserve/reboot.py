"""One reboot per host per deploy: roles say what needs one, the deploy's last operation honours the policy.

A role whose changes can leave the running system behind what it installed (a kernel argument not yet
live, a driver module older than the installed driver) records a `RebootCheck` on the host's `HostRun`.
After every role, `reboot_for_needs` asks each check (from facts, like any operation) and applies
`ironserve_reboot_policy` once to all that need it:
`auto` reboots and proves it (a new boot id, then every need's own check), `defer` leaves
/run/reboot-required with the reasons, `never` only reports. A container host shares the machine's
kernel, so `auto` defers there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from io import StringIO
from typing import Any, Literal

from pyinfra import logger
from pyinfra.api.command import FunctionCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import State
from pyinfra.context import host, state
from pyinfra.operations import files, server

from ironserve.facts import ContainerKind
from ironserve.operations import Commands
from ironserve.speed.reads import Read, read, reading_operation

RebootPolicy = Literal["auto", "defer", "never"]
REBOOT_MARKER = "/run/reboot-required"  # the file Debian and Ubuntu tools check (update-notifier's convention)
REBOOT_REASONS = "/run/ironserve/reboot-required"


@dataclass(frozen=True)
class RebootCheck:
    """Whether a role needs the host rebooted, and how to tell afterwards that the reboot brought the change in."""

    role: str
    # Reads facts (inside the operation); the reason a reboot is needed, or None.
    needed: Callable[[], str | None]
    # Called with the pyinfra host after the reboot; raises OperationError when the change did not take effect.
    took_effect: Callable[[Any], None]
    reads: tuple[Read, ...] = ()  # the facts `needed` reads, fetched with the host's others


@dataclass(frozen=True)
class RebootNeed:
    role: str
    reason: str
    took_effect: Callable[[Any], None]


def read_on(pyinfra_host: Any, command: str, secrets: tuple[str, ...] = ()) -> str:
    """stdout of `command` on the host, from inside a FunctionCommand; raises when it fails, with the last lines
    of its stderr, each of `secrets` in them masked."""
    status, output = pyinfra_host.run_shell_command(command)
    if not status:
        said = "\n".join(output.stderr_lines[-5:]) or "no output"
        for secret in secrets:
            said = said.replace(secret, "***")
        raise OperationError(f"{command!r} failed on {pyinfra_host.name}: {said}")
    return "\n".join(output.stdout_lines).strip()


def reasons_text(needs: tuple[RebootNeed, ...]) -> str:
    return "".join(f"{need.role}: {need.reason}\n" for need in needs)


@reading_operation(reads=lambda checks, **_: [Read(ContainerKind), *(r for check in checks for r in check.reads)])
def reboot_for_needs(checks: tuple[RebootCheck, ...], policy: RebootPolicy, timeout_s: int) -> Commands:
    """Reboot once for every role that needs it (auto), leave the markers (defer) or report (never)."""
    needs = tuple(
        RebootNeed(check.role, reason, check.took_effect) for check in checks if (reason := check.needed()) is not None
    )
    if not needs:
        host.noop("no role needs a reboot")
        return
    shown = "; ".join(f"{need.role}: {need.reason}" for need in needs)
    if state.is_executing:  # the body also runs to plan the deploy; say it once, whatever the policy
        logger.info(f"{host.print_prefix}reboot needed ({policy}): {shown}")
    if policy == "never":
        host.noop(f"reboot needed ({shown}), but ironserve_reboot_policy is never")
        return
    container = read(ContainerKind)
    if policy == "defer" or container:
        where = f"container host ({container}): the machine that runs it reboots, not the deploy\n" if container else ""
        yield from files.put._inner(src=StringIO("*** System restart required ***\n"), dest=REBOOT_MARKER)
        yield from files.put._inner(src=StringIO(reasons_text(needs) + where), dest=REBOOT_REASONS)
        return
    boot_ids: list[str] = []
    yield FunctionCommand(_record_boot_id, (boot_ids,), {})
    yield from server.reboot._inner(delay=5, interval=2, reboot_timeout=timeout_s)
    yield FunctionCommand(_prove_reboot, (boot_ids, needs), {})


# pyinfra passes (state, host) to a FunctionCommand only when its parameters carry exactly those names.
def _record_boot_id(state: State, host: Any, boot_ids: list[str]) -> bool:
    boot_ids.append(read_on(host, "cat /proc/sys/kernel/random/boot_id"))
    return True


def _prove_reboot(state: State, host: Any, boot_ids: list[str], needs: tuple[RebootNeed, ...]) -> bool:
    """The reboot happened (a new boot id) and brought in what every role needed."""
    if read_on(host, "cat /proc/sys/kernel/random/boot_id") == boot_ids[0]:
        raise OperationError("reboot not proven: the boot id did not change")
    for need in needs:
        need.took_effect(host)
    return True
