"""containerd's /etc/containerd/config.toml (version 2): rendered from the typed config, checked by schema.

`containerd config dump` accepts unknown keys and wrong option types silently (a misspelt
`SystemdCgrup = true` leaves the cgroupfs driver in place), so ironserve checks the file itself:
`check_config` parses it with tomllib and validates it against the models below, which refuse
any key they do not know. The models cover what ironserve renders; extend them with the template.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from roles.container_runtime.settings import CGROUP_DRIVER, REGISTRY_CONFIG_PATH, SOCKET, ContainerRuntimeSettings

CRI = "io.containerd.grpc.v1.cri"
DEVMAPPER = "io.containerd.snapshotter.v1.devmapper"
RUNC_V2 = "io.containerd.runc.v2"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class RuntimeOptions(_Strict):
    SystemdCgroup: bool
    BinaryName: str | None = None


class Runtime(_Strict):
    runtime_type: Literal["io.containerd.runc.v2"]
    options: RuntimeOptions


class CriContainerd(_Strict):
    snapshotter: Literal["overlayfs", "devmapper"]
    default_runtime_name: str
    runtimes: dict[str, Runtime]


class CriCni(_Strict):
    bin_dir: str
    conf_dir: str


class CriRegistry(_Strict):
    config_path: str


class CriPlugin(_Strict):
    sandbox_image: str
    containerd: CriContainerd
    cni: CriCni
    registry: CriRegistry


class DevmapperPlugin(_Strict):
    pool_name: str
    root_path: str
    base_image_size: str


class Plugins(_Strict):
    cri: CriPlugin = Field(alias=CRI)
    devmapper: DevmapperPlugin | None = Field(default=None, alias=DEVMAPPER)


class Grpc(_Strict):
    address: str


class ContainerdConfig(_Strict):
    version: Literal[2]
    root: str
    state: str
    grpc: Grpc
    plugins: Plugins


class ContainerdConfigError(ValueError):
    """The file is not a containerd config ironserve can vouch for; the message names each key."""


def config_data(settings: ContainerRuntimeSettings) -> dict[str, Any]:
    def runtime(binary: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {"SystemdCgroup": CGROUP_DRIVER == "systemd"}
        if binary:
            options["BinaryName"] = binary
        return {"runtime_type": RUNC_V2, "options": options}

    plugins: dict[str, Any] = {
        CRI: {
            "sandbox_image": settings.sandbox_image,
            "containerd": {
                "snapshotter": settings.snapshotter,
                "default_runtime_name": settings.default_runtime,
                "runtimes": {"runc": runtime(None), "nvidia": runtime(settings.nvidia_binary)},
            },
            "cni": {"bin_dir": settings.cni_bin_dir, "conf_dir": settings.cni_conf_dir},
            "registry": {"config_path": REGISTRY_CONFIG_PATH},
        }
    }
    if settings.snapshotter == "devmapper":
        plugins[DEVMAPPER] = {
            "pool_name": settings.devmapper_pool_name,
            "root_path": settings.devmapper_root_path,
            "base_image_size": settings.devmapper_base_image_size,
        }
    return {
        "version": 2,
        "root": "/var/lib/containerd",
        "state": "/run/containerd",
        "grpc": {"address": SOCKET},
        "plugins": plugins,
    }


def _key(key: str) -> str:
    return key if key.replace("_", "").isalnum() else '"' + key + '"'


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(data: Mapping[str, Any], path: tuple[str, ...] = ()) -> str:
    """TOML text of nested tables of scalars (all containerd's config needs), tables after their keys."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    text = ""
    if path and (lines or not any(isinstance(v, Mapping) for v in data.values())):
        text += "\n[" + ".".join(_key(p) for p in path) + "]\n"
    text += "".join(line + "\n" for line in lines)
    for key, value in data.items():
        if isinstance(value, Mapping):
            text += to_toml(value, (*path, key))
    return text


def check_config(text: str) -> ContainerdConfig:
    """Parse and validate config.toml text; ContainerdConfigError names every unknown or mistyped key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContainerdConfigError(f"not TOML: {exc}") from None
    try:
        return ContainerdConfig.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ContainerdConfigError("; ".join(problems)) from None


def render_config(settings: ContainerRuntimeSettings) -> str:
    """config.toml for `settings`, checked by the schema before it can be shipped."""
    text = "# Managed by ironserve (roles/container_runtime); checked against ironserve's schema.\n" + to_toml(
        config_data(settings)
    )
    check_config(text)
    return text


def hosts_toml(registry: str, mirror: str) -> str:
    """containerd's hosts.toml for `registry`: pulls go to `mirror` first, then the registry itself
    (containerd docs/hosts.md); docker.io's upstream is registry-1.docker.io."""
    upstream = "https://registry-1.docker.io" if registry == "docker.io" else f"https://{registry}"
    return (
        "# Managed by ironserve (roles/container_runtime): pull through the site's mirror.\n"
        f"server = {_value(upstream)}\n\n"
        f"[host.{_value(mirror)}]\n"
        '  capabilities = ["pull", "resolve"]\n'
    )


# --- /etc/nvidia-container-runtime/config.toml (NVIDIA container toolkit) -------------------------------------

NVIDIA_CLI_SECTION = "nvidia-container-cli"
_TABLE = re.compile(r"^\s*\[")
_CLI_TABLE = re.compile(r"^\s*\[\s*nvidia-container-cli\s*\]\s*(#.*)?$")
_NO_CGROUPS = re.compile(r"^\s*no-cgroups\s*=")
_NO_CGROUPS_COMMENTED = re.compile(r"^\s*#\s*no-cgroups\s*=")


def nvidia_cli_no_cgroups(text: str) -> object:
    """`no-cgroups` under [nvidia-container-cli] as TOML reads it (None when unset); raises on invalid TOML."""
    try:
        return tomllib.loads(text).get(NVIDIA_CLI_SECTION, {}).get("no-cgroups")
    except tomllib.TOMLDecodeError as exc:
        raise ContainerdConfigError(f"not valid TOML: {exc}") from exc


def nvidia_cli_keeps_cgroups(text: str) -> str:
    """`text` with `no-cgroups = false` under [nvidia-container-cli] (cri-nvidia-container-cli-cgroups).

    Unchanged when TOML already reads false. Otherwise the key's line in that table is replaced, or the
    toolkit's commented default (`#no-cgroups = false`) is uncommented in place, or the key is added under
    the table header (the table added when absent); every other line stays as the package shipped it.
    """
    if nvidia_cli_no_cgroups(text) is False:
        return text
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _CLI_TABLE.match(line)), None)
    if start is None:
        lines += ["", f"[{NVIDIA_CLI_SECTION}]", "no-cgroups = false"]
    else:
        end = next((i for i in range(start + 1, len(lines)) if _TABLE.match(lines[i])), len(lines))
        body = range(start + 1, end)
        active = [i for i in body if _NO_CGROUPS.match(lines[i])]
        commented = [i for i in body if _NO_CGROUPS_COMMENTED.match(lines[i])]
        found = active or commented
        target = found[0] if found else None
        if target is None:
            lines.insert(start + 1, "no-cgroups = false")
        else:
            lines[target] = "no-cgroups = false"
            lines = [line for i, line in enumerate(lines) if i not in active[1:]]  # a duplicate key is invalid TOML
    edited = "\n".join(lines) + "\n"
    if nvidia_cli_no_cgroups(edited) is not False:
        raise ContainerdConfigError(f"could not set no-cgroups = false under [{NVIDIA_CLI_SECTION}]")
    return edited
