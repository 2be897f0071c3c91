"""Settings of the security role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from ironserve.config import RoleSettings
from ironserve.validators import ABS_PATH

UNIT_NAME = r"^[\w@.:-]+\.service$"
CAPABILITY = r"^CAP_[A-Z_]+$"
ACCOUNT = r"^[a-z_][a-z0-9_-]{0,31}$"
# systemd's MemoryMax= syntax: bytes or a K/M/G/T suffix (base 1024).
MEMORY = re.compile(r"^(?P<n>[1-9][0-9]*)(?P<unit>[KMGT]?)$")
MEMORY_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def memory_bytes(value: str) -> int:
    """systemd's MemoryMax= text as bytes (24G -> 25769803776)."""
    match = MEMORY.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size such as 24G")
    return int(match["n"]) * MEMORY_UNITS[match["unit"]]


class SecuritySettings(RoleSettings):
    """Settings of roles/security."""

    user: str = Field(
        "ai-runner",
        alias="security_user",
        pattern=ACCOUNT,
        description="sec-ai-runner-user: the system account the service runs as (uid < 1000); its password is locked.",
    )
    group: str = Field(
        "ai-runner",
        alias="security_group",
        pattern=ACCOUNT,
        description="sec-ai-runner-group: the service's system group.",
    )
    shell: Literal["/bin/false", "/usr/sbin/nologin", "/sbin/nologin"] = Field(
        "/bin/false",
        alias="security_shell",
        description="sec-ai-runner-user: no login shell (the catalog's /bin/false); the password stays locked.",
    )
    model_dir: str = Field(
        "/srv/ai/models",
        alias="security_model_dir",
        pattern=ABS_PATH,
        description="Model files, root:<group> 0750: the service reads models and cannot change them.",
    )
    state_dir: str = Field(
        "/var/lib/ai-service",
        alias="security_state_dir",
        pattern=ABS_PATH,
        description="Service state (caches, compiled kernels), <user>:<group> 0700; also the account's home.",
    )
    log_dir: str = Field(
        "/var/log/ai-service",
        alias="security_log_dir",
        pattern=ABS_PATH,
        description="Service logs, <user>:<group> 0750.",
    )
    slice: str = Field(
        "ai-service.slice",
        alias="security_slice",
        pattern=r"^[\w-]+\.slice$",
        description="cgroup-ai-service-memory-max: the slice service units run in (a dash is a level: cgroup "
        "/ai.slice/ai-service.slice).",
    )
    memory_max: str = Field(
        "24G",
        alias="security_memory_max",
        description="cgroup-ai-service-memory-max: the slice's MemoryMax= (systemd syntax, K/M/G/T suffixes "
        "base 1024).",
    )
    cpu_weight: int = Field(
        1000,
        alias="security_cpu_weight",
        ge=1,
        le=10000,
        description="The slice's CPUWeight= (system.slice has 100): the service wins under contention.",
    )
    device_allow: tuple[Annotated[str, Field(pattern=r"^/dev/nvidia[\w-]*$")], ...] = Field(
        ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidia1"),
        alias="security_device_allow",
        description="cgroup-ai-service-devices-deny (correction): DevicePolicy=closed and one "
        "`DeviceAllow=... rw` per node; only /dev/nvidia* accepted.",
    )
    capabilities: tuple[Annotated[str, Field(pattern=CAPABILITY)], ...] = Field(
        ("CAP_SYS_NICE",),
        alias="security_capabilities",
        description="sec-cap-sys-nice (correction): AmbientCapabilities= and CapabilityBoundingSet= of the "
        "service; root-equivalent capabilities are refused.",
    )
    service_units: tuple[Annotated[str, Field(pattern=UNIT_NAME)], ...] = Field(
        ("ai-service.service", "ai-service@.service"),
        alias="security_service_units",
        min_length=1,
        description="Units that get /etc/systemd/system/<unit>.d/10-ironserve-security.conf (user, "
        "capabilities, seccomp filter, slice); ai-service@.service is the blue/green engine "
        "template (every colour).",
    )
    kubelet_seccomp_dir: str = Field(
        "/var/lib/kubelet/seccomp/profiles",
        alias="security_kubelet_seccomp_dir",
        pattern=ABS_PATH,
        description="sec-seccomp-profile: where ai-service.json goes for the kubelet (localhostProfile: "
        "profiles/ai-service.json).",
    )

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
