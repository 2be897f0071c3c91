"""The fact bundle: many facts read in one shell command (ironserve.speed.reads fetches through it).

The only module of ironserve that imports private pyinfra names (`_MISSING_COMMAND_MARKER`, the output of a
fact whose `requires_command` is missing, and `_handle_fact_kwargs`, the global arguments a fact's command runs
with): ironserve.speed.reads imports it only when a deploy installed its fact record, so with
IRONSERVE_PLAIN_PYINFRA=1 it is never imported (README.md beside it: why, and what pyinfra would need instead).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS
from pyinfra.api.command import StringCommand
from pyinfra.api.facts import _MISSING_COMMAND_MARKER, FactBase, ShortFactBase, _handle_fact_kwargs
from pyinfra.context import host, state

from ironserve.speed.reads import HostReads, Read, fact_arguments

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    """What one fact's command printed in a bundle: its exit status and its stdout lines."""

    status: int
    lines: list[str]


def bundle_command(commands: list[str], marker: str) -> str:
    """One shell script that runs the commands side by side (facts only read), each in its own subshell with its
    output in a private temporary folder followed by `marker <index> <status>` on a line of its own (the newline
    before it ends an unterminated last line), then prints them all in order with one `cat`: no process per
    command beyond its own subshells (printing each one apart took two `cat`s and a command substitution, three
    process starts per fact on the host). Without a temporary folder it prints nothing, and every fact is read
    on its own."""
    started = "\n".join(
        f'( (\n{command}\n) </dev/null >"$d/{index}" 2>/dev/null; '
        f"printf '\\n%s %d %d\\n' {marker} {index} $? >>\"$d/{index}\" ) &"
        for index, command in enumerate(commands)
    )
    outputs = " ".join(f'"$d/{index}"' for index in range(len(commands)))
    return f'd=$(mktemp -d) || exit 0\n{started}\nwait\ncat {outputs}\nrm -rf "$d"'


def split_bundle(lines: Iterable[str], marker: str) -> dict[int, Answer]:
    """Each command's answer from a bundle's stdout, its lines as pyinfra would have read them alone."""
    answers: dict[int, Answer] = {}
    chunk: list[str] = []
    for line in lines:
        words = line.split(" ")
        if len(words) == 3 and words[0] == marker and words[1].isdigit() and words[2].isdigit():
            if chunk and chunk[-1] == "":  # the newline printed before the marker
                chunk.pop()
            answers[int(words[1])] = Answer(int(words[2]), chunk)
            chunk = []
        else:
            chunk.append(line)
    return answers


def parsed(instance: FactBase[T], answer: Answer) -> tuple[bool, T | None]:
    """The fact's value from its bundled answer as pyinfra's `get_fact` computes it, or (False, None) where only
    pyinfra's own read gives the exact result (a failed command, a missing program, output it cannot parse).
    `instance` is the one whose `command()` ran: some facts keep a marker from it for `process()`."""
    if answer.status != 0 or answer.lines == [_MISSING_COMMAND_MARKER]:
        return False, None
    if not answer.lines:
        return True, instance.default()
    try:
        return True, instance.process(answer.lines)
    except Exception:  # pyinfra's own read reports it, with the host's name
        return False, None


def fact_command(request: Read, host_: Any) -> tuple[FactBase[Any], str | None]:
    """The fact, and the shell text pyinfra would run for it (None where it cannot join a bundle)."""
    instance = request.fact()
    if instance.shell_executable or issubclass(request.fact, ShortFactBase):
        return instance, None
    if instance.check_preconditions(state, host_):
        return instance, None
    arguments = fact_arguments(request.fact, request.kwargs)
    command = instance.command(**arguments) if callable(instance.command) else instance.command
    text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
    requires = instance.requires_command(**arguments) if callable(instance.requires_command) else None
    if requires:
        # Braces, not a subshell: the bundle already runs each command in a subshell of its own.
        text = (
            f"if command -v {requires} >/dev/null 2>&1; then {{\n{text}\n}}; else echo '{_MISSING_COMMAND_MARKER}'; fi"
        )
    return instance, text


def fetch(reads: HostReads, requests: list[Read]) -> None:
    """Read every request not known yet in one command; leave out what the bundle cannot answer exactly."""
    wanted = list({r.key: r for r in requests if r.key not in reads.known}.values())
    commands = [(r, *fact_command(r, host)) for r in wanted]
    bundled = [(r, instance, c) for r, instance, c in commands if c is not None]
    if len(bundled) < 2:
        return  # one fact alone: pyinfra's own read
    marker = f"@@ironserve-read-{secrets.token_hex(8)}"
    _, global_kwargs = _handle_fact_kwargs(state, host, bundled[0][0].fact, (), {})
    connector = {k: v for k, v in global_kwargs.items() if k in CONNECTOR_ARGUMENT_KEYS}
    status, output = host.run_shell_command(
        StringCommand(bundle_command([c for _, _, c in bundled], marker)),
        print_output=state.print_fact_output,
        print_input=state.print_fact_input,
        **connector,
    )
    if not status:
        return
    answers = split_bundle(output.stdout_lines, marker)
    for index, (request, instance, _) in enumerate(bundled):
        if index in answers:
            ok, value = parsed(instance, answers[index])
            if ok:
                reads.known[request.key] = value
