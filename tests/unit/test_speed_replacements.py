"""ironserve.speed.replacements' replacements of three pyinfra 3.10 functions give exactly what pyinfra's own give:
operation_order_from_frames, from any call stack, what get_operation_order_from_stack gives (the order is what pyinfra
hashes into an operation's identity, so a difference would reorder or merge operations across hosts),
global_arguments_once what all_global_arguments gives, and pop_global_arguments_reading_host_data_once what
pop_global_arguments gives."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any, get_type_hints

import pyinfra
import pytest
from pyinfra.api import Config, Inventory, State, util
from pyinfra.api.arguments import AllArguments

from ironserve.speed import replacements
from ironserve.speed.replacements import (
    global_arguments_once,
    operation_order_from_frames,
    pop_global_arguments_reading_host_data_once,
    pyinfra_without_repeated_work,
)

PYINFRA_ORIGINAL = util.get_operation_order_from_stack
PYINFRA_OPERATION = importlib.import_module("pyinfra.api.operation")
PYINFRA_ARGUMENTS = importlib.import_module("pyinfra.api.arguments")
PYINFRA_FACTS = importlib.import_module("pyinfra.api.facts")


def both(state: Any) -> tuple[list[int], list[int]]:
    # One line: both calls see this frame at the same line number.
    return PYINFRA_ORIGINAL(state), operation_order_from_frames(state)


def through_a_multi_line_call(state: Any, depth: int) -> tuple[list[int], list[int]]:
    if depth == 0:
        return both(state)
    return through_a_multi_line_call(
        state,
        depth - 1,
    )


DEPLOY_FILES = {
    "no deploy file": None,
    "this file, on the stack": __file__,
    "a file not on the stack": "/nowhere/deploy.py",
    "pyinfra's own module": util.__file__,
}


@pytest.mark.parametrize("cli", [True, False], ids=["cli", "api"])
@pytest.mark.parametrize("deploy_file", DEPLOY_FILES.values(), ids=DEPLOY_FILES.keys())
@pytest.mark.parametrize("depth", [0, 3])
def test_the_order_from_frames_is_pyinfras(
    monkeypatch: pytest.MonkeyPatch, cli: bool, deploy_file: str | None, depth: int
) -> None:
    monkeypatch.setattr(pyinfra, "is_cli", cli)
    state = SimpleNamespace(current_deploy_filename=deploy_file, current_op_file_number=7)
    original, from_frames = through_a_multi_line_call(state, depth)
    assert from_frames == original
    if deploy_file in (None, __file__):  # not vacuous: this file's frames are in it
        assert len(original) >= (2 if cli else 1) + depth


def test_the_global_arguments_computed_once_are_pyinfras() -> None:
    once = global_arguments_once()
    first = once()
    assert first == PYINFRA_ARGUMENTS.all_global_arguments() and len(first) > 10
    first.clear()  # a caller changing its list changes no other caller's
    assert once() == PYINFRA_ARGUMENTS.all_global_arguments()


def test_pyinfra_then_uses_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PYINFRA_OPERATION, "get_operation_order_from_stack", PYINFRA_ORIGINAL)
    for module in (PYINFRA_ARGUMENTS, PYINFRA_FACTS):
        monkeypatch.setattr(module, "all_global_arguments", PYINFRA_ARGUMENTS.all_global_arguments)
    pyinfra_without_repeated_work()
    assert PYINFRA_OPERATION.get_operation_order_from_stack is operation_order_from_frames
    assert PYINFRA_ARGUMENTS.all_global_arguments is PYINFRA_FACTS.all_global_arguments
    assert PYINFRA_ARGUMENTS.all_global_arguments() == list(get_type_hints(AllArguments).items())
    # Its own frame is outside pyinfra's folder: it starts from its caller's so as not to count itself.
    assert not replacements.__file__.startswith(util.PYINFRA_INSTALL_DIR)


def always() -> bool:
    return True


def fleet() -> tuple[Any, list[Any]]:
    """A real pyinfra inventory and state: global arguments set at each data layer (all hosts, group, host,
    override), one a list that pyinfra hands on as it is (so a shared value would show), beside keys that are no
    global argument."""
    inventory = Inventory(
        (
            ["web1", ("web2", {"_sudo_user": "deployer", "ironserve_profile": "r740-a10"})],
            {"_env": {"LANG": "C"}, "_if": [always]},
        ),
        override_data={"_timeout": 45},
        servers=(["web1", "web2"], {"_sudo": True, "_retries": 2, "site": "lab"}),
    )
    state = State(inventory, Config())
    return state, [inventory.get_host("web1"), inventory.get_host("web2")]


CALLS = {
    "no arguments": ({}, None, None),
    "arguments given": ({"_sudo": False, "_env": {"A": "1"}, "path": "/etc/x"}, None, None),
    "inside a deploy": ({"path": "/etc/x"}, {"_shell_executable": "bash", "_sudo": False}, {"_retries": 5}),
}


@pytest.mark.parametrize(("kwargs", "deploy_kwargs", "deploy_data"), CALLS.values(), ids=CALLS.keys())
def test_popping_global_arguments_with_the_host_data_read_once_is_pyinfras(
    kwargs: dict[str, Any], deploy_kwargs: dict[str, Any] | None, deploy_data: dict[str, Any] | None
) -> None:
    state, hosts = fleet()
    for host in hosts:
        host.current_deploy_kwargs, host.current_deploy_data = deploy_kwargs, deploy_data
        theirs, ours = dict(kwargs), dict(kwargs)
        expected = PYINFRA_ARGUMENTS.pop_global_arguments(state, host, theirs)
        assert pop_global_arguments_reading_host_data_once(state, host, ours) == expected
        assert ours == theirs  # the same arguments popped, the rest left
    hosts[1].current_deploy_kwargs = hosts[1].current_deploy_data = None
    arguments, _ = pop_global_arguments_reading_host_data_once(state, hosts[1], {})
    assert (arguments["_sudo"], arguments["_sudo_user"], arguments["_timeout"]) == (True, "deployer", 45)
    arguments["_if"].append(always)  # a copy, as HostData hands out: the inventory keeps its value
    assert hosts[1].data._if == [always]


def test_pyinfras_callers_pop_global_arguments_with_the_host_data_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    callers = [importlib.import_module(f"pyinfra.api.{name}") for name in ("operation", "deploy", "facts")]
    for module in callers:
        monkeypatch.setattr(module, "pop_global_arguments", PYINFRA_ARGUMENTS.pop_global_arguments)
    pyinfra_without_repeated_work()
    pyinfra_without_repeated_work()  # once per host's deploy file: no wrapper around a wrapper
    assert all(module.pop_global_arguments is pop_global_arguments_reading_host_data_once for module in callers)
