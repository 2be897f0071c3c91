"""Operations several roles use, each checking state through facts and yielding commands only on change."""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from typing import Any

from pyinfra import logger
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.operation import operation
from pyinfra.context import host, state
from pyinfra.facts.files import FindInFile, Sha256File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus
from pyinfra.operations import files, systemd
from pyinfra.operations.util.files import adjust_regex

from ironserve.facts import ContainerKind, StaleUnits, SysctlState, UnitsNeedingReload
from ironserve.speed.reads import Read, read, reading_operation

# What an operation function returns: the commands it yields (strings, StringCommand, FunctionCommand, or
# another operation's `_inner`).
Commands = Generator[Any, None, None]


def report(message: str) -> None:
    """A warning in the deploy's output, once: an operation's body runs when changes are detected and again when
    it executes."""
    if state.is_executing:
        logger.warning(f"{host.print_prefix}{message}")


def failing(message: str) -> StringCommand:
    """A command that fails this host with `message` on stderr. pyinfra then stops this host only and the others
    go on to the results table; an OperationError raised by an operation would stop the whole run, every host."""
    return StringCommand("echo", QuoteString(message), ">&2;", "exit", "1")


@operation()
def stop_host(reason: str) -> Commands:
    """Stop this host with `reason` before anything else of it runs; the other hosts go on."""
    yield failing(reason)


@reading_operation(reads=lambda key, **_: [Read(SysctlState, {"keys": (key,)}), Read(ContainerKind)])
def live_sysctl(key: str, value: str) -> Commands:
    """Set one sysctl in the running kernel when it differs.

    In a container a kernel-global key is read-only (and a module's key may be absent): it is persisted
    by the caller and applied at the next boot of the machine, so it is reported instead of failing.
    """
    entry = read(SysctlState, keys=(key,))[key]
    shown = value.replace("\t", " ")
    container = read(ContainerKind)
    if entry.value == value:
        host.noop(f"sysctl {key} is {shown}")
    elif entry.value is None and container:
        host.noop(f"sysctl {key}: absent in this container (module not loaded by the machine); persisted")
    elif entry.value is not None and not entry.writable:
        if not container:
            yield failing(f"sysctl {key} is not writable on this host (value {entry.value!r})")
            return
        host.noop(f"sysctl {key}: kernel-global, read-only in this container; persisted, applied at boot")
    else:
        yield StringCommand("sysctl", "-w", QuoteString(f"{key}={shown}"))


def _stale_reads(unit: str, inputs: list[str], written: dict[str, str] | None = None, **_: Any) -> list[Read]:
    return [
        Read(StaleUnits, {"inputs": {unit: inputs}}),
        *(Read(Sha256File, {"path": path}) for path in sorted(written or {})),
    ]


@reading_operation(reads=_stale_reads)
def restarted_when_stale(
    unit: str, inputs: list[str], check: str | None = None, written: dict[str, str] | None = None
) -> Commands:
    """Restart a running unit that started before one of its inputs changed (unit file, configuration), or whose
    files `written` at its start (path -> the text it would write now) differ on the host: a unit that renders its
    own files from a wider configuration restarts only when that configuration reaches them.
    Read from the host's state, not a handler: a run that failed between the write and the restart is
    completed by the next. `check` (e.g. promtool) runs first and stops the restart when it fails."""
    differing = [
        path
        for path, text in sorted((written or {}).items())
        if read(Sha256File, path=path) != hashlib.sha256(text.encode()).hexdigest()
    ]
    if unit not in read(StaleUnits, inputs={unit: inputs}) and not differing:
        host.noop(
            f"{unit} started after its inputs last changed" + (" and runs its files as rendered now" if written else "")
        )
        return
    if differing:
        report(f"{unit} restarts: {', '.join(differing)} differ from what it would write now")
    if check:
        yield check
    yield StringCommand("systemctl", "restart", unit)


@reading_operation(reads=lambda units, **_: [Read(UnitsNeedingReload, {"units": units})])
def daemon_reloaded(units: list[str]) -> Commands:
    """systemctl daemon-reload when systemd holds an older copy of any of these unit files."""
    if not read(UnitsNeedingReload, units=units):
        host.noop("systemd has loaded the current unit files")
        return
    yield "systemctl daemon-reload"


def _unit_reads(unit: str, **_: Any) -> list[Read]:
    return [Read(SystemdStatus, {"services": [unit]}), Read(SystemdEnabled, {"services": [unit]})]


@reading_operation(reads=_unit_reads)
def service_state(unit: str, running: bool | None = True, enabled: bool | None = True) -> Commands:
    """pyinfra's systemd.service for a unit's running and enabled state (None: either), run only when the unit
    differs: its state is read with the host's other facts, and pyinfra's operation reads it again itself."""
    is_running = bool(read(SystemdStatus, services=[unit]).get(unit))
    is_enabled = bool(read(SystemdEnabled, services=[unit]).get(unit))
    if running in (None, is_running) and enabled in (None, is_enabled):
        host.noop(f"{unit}: {'running' if is_running else 'stopped'}, {'enabled' if is_enabled else 'disabled'}")
        return
    yield from systemd.service._inner(service=unit, running=running, enabled=enabled)


def _line_reads(path: str, match: str, **_: Any) -> list[Read]:
    return [Read(FindInFile, {"path": path, "pattern": adjust_regex(match, False)})]


@reading_operation(reads=_line_reads)
def line_replaced(path: str, match: str, line: str) -> Commands:
    """The lines of `path` matching the regex `match` are exactly `line` (appended where none matches): pyinfra's
    files.line, run only when the file differs."""
    if read(FindInFile, path=path, pattern=adjust_regex(match, False)) == [line]:
        host.noop(f"{path}: {line}")
        return
    yield from files.line._inner(path=path, line=match, replace=line)
