"""Glue between pyinfra's inventory and the configuration model."""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Callable
from copy import copy
from types import FrameType, SimpleNamespace
from typing import Any, get_type_hints

import pyinfra
from pyinfra.api.arguments import AllArguments
from pyinfra.api.exceptions import DeployError
from pyinfra.api.util import PYINFRA_INSTALL_DIR

from ironserve.config import ConfigError, Registry, StackBase, validate_host
from ironserve.inventory import checked_at_load

# pyinfra's module; its own `pop_global_arguments` stays (the name is replaced in the modules that call it).
ARGUMENTS_MODULE: Any = importlib.import_module("pyinfra.api.arguments")
# The type hints of pyinfra's AllArguments TypedDict: its global arguments, which never change.
GLOBAL_ARGUMENTS = list(get_type_hints(AllArguments).items())
GLOBAL_ARGUMENT_NAMES = frozenset(name for name, _ in GLOBAL_ARGUMENTS)


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


def operation_order_from_frames(state: Any) -> list[int]:
    """pyinfra 3.10's `get_operation_order_from_stack` (pyinfra/api/util.py) read from the frames themselves: the
    same line numbers, in the same order, without `inspect.stack()`, which looks up every frame's source file and
    module (1.8 ms an operation, 2.2 s of a 16-host no-op's 3.6 s of controller CPU)."""
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(1)  # the caller's: pyinfra's, skipped below like the original's own
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    start = 0
    if state.current_deploy_filename:  # from the deploy file's first frame; none there: nothing (pyinfra's loop
        # then stops at its own frame, which it skips)
        deploy_file = state.current_deploy_filename
        start = next((i for i, f in enumerate(frames) if f.f_code.co_filename == deploy_file), len(frames))
    order = [state.current_op_file_number] if pyinfra.is_cli else []
    return order + [f.f_lineno for f in frames[start:] if not f.f_code.co_filename.startswith(PYINFRA_INSTALL_DIR)]


def global_arguments_once() -> Callable[[], list[tuple[str, type]]]:
    """pyinfra 3.10's `all_global_arguments` (pyinfra/api/arguments.py) computed once: the type hints of its
    AllArguments TypedDict, which never change, where pyinfra evaluates them again for every operation on every
    host (0.5 ms each). A new list each call, as the original returns."""
    return lambda: list(GLOBAL_ARGUMENTS)


class _HostDataReadOnce:
    """What pyinfra 3.10's `pop_global_arguments` (pyinfra/api/arguments.py) reads of a host, its data read once:
    it asks `host.data` for each of some 30 global arguments, and each ask evaluates every data layer again (the
    groups' data merged anew) to find, mostly, nothing: 0.14 to 0.19 s of a 16-host no-op's 1.7 s of controller
    CPU. `HostData.dict()` merges the same layers with the same precedence; a value is a shallow copy, as
    `HostData` hands out."""

    def __init__(self, host: Any) -> None:
        self.current_deploy_kwargs = host.current_deploy_kwargs
        data = host.data.dict()
        self.data = SimpleNamespace(**{key: copy(data[key]) for key in GLOBAL_ARGUMENT_NAMES.intersection(data)})


def pop_global_arguments_reading_host_data_once(state: Any, host: Any, kwargs: dict[str, Any]) -> Any:
    """pyinfra's own `pop_global_arguments`, given the host's data read once (`_HostDataReadOnce`)."""
    return ARGUMENTS_MODULE.pop_global_arguments(state, _HostDataReadOnce(host), kwargs)


def pyinfra_without_repeated_work() -> None:
    """Make pyinfra order operations with `operation_order_from_frames`, take its global arguments' types from
    `global_arguments_once` and pop them with `pop_global_arguments_reading_host_data_once`;
    tests/unit/test_deploying.py proves each gives what pyinfra's own gives."""
    # The modules, not the `operation` decorator that pyinfra.api exports under the same name.
    operation_module: Any = importlib.import_module("pyinfra.api.operation")
    operation_module.get_operation_order_from_stack = operation_order_from_frames
    once = global_arguments_once()
    for name in ("pyinfra.api.arguments", "pyinfra.api.facts"):
        module: Any = importlib.import_module(name)
        module.all_global_arguments = once
    for name in ("pyinfra.api.operation", "pyinfra.api.deploy", "pyinfra.api.facts"):
        module = importlib.import_module(name)
        module.pop_global_arguments = pop_global_arguments_reading_host_data_once
