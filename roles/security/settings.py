"""Settings of the security role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from ironserve.config import RoleSettings, prefixed
from ironserve.validators import (
    check_account,
    check_capability,
    check_service_unit,
    check_slice,
    fullmatch,
    is_within,
    path_rule,
)

# systemd's MemoryMax= syntax: bytes or a K/M/G/T suffix (base 1024).
MEMORY = re.compile(r"(?P<n>[1-9][0-9]{0,15})(?P<unit>[KMGT]?)")
MEMORY_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# A slice that cannot hold an engine, or more than an R740 holds (3 TiB) many times over, is a typo.
MEMORY_MIN, MEMORY_MAX = 256 * 1024**2, 64 * 1024**4
# The /dev/nvidia* nodes the engines open: the control node, UVM, modeset and one per GPU.
NVIDIA_NODE = re.compile(r"/dev/nvidia(ctl|-uvm|-uvm-tools|-modeset|[0-9]{1,2})")
# Where the role's three directories may live (each re-owned and re-moded by the role, so never a directory
# something else owns): models on site data (/srv, FHS "data served by this system"), add-on trees (/opt),
# state (/var/lib) or a mounted NVMe (/data, /mnt); state under /var/lib (FHS "state information") or the same
# data mounts; logs under /var/log (FHS "log files").
ENGINE_TEMPLATE_UNIT = "ai-service@.service"
MODEL_ROOTS = ("/srv", "/opt", "/var/lib", "/data", "/mnt")
STATE_ROOTS = ("/var/lib", "/srv", "/data", "/mnt")
LOG_ROOTS = ("/var/log",)


def memory_bytes(value: str) -> int:
    """systemd's MemoryMax= text as bytes (24G -> 25769803776)."""
    match = re.fullmatch(MEMORY, value)
    if not match:
        raise ValueError(f"{value!r} is not a size such as 24G (accepted: digits then K, M, G or T)")
    return int(match["n"]) * MEMORY_UNITS[match["unit"]]


def _nvidia_node(value: str) -> str:
    if not fullmatch(NVIDIA_NODE, value):
        raise ValueError(
            "is not an NVIDIA device node; accepted: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, "
            "/dev/nvidia-modeset, /dev/nvidia<N>"
        )
    return value


# The seccomp profile's file name, for the kubelet as for systemd (files/ai-service.json).
SECCOMP_PROFILE_NAME = "ai-service.json"


class SecuritySettings(RoleSettings):
    """Settings of roles/security."""

    model_config = ConfigDict(alias_generator=prefixed("security"))

    user: Annotated[str, AfterValidator(check_account)] = Field(
        "ai-runner",
        description="sec-ai-runner-user: the system account the service runs as (uid < 1000); its password is locked. "
        "A new name (useradd grammar); the host's own accounts (root, nobody, daemon, sshd, systemd-*, _apt, "
        "Debian's base-passwd names) are refused: the role rewrites the account's shell and home.",
    )
    group: Annotated[str, AfterValidator(check_account)] = Field(
        "ai-runner",
        description="sec-ai-runner-group: the service's system group; a new name, never one of the host's groups "
        "(sudo, adm, disk, root, ...), which would give the service that group's rights.",
    )
    uid: int | None = Field(
        None,
        ge=100,
        le=999,
        description="The account's uid, the same on every node (inference_mode kubernetes needs it: a pod runs as a "
        "number); a system uid, 100-999 (Debian policy 9.2.2, login.defs SYS_UID_MIN/MAX). None: the next free one. "
        "An existing account with another uid stops the host (renumbering is a migration).",
    )
    gid: int | None = Field(
        None,
        ge=100,
        le=999,
        description="The group's gid, the same on every node (inference_mode kubernetes: the pods read the model "
        "store through it); 100-999. None: the next free one. An existing group with another gid stops the host.",
    )
    shell: Literal["/bin/false", "/usr/sbin/nologin", "/sbin/nologin"] = Field(
        "/bin/false",
        description="sec-ai-runner-user: no login shell (the catalog's /bin/false); the password stays locked.",
    )
    model_dir: Annotated[str, path_rule(MODEL_ROOTS, example="/srv/ai/models")] = Field(
        "/srv/ai/models",
        description="Model files, root:<group> 0750: the service reads models and cannot change them. Re-owned, so "
        "inside /srv, /opt, /var/lib, /data or /mnt (site data and NVMe mounts), never a system directory.",
    )
    state_dir: Annotated[str, path_rule(STATE_ROOTS, example="/var/lib/ai-service")] = Field(
        "/var/lib/ai-service",
        description="Service state (caches, compiled kernels), <user>:<group> 0700; also the account's home. Given "
        "to the service, so inside /var/lib (FHS state), /srv, /data or /mnt, never a system directory.",
    )
    log_dir: Annotated[str, path_rule(LOG_ROOTS, example="/var/log/ai-service")] = Field(
        "/var/log/ai-service",
        description="Service logs, <user>:<group> 0750: a directory of its own inside /var/log (not /var/log "
        "itself, nor journal or apt). The three directories are distinct and none holds another.",
    )
    slice: Annotated[str, AfterValidator(check_slice)] = Field(
        "ai-service.slice",
        description="cgroup-ai-service-memory-max: the slice service units run in (a dash is a level: cgroup "
        "/ai.slice/ai-service.slice); never systemd's own (-.slice, system/user/machine and below).",
    )
    memory_max: str = Field(
        "24G",
        description="cgroup-ai-service-memory-max: the slice's MemoryMax= (systemd syntax, K/M/G/T suffixes "
        "base 1024), from 256M to 64T.",
    )
    cpu_weight: int = Field(
        1000,
        ge=1,
        le=10000,
        description="The slice's CPUWeight= (system.slice has 100): the service wins under contention.",
    )
    device_allow: tuple[Annotated[str, AfterValidator(_nvidia_node)], ...] = Field(
        ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidia1"),
        description="cgroup-ai-service-devices-deny (correction): DevicePolicy=closed and one "
        "`DeviceAllow=... rw` per node; only the NVIDIA nodes (/dev/nvidiactl, -uvm, -uvm-tools, -modeset, <N>).",
    )
    capabilities: tuple[Annotated[str, AfterValidator(check_capability)], ...] = Field(
        ("CAP_SYS_NICE",),
        description="sec-cap-sys-nice (correction): AmbientCapabilities= and CapabilityBoundingSet= of the "
        "service, from an allow-list: CAP_SYS_NICE (NUMA binding, thread priority), CAP_IPC_LOCK (pinned host "
        "memory for CUDA/NCCL), CAP_NET_BIND_SERVICE (a listener below 1024).",
    )
    service_units: tuple[Annotated[str, AfterValidator(check_service_unit)], ...] = Field(
        ("ai-service.service", "ai-service@.service"),
        description="Units that get /etc/systemd/system/<unit>.d/10-ironserve-security.conf (user, "
        "capabilities, seccomp filter, slice); ai-service@.service is the blue/green engine "
        "template (every colour). Only the service's family (ai-service[-<name>][@].service): on a system unit "
        "(ssh.service, dbus, getty, systemd-*) the drop-in would lock the host out.",
    )
    kubelet_seccomp_dir: Annotated[str, path_rule(example="/var/lib/kubelet/seccomp/profiles")] = Field(
        "/var/lib/kubelet/seccomp/profiles",
        description="sec-seccomp-profile: where ai-service.json goes for the kubelet (localhostProfile: "
        "profiles/ai-service.json); an absolute, normalised path, not a system directory.",
    )

    @field_validator("memory_max")
    @classmethod
    def _memory(cls, value: str) -> str:
        if not MEMORY_MIN <= memory_bytes(value) <= MEMORY_MAX:
            raise ValueError(f"{value!r} is not a size from 256M to 64T (accepted: digits then K, M, G or T)")
        return value

    @field_validator("service_units")
    @classmethod
    def _some_units(cls, units: tuple[str, ...]) -> tuple[str, ...]:
        if not units:
            raise ValueError(f"is empty; accepted: at least one unit of the service, such as {ENGINE_TEMPLATE_UNIT}")
        return units

    @model_validator(mode="after")
    def _directories_apart(self) -> SecuritySettings:
        # The service owns its state and logs: a model directory inside them would be the service's to replace,
        # and a shared directory gets one owner and mode, not two.
        named = [("security_model_dir", self.model_dir), ("security_state_dir", self.state_dir),
                 ("security_log_dir", self.log_dir)]  # fmt: skip
        for i, (key, path) in enumerate(named):
            for other, other_path in named[i + 1 :]:
                if is_within(path, other_path) or is_within(other_path, path):
                    raise ValueError(
                        f"{key} {path} and {other} {other_path} overlap; accepted: three separate directories "
                        "(models, state, logs), none inside another"
                    )
        return self

    @property
    def memory_max_bytes(self) -> int:
        return memory_bytes(self.memory_max)

    @property
    def kubelet_seccomp_profile(self) -> str:
        """Where the kubelet finds the profile (a pod names it relative to <kubelet root>/seccomp)."""
        return f"{self.kubelet_seccomp_dir}/{SECCOMP_PROFILE_NAME}"
