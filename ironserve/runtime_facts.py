"""Custom pyinfra facts of the security and container_runtime roles, with pure `process()`."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

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


class KernelModules(FactBase[dict[str, str]]):
    """For each module: loaded (in /sys/module), builtin (modules.builtin) or absent."""

    def command(self, names: Iterable[str]) -> str:
        return "; ".join(
            f"m={shlex.quote(name)}; if [ -d /sys/module/$m ]; then echo $m loaded; "
            f'elif grep -qs "/$m.ko" /lib/modules/$(uname -r)/modules.builtin; then echo $m builtin; '
            "else echo $m absent; fi"
            for name in names
        )

    def process(self, output: Iterable[str]) -> dict[str, str]:
        pairs = (line.split(None, 1) for line in output if line.strip())
        return {name: state.strip() for name, state in pairs}


class SwapState(FactBase[dict[str, list[str]]]):
    """Active swap areas (/proc/swaps) and the uncommented swap lines of /etc/fstab."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {"active": [], "fstab": []}

    def command(self) -> str:
        return (
            "tail -n +2 /proc/swaps | awk '{print \"active \" $1}'; "
            "grep -sE '^[^#]\\S*\\s+\\S+\\s+swap\\s' /etc/fstab | awk '{print \"fstab \" $1}' || true"
        )

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        state: dict[str, list[str]] = {"active": [], "fstab": []}
        for line in output:
            kind, _, device = line.strip().partition(" ")
            if kind in state and device:
                state[kind].append(device)
        return state


class HeldPackages(FactBase[list[str]]):
    """Packages on hold (apt-mark showhold)."""

    default = list

    def command(self) -> str:
        return "apt-mark showhold"

    def process(self, output: Iterable[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())
