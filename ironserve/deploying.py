"""Glue between pyinfra's inventory and the configuration model."""

from __future__ import annotations

import weakref
from typing import Any

from pyinfra.api.exceptions import DeployError

from ironserve.config import ConfigError, Registry, StackBase, validate_host
from ironserve.inventory import checked_at_load


def host_data(pyinfra_host: Any) -> dict[str, Any]:
    """The host's inventory data (override, host, group and all-group data) as a plain dict."""
    return dict(pyinfra_host.data.dict())


def config_for(pyinfra_host: Any, registry: Registry[Any]) -> Any:
    """The host's validated stack config (the registry's model); DeployError before any operation is queued.

    An inventory built with `ironserve.inventory.site()` was already validated, every host, before pyinfra
    connected; this check is the last line for any other inventory (pyinfra has connected by now, but no
    operation has run).
    """
    try:
        config: StackBase = validate_host(pyinfra_host.name, host_data(pyinfra_host), registry)
        return config
    except ConfigError as exc:
        hint = (
            ""
            if checked_at_load()
            else "\n(build the inventory's groups with ironserve.inventory.site() to have every host checked "
            "before pyinfra connects)"
        )
        raise DeployError(f"invalid inventory, nothing was changed:\n{exc}{hint}") from None


_FLEETS: weakref.WeakKeyDictionary[Any, dict[str, StackBase]] = weakref.WeakKeyDictionary()


def fleet_configs(state: Any, registry: Registry[Any]) -> dict[str, StackBase]:
    """Every inventory host's validated config in inventory order, built once per deploy (pyinfra State); a host
    whose data is invalid is left out (its own config_for stops it)."""
    if state not in _FLEETS:
        fleet = {}
        for pyinfra_host in state.inventory:
            try:
                fleet[pyinfra_host.name] = validate_host(pyinfra_host.name, host_data(pyinfra_host), registry)
            except ConfigError:
                continue
        _FLEETS[state] = fleet
    return _FLEETS[state]
