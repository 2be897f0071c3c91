"""The service's security boundary as text: seccomp profile, systemd slice and hardening drop-in.

Pure functions, unit-tested; roles/security ships their output. One syscall list serves both
enforcers: the OCI/Docker JSON profile in files/security/ (containerd, the kubelet's Localhost
profile) and systemd's SystemCallFilter=, with each argument filter mapped to the systemd
setting that enforces the same rule (see SYSTEMD_EQUIVALENTS).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ironserve.layout import role_file
from roles.security.settings import SECCOMP_PROFILE_NAME, SecuritySettings

SECCOMP_PROFILE = role_file("security", SECCOMP_PROFILE_NAME)
DROPIN_NAME = "10-ironserve-security.conf"  # in /etc/systemd/system/<unit>.d/
ERRNO_NAMES = {1: "EPERM", 38: "ENOSYS"}
# Argument filters of the JSON profile and the systemd settings that enforce the same rule.
SYSTEMD_EQUIVALENTS: dict[str, tuple[str, str]] = {
    "clone": ("RestrictNamespaces", "yes"),  # CLONE_NEW* flags refused
    "socket": ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6 AF_NETLINK"),  # tighter than "not AF_VSOCK"
    "personality": ("LockPersonality", "yes"),  # PER_LINUX only
}
# Never allowed, whatever the list grows into: these escape or reconfigure the machine.
FORBIDDEN_SYSCALLS = frozenset(
    {"mount", "umount2", "unshare", "setns", "pivot_root", "kexec_load", "kexec_file_load", "init_module",
     "finit_module", "delete_module", "bpf", "ptrace", "reboot", "swapon", "swapoff", "chroot", "open_by_handle_at"}
)  # fmt: skip


class SeccompArg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    index: int = Field(ge=0, le=5)
    value: int = Field(ge=0)
    valueTwo: int = 0
    op: Literal["SCMP_CMP_EQ", "SCMP_CMP_NE", "SCMP_CMP_MASKED_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT", "SCMP_CMP_LE"]


class SeccompRule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    names: tuple[str, ...] = Field(min_length=1)
    action: Literal["SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"]
    errnoRet: int | None = None
    args: tuple[SeccompArg, ...] = ()
    comment: str = ""


class SeccompProfile(BaseModel):
    """The OCI / Docker seccomp JSON format, as far as the profile uses it (unknown keys are refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    defaultAction: Literal["SCMP_ACT_ERRNO"]
    defaultErrnoRet: int = 1
    architectures: tuple[Literal["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"], ...]
    syscalls: tuple[SeccompRule, ...]

    def allowed(self) -> set[str]:
        """Every syscall some rule allows, with or without an argument filter."""
        return {n for rule in self.syscalls if rule.action == "SCMP_ACT_ALLOW" for n in rule.names}

    def filtered(self) -> set[str]:
        """Syscalls allowed only under an argument rule (each mapped to a systemd setting)."""
        return {n for rule in self.syscalls if rule.args for n in rule.names}

    def refused(self) -> dict[str, int]:
        """Syscalls refused with their own errno (clone3: ENOSYS, so glibc falls back to clone)."""
        return {
            n: rule.errnoRet or self.defaultErrnoRet
            for rule in self.syscalls
            if rule.action == "SCMP_ACT_ERRNO"
            for n in rule.names
        }


def read_seccomp_profile(path: Path = SECCOMP_PROFILE) -> SeccompProfile:
    profile = SeccompProfile.model_validate(json.loads(path.read_text()))
    forbidden = sorted(profile.allowed() & FORBIDDEN_SYSCALLS)
    if forbidden:
        raise ValueError(f"{path}: allows {', '.join(forbidden)}")
    unmapped = sorted(profile.filtered() - SYSTEMD_EQUIVALENTS.keys())
    if unmapped:
        raise ValueError(f"{path}: argument rules for {', '.join(unmapped)} have no systemd equivalent")
    return profile


def slice_cgroup(name: str) -> str:
    """The cgroup path of a slice: each dash is a level (ai-service.slice -> /ai.slice/ai-service.slice)."""
    stem = name.removesuffix(".slice")
    parts = stem.split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def render_slice(settings: SecuritySettings) -> str:
    devices = "".join(f"DeviceAllow={node} rw\n" for node in settings.device_allow)
    return (
        "# Managed by ironserve (roles/security): the inference service's cgroup v2 slice.\n"
        "[Unit]\n"
        "Description=AI inference service slice\n"
        "Before=slices.target\n\n"
        "[Slice]\n"
        f"MemoryAccounting=yes\nMemoryMax={settings.memory_max}\n"
        f"CPUAccounting=yes\nCPUWeight={settings.cpu_weight}\n"
        "# cgroup v2 has no devices.deny: an eBPF device filter allows the standard pseudo-devices\n"
        "# and these NVIDIA nodes only.\n"
        f"DevicePolicy=closed\n{devices}"
    )


def service_properties(settings: SecuritySettings, profile: SeccompProfile) -> list[tuple[str, str]]:
    """The hardening of every service unit, as (systemd property, value) pairs."""
    caps = " ".join(settings.capabilities)
    errno = ERRNO_NAMES.get(profile.defaultErrnoRet, str(profile.defaultErrnoRet))
    equivalents = sorted({SYSTEMD_EQUIVALENTS[name] for name in profile.filtered()})
    allowed = sorted(profile.allowed() - profile.refused().keys())
    refused = [("SystemCallFilter", f"~{n}:{ERRNO_NAMES.get(e, str(e))}") for n, e in sorted(profile.refused().items())]
    return [
        ("Slice", settings.slice),
        ("User", settings.user),
        ("Group", settings.group),
        ("AmbientCapabilities", caps),
        ("CapabilityBoundingSet", caps),
        ("NoNewPrivileges", "yes"),
        ("SystemCallArchitectures", "native"),
        ("SystemCallErrorNumber", errno),
        ("SystemCallFilter", " ".join(allowed)),
        *refused,
        *equivalents,
    ]


def render_service_dropin(settings: SecuritySettings, profile: SeccompProfile) -> str:
    lines = "".join(f"{key}={value}\n" for key, value in service_properties(settings, profile))
    return (
        "# Managed by ironserve (roles/security): non-root, CAP_SYS_NICE only, seccomp allow-list\n"
        "# (the same list as files/security/ai-service.json), in the service slice.\n"
        f"[Service]\n{lines}"
    )


def dropin_properties(text: str) -> list[tuple[str, str]]:
    """(property, value) pairs of a drop-in's [Service] section, as written on a host."""
    pairs: list[tuple[str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            pairs.append((key.strip(), value.strip()))
    return pairs


def systemd_run_command(dropin_text: str, command: str, extra: tuple[str, ...] = ()) -> str:
    """A shell command running `command` as a transient unit with the drop-in's settings (a behaviour probe)."""
    props = [f"-p {shlex.quote(f'{k}={v}')}" for k, v in dropin_properties(dropin_text)]
    props += [f"-p {shlex.quote(p)}" for p in extra]
    return f"systemd-run --quiet --wait --pipe --collect {' '.join(props)} {command}"
