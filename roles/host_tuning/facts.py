"""Facts of the host_tuning role: the kernel command line GRUB writes and the one the kernel booted with."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from pyinfra.api.facts import FactBase

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
