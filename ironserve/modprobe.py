"""Rules in modprobe.d that keep a module the stack needs out (`blacklist nvidia`, `install br_netfilter /bin/false`),
found in the files and commented out: no setting keeps such a line, since the stack cannot run without the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve.facts import grep_files, lines_by_file
from ironserve.operations import Commands
from ironserve.owned import backed_up
from ironserve.speed.reads import Read, read, reading_operation

# Where modprobe reads its configuration (modprobe.d(5)); /lib is /usr/lib on a merged-/usr system, read once.
MODPROBE_GLOBS = ("/etc/modprobe.d/*.conf", "/run/modprobe.d/*.conf", "/usr/lib/modprobe.d/*.conf")
# The commands an `install` line runs instead of loading a module when it is meant to keep it out.
REFUSING_COMMANDS = {"/bin/false", "/usr/bin/false", "false", "/bin/true", "/usr/bin/true", "true"}


class ModprobeRules(FactBase[dict[str, list[str]]]):
    """The `blacklist` and `install` lines of every modprobe.d file, by path."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def command(self) -> str:
        return grep_files(MODPROBE_GLOBS, "^[[:space:]]*(blacklist|install)[[:space:]]")

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        return lines_by_file(output)


def module_name(name: str) -> str:
    """A module's name as modprobe compares it: `-` and `_` are the same (nvidia-uvm is nvidia_uvm)."""
    return name.replace("-", "_")


def blocks(line: str, modules: Iterable[str]) -> str | None:
    """The module of `modules` a modprobe rule keeps out (`blacklist M`, or `install M` running false or true
    instead of loading it), else None. `line` is one rule as modprobe.d(5) or `modprobe --showconfig` prints it."""
    fields = line.split()
    wanted = {module_name(m) for m in modules}
    if len(fields) < 2 or module_name(fields[1]) not in wanted:
        return None
    if fields[0] == "blacklist" or (fields[0] == "install" and fields[2:3] and fields[2] in REFUSING_COMMANDS):
        return module_name(fields[1])
    return None


def blocking_rules(rules: dict[str, list[str]], modules: Iterable[str]) -> dict[str, list[str]]:
    """The files of ModprobeRules with a line that keeps one of `modules` out -> those lines."""
    found = {path: [line for line in lines if blocks(line, modules)] for path, lines in sorted(rules.items())}
    return {path: lines for path, lines in found.items() if lines}


@reading_operation(reads=lambda **_: [Read(ModprobeRules)])
def modules_not_blocked(modules: tuple[str, ...]) -> Commands:
    """Comment out every modprobe.d line that keeps one of `modules` out (`blacklist`, `install M /bin/false`), a
    copy of its file kept in BACKUP_DIR: the stack cannot run without them, so no setting keeps such a line."""
    found = blocking_rules(read(ModprobeRules), modules)
    if not found:
        host.noop("no modprobe.d rule blocks " + ", ".join(modules))
        return
    names = "|".join(sorted({re.escape(module_name(m)).replace("_", "[-_]") for m in modules}))
    refusing = "|".join(re.escape(command) for command in sorted(REFUSING_COMMANDS))
    blacklist, install = rf"blacklist[[:space:]]+({names})", rf"install[[:space:]]+({names})[[:space:]]+({refusing})"
    rule = rf"^([[:space:]]*({blacklist}|{install})([[:space:]]|$))"
    for path, lines in found.items():
        yield from backed_up(path, f"keeps a module the stack needs out ({'; '.join(lines)})", keep_original=True)
        # @ delimits: the pattern holds / (/bin/false) and | (alternatives), never @.
        script = rf"s@{rule}@# disabled by ironserve: \1@"
        yield StringCommand("sed", "-i", "-E", QuoteString(script), QuoteString(path))
