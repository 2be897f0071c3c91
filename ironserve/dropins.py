"""Drop-ins an admin's tools leave on a unit a role manages, found and moved aside.

`systemctl edit` writes an override.conf into /etc/systemd/system/<unit>.d, `systemctl set-property` into
system.control, their --runtime forms into /run: each outranks the unit file and the role's own drop-in (another
ExecStart, User=root, a MemoryMax). Every role that manages a unit moves the others into the backups with
`foreign_dropins_moved_aside`, naming what the drop-in overrode and where the site sets it instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve.operations import Commands
from ironserve.owned import backed_up
from ironserve.speed.reads import Read, read, reading_operation

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


@reading_operation(reads=lambda units, **_: [Read(ForeignDropins, {"units": units})])
def foreign_dropins_moved_aside(units: list[str], own: list[str], why: str) -> Commands:
    """Move drop-ins other than `own` on units a role manages into BACKUP_DIR: a `systemctl edit` override.conf
    (User=root, another ExecStart), a `systemctl set-property` MemoryMax or a same-named mask outranks the role's
    unit and settings. `why` names what the drop-in overrode and where the site sets it instead."""
    foreign = [path for path in read(ForeignDropins, units=units) if path not in own]
    if not foreign:
        host.noop("no drop-in but ironserve's on " + ", ".join(units))
        return
    for path in foreign:
        yield from backed_up(path, why)
