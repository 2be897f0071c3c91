"""Settings of the host_tuning role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator

from ironserve.config import RoleSettings, prefixed
from ironserve.validators import (
    canonical_sysctls,
    check_allowed_kernel_arg_name,
    check_allowed_sysctl_key,
    check_host,
    check_kernel_arg,
    fullmatch,
    kernel_args_accepted,
    unlisted_kernel_args,
)

CGROUP_V2_ARG = "systemd.unified_cgroup_hierarchy=1"
# A drop-in of its own in /etc/sysctl.d; never Debian's 99-sysctl.conf (a symlink to /etc/sysctl.conf) nor the
# container runtime role's file.
SYSCTL_FILE = re.compile(r"/etc/sysctl\.d/[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\.conf")
PORT_RANGE = "net.ipv4.ip_local_port_range"
NOT_OURS = frozenset({"/etc/sysctl.d/99-sysctl.conf", "/etc/sysctl.d/91-ironserve-containers.conf"})


def _sysctl_file(value: str) -> str:
    accepted = "a file of its own such as /etc/sysctl.d/90-ironserve.conf"
    if value in NOT_OURS:
        raise ValueError(f"{value} belongs to the distribution or another role; accepted: {accepted}")
    if not fullmatch(SYSCTL_FILE, value) or ".." in value:
        raise ValueError(f"is not a file directly in /etc/sysctl.d ending .conf; accepted: {accepted}")
    return value


class HostTuningSettings(RoleSettings):
    """Settings of roles/host_tuning."""

    model_config = ConfigDict(alias_generator=prefixed("host_tuning"))

    allow_sysctl_keys: tuple[Annotated[str, AfterValidator(check_allowed_sysctl_key)], ...] = Field(
        (),
        description="Opt-in: sysctl keys outside the catalog's that host_tuning_sysctls may set, such as "
        "net.core.somaxconn (each a bounded integer, 0 to 2147483647).",
    )
    sysctls: dict[str, str] = Field(
        default_factory=lambda: {
            "net.core.rmem_max": "26214400",  # sysctl-rmem-max: 25 MB socket receive buffer ceiling
            "net.core.wmem_max": "26214400",  # sysctl-wmem-max: 25 MB socket send buffer ceiling
            "net.ipv4.tcp_slow_start_after_idle": "0",  # keep cwnd on idle keep-alive connections
            PORT_RANGE: "32768 60999",  # net-ip-local-port-range: never narrowed
        },
        description="Kernel parameters written to host_tuning_sysctl_file and applied live (catalog: network_tuning): "
        "ASCII integers without leading zeros in the kernel's bounds (net.rst: r/wmem_max 4608 to 2147483647, "
        "booleans 0/1, the port range 1024 <= LOW < HIGH <= 65535). Keys: the catalog's (net.core.rmem_max, "
        "wmem_max, default_qdisc; net.ipv4.tcp_slow_start_after_idle, ip_local_port_range, ip_forward, "
        "tcp_congestion_control; net.bridge.bridge-nf-call-ip(6)tables) or host_tuning_allow_sysctl_keys.",
    )
    sysctl_file: Annotated[str, AfterValidator(_sysctl_file)] = Field(
        "/etc/sysctl.d/90-ironserve.conf",
        description="The file the sysctls persist in; systemd-sysctl applies it at every boot.",
    )
    allow_kernel_args: tuple[Annotated[str, AfterValidator(check_allowed_kernel_arg_name)], ...] = Field(
        (),
        description="Opt-in: kernel parameter names outside ironserve's list that host_tuning_kernel_args may "
        "carry (any value); single, rescue, init=, mem=, root=, systemd.unit= and the like are never accepted.",
    )
    kernel_args: tuple[Annotated[str, AfterValidator(check_kernel_arg)], ...] = Field(
        (CGROUP_V2_ARG,),
        description="Arguments GRUB_CMDLINE_LINUX must carry (kernel-cgroup-v2: the unified cgroup v2 hierarchy, "
        "always included), from an allow-list: iommu=pt, intel_iommu=on, amd_iommu=on, pci=realloc, "
        "pcie_aspm=off, transparent_hugepage=never|madvise, numa_balancing=disable, ironserve.<marker>=<value>.",
    )
    ntp_servers: tuple[Annotated[str, AfterValidator(check_host)], ...] = Field(
        (),
        description="NTP servers for systemd-timesyncd (kernel-time-sync), ASCII host names or IP addresses; empty "
        "keeps the distribution's pool.",
    )

    @field_validator("sysctls", mode="before")
    @classmethod
    def _canonical_sysctls(cls, raw: object, info: ValidationInfo) -> dict[str, str]:
        return canonical_sysctls(raw, info.data.get("allow_sysctl_keys"), "host_tuning_allow_sysctl_keys")

    @field_validator("kernel_args")
    @classmethod
    def _listed_kernel_args(cls, args: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if CGROUP_V2_ARG not in args:
            raise ValueError(f"must include {CGROUP_V2_ARG} (kernel-cgroup-v2: the security role's slice needs it)")
        names = [a.split("=", 1)[0] for a in args]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} given more than once; accepted: each parameter once")
        allowed = info.data.get("allow_kernel_args")
        unlisted = unlisted_kernel_args(args, allowed) if allowed is not None else []
        if unlisted:
            raise ValueError(f"{', '.join(unlisted)}: not on ironserve's list; accepted: {kernel_args_accepted()}")
        return args

    def ephemeral_ports(self) -> tuple[str, int, int] | None:
        given = self.sysctls.get(PORT_RANGE)
        if given is None:
            return None
        low, high = map(int, given.split())
        return f"host_tuning_sysctls[{PORT_RANGE!r}]", low, high
