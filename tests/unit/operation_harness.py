"""Run an ironserve operation on a fake host: facts in, commands out (or a no-op), no root, network or lab.

The way pyinfra tests its own operations (tests/operations/<op>/*.json), kept small: `FakeHost.get_fact`
answers only from the table a test gives, keyed by the fact's dotted name and its arguments, and fails on a
fact the test did not provide, so a case states exactly what the operation reads. `run_operation` runs the
operation's raw generator (`op._inner`) under pyinfra's host and state contexts and renders what it yields:
a shell command as its text, a function as `function:<name>`, an upload as a dict with its destination and
content. Nested operations (`yield from files.put._inner(...)`) flatten like they do in a deploy.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from unittest.mock import patch

from pydantic import BaseModel
from pyinfra.api.command import FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.api.config import Config
from pyinfra.api.facts import FactBase
from pyinfra.context import ctx_host, ctx_state

from ironserve.lock import StackLock
from ironserve.speed import reads
from ironserve.speed.reads import freeze
from roles.kubernetes.settings import KubernetesSettings

# A command as a test compares it: the shell text, a `function:<name>` marker, or a dict for what a string
# cannot say alone (an upload; a command whose logged form masks a secret: {"raw": ..., "masked": ...}).
Rendered = str | dict[str, str]
FactKey = tuple[str, Any]  # (dotted fact class name, frozen arguments)
FactClass = type[FactBase[Any]]
TIMESTAMP = "a-timestamp"


class MissingFact(LookupError):
    """The operation read a fact the test did not provide."""


def fact_name(fact: type | str) -> str:
    return fact if isinstance(fact, str) else reads.fact_name(fact)


def fact_class(name: str) -> FactClass:
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def fact_key(fact: FactClass | str, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> FactKey:
    cls = fact_class(fact) if isinstance(fact, str) else fact
    return fact_name(cls), freeze(reads.fact_arguments(cls, kwargs or {}, args))


def build(hint: Any, value: Any) -> Any:
    """A JSON value as the fact's declared type: dicts become the dataclasses the fact returns, nested too."""
    if value is None:
        return None
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, dict):
        hints = typing.get_type_hints(hint)
        unknown = set(value) - {f.name for f in dataclasses.fields(hint)}
        if unknown:
            raise TypeError(f"{hint.__name__} has no field {', '.join(sorted(unknown))}")
        return hint(**{k: build(hints[k], v) for k, v in value.items()})
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for param in params:
            if dataclasses.is_dataclass(param) and isinstance(value, dict):
                return build(param, value)
        for param in params:
            if typing.get_origin(param) in (dict, list) and isinstance(value, typing.get_origin(param)):
                return build(param, value)
        return value
    if origin is dict and isinstance(value, dict) and len(params) == 2:
        return {k: build(params[1], v) for k, v in value.items()}
    if origin is list and isinstance(value, list) and params:
        return [build(params[0], v) for v in value]
    if origin is tuple and isinstance(value, list) and len(params) == 2 and params[1] is Ellipsis:
        return tuple(build(params[0], v) for v in value)
    return value


def fact_value(fact: FactClass, value: Any) -> Any:
    try:
        hint = typing.get_type_hints(fact.process)["return"]
    except (NameError, KeyError, TypeError):  # an untyped pyinfra fact: the JSON value as it is
        return value
    return build(hint, value)


class FakeState:
    """What operations read from pyinfra's state: whether the deploy executes, the config, the deploy folder."""

    def __init__(self, executing: bool = True) -> None:
        self.is_executing = executing
        self.config = Config()  # type: ignore[no-untyped-call]
        self.cwd: str | None = None
        self.print_noop_info = False


class FakeHost:
    """Answers facts from a table and records no-op messages and the facts read."""

    name = "testhost"

    def __init__(self, facts: Mapping[FactKey, Any]) -> None:
        self.facts = dict(facts)
        self.noops: list[str] = []
        self.read: list[FactKey] = []
        self.data: dict[str, Any] = {}
        self.in_op = True
        self.current_op_hash: str | None = None
        self.current_op_global_arguments: dict[str, Any] = {}
        self.current_op_deploy_data: dict[str, Any] | None = None

    def get_fact(self, fact: FactClass | str, *args: Any, **kwargs: Any) -> Any:
        key = fact_key(fact, args, kwargs)
        if key not in self.facts:
            given = "".join(f"\n  {name} {dict(arguments)}" for name, arguments in self.facts) or " none"
            raise MissingFact(
                f"operation read {key[0]} with {dict(key[1])}, which the test does not provide; given:{given}"
            )
        self.read.append(key)
        return self.facts[key]

    def noop(self, description: str) -> None:
        self.noops.append(description)

    def log(self, message: str, *args: Any, **kwargs: Any) -> None:
        pass

    def get_temp_filename(self, *args: Any, **kwargs: Any) -> str:
        return "_tempfile_"

    @property
    def print_prefix(self) -> str:
        return ""


def render(command: Any) -> Rendered:
    if isinstance(command, str):
        return command.strip()  # as pyinfra's operation wrapper does
    if isinstance(command, StringCommand):
        raw, masked = command.get_raw_value(), command.get_masked_value()
        return raw if raw == masked else {"raw": raw, "masked": masked}
    if isinstance(command, FunctionCommand):
        return f"function:{command.function.__name__}"
    if isinstance(command, FileUploadCommand):
        src = command.src
        if isinstance(src, str):
            return {"upload": command.dest, "src": src}
        src.seek(0)
        content = src.read()
        return {"upload": command.dest, "content": content.decode() if isinstance(content, bytes) else content}
    if inspect.isgenerator(command):
        raise TypeError("the operation yielded a generator: a nested operation needs `yield from op._inner(...)`")
    raise TypeError(f"the operation yielded {command!r}, which is no pyinfra command")


# Models an operation may take, built from their JSON form by the annotation's name.
MODELS: dict[str, type[BaseModel]] = {"StackLock": StackLock, "KubernetesSettings": KubernetesSettings}


def op_arguments(operation: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """JSON lists become tuples where the operation's signature says tuple (`args: tuple[str, ...]`), and JSON
    objects become the model the signature names (`lock: StackLock`)."""
    # The annotations' text: some name types imported only for type checking (StackConfig).
    hints = {k: str(hint) for k, hint in operation._inner.__annotations__.items()}  # type: ignore[attr-defined]
    arguments = {}
    for key, value in kwargs.items():
        hint = hints.get(key, "")
        if isinstance(value, list) and hint.startswith(("tuple[", "Tuple[")):
            value = tuple(value)
        elif isinstance(value, dict) and hint in MODELS:
            value = MODELS[hint].model_validate(value)
        arguments[key] = value
    return arguments


def collect(operation: Callable[..., Any], host: FakeHost, state: FakeState | None = None, **kwargs: Any) -> list[Any]:
    """What `operation(**kwargs)` yields on `host`, as pyinfra objects; what it raises propagates."""
    # pyinfra names backups (sed -i.<timestamp>) by the clock: fixed, as pyinfra's own tests do.
    with (
        ctx_state.use(state or FakeState()),
        ctx_host.use(host),
        patch("pyinfra.operations.files.get_timestamp", lambda: TIMESTAMP),
        patch("pyinfra.operations.util.files.get_timestamp", lambda: TIMESTAMP),
    ):
        return list(operation._inner(**op_arguments(operation, kwargs)))  # type: ignore[attr-defined]


def declared_reads(operation: Callable[..., Any], **kwargs: Any) -> set[FactKey] | None:
    """The facts `operation(**kwargs)` declares it reads when queued (ironserve.speed.reads), or None if it declares
    none (an operation that reads no fact)."""
    plan = getattr(operation, "reads", None)
    if plan is None:
        return None
    bound = inspect.signature(operation._inner).bind(**op_arguments(operation, kwargs))  # type: ignore[attr-defined]
    bound.apply_defaults()
    return {request.key for request in plan(**bound.arguments)}


def run_operation(
    operation: Callable[..., Any], host: FakeHost, state: FakeState | None = None, **kwargs: Any
) -> list[Rendered]:
    """The commands `operation(**kwargs)` yields on `host`, rendered; what it raises propagates."""
    return [render(command) for command in collect(operation, host, state, **kwargs)]


def facts_table(entries: Iterable[Mapping[str, Any]]) -> dict[FactKey, Any]:
    """[{"fact": "dotted.Class", "kwargs": {...}, "value": ...}] -> the fake host's table, values typed."""
    table: dict[FactKey, Any] = {}
    for entry in entries:
        cls = fact_class(entry["fact"])
        key = fact_key(cls, (), entry.get("kwargs", {}))
        if key in table:
            raise ValueError(f"fact {key[0]} {dict(key[1])} given twice")
        table[key] = fact_value(cls, entry["value"])
    return table
