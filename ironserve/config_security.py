"""Settings models of roles/security and roles/container_runtime, part of `StackConfig`.

Kept apart from config.py so the roles of other issues can grow that file independently;
config.py imports these models and merges the roles' defaults like every other role's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ABS_PATH = r"^(/[\w.@+-]+)+$"
UNIT_NAME = r"^[\w@.:-]+\.service$"
CAPABILITY = r"^CAP_[A-Z_]+$"
# systemd's MemoryMax= syntax: bytes or a K/M/G/T suffix (base 1024).
MEMORY = re.compile(r"^(?P<n>[1-9][0-9]*)(?P<unit>[KMGT]?)$")
MEMORY_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
SYSCTL_KEY = re.compile(r"^[a-z0-9_]+(\.[A-Za-z0-9_-]+)+$")
DEBIAN_VERSION = r"^[0-9][A-Za-z0-9.+~:-]*$"


def memory_bytes(value: str) -> int:
    """systemd's MemoryMax= text as bytes (24G -> 25769803776)."""
    match = MEMORY.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size such as 24G")
    return int(match["n"]) * MEMORY_UNITS[match["unit"]]


class SecuritySettings(BaseModel):
    """Settings of roles/security (keys documented in roles/security/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    user: str = Field(alias="security_user", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    group: str = Field(alias="security_group", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    shell: Literal["/bin/false", "/usr/sbin/nologin", "/sbin/nologin"] = Field(alias="security_shell")
    model_dir: str = Field(alias="security_model_dir", pattern=ABS_PATH)
    state_dir: str = Field(alias="security_state_dir", pattern=ABS_PATH)
    log_dir: str = Field(alias="security_log_dir", pattern=ABS_PATH)
    slice: str = Field(alias="security_slice", pattern=r"^[\w-]+\.slice$")
    memory_max: str = Field(alias="security_memory_max")
    cpu_weight: int = Field(alias="security_cpu_weight", ge=1, le=10000)
    device_allow: tuple[Annotated[str, Field(pattern=r"^/dev/nvidia[\w-]*$")], ...] = Field(
        alias="security_device_allow"
    )
    capabilities: tuple[Annotated[str, Field(pattern=CAPABILITY)], ...] = Field(alias="security_capabilities")
    service_units: tuple[Annotated[str, Field(pattern=UNIT_NAME)], ...] = Field(
        alias="security_service_units", min_length=1
    )
    kubelet_seccomp_dir: str = Field(alias="security_kubelet_seccomp_dir", pattern=ABS_PATH)

    @field_validator("memory_max")
    @classmethod
    def _memory(cls, value: str) -> str:
        memory_bytes(value)
        return value

    @field_validator("capabilities")
    @classmethod
    def _no_root_equivalents(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        forbidden = sorted(set(value) & {"CAP_SYS_ADMIN", "CAP_SYS_MODULE", "CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE"})
        if forbidden:
            raise ValueError(f"{', '.join(forbidden)} would make the service as good as root; accepted: CAP_SYS_NICE")
        return value

    @property
    def memory_max_bytes(self) -> int:
        return memory_bytes(self.memory_max)


class ContainerRuntimeSettings(BaseModel):
    """Settings of roles/container_runtime (keys documented in roles/container_runtime/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    packages: dict[
        Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.+-]+$")], Annotated[str, Field(pattern=DEBIAN_VERSION)]
    ] = Field(alias="container_runtime_packages")
    default_runtime: Literal["runc", "nvidia"] = Field(alias="container_runtime_default_runtime")
    nvidia_binary: str = Field(alias="container_runtime_nvidia_binary", pattern=ABS_PATH)
    snapshotter: Literal["overlayfs", "devmapper"] = Field(alias="container_runtime_snapshotter")
    devmapper_pool_name: str | None = Field(alias="container_runtime_devmapper_pool_name", pattern=r"^[\w.-]+$")
    devmapper_root_path: str = Field(alias="container_runtime_devmapper_root_path", pattern=ABS_PATH)
    devmapper_base_image_size: str = Field(
        alias="container_runtime_devmapper_base_image_size", pattern=r"^[1-9][0-9]*(MB|GB|TB)$"
    )
    cni_bin_dir: str = Field(alias="container_runtime_cni_bin_dir", pattern=ABS_PATH)
    cni_conf_dir: str = Field(alias="container_runtime_cni_conf_dir", pattern=ABS_PATH)
    kernel_modules: tuple[Annotated[str, Field(pattern=r"^[a-z0-9_]+$")], ...] = Field(
        alias="container_runtime_kernel_modules"
    )
    sysctls: dict[str, str] = Field(alias="container_runtime_sysctls")
    swap_off: bool = Field(alias="container_runtime_swap_off")

    @field_validator("sysctls", mode="before")
    @classmethod
    def _sysctls(cls, raw: object) -> dict[str, str]:
        if not isinstance(raw, Mapping):
            raise ValueError("expected a mapping of sysctl key to value")
        canonical = {}
        for key, value in raw.items():
            if not isinstance(key, str) or not SYSCTL_KEY.match(key):
                raise ValueError(f"{key!r} is not a sysctl key such as net.ipv4.ip_forward")
            if isinstance(value, bool) or not str(value).isdigit():
                raise ValueError(f"{key}: expected a non-negative integer, got {value!r}")
            canonical[key] = str(value)
        return canonical

    @field_validator("packages")
    @classmethod
    def _containerd_listed(cls, value: dict[str, str]) -> dict[str, str]:
        if "containerd" not in value:
            raise ValueError("containerd must be listed with its pinned version")
        return value

    @model_validator(mode="after")
    def _devmapper_has_pool(self) -> ContainerRuntimeSettings:
        if self.snapshotter == "devmapper" and not self.devmapper_pool_name:
            raise ValueError(
                "container_runtime_snapshotter devmapper needs container_runtime_devmapper_pool_name "
                "(a provisioned LVM thin-pool); accepted without one: overlayfs"
            )
        return self
