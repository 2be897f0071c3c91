"""Facts of the security role."""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from ironserve.facts import lines_by_file


class PasswordState(FactBase[str | None]):
    """locked, empty or set: the account's password field in /etc/shadow; None when the account is missing."""

    def command(self, user: str) -> str:
        return f"getent shadow {shlex.quote(user)} | cut -d: -f2 || true"

    def process(self, output: Iterable[str]) -> str | None:
        lines = list(output)
        if not lines:
            return None
        field = lines[0].strip()
        if field.startswith(("!", "*")):
            return "locked"
        return "empty" if field == "" else "set"


class SupplementaryGroups(FactBase[list[str]]):
    """The groups the account really has beyond its primary one (`id -nG`, what a process of it gets)."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self, user: str) -> str:
        quoted = shlex.quote(user)
        return f"id -gn {quoted} 2>/dev/null && id -nG {quoted} 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> list[str]:
        lines = list(output)
        if len(lines) < 2:
            return []
        primary = lines[0].strip()
        return [group for group in lines[1].split() if group != primary]


@dataclass(frozen=True)
class Account:
    group: str  # the primary group's name
    home: str
    shell: str
    uid: int
    gid: int  # the primary group's number


class AccountShape(FactBase[Account | None]):
    """An account's primary group, home, shell and numbers as the system resolves them (`getent passwd`, `id -gn`: local
    files or a directory service alike), or None when there is no such account."""

    def command(self, user: str) -> str:
        quoted = shlex.quote(user)
        return f"getent passwd {quoted} && id -gn {quoted} 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> Account | None:
        lines = list(output)
        fields = lines[0].split(":") if lines else []
        if len(lines) < 2 or len(fields) != 7:
            return None
        return Account(group=lines[1].strip(), home=fields[5], shell=fields[6], uid=int(fields[2]), gid=int(fields[3]))


class GroupNumber(FactBase[int | None]):
    """A group's number as the system resolves it (`getent group`), or None when there is no such group."""

    def command(self, group: str) -> str:
        return f"getent group {shlex.quote(group)} | cut -d: -f3; true"

    def process(self, output: Iterable[str]) -> int | None:
        lines = [line.strip() for line in output if line.strip()]
        return int(lines[0]) if lines else None


SUDOERS = "/etc/sudoers"
SUDOERS_DIR = "/etc/sudoers.d"


class SudoGrants(FactBase[dict[str, list[str]]]):
    """The sudoers lines that name `user` or `%group` (a rule, or a User_Alias that a rule of the same file uses),
    by file: /etc/sudoers and each file of /etc/sudoers.d that sudo reads (its names without a dot or a trailing
    ~, sudoers(5)); comments and Defaults lines left out; empty without sudo's files."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def command(self, user: str, group: str) -> str:
        # ERE specials escaped; `-` stays bare (grep 3.8 warns of a stray backslash before it). A name is a whole
        # token: bounded by what sudoers puts around a user list (start, blanks, `=`, `,`, `!`).
        who = "|".join(re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", name) for name in (user, f"%{group}"))
        pattern = shlex.quote(f"^[^#]*(^|[[:space:]=,!])({who})([[:space:],]|$)")
        return (
            f'for f in {SUDOERS} {SUDOERS_DIR}/*; do case "${{f##*/}}" in *.*|*~) '
            f'[ "$f" = {SUDOERS} ] || continue;; esac; '
            f'[ -f "$f" ] && grep -H -E {pattern} "$f"; done; true'
        )

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        files = {
            path: [line for line in lines if not line.startswith("Defaults")]
            for path, lines in lines_by_file(output).items()
        }
        return {path: lines for path, lines in files.items() if lines}


NO_SUDO = "no sudo"
# sudo's "no rights" answers: the account may not run sudo, or sudo does not know it (1.9, Debian 12: "sudo: unknown
# user ai-runner"; 1.8: "sudo: unknown user: ai-runner"); an account not created yet has no rights yet (a rule naming
# it is SudoGrants' to find).
NO_RIGHTS = re.compile(r"^(User \S+ is not allowed to run sudo on |sudo: unknown user:? \S+$)")


class SudoAllows(FactBase[list[str] | None]):
    """What sudo itself allows `user` (`sudo -n -l -U`: every sudoers file, alias, group and ALL rule in force):
    the rules it lists, [] when it says the user may not run sudo or does not know the user, None without sudo.
    Output of neither shape (a sudoers file sudo cannot parse) is returned whole, so that it is named rather than
    read as no rights."""

    def command(self, user: str) -> str:
        return f"command -v sudo >/dev/null || {{ echo {shlex.quote(NO_SUDO)}; exit 0; }}; " + (
            f"LC_ALL=C sudo -n -l -U {shlex.quote(user)} 2>&1; true"
        )

    def process(self, output: Iterable[str]) -> list[str] | None:
        lines = [line.rstrip() for line in output if line.strip()]
        if lines == [NO_SUDO]:
            return None
        if any(NO_RIGHTS.match(line) for line in lines):
            return []
        for index, line in enumerate(lines):
            if line.startswith("User ") and " may run the following commands on " in line:
                rules = itertools.takewhile(lambda rule: rule.startswith((" ", "\t")), lines[index + 1 :])
                return [rule.strip() for rule in rules]
        return lines
