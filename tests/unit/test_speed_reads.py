"""ironserve.speed.reads and .bundle: a bundle of fact commands answers each fact exactly as its own command would.

The bundle runs for real here (`sh`, this machine's files and dpkg database): every fact's lines and exit
status from the bundle are compared with the same command run alone, read line by line the way pyinfra's
connector reads it.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from pyinfra.api.command import StringCommand
from pyinfra.facts.files import FileContents, FindInFile

from ironserve.facts import DpkgPackages, OsDistro
from ironserve.owned import OwnedPath, PathShape
from ironserve.speed.bundle import Answer, bundle_command, parsed, split_bundle
from ironserve.speed.reads import WINDOW_AFTER_CHANGE, HostReads, Read, fact_arguments

MARKER = "@@ironserve-read-test"


def command_of(request: Read) -> str:
    command = request.fact().command(**fact_arguments(request.fact, request.kwargs))
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


def alone(command: str) -> Answer:
    """What pyinfra reads from one command: its stdout split into lines (the last one unterminated or not)."""
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return Answer(run.returncode, run.stdout.splitlines())


COMMANDS = [
    "printf 'no newline at the end'",
    "printf 'two\\nlines\\n'",
    "printf 'blank last line\\n\\n'",
    "printf '\\n'",
    "true",
    "echo partial; exit 3",
    "echo one # a comment the bundle must not swallow",
    "cat <<'EOF'\nheredoc $HOME\nEOF",
    "echo 'quote'\"s\" & wait",
]


def test_split_bundle_gives_each_command_its_own_lines_and_status() -> None:
    run = subprocess.run(["sh", "-c", bundle_command(COMMANDS, MARKER)], capture_output=True, text=True, check=True)
    answers = split_bundle(run.stdout.splitlines(), MARKER)
    assert answers == {index: alone(command) for index, command in enumerate(COMMANDS)}


REAL_READS = [
    Read(OsDistro),
    Read(DpkgPackages, {"patterns": ("dpkg", "bash", "no-such-package-here")}),
    Read(OwnedPath, {"path": "/etc/hostname"}),
    Read(OwnedPath, {"path": "/nonexistent/ironserve"}),
    Read(FileContents, {"path": "/etc/debian_version"}),
    Read(FileContents, {"path": "/nonexistent/ironserve"}),
    Read(FindInFile, {"path": "/etc/passwd", "pattern": "^root:.*$"}),
]


@pytest.mark.parametrize("index", range(len(REAL_READS)), ids=lambda i: REAL_READS[i].fact.__name__)
def test_a_bundled_fact_has_the_value_of_its_own_read(index: int) -> None:
    commands = [command_of(request) for request in REAL_READS]
    run = subprocess.run(["sh", "-c", bundle_command(commands, MARKER)], capture_output=True, text=True, check=True)
    request = REAL_READS[index]
    bundled = split_bundle(run.stdout.splitlines(), MARKER)[index]
    assert bundled == alone(commands[index])
    # One instance runs the command and parses it: FileContents and FindInFile keep a marker between the two.
    instance: Any = request.fact()
    instance.command(**fact_arguments(request.fact, request.kwargs))
    ok, value = parsed(instance, bundled)
    expected_instance: Any = request.fact()
    expected_instance.command(**fact_arguments(request.fact, request.kwargs))
    answer = alone(commands[index])
    assert ok
    assert value == (expected_instance.process(answer.lines) if answer.lines else expected_instance.default())


def test_what_only_pyinfra_can_answer_is_left_to_it() -> None:
    shape = OwnedPath()
    assert parsed(shape, Answer(1, ["file|644|root|root|-||"])) == (False, None)  # failed: pyinfra reports it
    assert parsed(shape, Answer(0, ["##PYINFRA_NOCMD##"])) == (False, None)  # a program missing
    assert parsed(shape, Answer(0, [])) == (True, shape.default())
    assert parsed(shape, Answer(0, ["absent"])) == (True, PathShape("absent"))


def test_a_key_is_the_same_however_the_arguments_are_passed() -> None:
    assert Read(DpkgPackages, {"patterns": ["a", "b"]}).key == Read(DpkgPackages, {"patterns": ("a", "b")}).key
    assert Read(FindInFile, {"path": "/p", "pattern": "x"}).key == (
        Read(FindInFile, {"path": "/p", "pattern": "x", "interpolate_variables": False}).key
    )


def test_after_a_change_a_fetch_covers_a_window_that_doubles_until_the_next_change() -> None:
    reads = HostReads(planned=[[Read(OwnedPath, {"path": f"/etc/f{i}"})] for i in range(40)])
    assert len(reads.ahead()) == 40  # nothing changed yet: every declared read at once
    reads.cursor = 3
    reads.forget()
    assert [r.kwargs["path"] for r in reads.ahead()] == [f"/etc/f{i}" for i in range(3, 3 + WINDOW_AFTER_CHANGE)]
    reads.cursor = 3 + WINDOW_AFTER_CHANGE
    assert len(reads.ahead()) == 2 * WINDOW_AFTER_CHANGE
    reads.forget()
    assert len(reads.ahead()) == WINDOW_AFTER_CHANGE
