"""Host tuning: network sysctls, time sync, and the cgroup v2 kernel argument in GRUB.

Every step reads state through facts and changes only what differs, so a second run reports
zero changes. Inside a container a kernel-global key cannot be set live; the role persists it
and reports it as applied at boot instead of failing. A kernel argument GRUB carries but the
running kernel lacks is a reboot need, honoured once at the end of the deploy (ironserve.reboot).
"""

from __future__ import annotations

import re
from importlib.resources import files as package_files
from typing import TYPE_CHECKING, Any

from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.operations import apt, files, systemd

from ironserve.facts import ContainerKind
from ironserve.operations import Commands, live_sysctl
from ironserve.reboot import RebootCheck, read_on
from ironserve.run import HostRun
from roles.host_tuning.facts import GrubCmdlineLinux, KernelCmdline, missing_kernel_args, with_kernel_args

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig
    from roles.host_tuning.settings import HostTuningSettings

TEMPLATES = package_files(__package__) / "templates"
CGROUP_V2_ARG = "systemd.unified_cgroup_hierarchy=1"


# /etc/default/grub is shell, sourced by update-grub as root: inside GRUB_CMDLINE_LINUX's double quotes these
# would be expanded or end the string (and sed's replacement text treats the backslash specially too).
GRUB_SHELL_CHARACTERS = re.compile(r'[\\"$`\n]')


def grub_assignment(args: list[str]) -> str:
    """The GRUB_CMDLINE_LINUX line for `args`; OperationError when an argument (one read back from the host
    included: the inventory's cannot) holds a character the shell would expand inside the double quotes."""
    unsafe = [arg for arg in args if GRUB_SHELL_CHARACTERS.search(arg)]
    if unsafe:
        raise OperationError(
            f"/etc/default/grub: GRUB_CMDLINE_LINUX would carry shell characters in {unsafe!r}; edit it by hand"
        )
    return f'GRUB_CMDLINE_LINUX="{" ".join(args)}"'


@operation()
def grub_kernel_args(args: tuple[str, ...]) -> Commands:
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
    yield from files.line._inner(
        path="/etc/default/grub", line="^GRUB_CMDLINE_LINUX=.*", replace=grub_assignment(wanted)
    )
    yield "update-grub"


def kernel_args_reboot(args: tuple[str, ...]) -> RebootCheck:
    """A reboot is needed while the running kernel lacks `args` (never in a container: the kernel is the machine's)."""

    def needed() -> str | None:
        if host.get_fact(ContainerKind):
            return None
        missing = missing_kernel_args(host.get_fact(KernelCmdline), args)
        return "kernel arguments not yet active: " + " ".join(missing) if missing else None

    def took_effect(pyinfra_host: Any) -> None:
        """The arguments are live and, for the cgroup v2 one, cgroup2 is mounted."""
        missing = missing_kernel_args(read_on(pyinfra_host, "cat /proc/cmdline").split(), args)
        if missing:
            raise OperationError(f"rebooted, but the kernel still lacks {' '.join(missing)}")
        if CGROUP_V2_ARG in args:
            fs_type = read_on(pyinfra_host, "stat -fc %T /sys/fs/cgroup")
            if fs_type != "cgroup2fs":
                raise OperationError(f"rebooted, but /sys/fs/cgroup is {fs_type}, not cgroup2fs")

    return RebootCheck("host_tuning", needed, took_effect)


def _time_sync(settings: HostTuningSettings) -> None:
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


@deploy("Host tuning")
def host_tuning(config: StackConfig, run: HostRun) -> None:
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
    run.reboots.append(kernel_args_reboot(settings.kernel_args))
