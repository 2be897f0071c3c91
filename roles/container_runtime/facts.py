"""Facts of the container_runtime role: kernel modules, what blocks them in modprobe.d, and swap, with pure
`process()`."""

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


# An active swap entry of /etc/fstab (fstab(5): fields split by blanks, a leading blank allowed, type `swap` in the
# third field, options optional), as an ERE for grep -E and sed -E.
FSTAB_SWAP_LINE = r"^[[:space:]]*[^#[:space:]][^[:space:]]*[[:space:]]+[^[:space:]]+[[:space:]]+swap([[:space:]]|$)"


ENABLED_SWAP_LINKS = " ".join(
    f"{root}/*.{kind}/*.swap"
    for root in ("/etc/systemd/system", "/run/systemd/system")
    for kind in ("wants", "requires")
)


class SwapState(FactBase[dict[str, list[str]]]):
    """Active swap areas (/proc/swaps), the uncommented swap lines of /etc/fstab and enabled .swap units: what
    turns swap on at the next boot as well as now."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {"active": [], "fstab": [], "unit": []}

    def command(self) -> str:
        return (
            "tail -n +2 /proc/swaps | awk '{print \"active \" $1}'; "
            f"grep -sE '{FSTAB_SWAP_LINE}' /etc/fstab | awk '{{print \"fstab \" $1}}'; "
            # Enabled = linked into a target's .wants/.requires by `systemctl enable` (systemctl(1)), in /etc or,
            # --runtime, /run; read from disk because `systemctl list-unit-files` scans every unit (0.6 s).
            f'for f in {ENABLED_SWAP_LINKS}; do if [ -L "$f" ] || [ -e "$f" ]; then echo "unit ${{f##*/}}"; fi; '
            "done | sort -u; true"
        )

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        state: dict[str, list[str]] = {"active": [], "fstab": [], "unit": []}
        for line in output:
            kind, _, device = line.strip().partition(" ")
            if kind in state and device:
                state[kind].append(device)
        return state


def config_argument(argv: list[str], default: str) -> str:
    """The config file a containerd command line names (`--config PATH`, `--config=PATH`, `-c PATH`), else
    `default`, the one containerd reads without it."""
    for index, argument in enumerate(argv):
        if argument in {"--config", "-c"} and index + 1 < len(argv):
            return argv[index + 1]
        if argument.startswith("--config="):
            return argument.partition("=")[2]
    return default
