"""One validated configuration per host, assembled from an ordered registry of roles.

Inventory data stays plain (strings, numbers, lists, dicts) because pyinfra's group data does not
carry objects well. Each role owns the inventory keys prefixed with its name and declares them as a
`RoleSettings` model whose fields carry the defaults and a one-line description (the role's public
API). `build_config` validates one host's data into the registry's stack model, `validate_host` also
checks that every selected role can run (its required keys); both raise `ConfigError` and nothing else,
with one line per problem, every problem of the host at once. Each line names the host, the inventory
key, the value given (control and non-ASCII characters escaped, long values cut, secrets redacted) and
what is accepted. The core knows no role: the registry (`roles/__init__.py`) is passed in.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import re
import types
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ironserve.lock import LockViolation, StackLock, check_lock
from ironserve.packages import package_violations
from ironserve.profiles import DEFAULT_PROFILE, Profile, available_profiles, profile_data, read_profile
from ironserve.reboot import RebootPolicy
from ironserve.secrets import MASK, SECRET_KEY, SECRET_PARAMETER, SECRET_SHAPE, redact_text
from ironserve.versions import Version

# Inventory keys build_config reads itself; every other `ironserve_*` key is a field of StackBase.
STACK_INPUTS = frozenset({"ironserve_profile", "ironserve_lock", "ironserve_roles"})

# `json_schema_extra` of a settings field whose value is a path on the admin's machine (a file the deploy
# reads or uploads, a folder it writes reports to): a relative value written in an inventory file is
# resolved against that file's folder (`ironserve.inventory.site`), whatever the working directory.
LOCAL_PATH: dict[str, Any] = {"local_path": True}

# Host-data keys pyinfra's connectors read outside their declared `data_meta` (pyinfra 3.10:
# connectors/chroot.py reads chroot_directory, connectors/dockerssh.py docker_image).
PYINFRA_UNDECLARED_KEYS = frozenset({"chroot_directory", "docker_image"})

SHOWN_MAX = 80  # characters of a value a message shows
MESSAGE_MAX = 600  # characters of a validator's own message (a list of the accepted names fits)


def prefixed(prefix: str) -> Callable[[str], str]:
    """A role settings model's `alias_generator`: its field `mode` is read from the inventory key `<prefix>_mode`.

    Each role names its prefix (the role's name) once, `model_config = ConfigDict(alias_generator=prefixed("bios"))`,
    instead of one `alias=` per field; messages and the accepted-key lists read the generated aliases.
    """

    def alias(name: str) -> str:
        return f"{prefix}_{name}"

    return alias


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes a number and no boolean (int, float, optional or constrained)."""
    if get_origin(annotation) is Annotated:
        return _numeric(get_args(annotation)[0])
    if get_origin(annotation) in {Union, types.UnionType}:
        options = get_args(annotation)
        return bool not in options and any(_numeric(option) for option in options)
    return annotation in {int, float}


def numbers_are_not_booleans(model: type[BaseModel], value: object, info: ValidationInfo) -> object:
    """A field validator: pydantic reads `true` as 1 for a number (`ironserve_reboot_timeout_s: true` would
    wait one second); a boolean given for a number is refused instead."""
    field = model.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and _numeric(field.annotation):
        raise ValueError("a boolean is not a number; accepted: a number such as 600")
    return value


@dataclass(frozen=True)
class Listener:
    """A TCP port a role's software listens on, an entry of the host's port plan."""

    port: int
    key: str  # the inventory key (and path inside it) that sets the port, e.g. inference_service.swap.listen_port
    what: str  # who listens, e.g. "Envoy's listener"
    # The role writes the port into net.ipv4.ip_local_reserved_ports, so an ephemeral range over it is harmless.
    reserved: bool = False


class RoleSettings(BaseModel):
    """Base of every role's settings: immutable, unknown keys refused, defaults validated like input.

    A role's model sets `model_config = ConfigDict(alias_generator=prefixed("<role>"))`, so each field's inventory
    key is `<role>_<field>`. A role whose software listens on the host names its ports in `listeners`, a role that
    sets the kernel's ephemeral port range names it in `ephemeral_ports`: the core checks one port plan per host.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: object, info: ValidationInfo) -> object:
        return numbers_are_not_booleans(cls, value, info)

    def listeners(self) -> tuple[Listener, ...]:
        """The TCP ports this role's software will listen on with these settings."""
        return ()

    def ephemeral_ports(self) -> tuple[str, int, int] | None:
        """(inventory key, LOW, HIGH) of the ephemeral port range this role sets on the host, if it sets one."""
        return None

    def addresses(self) -> tuple[tuple[str, str], ...]:
        """(inventory key, IP address) of the addresses this host answers on that this role's settings name."""
        return ()

    def private_networks(self) -> tuple[tuple[str, str], ...]:
        """(inventory key, CIDR) of the networks this role gives its own software (pods, services): none of the
        fleet's host addresses may fall inside one."""
        return ()

    def secret_variables(self) -> dict[str, tuple[str | None, str]]:
        """The deploy machine's environment variables this role reads a secret from: variable -> (the inventory key
        naming it, None for a fixed name; what it holds)."""
        return {}


class StackBase(BaseModel):
    """What every host's configuration has besides its roles' settings (declared by the registry's subclass).

    Its aliases stay written out, unlike the roles': the model also holds fields that are no inventory key (`host`,
    `profile`, the registry subclass's one field per role, set by build_config under their own names), and
    `profile_name` is read from `ironserve_profile`, not `ironserve_profile_name`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: object, info: ValidationInfo) -> object:
        return numbers_are_not_booleans(cls, value, info)

    host: str
    profile_name: str = Field(
        DEFAULT_PROFILE,
        alias="ironserve_profile",
        description="The hardware/software profile (ironserve/profiles/<name>.yaml): what the host is and the pinned "
        "set it gets.",
    )
    profile: Profile
    os: str | None = Field(
        None,
        alias="ironserve_os",
        pattern=r"^[a-z]+[0-9]+$",
        description="The host's OS as /etc/os-release names it (`ubuntu2204`, `debian12`). Declared, an OS the "
        "profile's lock is not published for is refused before any host is contacted; a host whose own OS differs "
        "stops before any package moves. None: checked on the host only.",
    )
    roles: tuple[str, ...] = Field(
        alias="ironserve_roles",
        description='The roles this run applies, a list or "a,b" (kept in deploy order); `ironserve deploy --roles` '
        "sets it for one run.",
        json_schema_extra={"default_shown": "every role but the opt-in kubernetes"},
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
    clear_immutable: bool = Field(
        False,
        alias="ironserve_clear_immutable",
        description="Let the deploy clear an immutable flag (chattr +i) on a path a role owns, restore the path and "
        "set the flag again; by default an immutable path stops that host with this key's name.",
    )

    @property
    def lock(self) -> StackLock:
        return self.profile.lock

    @model_validator(mode="after")
    def _os_supported(self) -> StackBase:
        if self.os is not None:
            self.profile.repository_for(self.os)  # ValueError naming the OS, the profile and the supported ones
        return self


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
    # The problems of the hosts that run this role taken together ({host: config}, inventory order), one line
    # each: a layout the role cannot build from them (a worker with no control plane to join).
    check_fleet: Callable[[Mapping[str, Any]], list[str]] | None = None
    # Runs only where ironserve_roles names it (a layer a site adds, such as Kubernetes on a single server).
    opt_in: bool = False
    # The facts the role reads while it is queued (ironserve.speed.reads.Read), fetched with the deploy's first facts.
    queue_reads: Callable[[Any], list[Any]] | None = None
    # How `ironserve rollout` moves this host's traffic off and back (ironserve.traffic.TrafficControl), given the
    # host's name, the fleet's configs ({host: config}, inventory order) and the rollout's drain bound in seconds
    # (None: the role's own setting); None: no traffic here.
    traffic: Callable[[str, Mapping[str, Any], float | None], Any] | None = None


@dataclass(frozen=True)
class Registry(Generic[S]):
    """The roles of a deploy in order, and the stack model with one field per role named after it."""

    stack: type[S]
    roles: tuple[Role, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)

    @property
    def default_names(self) -> tuple[str, ...]:
        """The roles a host runs when its inventory names none: every role but the opt-in ones."""
        return tuple(role.name for role in self.roles if not role.opt_in)


class ConfigError(Exception):
    """Inventory data that cannot be deployed; one line per problem, each naming host, key and accepted values."""


# --- how a message shows what was given ------------------------------------------------------------------


def visible(text: str) -> str:
    """`text` with every character outside printable ASCII escaped (`\\x00`, `\\r`, `\\u0430`)."""
    return "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text)


def cut(text: str, limit: int = SHOWN_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_secret(path: Iterable[object]) -> bool:
    return any(isinstance(p, str) and SECRET_KEY.search(p) for p in path)


def _may_carry_credentials(word: str) -> bool:
    # `scheme://user:pw@host`, `user:pw@host`, `https://token@host` (also with look-alike characters), a
    # `?token=` query: not `ai-service@blue.service` or `root@host`, which name no secret.
    plain = unicodedata.normalize("NFKC", word)
    return bool(re.search(r":\S*@[^\s)\]'\"]", plain) or re.search(r"[?&;]\S*=", plain))


def redacted_text(text: str) -> str:
    """`text` with every value shaped like a credential and the credentials of every URL replaced by `***`
    (ironserve.secrets.redact_text, its URL rules applied to the words that can carry one)."""
    text = SECRET_SHAPE.sub(MASK, text)
    return re.sub(r"\S+", lambda m: redact_text(m.group()) if _may_carry_credentials(m.group()) else m.group(), text)


def redacted(value: object, key: object = None) -> object:
    """`value` of inventory key `key` with every secret replaced by `***`: the whole value of a key named like
    a password/token/secret/credential, the credentials of URLs, in nested mappings and lists too."""
    if isinstance(key, str) and SECRET_KEY.search(key):
        return MASK
    if isinstance(value, str):
        return redacted_text(value)
    if isinstance(value, Mapping):
        return {k: redacted(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [redacted(v, key) for v in value]
    return value


def shown(value: object, path: tuple[object, ...] = ()) -> str:
    """`value` as a message shows it: secrets redacted (a key named like a password/token/secret/credential
    anywhere in `path`, a URL's userinfo), control and non-ASCII characters escaped, cut to SHOWN_MAX."""
    if _is_secret(path):
        return MASK
    return cut(ascii(redacted(value)))


def _shown_unknown(value: object, path: tuple[object, ...]) -> str:
    """The value of an unknown key: `***` when the key is named like a credential (`inference_api_key`,
    `access_token`): nothing says what it holds, so it is taken to hold one."""
    key = path[-1] if path else None
    if isinstance(key, str) and (SECRET_PARAMETER.search(key) or re.search(r"(^|[_.-])keys?$", key, re.IGNORECASE)):
        return MASK
    return shown(value, path)


def key_text(key: object) -> str:
    """An inventory key as a message names it: as written when it is a plain name, else escaped and quoted."""
    return key if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", key) else ascii(key)


def _leaves(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list | tuple | set | frozenset):
        return [leaf for v in value for leaf in _leaves(v)]
    return [str(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


def message_text(text: str, value: object = None, path: tuple[object, ...] = ()) -> str:
    """A validator's message as a line shows it: the secret value (if `path` names a secret) and URL
    credentials redacted, control and non-ASCII characters escaped, a long word (a value it quotes) cut
    to SHOWN_MAX and the whole to MESSAGE_MAX."""
    if _is_secret(path):
        for leaf in sorted(_leaves(value), key=len, reverse=True):
            if len(leaf) >= 3:
                text = text.replace(leaf, MASK)
    text = re.sub(rf"\S{{{SHOWN_MAX + 1},}}", lambda m: cut(m.group()), visible(redacted_text(text)))
    return cut(text, MESSAGE_MAX)


def host_text(host: object) -> str:
    return host if isinstance(host, str) and re.fullmatch(r"[!-~]+", host) else ascii(host)


def closest(key: str, candidates: Iterable[str]) -> list[str]:
    """The accepted keys `key` most likely means: same letters in another case, the key with its prefix
    (`profile` for `ironserve_profile`), then the nearest spellings (difflib)."""
    pool = sorted(set(candidates))
    folded = [c for c in pool if c.lower() == key.lower()]
    if folded:
        return folded
    suffixed = [c for c in pool if len(key) >= 4 and c.endswith("_" + key.lower())]
    if suffixed:
        return suffixed[:3]
    scored = sorted(((difflib.SequenceMatcher(None, key.lower(), c).ratio(), c) for c in pool), reverse=True)
    near = [(score, c) for score, c in scored if score >= 0.8]
    return [c for score, c in near[:3] if score >= near[0][0] - 0.03]


def _did_you_mean(key: str, candidates: Iterable[str]) -> str:
    hint = closest(key, candidates)
    return f"; did you mean {' or '.join(hint)}?" if hint else ""


# --- which keys exist ---------------------------------------------------------------------------------


@functools.cache
def pyinfra_keys() -> frozenset[str]:
    """Host-data keys pyinfra itself reads, from pyinfra: its operations' global arguments (`_sudo`, `_su_user`,
    `_env`, ...: host data sets their defaults) and every installed connector's declared data keys (`ssh_*`,
    `docker_*`, ...), plus the few a connector reads undeclared (PYINFRA_UNDECLARED_KEYS)."""
    from pyinfra.api.arguments import all_global_arguments

    keys = {name for name, _ in all_global_arguments() if name.startswith("_")}
    for entry in entry_points(group="pyinfra.connectors"):  # as pyinfra.api.connectors finds them
        try:
            keys |= set(getattr(entry.load(), "data_meta", {}))
        except Exception:  # a connector plugin that cannot load cannot be used either
            continue
    return frozenset(keys | PYINFRA_UNDECLARED_KEYS)


def _alias(name: str, field: Any) -> str:
    return str(field.alias or name)


def stack_keys(registry: Registry[Any]) -> frozenset[str]:
    """The `ironserve_*` keys: build_config's own inputs and the stack model's aliased fields."""
    return STACK_INPUTS | {f.alias for f in registry.stack.model_fields.values() if f.alias}


def role_keys(role: Role) -> frozenset[str]:
    return frozenset(_alias(name, f) for name, f in role.settings.model_fields.items())


def accepted_keys(registry: Registry[Any]) -> frozenset[str]:
    """Every key an inventory may set: ironserve's, each role's, and pyinfra's own."""
    return stack_keys(registry).union(*(role_keys(r) for r in registry.roles)) | pyinfra_keys()


def local_path_keys(registry: Registry[Any]) -> frozenset[str]:
    """The keys whose value is a path on the admin's machine (fields marked with LOCAL_PATH)."""
    return frozenset(
        _alias(name, field)
        for role in registry.roles
        for name, field in role.settings.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("local_path") is True
    )


def _model_at(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model that validates the value at `loc` inside `model` (best effort, for suggestions)."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if part in {n, f.alias}), None)
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in {Union, types.UnionType}:
        return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)
    return None


# --- one host's problems ----------------------------------------------------------------------------------


def _where(loc: tuple[int | str, ...], empty: str = "(inventory)") -> str:
    if not loc:
        return empty
    head, *rest = loc
    return key_text(head) + "".join(f"[{ascii(p) if isinstance(p, str) else p}]" for p in rest)


def _accepted(error: Mapping[str, Any]) -> str:
    ctx = error.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in error["msg"]:
        return f" (accepted: {visible(str(ctx['expected']))})"
    if "pattern" in ctx and ctx["pattern"] not in error["msg"]:
        return f" (accepted: text matching {visible(str(ctx['pattern']))})"
    return ""


def _lines(
    host: str,
    exc: ValidationError,
    model: type[BaseModel],
    rename: Mapping[str, str] | None = None,
    empty: str = "(inventory)",
) -> list[str]:
    """One line per pydantic error, the location written as the inventory key (`rename` maps a model
    field to the key that sets it, e.g. the profile's `lock` to `ironserve_lock`)."""
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        shown_loc = (rename.get(str(loc[0]), loc[0]), *loc[1:]) if rename and loc else loc
        given = error["input"]
        if error["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            fields = sorted(_alias(n, f) for n, f in parent.model_fields.items()) if parent else []
            hint = _did_you_mean(str(loc[-1]), fields)
            accepted = f" (accepted: {', '.join(fields)})" if fields else ""
            lines.append(
                f"host {host}: {_where(shown_loc)}: unknown key (got {_shown_unknown(given, loc)}){hint}{accepted}"
            )
            continue
        # A validator reports each of a value's problems on a line of its own.
        for problem in str(error["msg"]).removeprefix("Value error, ").split("\n"):
            msg = message_text(problem, given, loc)
            lines.append(f"host {host}: {_where(shown_loc, empty)}: {msg} (got {shown(given, loc)}){_accepted(error)}")
    return lines


def _failure(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return visible(exc.strerror)
    return message_text(f"{type(exc).__name__}: {exc}")


@dataclass
class _Section:
    settings: BaseModel | None  # validated, or a stand-in (defaults for what failed) for the deploy checks
    problems: list[str]
    dropped: set[str]  # keys that failed: left out of the stand-in, so checks do not repeat them


def _section(host: str, model: type[BaseModel], raw: dict[str, Any], prefix: str) -> _Section:
    """Validate one role's keys; a validator that raises anything but ValueError is named by its key."""
    problems: list[str] = []
    dropped: set[str] = set()
    try:
        return _Section(model.model_validate(raw), [], set())
    except ValidationError as exc:
        problems = _lines(host, exc, model, empty=f"{prefix}*")
        heads = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        dropped = heads & set(raw) if all(e["loc"] for e in exc.errors()) else set(raw)
    except Exception as exc:  # a validator's OSError, TypeError...: find the key it came from
        for key, value in raw.items():
            try:
                model.model_validate({key: value})
            except ValidationError:
                continue
            except Exception as one:
                problems.append(
                    f"host {host}: {key_text(key)}: cannot be checked: {_failure(one)} (got {shown(value, (key,))})"
                )
                dropped.add(key)
        if not dropped:
            problems.append(f"host {host}: {prefix}*: cannot be checked: {_failure(exc)}")
            dropped = set(raw)
        rest = _section(host, model, {k: v for k, v in raw.items() if k not in dropped}, prefix)
        problems += rest.problems
        dropped |= rest.dropped
    try:
        stand_in: BaseModel | None = model.model_validate({k: v for k, v in raw.items() if k not in dropped})
    except Exception:
        try:
            stand_in, dropped = model.model_validate({}), set(raw)
        except Exception:
            stand_in = None
    return _Section(stand_in, problems, dropped)


def _selected_roles(host: str, raw: object, names: tuple[str, ...]) -> tuple[tuple[str, ...] | None, list[str]]:
    accepted = f"accepted: {', '.join(names)}"
    selected = [part.strip() for part in raw.split(",")] if isinstance(raw, str) else raw
    if not isinstance(selected, list | tuple) or not selected:
        return None, [
            f'host {host}: ironserve_roles: expected a non-empty list of roles or "a,b" (got {shown(raw)}); {accepted}'
        ]
    problems = []
    for i, name in enumerate(selected):
        where = "ironserve_roles" if isinstance(raw, str) else f"ironserve_roles[{i}]"
        if not isinstance(name, str):
            problems.append(f"host {host}: {where}: a role is named by text (got {shown(name)}); {accepted}")
        elif name not in names:
            hint = _did_you_mean(name, names)
            problems.append(f"host {host}: {where}: unknown role {shown(name)}{hint} ({accepted})")
    return (None if problems else tuple(n for n in names if n in selected)), problems


def _nul_path(value: object, path: tuple[int | str, ...] = ()) -> tuple[int | str, ...] | None:
    """Where a NUL character is inside `value` (strings, and keys and values of mappings and lists)."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str) and "\x00" in k:
                return (*path, k)
            found = _nul_path(v, (*path, k if isinstance(k, int | str) else repr(k)))
            if found is not None:
                return found
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _nul_path(v, (*path, i))
            if found is not None:
                return found
    return None


def _host_name_problems(host: str, data: Mapping[str, Any]) -> list[str]:
    name = host_text(host)
    problems = []
    if not isinstance(host, str) or not re.fullmatch(r"[!-~]+", host):
        problems.append(
            f"host {name}: the host name is not plain ASCII without spaces (got {shown(host)}); a look-alike letter "
            "connects elsewhere. Accepted: ASCII letters, digits and . - _ @ : / [ ]"
        )
    hostname = data.get("ssh_hostname")
    if hostname is not None and not (isinstance(hostname, str) and re.fullmatch(r"[!-~]+", hostname)):
        problems.append(
            f"host {name}: ssh_hostname: not a plain ASCII host name or address (got {shown(hostname)}); "
            "accepted: ASCII letters, digits and . - : [ ]"
        )
    return problems


def _unknown(host: str, key: str, value: object, registry: Registry[Any]) -> str:
    start = f"host {host}: {key_text(key)}: unknown key (got {_shown_unknown(value, (key,))})"
    hint = _did_you_mean(key, accepted_keys(registry))
    owners = [("ironserve", stack_keys(registry), "README.md")]
    owners += [(r.name, role_keys(r), f"roles/{r.name}/README.md") for r in registry.roles]
    owner = next((o for o in owners if key.startswith(o[0] + "_")), None)
    if owner is not None:  # a misspelt key of ironserve or a role: name its keys
        _, keys, readme = owner
        listed = ", ".join(sorted(keys)) if len(keys) <= 10 else f"the keys in {readme}"
        return f"{start}{hint} (accepted: {listed})"
    if hint:
        return start + hint
    prefixes = ", ".join(f"{name}_*" for name in registry.names)
    return (
        f"{start}; accepted: ironserve_* (README.md), the roles' {prefixes} (roles/<role>/README.md) and "
        "pyinfra's host keys (ssh_*, _sudo, _env, ...)"
    )


def _profile(host: str, given: Mapping[str, Any]) -> tuple[Profile | None, list[str]]:
    name = given.get("ironserve_profile", DEFAULT_PROFILE)
    overrides = given.get("ironserve_lock")
    profiles = available_profiles()
    if not isinstance(name, str) or name not in profiles:
        hint = _did_you_mean(name, profiles) if isinstance(name, str) else ""
        return None, [
            f"host {host}: ironserve_profile: unknown profile {shown(name)} (accepted: {', '.join(profiles)}){hint}"
        ]
    if overrides is not None and not isinstance(overrides, Mapping):
        return None, [
            f"host {host}: ironserve_lock: expected a mapping of lock component to value such as "
            f"{{'driver': '525.85.12'}} (got {shown(overrides, ('ironserve_lock',))})"
        ]
    try:
        profile = Profile.model_validate(profile_data(name, overrides))
    except ValidationError as exc:
        return None, _lines(host, exc, Profile, {"lock": "ironserve_lock"})
    except Exception as exc:
        return None, [f"host {host}: ironserve_lock: cannot be checked: {_failure(exc)} (got {shown(overrides)})"]
    return profile, _lock_problems(host, profile)


def _lock_problems(host: str, profile: Profile) -> list[str]:
    lock = profile.lock
    if len(Version(lock.cuda).parts) < 2:  # the rules compare CUDA lines (major.minor)
        return [
            f"host {host}: ironserve_lock['cuda']: expected a CUDA version major.minor[.patch] such as 11.8.0 "
            f"(got {shown(lock.cuda)})"
        ]
    try:
        violations = check_lock(lock) + package_violations(lock, profile.packages)
    except Exception as exc:
        return [f"host {host}: ironserve_lock: the lock rules cannot be checked: {_failure(exc)}"]
    return lock_messages(host, violations)


@dataclass
class _Assessment:
    config: Any  # the validated config; after problems, a stand-in for the deploy checks (or None)
    problems: list[str]
    skipped: set[str]  # roles whose deploy checks would only repeat a problem already found
    dropped: set[str]  # keys that failed


def _assess(host: str, data: Mapping[str, Any], registry: Registry[Any]) -> _Assessment:
    name = host_text(host)
    problems = _host_name_problems(host, data)
    given: dict[str, Any] = {}
    known = stack_keys(registry).union(*(role_keys(r) for r in registry.roles))
    pyinfra = pyinfra_keys()
    for key, value in data.items():
        if value is None:  # unset: the default applies
            continue
        if not isinstance(key, str):
            problems.append(
                f"host {name}: {key_text(key)}: an inventory key is text such as ironserve_profile "
                f"(got the {type(key).__name__} {shown(key)})"
            )
        elif key in pyinfra:
            continue  # pyinfra's own (connection, sudo...): pyinfra reads and checks it
        elif key not in known:
            problems.append(_unknown(name, key, value, registry))
        elif (nul := _nul_path(value)) is not None:
            problems.append(
                f"host {name}: {_where((key, *nul))}: contains a NUL character, which no value may hold "
                f"(got {shown(value, (key,))})"
            )
        else:
            given[key] = value
    dropped = {
        k for k, v in data.items() if isinstance(k, str) and v is not None and k not in given and k not in pyinfra
    }

    profile, profile_problems = _profile(name, given)
    problems += profile_problems
    if profile is None:
        dropped |= {"ironserve_profile", "ironserve_lock"} & set(given)
    roles, roles_problems = _selected_roles(name, given.get("ironserve_roles", registry.default_names), registry.names)
    problems += roles_problems
    skipped: set[str] = set() if roles is not None else set(registry.names)

    sections: dict[str, BaseModel | None] = {}
    for role in registry.roles:
        keys = role_keys(role)
        raw = {k: v for k, v in given.items() if k in keys}
        section = _section(name, role.settings, raw, role.name + "_")
        problems += section.problems
        dropped |= section.dropped
        sections[role.name] = section.settings
        if section.settings is None:
            skipped.add(role.name)

    top = {k: v for k, v in given.items() if k in stack_keys(registry) - STACK_INPUTS}
    config = None
    if all(s is not None for s in sections.values()):
        stand_in_profile = profile or read_profile(DEFAULT_PROFILE)
        base = {
            "host": host,
            "ironserve_profile": stand_in_profile.name,
            "profile": stand_in_profile,
            "ironserve_roles": roles or registry.default_names,
            **sections,
        }
        stack = _section(name, registry.stack, {**base, **top}, "ironserve_")
        problems += stack.problems
        dropped |= stack.dropped - set(base)
        config = stack.settings if set(base).isdisjoint(stack.dropped) else None
        if isinstance(config, StackBase):
            problems += _port_plan_problems(host, config, registry) + _secret_variable_problems(host, config, registry)
    return _Assessment(config, problems, skipped, dropped)


def _port_plan_problems(host: str, config: StackBase, registry: Registry[Any]) -> list[str]:
    """One port plan per host: every selected role's listeners, each port claimed once, none inside an ephemeral
    range unless its role reserves it (the kernel hands ephemeral ports to outgoing connections, which can take a
    listener's port before it binds)."""
    selected = [getattr(config, role.name) for role in registry.roles if role.name in config.roles]
    listeners = [listener for settings in selected for listener in settings.listeners()]
    problems = []
    by_port: dict[int, list[Listener]] = {}
    for listener in listeners:
        by_port.setdefault(listener.port, []).append(listener)
    for port, claims in sorted(by_port.items()):
        if len(claims) > 1:
            first, *others = claims
            also = " and ".join(f"{o.what} ({o.key})" for o in others)
            problems.append(
                f"host {host_text(config.host)}: {first.key}: port {port} of {first.what} is also the port of {also}; "
                "accepted: one port per listener on a host"
            )
    for settings in selected:
        ephemeral = settings.ephemeral_ports()
        if ephemeral is None:
            continue
        key, low, high = ephemeral
        inside = [x for x in listeners if low <= x.port <= high and not x.reserved]
        for listener in sorted(inside, key=lambda x: x.port):
            problems.append(
                f"host {host_text(config.host)}: {key}: the ephemeral range {low}-{high} contains port "
                f"{listener.port} of {listener.key} ({listener.what}), which nothing reserves: an outgoing connection "
                f"can take it before the listener binds; accepted: a range apart from the host's listeners, such as "
                "the kernel's default 32768-60999"
            )
    return problems


def _secret_variable_problems(host: str, config: StackBase, registry: Registry[Any]) -> list[str]:
    """A variable read for one secret may not be the one another secret is read from: the first role would carry
    the second's secret where it goes (a cluster Secret, a request)."""
    readers: dict[str, list[tuple[str | None, str]]] = {}
    for role in registry.roles:
        for variable, reader in getattr(config, role.name).secret_variables().items():
            readers.setdefault(variable, []).append(reader)
    problems = []
    for variable, found in sorted(readers.items()):
        if len(found) < 2:
            continue
        named = [key for key, _ in found if key is not None]
        problems.append(
            f"host {host_text(config.host)}: {named[0] if named else '(environment)'}: {variable} is where "
            f"{' and also '.join(what for _, what in found)} are read from; accepted: a variable of its own for each "
            "secret"
        )
    return problems


def _ip(value: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(value).strip("[]"))
    except ValueError:
        return None


def address_problems(
    configs: Mapping[str, StackBase], connect_to: Mapping[str, object], registry: Registry[Any]
) -> list[str]:
    """A host's address inside a network a role gives its own software (a pod or service subnet) is routed to pods
    instead of the host, on every node. The addresses are every host's: the ones roles name and the address the
    deploy connects to (`connect_to`: ssh_hostname, else the host name), where it is an IP literal."""
    addresses: list[tuple[str, str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    for name, config in configs.items():
        given = [("ssh_hostname", connect_to.get(name))]
        for role in registry.roles:
            if role.name in config.roles:
                given += list(getattr(config, role.name).addresses())
        addresses += [
            (name, key, ip) for key, value in given if (ip := _ip(value)) is not None and not ip.is_unspecified
        ]
    problems = []
    for name, config in configs.items():
        for role in registry.roles:
            if role.name not in config.roles:
                continue
            for key, cidr in getattr(config, role.name).private_networks():
                network = ipaddress.ip_network(cidr, strict=False)
                for other, where, ip in addresses:
                    if ip.version == network.version and ip in network:
                        problems.append(
                            f"host {host_text(name)}: {key}: {cidr} contains {ip}, host {host_text(other)}'s {where}: "
                            "traffic to that host would be routed to pods; accepted: a network apart from every "
                            "host's addresses"
                        )
    return problems


def build_config(host: str, data: Mapping[str, Any], registry: Registry[S]) -> S:
    """Validate one host's inventory data into the registry's stack model (role defaults fill the rest).

    Raises ConfigError listing every problem (unknown keys, every section's values, the lock rules).
    """
    assessment = _guarded(host, lambda: _assess(host, data, registry))
    if assessment.problems:
        raise ConfigError("\n".join(assessment.problems))
    config: S = assessment.config
    return config


def validate_host(host: str, data: Mapping[str, Any], registry: Registry[S]) -> S:
    """build_config, and every selected role's required keys (check_deployable): all problems in one ConfigError."""
    assessment = _guarded(host, lambda: _assess(host, data, registry))
    problems = list(assessment.problems)
    if isinstance(assessment.config, StackBase):
        problems += address_problems({host: assessment.config}, {host: data.get("ssh_hostname") or host}, registry)
    if assessment.config is not None:
        keys = stack_keys(registry).union(*(role_keys(r) for r in registry.roles))
        for line in _deploy_problems(assessment.config, registry, assessment.skipped):
            # A check that names only keys already refused would repeat them ("... must be set").
            named = {key for key in keys if re.search(rf"\b{re.escape(key)}\b", line)}
            if not named or not named <= assessment.dropped:
                problems.append(line)
    if problems:
        raise ConfigError("\n".join(problems))
    config: S = assessment.config
    return config


def _guarded(host: str, assess: Callable[[], _Assessment]) -> _Assessment:
    try:
        return assess()
    except ConfigError:
        raise
    except Exception as exc:  # a bug of ours, not the admin's: still a message, never a traceback
        raise ConfigError(f"host {host_text(host)}: the inventory data cannot be checked: {_failure(exc)}") from None


def _deploy_problems(config: StackBase, registry: Registry[Any], skipped: Iterable[str] = ()) -> list[str]:
    problems = []
    for role in registry.roles:
        if role.name in config.roles and role.check_deployable is not None and role.name not in set(skipped):
            try:
                role.check_deployable(config)
            except ValueError as exc:
                problems += [f"host {host_text(config.host)}: {message_text(line)}" for line in str(exc).split("\n")]
            except Exception as exc:
                problems.append(f"host {host_text(config.host)}: {role.name}: cannot be checked: {_failure(exc)}")
    return problems


def check_roles_deployable(config: StackBase, registry: Registry[Any]) -> None:
    """Raise ConfigError when a selected role lacks a key it cannot run without (no built-in default).

    Kept out of build_config so a config can be built and inspected for any role; validate_host runs
    both, reporting every problem at once.
    """
    problems = _deploy_problems(config, registry)
    if problems:
        raise ConfigError("\n".join(problems))


def lock_messages(host: str, violations: Iterable[LockViolation]) -> list[str]:
    return [f"host {host}: ironserve_lock: rule {v.rule} failed: {v.message}" for v in violations]
