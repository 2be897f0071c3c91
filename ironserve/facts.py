"""Custom pyinfra facts: small, typed, with pure `process()` so parsers are unit-tested on captured output."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from pyinfra.api.facts import FactBase


@dataclass(frozen=True)
class SysctlEntry:
    value: str | None  # as /proc/sys shows it, fields joined by a tab; None when the key does not exist
    writable: bool  # False on a read-only /proc/sys or a kernel-global key inside a container


def _proc_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


class SysctlState(FactBase[dict[str, SysctlEntry]]):
    """Current value and writability of each sysctl key, read straight from /proc/sys."""

    def command(self, keys: Iterable[str]) -> str:
        lines = [
            f"k={shlex.quote(key)}; p={shlex.quote(_proc_path(key))}; "
            'if [ -e "$p" ]; then v=$(tr -s " \\t" "\\t" < "$p"); '
            'if [ -w "$p" ]; then w=rw; else w=ro; fi; else v=-; w=absent; fi; '
            'printf "%s|%s|%s\\n" "$k" "$w" "$v"'
            for key in keys
        ]
        return "; ".join(lines)

    def process(self, output: Iterable[str]) -> dict[str, SysctlEntry]:
        entries = {}
        for line in output:
            key, access, value = line.split("|", 2)
            entries[key] = SysctlEntry(value=None if access == "absent" else value, writable=access == "rw")
        return entries


class ContainerKind(FactBase[str | None]):
    """The container technology the host runs in (systemd-detect-virt), or None on metal or a VM."""

    def command(self) -> str:
        return "systemd-detect-virt --container || true"

    def process(self, output: Iterable[str]) -> str | None:
        kind = " ".join(output).strip()
        return None if kind in {"", "none"} else kind


GRUB_LINE = re.compile(r"^GRUB_CMDLINE_LINUX=(?P<value>.*)$")


class GrubCmdlineLinux(FactBase[list[str] | None]):
    """The arguments in /etc/default/grub's GRUB_CMDLINE_LINUX; None when the host has no GRUB defaults."""

    def command(self) -> str:
        return (
            "if [ -f /etc/default/grub ]; then grep '^GRUB_CMDLINE_LINUX=' /etc/default/grub || true; "
            "else echo ABSENT; fi"
        )

    def process(self, output: Iterable[str]) -> list[str] | None:
        lines = list(output)
        if lines == ["ABSENT"]:
            return None
        args: list[str] = []
        for line in lines:
            match = GRUB_LINE.match(line.strip())
            if match:
                # The file is shell: the last assignment wins and quotes group the words.
                args = " ".join(shlex.split(match["value"])).split()
        return args


class KernelCmdline(FactBase[list[str]]):
    """The arguments the running kernel booted with."""

    def command(self) -> str:
        return "cat /proc/cmdline"

    def process(self, output: Iterable[str]) -> list[str]:
        return " ".join(output).split()


def with_kernel_args(current: list[str], wanted: Iterable[str]) -> list[str]:
    """`current` with every wanted argument present; a wanted key=value replaces the same key's old value."""
    result = list(current)
    for arg in wanted:
        key = arg.split("=", 1)[0]
        same_key = [i for i, a in enumerate(result) if a.split("=", 1)[0] == key]
        if same_key:
            result[same_key[0]] = arg
            for extra in reversed(same_key[1:]):
                del result[extra]
        else:
            result.append(arg)
    return result


def missing_kernel_args(running: list[str], wanted: Iterable[str]) -> list[str]:
    return [arg for arg in wanted if arg not in running]
