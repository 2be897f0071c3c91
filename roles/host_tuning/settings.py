"""Settings of the host_tuning role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from ironserve.config import RoleSettings
from ironserve.validators import canonical_sysctls


class HostTuningSettings(RoleSettings):
    """Settings of roles/host_tuning."""

    sysctls: dict[str, str] = Field(
        default_factory=lambda: {
            "net.core.rmem_max": "26214400",  # sysctl-rmem-max: 25 MB socket receive buffer ceiling
            "net.core.wmem_max": "26214400",  # sysctl-wmem-max: 25 MB socket send buffer ceiling
            "net.ipv4.tcp_slow_start_after_idle": "0",  # keep cwnd on idle keep-alive connections
            "net.ipv4.ip_local_port_range": "32768 60999",  # net-ip-local-port-range: never narrowed
        },
        alias="host_tuning_sysctls",
        description="Kernel parameters written to host_tuning_sysctl_file and applied live (catalog: network_tuning).",
    )
    sysctl_file: str = Field(
        "/etc/sysctl.d/90-ironserve.conf",
        alias="host_tuning_sysctl_file",
        pattern=r"^/etc/sysctl\.d/[\w.-]+\.conf$",
        description="The file the sysctls persist in; systemd-sysctl applies it at every boot.",
    )
    kernel_args: tuple[Annotated[str, Field(pattern=r"^[\w.-]+(=[\w.,:-]+)?$")], ...] = Field(
        ("systemd.unified_cgroup_hierarchy=1",),
        alias="host_tuning_kernel_args",
        description="Arguments GRUB_CMDLINE_LINUX must carry (kernel-cgroup-v2: the unified cgroup v2 hierarchy).",
    )
    ntp_servers: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9.:-]+$")], ...] = Field(
        (),
        alias="host_tuning_ntp_servers",
        description="NTP servers for systemd-timesyncd (kernel-time-sync); empty keeps the distribution's pool.",
    )

    @field_validator("sysctls", mode="before")
    @classmethod
    def _canonical_sysctls(cls, raw: object) -> dict[str, str]:
        return canonical_sysctls(raw)
