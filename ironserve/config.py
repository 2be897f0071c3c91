"""One validated configuration per host, assembled from an ordered registry of roles.

Inventory data stays plain (strings, numbers, lists, dicts) because pyinfra's group data does not
carry objects well. Each role owns the inventory keys prefixed with its name and declares them as a
`RoleSettings` model whose fields carry the defaults and a one-line description (the role's public
API). `build_config` validates one host's data into the registry's stack model; `ConfigError` names
the host, the inventory key and the accepted values, and is raised before any operation is queued.
The core knows no role: the registry (`roles/__init__.py`) is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ironserve.lock import LockViolation, StackLock, check_lock
from ironserve.packages import package_violations
from ironserve.profiles import DEFAULT_PROFILE, Profile, profile_data
from ironserve.reboot import RebootPolicy

# Inventory keys build_config reads itself; every other `ironserve_*` key is a field of StackBase.
STACK_INPUTS = frozenset({"ironserve_profile", "ironserve_lock", "ironserve_roles"})


class RoleSettings(BaseModel):
    """Base of every role's settings: immutable, unknown keys refused, defaults validated like input."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class StackBase(BaseModel):
    """What every host's configuration has besides its roles' settings (declared by the registry's subclass)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str
    profile_name: str = Field(
        DEFAULT_PROFILE,
        alias="ironserve_profile",
        description="The hardware/software profile (ironserve/profiles/<name>.yaml): what the host is and the pinned "
        "set it gets.",
    )
    profile: Profile
    roles: tuple[str, ...] = Field(
        alias="ironserve_roles",
        description='The roles this run applies, a list or "a,b" (kept in deploy order); `ironserve deploy --roles` '
        "sets it for one run.",
        json_schema_extra={"default_shown": "every role"},
    )
    reboot_policy: RebootPolicy = Field(
        "defer",
        alias="ironserve_reboot_policy",
        description="auto: reboot once at the end of the deploy when a role needs it, and prove it; defer: leave "
        "/run/reboot-required with the reasons; never: only report.",
    )
    reboot_timeout_s: int = Field(
        600,
        alias="ironserve_reboot_timeout_s",
        gt=0,
        le=3600,
        description="Seconds to wait for SSH to come back after a reboot under the auto policy.",
    )

    @property
    def lock(self) -> StackLock:
        return self.profile.lock


S = TypeVar("S", bound=StackBase)


@dataclass(frozen=True)
class Role:
    """One role as the registry lists it: its name (the prefix of its keys), settings model and entry point.

    `deploy` is the role's `@deploy`, called as `deploy(config=StackConfig, run=HostRun)` in registry order.
    """

    name: str
    settings: type[RoleSettings]
    deploy: Callable[..., object]
    # Raises ValueError naming the key when the role cannot run with this host's config (a required key unset).
    check_deployable: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class Registry(Generic[S]):
    """The roles of a deploy in order, and the stack model with one field per role named after it."""

    stack: type[S]
    roles: tuple[Role, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)


class ConfigError(Exception):
    """Inventory data that cannot be deployed; the message names host, key and accepted values."""


def _selected_roles(raw: object, names: tuple[str, ...]) -> tuple[str, ...]:
    selected = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(selected, list | tuple) or not selected:
        raise ValueError(f"ironserve_roles: expected a non-empty list of roles; accepted: {', '.join(names)}")
    unknown = [n for n in selected if n not in names]
    if unknown:
        raise ValueError(f"ironserve_roles: unknown role {unknown[0]!r}; accepted: {', '.join(names)}")
    return tuple(n for n in names if n in selected)


def _location(loc: tuple[int | str, ...], sections: Iterable[str]) -> str:
    # Drop the model's section names so the message shows the inventory key the admin wrote.
    parts = [p for p in loc if p not in {"profile", *sections}]
    if not parts:
        return "(inventory)"
    head, *rest = parts
    head = "ironserve_lock" if head == "lock" else head
    return str(head) + "".join(f"[{p!r}]" for p in rest)


def _accepted(error: Mapping[str, Any]) -> str:
    ctx = error.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in error["msg"]:
        return f" (accepted: {ctx['expected']})"
    if "pattern" in ctx and ctx["pattern"] not in error["msg"]:
        return f" (accepted: text matching {ctx['pattern']})"
    return ""


def _describe(host: str, exc: ValidationError, sections: Iterable[str]) -> list[str]:
    return [
        f"host {host}: {_location(tuple(e['loc']), sections)}: {e['msg'].removeprefix('Value error, ')}"
        f" (got {e['input']!r}){_accepted(e)}"
        for e in exc.errors()
    ]


def build_config(host: str, data: Mapping[str, Any], registry: Registry[S]) -> S:
    """Validate one host's inventory data into the registry's stack model (role defaults fill the rest).

    Raises ConfigError listing every problem, and also every broken lock rule.
    """
    given = {k: v for k, v in data.items() if v is not None}
    profile_name = given.get("ironserve_profile", DEFAULT_PROFILE)
    try:
        profile = profile_data(profile_name, given.get("ironserve_lock"))
    except ValueError as exc:
        where = "" if str(exc).startswith("ironserve_lock") else "ironserve_profile: "
        raise ConfigError(f"host {host}: {where}{exc}") from None
    try:
        roles = _selected_roles(given.get("ironserve_roles", registry.names), registry.names)
    except ValueError as exc:
        raise ConfigError(f"host {host}: {exc}") from None
    try:
        config = registry.stack.model_validate(
            {
                "host": host,
                "ironserve_profile": profile_name,
                "profile": profile,
                "ironserve_roles": roles,
                **{k: v for k, v in given.items() if k.startswith("ironserve_") and k not in STACK_INPUTS},
                **{role: {k: v for k, v in given.items() if k.startswith(role + "_")} for role in registry.names},
            }
        )
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(host, exc, registry.names))) from None
    violations = check_lock(config.lock) + package_violations(config.lock, config.profile.packages)
    if violations:
        raise ConfigError("\n".join(lock_messages(host, violations)))
    return config


def check_roles_deployable(config: StackBase, registry: Registry[Any]) -> None:
    """Raise ConfigError when a selected role lacks a key it cannot run without (no built-in default).

    Kept out of build_config so a config can be built and inspected for any role; the deploy and
    `ironserve deploy` call this before any host is touched.
    """
    problems = []
    for role in registry.roles:
        if role.name in config.roles and role.check_deployable is not None:
            try:
                role.check_deployable(config)
            except ValueError as exc:
                problems.append(f"host {config.host}: {exc}")
    if problems:
        raise ConfigError("\n".join(problems))


def lock_messages(host: str, violations: Iterable[LockViolation]) -> list[str]:
    return [f"host {host}: ironserve_lock: rule {v.rule} failed: {v.message}" for v in violations]
