"""Facts of the host_tuning role: the kernel command line GRUB writes and the one the kernel booted with."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

GRUB_DEFAULTS = "/etc/default/grub"
GRUB_DROP_INS = "/etc/default/grub.d/*.cfg"
# GRUB_CMDLINE_LINUX's value while one file is sourced: where the file's value still holds it, the file appends.
PREVIOUS = "@ironserve-previous@"


@dataclass(frozen=True)
class GrubCmdlineSource:
    path: str
    value: str  # GRUB_CMDLINE_LINUX once the file is sourced, PREVIOUS standing for the value before it

    @property
    def changes(self) -> bool:
        return self.value != PREVIOUS

    @property
    def overrides(self) -> bool:
        return PREVIOUS not in self.value


class GrubCmdlineLinux(FactBase[list[GrubCmdlineSource] | None]):
    """/etc/default/grub, then each /etc/default/grub.d/*.cfg, in the order grub-mkconfig sources them, with the
    GRUB_CMDLINE_LINUX each leaves; None when the host has no GRUB defaults."""

    def command(self) -> str:
        # grub-mkconfig sources these as root too; a file that fails to source (a syntax error update-grub would hit
        # as well) fails the fact, and the host, instead of reporting a value the repair would then write.
        return (
            f"if [ -f {GRUB_DEFAULTS} ]; then ( "
            f'for ironserve_grub in {GRUB_DEFAULTS} {GRUB_DROP_INS}; do if [ -e "$ironserve_grub" ]; then '
            f'GRUB_CMDLINE_LINUX={PREVIOUS}; {{ . "$ironserve_grub"; }} >/dev/null; '
            "printf '%s\\t' \"$ironserve_grub\"; printf '%s' \"$GRUB_CMDLINE_LINUX\" | tr '\\t\\n' '  '; echo; "
            "fi; done ) || exit 1; else echo ABSENT; fi"
        )

    def process(self, output: Iterable[str]) -> list[GrubCmdlineSource] | None:
        lines = list(output)
        if lines == ["ABSENT"]:
            return None
        sources = []
        for line in lines:
            path, _, value = line.partition("\t")
            sources.append(GrubCmdlineSource(path, value.strip()))
        return sources


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


def cmdline_after(sources: Iterable[GrubCmdlineSource], before: Sequence[str] = ()) -> list[str]:
    """GRUB_CMDLINE_LINUX's arguments once grub-mkconfig has sourced `sources`, starting from `before`."""
    value = " ".join(before)
    for source in sources:
        value = source.value.replace(PREVIOUS, value)
    return value.split()


def drop_in_repair(
    sources: list[GrubCmdlineSource], new_defaults: list[str], wanted: Iterable[str]
) -> tuple[str, list[str]]:
    """The drop-in to rewrite, and the arguments to write there, when the drop-ins keep the effective
    GRUB_CMDLINE_LINUX from carrying `wanted` even once /etc/default/grub holds `new_defaults` (which carry them).

    The last drop-in that sets the value outright is chosen, so the ones after it that only append keep doing so;
    when those undo an argument, the last drop-in that changes the value gets the whole effective value instead.
    """
    wanted = list(wanted)
    drop_ins = sources[1:]
    overriding = [source for source in drop_ins if source.overrides]
    if overriding:
        base = overriding[-1]
        value = with_kernel_args(base.value.split(), wanted)
        after = cmdline_after(drop_ins[drop_ins.index(base) + 1 :], value)
        if with_kernel_args(after, wanted) == after:
            return base.path, value
    last = [source for source in drop_ins if source.changes][-1]
    return last.path, with_kernel_args(cmdline_after(drop_ins, new_defaults), wanted)
