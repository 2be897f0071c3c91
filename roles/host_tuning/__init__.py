"""Host tuning: network sysctls, time sync, and the cgroup v2 kernel argument in GRUB.

Every step reads state through facts and changes only what differs, so a second run reports
zero changes. Inside a container a kernel-global key cannot be set live; the role persists it
and reports it as applied at boot instead of failing. A kernel argument GRUB carries but the
running kernel lacks is a reboot need, honoured once at the end of the deploy (ironserve.reboot).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.context import host
from pyinfra.operations import files, systemd

from ironserve.apt import installed
from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.facts import ContainerKind
from ironserve.layout import role_template
from ironserve.operations import Commands, failing, live_sysctl, service_state
from ironserve.owned import owned_file, render_template, unmasked
from ironserve.reboot import RebootCheck, read_on
from ironserve.run import HostRun
from ironserve.speed.reads import Read, read, reading_operation
from ironserve.sysctl_boot import boot_sysctls_win
from roles.host_tuning.facts import (
    GRUB_DEFAULTS,
    GrubCmdlineLinux,
    KernelCmdline,
    cmdline_after,
    drop_in_repair,
    missing_kernel_args,
    with_kernel_args,
)

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig
    from roles.host_tuning.settings import HostTuningSettings

CGROUP_V2_ARG = "systemd.unified_cgroup_hierarchy=1"


# /etc/default/grub and its drop-ins are shell, sourced by update-grub as root: inside GRUB_CMDLINE_LINUX's double
# quotes these would be expanded or end the string (and sed's replacement text treats the backslash specially too).
GRUB_SHELL_CHARACTERS = re.compile(r'[\\"$`\n]')
GRUB_CMDLINE_LINE = "^GRUB_CMDLINE_LINUX=.*"


def grub_assignment(args: list[str], path: str = GRUB_DEFAULTS) -> str:
    """The GRUB_CMDLINE_LINUX line for `args` in `path`; OperationError when an argument (one read back from the
    host included: the inventory's cannot) holds a character the shell would expand inside the double quotes."""
    unsafe = [arg for arg in args if GRUB_SHELL_CHARACTERS.search(arg)]
    if unsafe:
        raise OperationError(f"{path}: GRUB_CMDLINE_LINUX would carry shell characters in {unsafe!r}; edit it by hand")
    return f'GRUB_CMDLINE_LINUX="{" ".join(args)}"'


@reading_operation(reads=lambda **_: [Read(GrubCmdlineLinux), Read(ContainerKind)])
def grub_kernel_args(args: tuple[str, ...]) -> Commands:
    """Make GRUB_CMDLINE_LINUX carry `args` as update-grub computes it (after the /etc/default/grub.d drop-ins)
    and in /etc/default/grub itself, and regenerate grub.cfg when a file changes."""
    sources = read(GrubCmdlineLinux)
    if sources is None:
        if read(ContainerKind):
            host.noop("no GRUB in a container: the kernel command line belongs to the machine running it")
            return
        yield failing("/etc/default/grub is missing: ironserve supports GRUB-booted hosts")
        return
    defaults = cmdline_after(sources[:1])
    new_defaults = with_kernel_args(defaults, args)
    # /etc/default/grub carries the args even where a drop-in overrides it, so removing the drop-in keeps them.
    edits: dict[str, list[str]] = {GRUB_DEFAULTS: new_defaults} if new_defaults != defaults else {}
    # update-grub's value once /etc/default/grub holds new_defaults: drop-ins that only append then carry them too.
    effective = cmdline_after(sources[1:], new_defaults)
    if with_kernel_args(effective, args) != effective:
        path, drop_in_args = drop_in_repair(sources, new_defaults, args)
        edits[path] = drop_in_args
    if not edits:
        # The files that shape the value: the last that sets it outright, then those that append to it.
        start = max((i for i, source in enumerate(sources) if source.overrides), default=0)
        set_by = ", ".join(source.path for source in sources[start:] if source.changes)
        host.noop(f"GRUB_CMDLINE_LINUX is {' '.join(effective)!r} (set by {set_by}) and carries {' '.join(args)}")
        return
    try:
        lines = {path: grub_assignment(new_args, path) for path, new_args in edits.items()}
    except OperationError as unsafe:
        yield failing(str(unsafe))
        return
    for path, line in lines.items():
        yield from files.line._inner(path=path, line=GRUB_CMDLINE_LINE, replace=line)
    yield "update-grub"


def kernel_args_reboot(args: tuple[str, ...]) -> RebootCheck:
    """A reboot is needed while the running kernel lacks `args` (never in a container: the kernel is the machine's)."""

    def needed() -> str | None:
        if read(ContainerKind):
            return None
        missing = missing_kernel_args(read(KernelCmdline), args)
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

    return RebootCheck("host_tuning", needed, took_effect, reads=(Read(ContainerKind), Read(KernelCmdline)))


def _time_sync(settings: HostTuningSettings, clear_immutable: bool) -> None:
    installed(name="Install systemd-timesyncd", packages=["systemd-timesyncd"])
    if settings.ntp_servers:
        owned_file(
            name="Configure NTP servers",
            path="/etc/systemd/timesyncd.conf.d/ironserve.conf",
            content=render_template(role_template("host_tuning", "timesyncd.conf.j2"), settings=settings),
            clear_immutable=clear_immutable,
        )
    unmasked(name="systemd-timesyncd not masked", unit="systemd-timesyncd.service")
    dropins = foreign_dropins_moved_aside(
        name="No foreign drop-in on systemd-timesyncd",
        units=["systemd-timesyncd.service"],
        own=[],
        why="overrides systemd-timesyncd's unit (set its servers through host_tuning_ntp_servers)",
    )
    systemd.daemon_reload(name="systemd drops the foreign timesyncd drop-in", _if=dropins.did_change)
    # pyinfra restarts it only when it runs (never in a container, where it refuses to).
    systemd.service(
        name="Restart systemd-timesyncd without the foreign drop-in",
        service="systemd-timesyncd.service",
        restarted=True,
        _if=dropins.did_change,
    )
    # timesyncd refuses to run in a container (ConditionVirtualization=!container): the machine keeps its clock.
    service_state(
        name="Enable systemd-timesyncd",
        unit="systemd-timesyncd.service",
        enabled=True,
        running=None if read(ContainerKind) else True,
    )


@deploy("Host tuning")
def host_tuning(config: StackConfig, run: HostRun) -> None:
    settings = config.host_tuning
    owned_file(
        name="Persist sysctls",
        path=settings.sysctl_file,
        content=render_template(role_template("host_tuning", "sysctl.conf.j2"), settings=settings),
        clear_immutable=config.clear_immutable,
    )
    boot_sysctls_win(name="Sysctls win at boot", own_file=settings.sysctl_file, sysctls=settings.sysctls)
    for key, value in settings.sysctls.items():
        live_sysctl(name=f"Apply sysctl {key}", key=key, value=value)
    _time_sync(settings, config.clear_immutable)
    grub_kernel_args(name="Kernel arguments in GRUB", args=settings.kernel_args)
    run.reboots.append(kernel_args_reboot(settings.kernel_args))
