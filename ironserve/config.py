"""The whole stack's configuration as one validated model, built once per host.

Inventory data stays plain (strings, numbers, lists, dicts) because pyinfra's group data does
not carry objects well. `build_config` merges every role's documented defaults with the host's
inventory data and validates the result into `StackConfig`; `ConfigError` names the host, the
inventory key and the accepted values, and is raised before any operation is queued.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ironserve.config_inference import InferenceSettings, check_deployable
from ironserve.config_nvidia import AptPackages, NvidiaSettings, package_violations
from ironserve.config_security import ContainerRuntimeSettings, SecuritySettings
from ironserve.lock import LockViolation, StackLock, check_lock
from roles.bios.defaults import DEFAULTS as BIOS_DEFAULTS
from roles.container_runtime.defaults import DEFAULTS as CONTAINER_RUNTIME_DEFAULTS
from roles.host_tuning.defaults import DEFAULTS as HOST_TUNING_DEFAULTS
from roles.inference.defaults import DEFAULTS as INFERENCE_DEFAULTS
from roles.nvidia.defaults import DEFAULTS as NVIDIA_DEFAULTS
from roles.preflight.defaults import DEFAULTS as PREFLIGHT_DEFAULTS
from roles.security.defaults import DEFAULTS as SECURITY_DEFAULTS

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
# Every role in deploy order; each reads the inventory keys prefixed with its name.
ROLE_NAMES = ("bios", "preflight", "nvidia", "host_tuning", "security", "container_runtime", "inference")
ROLE_DEFAULTS: tuple[Mapping[str, object], ...] = (
    BIOS_DEFAULTS,
    PREFLIGHT_DEFAULTS,
    NVIDIA_DEFAULTS,
    HOST_TUNING_DEFAULTS,
    SECURITY_DEFAULTS,
    CONTAINER_RUNTIME_DEFAULTS,
    INFERENCE_DEFAULTS,
)
SYSCTL_KEY = re.compile(r"^[a-z0-9_]+(\.[A-Za-z0-9_-]+)+$")
# Keys whose value is a pair of ports, low before high.
PORT_RANGE_KEYS = frozenset({"net.ipv4.ip_local_port_range"})
# Keys whose value is a word (an algorithm name), not a number.
WORD_KEYS = frozenset({"net.ipv4.tcp_congestion_control", "net.core.default_qdisc"})


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


class GpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    memory_gib: int = Field(gt=0)
    compute_capability: str
    board_power_w: int = Field(gt=0)


class ServerSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    pcie_gen: int = Field(ge=1, le=6)


# What the physical host must be, as profile data (roles/preflight).


class PreflightSpec(BaseModel):
    """What the preflight expects of the machine (roles/preflight); the profile's `preflight` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cpu_sockets: int = Field(ge=1)
    gpus_installed: int = Field(ge=0)  # NVIDIA GPUs physically present (all draw power)
    gpu_pci_name: str  # how lspci names the card, e.g. "[A10]" in "GA102GL [A10]"
    serving_gpus: int = Field(ge=0)  # full-width GPUs the service uses, lowest slots first
    serving_width: int = Field(default=16, ge=1)  # lanes a GPU needs to serve; narrower ones are excluded
    same_socket: bool = True  # serving GPUs must share one NUMA node / CPU socket
    platform_power_w: int = Field(ge=0)  # CPUs, memory, fans, disks, NICs: added to the GPUs' board power
    bios_attributes: dict[str, str] = Field(default_factory=dict)  # Redfish Bios attribute -> required value


class Profile(BaseModel):
    """A hardware/software profile: what the host is and the pinned software set it gets."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    description: str
    server: ServerSpec
    gpu: GpuSpec
    lock: StackLock
    preflight: PreflightSpec | None = None  # None: the profile states no hardware expectations
    packages: AptPackages | None = None  # exact apt versions of the lock per target OS


def load_profile(name: str) -> Profile:
    path = PROFILE_DIR / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"unknown profile {name!r}")
    return Profile.model_validate({**yaml.safe_load(path.read_text()), "name": name})


def _profile_name(name: str) -> str:
    if name not in available_profiles():
        raise ValueError(f"unknown profile {name!r}; accepted: {', '.join(available_profiles())}")
    return name


def _sysctl_value(key: str, value: object) -> str:
    """Canonical text of a sysctl value, as `sysctl -n` prints it (fields separated by a tab)."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: a boolean is not a sysctl value; use 0 or 1")
    if key in WORD_KEYS:
        if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9_]+", value):
            raise ValueError(f"{key}: expected a single word such as 'bbr', got {value!r}")
        return value
    if key in PORT_RANGE_KEYS:
        fields = str(value).split()
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise ValueError(f"{key}: expected two port numbers 'LOW HIGH', got {value!r}")
        low, high = (int(f) for f in fields)
        if not 1024 <= low < high <= 65535:
            raise ValueError(f"{key}: expected 1024 <= LOW < HIGH <= 65535, got {value!r}")
        return f"{low}\t{high}"
    # Integers, or their text (a validated config re-validates its own canonical form).
    if (isinstance(value, int) and value >= 0) or (isinstance(value, str) and value.isdigit()):
        return str(value)
    raise ValueError(f"{key}: expected a non-negative integer, got {value!r}")


class HostTuning(BaseModel):
    """Settings of roles/host_tuning (keys documented in roles/host_tuning/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sysctls: dict[str, str] = Field(alias="host_tuning_sysctls")
    sysctl_file: str = Field(alias="host_tuning_sysctl_file", pattern=r"^/etc/sysctl\.d/[\w.-]+\.conf$")
    kernel_args: tuple[Annotated[str, Field(pattern=r"^[\w.-]+(=[\w.,:-]+)?$")], ...] = Field(
        alias="host_tuning_kernel_args"
    )
    reboot_policy: Literal["auto", "defer", "never"] = Field(alias="host_tuning_reboot_policy")
    reboot_timeout_s: int = Field(alias="host_tuning_reboot_timeout_s", gt=0, le=3600)
    ntp_servers: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9.:-]+$")], ...] = Field(
        alias="host_tuning_ntp_servers"
    )

    @field_validator("sysctls", mode="before")
    @classmethod
    def _canonical_sysctls(cls, raw: object) -> dict[str, str]:
        if not isinstance(raw, Mapping):
            raise ValueError("expected a mapping of sysctl key to value")
        canonical = {}
        for key, value in raw.items():
            if not isinstance(key, str) or not SYSCTL_KEY.match(key):
                raise ValueError(f"{key!r} is not a sysctl key such as net.core.rmem_max")
            canonical[key] = _sysctl_value(key, value)
        return canonical


def _known_check(name: str) -> str:
    from ironserve.preflight import CHECK_NAMES  # late: ironserve.preflight reads this module's types

    if name not in CHECK_NAMES:
        raise ValueError(f"unknown preflight check {name!r}; accepted: {', '.join(CHECK_NAMES)}")
    return name


class PreflightSettings(BaseModel):
    """Settings of roles/preflight (keys documented in roles/preflight/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    overrides: tuple[Annotated[str, AfterValidator(_known_check)], ...] = Field(alias="preflight_overrides")
    report_dir: str = Field(alias="preflight_report_dir", min_length=1)


class BiosSettings(BaseModel):
    """Settings of roles/bios (keys documented in roles/bios/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    redfish_address: str | None = Field(alias="bios_redfish_address", pattern=r"^https?://[\w.:\[\]-]+/?$")
    mode: Literal["check", "apply"] = Field(alias="bios_mode")
    reboot_policy: Literal["auto", "never"] = Field(alias="bios_reboot_policy")
    credentials_file: str | None = Field(alias="bios_credentials_file")
    verify_tls: bool = Field(alias="bios_verify_tls")
    apply_timeout_s: int = Field(alias="bios_apply_timeout_s", gt=0, le=7200)


class StackConfig(BaseModel):
    """Everything ironserve deploys to one host; roles and tests receive it explicitly."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str
    profile_name: Annotated[str, AfterValidator(_profile_name)] = Field(alias="ironserve_profile")
    profile: Profile
    host_tuning: HostTuning
    preflight: PreflightSettings
    bios: BiosSettings
    security: SecuritySettings
    container_runtime: ContainerRuntimeSettings
    nvidia: NvidiaSettings
    inference: InferenceSettings
    # The roles this run applies, in deploy order (ironserve_roles: a list or "a,b"; default all).
    roles: tuple[str, ...] = Field(alias="ironserve_roles")

    @field_validator("roles", mode="before")
    @classmethod
    def _known_roles_in_order(cls, raw: object) -> tuple[str, ...]:
        names = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(names, list | tuple) or not names:
            raise ValueError(f"expected a non-empty list of roles; accepted: {', '.join(ROLE_NAMES)}")
        unknown = [n for n in names if n not in ROLE_NAMES]
        if unknown:
            raise ValueError(f"unknown role {unknown[0]!r}; accepted: {', '.join(ROLE_NAMES)}")
        return tuple(n for n in ROLE_NAMES if n in names)

    @property
    def lock(self) -> StackLock:
        return self.profile.lock


class ConfigError(Exception):
    """Inventory data that cannot be deployed; the message names host, key and accepted values."""


def _location(loc: tuple[int | str, ...]) -> str:
    # Drop the model's section names so the message shows the inventory key the admin wrote.
    parts = [p for p in loc if p not in {"profile", *ROLE_NAMES}]
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


def _describe(host: str, exc: ValidationError) -> list[str]:
    return [
        f"host {host}: {_location(tuple(e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
        f" (got {e['input']!r}){_accepted(e)}"
        for e in exc.errors()
    ]


def _lock_overrides(lock: Mapping[str, Any], overrides: object) -> dict[str, Any]:
    if overrides is None:
        return dict(lock)
    if not isinstance(overrides, Mapping):
        raise ValueError("ironserve_lock: expected a mapping of lock component to value")
    merged = dict(lock)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def build_config(host: str, data: Mapping[str, Any]) -> StackConfig:
    """Validate one host's inventory data (plus role defaults) into a StackConfig.

    Raises ConfigError listing every problem, and also every broken lock rule.
    """
    merged: dict[str, Any] = {}
    for defaults in ROLE_DEFAULTS:
        merged.update(defaults)
    merged.update({k: v for k, v in data.items() if v is not None})
    profile_name = merged.get("ironserve_profile", "r740-a10")
    errors: list[str] = []
    try:
        profile_data = yaml.safe_load((PROFILE_DIR / f"{profile_name}.yaml").read_text())
    except (OSError, TypeError):
        raise ConfigError(
            f"host {host}: ironserve_profile: unknown profile {profile_name!r} "
            f"(accepted: {', '.join(available_profiles())})"
        ) from None
    try:
        profile_data["lock"] = _lock_overrides(profile_data["lock"], merged.get("ironserve_lock"))
    except ValueError as exc:
        raise ConfigError(f"host {host}: {exc}") from None
    try:
        config = StackConfig.model_validate(
            {
                "host": host,
                "ironserve_profile": profile_name,
                "profile": {**profile_data, "name": profile_name},
                "ironserve_roles": merged.get("ironserve_roles", ROLE_NAMES),
                **{role: {k: v for k, v in merged.items() if k.startswith(role + "_")} for role in ROLE_NAMES},
            }
        )
    except ValidationError as exc:
        errors = _describe(host, exc)
        raise ConfigError("\n".join(errors)) from None
    violations = check_lock(config.lock)
    violations += package_violations(config.lock, config.profile.packages)
    if violations:
        raise ConfigError("\n".join(lock_messages(host, violations)))
    return config


def check_roles_deployable(config: StackConfig) -> None:
    """Raise ConfigError when a selected role lacks a key it cannot run without (no built-in default).

    Kept out of build_config so a config can be built and inspected for any role; the deploy and
    `ironserve deploy` call this before any host is touched.
    """
    if "inference" in config.roles:
        try:
            check_deployable(config.inference, config.security.model_dir, config.security.service_units)
        except ValueError as exc:
            raise ConfigError(f"host {config.host}: {exc}") from None


def lock_messages(host: str, violations: Iterable[LockViolation]) -> list[str]:
    return [f"host {host}: ironserve_lock: rule {v.rule} failed: {v.message}" for v in violations]
