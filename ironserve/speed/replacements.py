"""Drop-in replacements of three pyinfra 3.10 functions that redo, for every operation on every host, work whose
result never changes within a run; `pyinfra_without_repeated_work` rebinds them where pyinfra calls them.

Imported only by `ironserve.speed.install` with the speed work on: with IRONSERVE_PLAIN_PYINFRA=1 pyinfra keeps its
own. tests/unit/test_speed_replacements.py proves each returns what pyinfra's own returns; README.md beside it says
what each saves and the change to pyinfra that would let ironserve drop it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from copy import copy
from types import FrameType, SimpleNamespace
from typing import Any, get_type_hints

import pyinfra
from pyinfra.api.arguments import AllArguments
from pyinfra.api.util import PYINFRA_INSTALL_DIR

# pyinfra's module; its own `pop_global_arguments` stays (the name is replaced in the modules that call it).
ARGUMENTS_MODULE: Any = importlib.import_module("pyinfra.api.arguments")
# The type hints of pyinfra's AllArguments TypedDict: its global arguments, which never change.
GLOBAL_ARGUMENTS = list(get_type_hints(AllArguments).items())
GLOBAL_ARGUMENT_NAMES = frozenset(name for name, _ in GLOBAL_ARGUMENTS)


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
    tests/unit/test_speed_replacements.py proves each gives what pyinfra's own gives."""
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
