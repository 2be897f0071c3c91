"""Facts of the security role."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from pyinfra.api.facts import FactBase


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


# Where an admin's tools put drop-ins that outrank a unit's own (systemd.unit(5), "Unit File Load Path"):
# `systemctl set-property` (system.control), `systemctl edit` (/etc/systemd/system), and their --runtime forms.
DROPIN_ROOTS = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/etc/systemd/system",
    "/run/systemd/system",
)


def dropin_dir_names(unit: str) -> list[str]:
    """The names (shell globs) of the drop-in directories that apply to `unit`: its own, its instances' for a
    template, and each dash prefix's (`ai-.service.d` applies to every ai-* service; systemd.unit(5))."""
    stem, _, kind = unit.rpartition(".")
    names = [unit, *([unit.replace("@.", "@*.")] if "@." in unit else [])]
    parts = stem.split("-")
    names += [f"{'-'.join(parts[:i])}-.{kind}" for i in range(len(parts) - 1, 0, -1)]
    return [f"{name}.d" for name in names]


def dropin_dirs(unit: str) -> list[str]:
    """The admin-writable drop-in directories (shell globs) that apply to `unit`."""
    return [f"{root}/{name}" for root in DROPIN_ROOTS for name in dropin_dir_names(unit)]


class ForeignDropins(FactBase[list[str]]):
    """Every drop-in file in the admin-writable directories that apply to `units` (the caller knows its own)."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self, units: Iterable[str]) -> str:
        globs = " ".join(f"{directory}/*.conf" for unit in units for directory in dropin_dirs(unit))
        # A glob that matches nothing stays literal; -e drops it. Names are validated unit names (no spaces).
        return f'for f in {globs}; do [ -e "$f" ] || [ -L "$f" ] && echo "$f"; done; true'

    def process(self, output: Iterable[str]) -> list[str]:
        return sorted({line.strip() for line in output if line.strip()})
