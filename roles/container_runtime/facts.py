"""Facts of the container_runtime role: kernel modules and swap, with pure `process()`."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from pyinfra.api.facts import FactBase


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
