"""Load a pyinfra inventory without connecting, and validate every host's configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyinfra.api.state import State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory

from ironserve.config import ConfigError, Registry, StackBase, build_config, check_roles_deployable


@dataclass(frozen=True)
class InventoryHost:
    name: str
    groups: tuple[str, ...]
    data: dict[str, Any]


def load_inventory(path: str, override: dict[str, str] | None = None) -> list[InventoryHost]:
    """The inventory's hosts and data, without connecting; `override` wins like pyinfra's --data."""
    if not Path(path).exists():
        raise FileNotFoundError(f"inventory file {path} does not exist")
    # pyinfra's loader records the file it executes on the current State: give it one (as its CLI does),
    # and the current directory, where pyinfra (and `ironserve deploy`) looks for group_data/ too.
    with ctx_state.use(State()):
        inventory = make_inventory(path, cwd=os.getcwd())
    return [
        InventoryHost(name=host.name, groups=tuple(host.groups), data={**host.data.dict(), **(override or {})})
        for host in inventory
    ]


def validate_inventory(hosts: list[InventoryHost], registry: Registry[Any]) -> tuple[dict[str, StackBase], list[str]]:
    """Every host's stack config, and every problem found (all hosts are checked, none is touched)."""
    configs: dict[str, StackBase] = {}
    problems: list[str] = []
    for host in hosts:
        try:
            configs[host.name] = build_config(host.name, host.data, registry)
            check_roles_deployable(configs[host.name], registry)
        except ConfigError as exc:
            problems.extend(str(exc).splitlines())
    if not hosts:
        problems.append("the inventory lists no hosts")
    return configs, problems
