"""Glue between pyinfra's inventory and the configuration model."""

from __future__ import annotations

from typing import Any

from pyinfra.api.exceptions import DeployError

from ironserve.config import ConfigError, Registry, StackBase, build_config, check_roles_deployable


def host_data(pyinfra_host: Any) -> dict[str, Any]:
    """The host's inventory data (host, group and all-group data) as a plain dict."""
    return dict(pyinfra_host.data.dict())


def config_for(pyinfra_host: Any, registry: Registry[Any]) -> Any:
    """The host's validated stack config (the registry's model); DeployError before any operation is queued."""
    try:
        config: StackBase = build_config(pyinfra_host.name, host_data(pyinfra_host), registry)
        check_roles_deployable(config, registry)
        return config
    except ConfigError as exc:
        raise DeployError(f"invalid inventory, nothing was changed:\n{exc}") from None
