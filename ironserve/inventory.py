"""Site inventories, validated when they are loaded: before pyinfra connects to any host, on every entry point.

A site inventory (`inventory/<site>.py`) builds its groups with `site()`:

    from ironserve.inventory import site

    gpu_servers = site([("r740-01", {...host data...}), ...], {...group data...})

pyinfra executes an inventory file before it connects to anything. The first `site()` call of that
execution loads the whole file again through pyinfra's own loader (`pyinfra_cli.inventory`), with the
arguments pyinfra is loading it with: the `--data` overrides (so `ironserve deploy --roles`), the
working directory's and the file's `group_data/`, `--group-data`. It so sees every host's data exactly
as the deploy will, validates every host (`ironserve.config.validate_host`: every key, every value,
every selected role's required keys) and, on any problem, prints one report listing every host's
problems and exits with status 2: pyinfra never reaches "Connecting". `ironserve validate`, `deploy`
and `verify` load the same way (`load_inventory`) and print the same report.

Relative paths in the data given to `site()` (the keys whose settings field is marked LOCAL_PATH:
nvidia_repo_key, inference_requirements, inference_model_source, bios_credentials_file,
preflight_report_dir) are made absolute against the inventory file's folder, so every entry point reads
the same files from any working directory. Values from `group_data/` files and `--data` are used as
given (relative to the working directory).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from types import FrameType
from typing import Any, NoReturn

import pyinfra
from pyinfra.api.state import State
from pyinfra.context import ctx_state
from pyinfra_cli import inventory as pyinfra_inventory
from pyinfra_cli import util as pyinfra_util
from pyinfra_cli.exceptions import UnexpectedExternalError

from ironserve.config import (
    ConfigError,
    Registry,
    StackBase,
    address_problems,
    build_config,
    host_text,
    local_path_keys,
    message_text,
    shown,
    validate_host,
)
from ironserve.registry import registry as current_registry

HostEntry = str | tuple[str, dict[str, Any]]
Group = tuple[list[HostEntry], dict[str, Any]]

REPORT_TITLE = "invalid inventory, no host was contacted:"
# Set while ironserve loads an inventory itself: the site() calls of that load only build their groups.
_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("ironserve_inventory_loading", default=False)
_CHECKED = "__ironserve_site_checked__"  # in the inventory's namespace: this execution was validated
_checked_files: set[str] = set()


@dataclass(frozen=True)
class InventoryHost:
    name: str
    groups: tuple[str, ...]
    data: dict[str, Any]


def report(problems: Sequence[str]) -> str:
    """The report every entry point prints for an invalid inventory."""
    return "\n".join([REPORT_TITLE, *(f"  {p}" for p in problems)]) + "\n"


def site(hosts: Sequence[HostEntry], data: Mapping[str, Any] | None = None) -> Group:
    """One group of a site inventory: `gpu_servers = site([("r740-01", {...}), "r740-02"], {...group data...})`.

    Returns the `(hosts, data)` group pyinfra reads, relative local paths made absolute against the
    inventory file's folder. The first call while a file is executed validates every host of the whole
    inventory as pyinfra will load it (see the module's docstring) and stops pyinfra with the report
    (exit status 2) before any connection; outside pyinfra's command line it raises ConfigError.
    """
    caller = sys._getframe(1)
    path = caller.f_globals.get("__file__")
    if not isinstance(path, str):
        raise ConfigError("site() builds the groups of an inventory file (inventory/<site>.py)")
    problems = _shape_problems(path, hosts, data)
    if problems:
        _refuse(problems)
    base = Path(os.path.abspath(path)).parent
    keys = local_path_keys(current_registry())
    group: Group = (
        [entry if isinstance(entry, str) else (entry[0], _resolved(entry[1], base, keys)) for entry in hosts],
        _resolved(data or {}, base, keys),
    )
    if not _LOADING.get() and not caller.f_globals.get(_CHECKED):
        caller.f_globals[_CHECKED] = True
        _check_at_load(path, caller)
    return group


def checked_at_load() -> bool:
    """Whether this process validated an inventory while loading it (site()), before any connection."""
    return bool(_checked_files)


def _resolved(data: Mapping[str, Any], base: Path, keys: frozenset[str]) -> dict[str, Any]:
    out = dict(data)
    for key in keys & set(out):
        value = out[key]
        # Relative: joined to the inventory's folder; absolute and `~/...` (the admin's home) as written.
        if isinstance(value, str | PurePath) and str(value)[:1] not in {"", "/", "~"}:
            out[key] = str(base / value)
    return out


def _shape_problems(path: str, hosts: object, data: object) -> list[str]:
    where = f"inventory {os.path.abspath(path)}"
    expected = 'expected "name" or ("name", {data})'
    if not isinstance(hosts, list | tuple):
        return [f"{where}: site(): the hosts are a list of entries, each {expected} (got {shown(hosts)})"]
    problems = []
    for number, entry in enumerate(hosts, 1):
        if isinstance(entry, str):
            continue
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            problems.append(f"{where}: host entry {number}: {expected} (got {shown(entry)})")
        elif not isinstance(entry[1], Mapping):
            problems.append(
                f"host {host_text(entry[0])}: its data is a mapping of inventory key to value (got {shown(entry[1])})"
            )
    if data is not None and not isinstance(data, Mapping):
        problems.append(f"{where}: site(): the group data is a mapping of inventory key to value (got {shown(data)})")
    return problems


def _refuse(problems: Sequence[str]) -> NoReturn:
    """Stop: under pyinfra's command line print the report and exit 2 (nothing connected yet); elsewhere raise."""
    if getattr(pyinfra, "is_cli", False) and not _LOADING.get():
        sys.stderr.write(report(problems))
        sys.stderr.flush()
        raise SystemExit(2)
    raise ConfigError("\n".join(problems))


def _loader_arguments(path: str, frame: FrameType | None) -> tuple[dict[str, Any] | None, str | None, list[str] | None]:
    """The --data overrides, working directory and --group-data folders pyinfra's loader was called with for
    `path` (read from its frame on the stack); outside pyinfra: none, the current directory, none."""
    code = pyinfra_inventory.make_inventory_from_files.__code__
    while frame is not None:
        if frame.f_code is code:
            given = frame.f_locals
            if os.path.abspath(str(given.get("inventory_filename"))) == os.path.abspath(path):
                return given.get("override_data"), given.get("cwd"), given.get("group_data_directories")
        frame = frame.f_back
    return None, os.getcwd(), None


def _check_at_load(path: str, frame: FrameType) -> None:
    override, cwd, group_data = _loader_arguments(path, frame)
    try:
        hosts = load_inventory(path, override, cwd=cwd, group_data=group_data)
    except ConfigError as exc:
        _refuse(str(exc).splitlines())
    _, problems = validate_inventory(hosts, current_registry())
    if problems:
        _refuse(problems)
    _checked_files.add(os.path.abspath(path))


def load_inventory(
    path: str,
    override: Mapping[str, Any] | None = None,
    *,
    cwd: str | None = None,
    group_data: Sequence[str] | None = None,
) -> list[InventoryHost]:
    """The inventory's hosts and data as pyinfra composes them (its loader: host, group, `group_data/` and
    `override` data, override winning like --data), without connecting. ConfigError when it cannot be loaded."""
    path = os.path.abspath(path)
    if not Path(path).is_file():
        raise ConfigError(f"inventory {path}: no such file")
    # pyinfra keeps each file's compiled code by name for the process: read this one as it is now.
    pyinfra_util.PYTHON_CODES.pop(path, None)
    token = _LOADING.set(True)
    try:
        # pyinfra's loader records the file it executes on the current State: give it one (as its CLI does),
        # and the working directory, where pyinfra (and `ironserve deploy`) looks for group_data/ too.
        with ctx_state.use(State()):
            inventory = pyinfra_inventory.make_inventory_from_files(
                path,
                override_data=dict(override or {}),
                cwd=os.getcwd() if cwd is None else cwd,
                group_data_directories=list(group_data or []),
            )
            hosts = [
                InventoryHost(name=host.name, groups=tuple(host.groups), data=dict(host.data.dict()))
                for host in inventory
            ]
    except ConfigError:
        raise
    except UnexpectedExternalError as exc:  # raised by the inventory file (or a group_data file) itself
        if isinstance(exc.exception, ConfigError):
            raise exc.exception from None
        raise ConfigError(f"inventory {path}: {_raised(exc.exception, exc.filename)}") from None
    except Exception as exc:  # pyinfra refusing the groups' shape (TypeError, ValueError...)
        raise ConfigError(
            f"inventory {path}: pyinfra cannot load it: {_raised(exc)}; a group is `name = [hosts]` or "
            '`name = ([hosts], {data})`, a host "name" or ("name", {data}) (site() names the wrong entry)'
        ) from None
    finally:
        _LOADING.reset(token)
    return hosts


def _raised(exc: BaseException, filename: object = None) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if filename is None or f.filename == filename]
    line = f" (line {frames[-1].lineno})" if frames and filename is not None else ""
    return message_text(f"{type(exc).__name__}{line}: {exc}")


def validate_inventory(hosts: list[InventoryHost], registry: Registry[Any]) -> tuple[dict[str, StackBase], list[str]]:
    """Every host's stack config, and every problem of every host (none is touched)."""
    configs: dict[str, StackBase] = {}
    built: dict[str, StackBase] = {}  # every host whose values are valid, deployable or not: the address plan's
    problems: list[str] = []
    for host in hosts:
        try:
            configs[host.name] = validate_host(host.name, host.data, registry)
        except ConfigError as exc:
            problems.extend(str(exc).splitlines())
        with contextlib.suppress(ConfigError):  # its problems are above
            built[host.name] = configs.get(host.name) or build_config(host.name, host.data, registry)
    if not hosts:
        problems.append("the inventory lists no hosts")
    problems += fleet_problems(configs, registry)
    connect_to = {host.name: host.data.get("ssh_hostname") or host.name for host in hosts}
    problems += address_problems(built, connect_to, registry)
    return configs, list(dict.fromkeys(problems))  # a host's own address in its subnet: once, not per check


def fleet_problems(configs: Mapping[str, StackBase], registry: Registry[Any]) -> list[str]:
    """Each role's problems with the valid hosts that run it, taken together (Role.check_fleet)."""
    problems: list[str] = []
    for role in registry.roles:
        if role.check_fleet is not None:
            problems += role.check_fleet({name: c for name, c in configs.items() if role.name in c.roles})
    return problems
