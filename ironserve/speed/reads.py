"""Facts a host's operations will read, fetched in one SSH round trip instead of one command each.

pyinfra 3.10 keeps no fact cache: every `host.get_fact` is one command over SSH (about 65 ms to a lab host),
and a no-op run of the host roles read 102 facts that way. Here an operation says, when it is queued, which
facts it will read (`@reading_operation(reads=...)`). When it executes, the first fact it asks for (`read`)
fetches every declared fact this host does not know yet in one shell command (ironserve.speed.bundle), each
parsed by its own fact class. A host is known only until something changes it: any command an operation runs
forgets what was read, so a later read sees the host as it is now. Whatever the bundle cannot answer exactly as
pyinfra would (a failed or missing command, an unparsable output) is read again on its own with `host.get_fact`,
so a fact's value and its errors are pyinfra's either way.

Only public pyinfra names here. With IRONSERVE_PLAIN_PYINFRA=1 no record is installed (ironserve.speed.install):
`read` is `host.get_fact`, `plan` and `forget` do nothing, and a `reading_operation` is queued as pyinfra's own
operation of its body.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, wraps
from typing import Any, TypeVar

from pyinfra.api.facts import FactBase
from pyinfra.api.operation import operation
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import host, state

from ironserve import speed

T = TypeVar("T")
FactKey = tuple[str, Any]  # (dotted fact class name, frozen command arguments)
Body = Callable[..., Generator[Any, None, None]]  # an operation function: the commands it yields


def freeze(value: Any) -> Any:
    """A hashable, order-insensitive form of fact arguments: lists and tuples alike, dicts by sorted items."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return tuple(sorted(freeze(v) for v in value))
    return value


def fact_name(fact: type) -> str:
    return f"{fact.__module__}.{fact.__qualname__}"


_SIGNATURES: dict[type[FactBase[Any]], inspect.Signature] = {}


def command_signature(fact: type[FactBase[Any]]) -> inspect.Signature:
    """The signature of the fact's `command()`, once per fact class: a deploy binds arguments to it some 700 times
    a host."""
    if fact not in _SIGNATURES:
        _SIGNATURES[fact] = inspect.signature(fact.command)
    return _SIGNATURES[fact]


def fact_arguments(fact: type[FactBase[Any]], kwargs: Mapping[str, Any], args: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The fact's `command()` arguments by name, defaults filled in, however the caller passed them."""
    bound = command_signature(fact).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "self"}


@dataclass(frozen=True)
class Read:
    """One fact an operation reads: its class and the arguments of its command."""

    fact: type[FactBase[Any]]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def key(self) -> FactKey:
        return fact_name(self.fact), freeze(fact_arguments(self.fact, self.kwargs))


# After a change, a fetch covers the reads of this many operations (the current one first), doubling with each
# fetch until the next change: a no-op run reads everything in one command; where changes come one after another
# (a first converge), nothing is fetched that the next change makes stale before it is used.
WINDOW_AFTER_CHANGE = 1


@dataclass
class HostReads:
    planned: list[list[Read]] = field(default_factory=list)  # each queued operation's declared reads, in order
    position: dict[str, int] = field(default_factory=dict)  # operation hash -> its index in `planned`
    cursor: int = 0  # the index of the operation executing now
    known: dict[FactKey, Any] = field(default_factory=dict)
    window: int | None = None  # operations a fetch covers ahead of the cursor; None: all the rest
    last_op: str | None = None

    def forget(self) -> None:
        self.known.clear()
        self.window = WINDOW_AFTER_CHANGE

    def ahead(self) -> list[Read]:
        """The declared reads of the operations a fetch covers now, widening the window for the next one."""
        stop = None if self.window is None else self.cursor + self.window
        if self.window is not None:
            self.window *= 2
        return [request for requests in self.planned[self.cursor : stop] for request in requests]


class FactReads(BaseStateCallback):
    """The per-host record of declared and known facts of one pyinfra state, kept with its callbacks."""

    def __init__(self) -> None:
        self.hosts: dict[str, HostReads] = {}

    def of(self, name: str) -> HostReads:
        return self.hosts.setdefault(name, HostReads())

    # pyinfra's callbacks are static methods with the state first; this one is bound, as add_callback_handler
    # allows, to reach the record.
    def operation_host_start(self, state_: Any, host_: Any, op_hash: str) -> None:  # type: ignore[override]
        """Follow the executing operation; a host that the previous one changed (pyinfra's own operations
        included) is read again."""
        reads = self.of(host_.name)
        ops = state_.ops.get(host_, {})
        if reads.last_op in ops:
            meta = ops[reads.last_op].operation_meta
            if meta.is_complete() and (meta.did_change() or not meta.did_succeed()):
                reads.forget()
        if op_hash in ops:  # pyinfra also starts, and skips, operations queued only for other hosts
            reads.last_op = op_hash
        reads.cursor = reads.position.get(op_hash, reads.cursor)


def fact_reads(state_: Any = None) -> FactReads | None:
    """This state's record, or None outside a deploy started by `install` (an operation test's fake state)."""
    for handler in getattr(state if state_ is None else state_, "callback_handlers", ()):
        if isinstance(handler, FactReads):
            return handler
    return None


def install(state_: Any) -> FactReads:
    """Keep fact reads for this pyinfra state (once; deploy.py runs per host)."""
    return fact_reads(state_) or _added(state_, FactReads())


def _added(state_: Any, handler: FactReads) -> FactReads:
    state_.add_callback_handler(handler)
    return handler


def plan(requests: Iterable[Read], op_hash: str | None = None) -> None:
    """Declare reads the current host will make: an operation's (`op_hash`, when it is queued), or reads made
    while the deploy is prepared (none)."""
    record = fact_reads()
    if record is None:
        return
    reads = record.of(host.name)
    if op_hash is not None:
        reads.position[op_hash] = len(reads.planned)
    reads.planned.append(list(requests))


def forget() -> None:
    """The current host just changed: what was read of it may be stale."""
    record = fact_reads()
    if record is not None:
        record.of(host.name).forget()


def read(fact: type[FactBase[T]], **kwargs: Any) -> T:
    """`host.get_fact(fact, **kwargs)`, answered from this host's known facts, fetching the declared facts it
    does not know yet in the same round trip."""
    record = fact_reads()
    if record is None:
        return host.get_fact(fact, **kwargs)
    request = Read(fact, kwargs)
    reads = record.of(host.name)
    if request.key not in reads.known:
        from ironserve.speed.bundle import fetch  # the private pyinfra names: only where a deploy installed reads

        fetch(reads, [request, *reads.ahead()])
    if request.key not in reads.known:
        reads.known[request.key] = host.get_fact(fact, **kwargs)
    return reads.known[request.key]  # type: ignore[no-any-return]


def reading_operation(reads: Callable[..., Iterable[Read]]) -> Callable[[Body], Any]:
    """pyinfra's `@operation()`, and `reads(**the operation's arguments)` declared when it is queued; every
    command the operation runs forgets what was read (a later read in it or after it sees the change).
    With IRONSERVE_PLAIN_PYINFRA=1 (`speed.enabled()` false, asked as each operation is queued), queueing it
    queues `plain`: pyinfra's own operation of the body, nothing declared; its `_inner`, composed into other
    operations, runs the body's commands (its `forget` finds no record: none is installed)."""

    def decorate(body: Body) -> Any:
        signature = inspect.signature(body)

        @wraps(body)
        def changing(*args: Any, **kwargs: Any) -> Generator[Any, None, None]:
            for command in body(*args, **kwargs):
                yield command
                forget()

        queued_op = operation()(changing)
        plain = operation()(body)

        @wraps(queued_op)
        def queued(*args: Any, **kwargs: Any) -> Any:
            if not speed.enabled():
                return plain(*args, **kwargs)
            own = {k: v for k, v in kwargs.items() if k in signature.parameters}
            bound = signature.bind_partial(*args, **own)
            bound.apply_defaults()
            queued_meta = queued_op(*args, **kwargs)
            # pyinfra records each operation's hash on the host as it is queued.
            plan(reads(**bound.arguments), op_hash=host.op_hash_order[-1])
            return queued_meta

        queued.reads = reads  # type: ignore[attr-defined]
        queued.plain = plain  # type: ignore[attr-defined]
        return queued

    return decorate
