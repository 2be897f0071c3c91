"""Host tuning: cgroup v2 kernel argument in GRUB, network sysctls, time sync, reboot orchestration.

Every step reads state through facts and changes only what differs, so a second run reports
zero changes. Inside a container a kernel-global key cannot be set live; the role persists it
and reports it as applied at boot instead of failing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyinfra.api.command import FunctionCommand, QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.operations import apt, files, server, systemd

from ironserve.facts import (
    ContainerKind,
    GrubCmdlineLinux,
    KernelCmdline,
    SysctlState,
    missing_kernel_args,
    with_kernel_args,
)
from roles.host_tuning.defaults import DEFAULTS

if TYPE_CHECKING:  # the config model imports this package's defaults
    from ironserve.config import HostTuning, StackConfig

TEMPLATES = Path(__file__).parent / "templates"
REBOOT_MARKER = "/run/reboot-required"
REBOOT_REASON = "/run/ironserve/reboot-required"


@operation()
def live_sysctl(key: str, value: str):  # type: ignore[no-untyped-def]
    """Set one sysctl in the running kernel when it differs; a read-only key in a container is left to boot."""
    entry = host.get_fact(SysctlState, keys=(key,))[key]
    shown = value.replace("\t", " ")
    if entry.value == value:
        host.noop(f"sysctl {key} is {shown}")
    elif entry.writable:
        yield StringCommand("sysctl", "-w", QuoteString(f"{key}={shown}"))
    elif host.get_fact(ContainerKind):
        host.noop(f"sysctl {key}: kernel-global, read-only in this container; persisted, applied at boot")
    else:
        raise OperationError(f"sysctl {key} is not writable on this host (value {entry.value!r})")


@operation()
def grub_kernel_args(args: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """Make GRUB_CMDLINE_LINUX carry `args` and regenerate grub.cfg when it changes."""
    current = host.get_fact(GrubCmdlineLinux)
    if current is None:
        if host.get_fact(ContainerKind):
            host.noop("no GRUB in a container: the kernel command line belongs to the machine running it")
            return
        raise OperationError("/etc/default/grub is missing: ironserve supports GRUB-booted hosts")
    wanted = with_kernel_args(current, args)
    if wanted == current:
        host.noop(f"GRUB_CMDLINE_LINUX carries {' '.join(args)}")
        return
    line = f'GRUB_CMDLINE_LINUX="{" ".join(wanted)}"'
    yield from files.line._inner(path="/etc/default/grub", line="^GRUB_CMDLINE_LINUX=.*", replace=line)
    yield "update-grub"


@operation()
def reboot_for_kernel_args(args: tuple[str, ...], policy: str, timeout_s: int):  # type: ignore[no-untyped-def]
    """Reboot (auto), leave a marker (defer) or only report (never) when the running kernel lacks `args`."""
    if host.get_fact(ContainerKind):
        host.noop("container: the running kernel is the machine's, no reboot applies")
        return
    missing = missing_kernel_args(host.get_fact(KernelCmdline), args)
    if not missing:
        host.noop("the running kernel already has " + " ".join(args))
        return
    if policy == "never":
        host.noop(f"reboot needed for {' '.join(missing)}, but host_tuning_reboot_policy is never")
    elif policy == "defer":
        yield from files.put._inner(src=StringIO("*** System restart required ***\n"), dest=REBOOT_MARKER)
        yield from files.put._inner(
            src=StringIO("kernel arguments not yet active: " + " ".join(missing) + "\n"), dest=REBOOT_REASON
        )
    else:
        yield from reboot_proven(timeout_s, functools.partial(_kernel_args_effective, args=args))


def reboot_proven(timeout_s: int, took_effect: Callable[[Any], None]):  # type: ignore[no-untyped-def]
    """Commands that reboot the host and prove it: a new boot id, then `took_effect(host)` (raises when not).

    The one reboot path of ironserve (host_tuning_reboot_policy: auto); other roles yield from it.
    """
    boot_ids: list[str] = []
    yield FunctionCommand(_record_boot_id, (boot_ids,), {})
    yield from server.reboot._inner(delay=5, interval=2, reboot_timeout=timeout_s)
    yield FunctionCommand(_prove_reboot, (boot_ids, took_effect), {})


def read_on(host, command: str) -> str:  # type: ignore[no-untyped-def]
    """stdout of `command` on `host`, from inside a FunctionCommand; raises when it fails."""
    status, output = host.run_shell_command(command)
    if not status:
        raise OperationError(f"{command!r} failed on {host.name}")
    return "\n".join(output.stdout_lines).strip()


# pyinfra passes (state, host) to a FunctionCommand only when its parameters carry exactly those names.
def _record_boot_id(state, host, boot_ids: list[str]) -> bool:  # type: ignore[no-untyped-def]
    boot_ids.append(read_on(host, "cat /proc/sys/kernel/random/boot_id"))
    return True


def _prove_reboot(state, host, boot_ids: list[str], took_effect: Callable[[Any], None]) -> bool:  # type: ignore[no-untyped-def]
    """The reboot happened (new boot id) and took effect (`took_effect` raises when not)."""
    boot_id = read_on(host, "cat /proc/sys/kernel/random/boot_id")
    if boot_id == boot_ids[0]:
        raise OperationError("reboot not proven: the boot id did not change")
    took_effect(host)
    return True


def _kernel_args_effective(host, args: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """The arguments are live and, for the cgroup v2 one, cgroup2 is mounted."""
    missing = missing_kernel_args(read_on(host, "cat /proc/cmdline").split(), args)
    if missing:
        raise OperationError(f"rebooted, but the kernel still lacks {' '.join(missing)}")
    if "systemd.unified_cgroup_hierarchy=1" in args:
        fs_type = read_on(host, "stat -fc %T /sys/fs/cgroup")
        if fs_type != "cgroup2fs":
            raise OperationError(f"rebooted, but /sys/fs/cgroup is {fs_type}, not cgroup2fs")


def _time_sync(settings: HostTuning) -> None:
    apt.packages(name="Install systemd-timesyncd", packages=["systemd-timesyncd"], update=True, cache_time=86400)
    if settings.ntp_servers:
        files.template(
            name="Configure NTP servers",
            src=str(TEMPLATES / "timesyncd.conf.j2"),
            dest="/etc/systemd/timesyncd.conf.d/ironserve.conf",
            create_remote_dir=True,
            settings=settings,
        )
    # timesyncd refuses to run in a container (ConditionVirtualization=!container): the machine keeps its clock.
    systemd.service(
        name="Enable systemd-timesyncd",
        service="systemd-timesyncd.service",
        enabled=True,
        running=None if host.get_fact(ContainerKind) else True,
    )


@deploy("Host tuning", data_defaults=DEFAULTS)
def host_tuning(config: StackConfig) -> None:
    settings = config.host_tuning
    files.template(
        name="Persist sysctls",
        src=str(TEMPLATES / "sysctl.conf.j2"),
        dest=settings.sysctl_file,
        mode="644",
        settings=settings,
    )
    for key, value in settings.sysctls.items():
        live_sysctl(name=f"Apply sysctl {key}", key=key, value=value)
    _time_sync(settings)
    grub_kernel_args(name="Kernel arguments in GRUB", args=settings.kernel_args)
    reboot_for_kernel_args(
        name="Reboot into the new kernel arguments",
        args=settings.kernel_args,
        policy=settings.reboot_policy,
        timeout_s=settings.reboot_timeout_s,
    )
