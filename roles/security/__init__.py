"""Security boundary of the inference service: service account, owned directories, cgroup v2 slice,
the hardening drop-in of every service unit (non-root, CAP_SYS_NICE only, seccomp allow-list) and
the same seccomp profile as a kubelet Localhost profile.

The drop-in and slice are rendered by roles/security/seccomp.py from files/ai-service.json, so
systemd and the container runtime enforce one syscall list.
"""

from __future__ import annotations

from io import StringIO
from typing import TYPE_CHECKING

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from ironserve.operations import Commands
from ironserve.run import HostRun
from roles.security.facts import PasswordState
from roles.security.seccomp import (
    DROPIN_NAME,
    SECCOMP_PROFILE,
    read_seccomp_profile,
    render_service_dropin,
    render_slice,
)

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig


@operation()
def locked_password(user: str) -> Commands:
    """Lock the account's password (no password login, ever), unless it already is."""
    state = host.get_fact(PasswordState, user=user)
    if state == "locked":
        host.noop(f"{user}: password locked")
    else:
        yield StringCommand("usermod", "--lock", QuoteString(user))


@deploy("Security")
def security(config: StackConfig, run: HostRun) -> None:
    settings = config.security
    profile = read_seccomp_profile()

    server.group(name="Service group", group=settings.group, system=True)
    server.user(
        name="Service account (no login shell)",
        user=settings.user,
        group=settings.group,
        groups=[],
        shell=settings.shell,
        home=settings.state_dir,
        system=True,
        create_home=False,
        ensure_home=False,
    )
    locked_password(name="Service account password locked", user=settings.user)

    # Least privilege: the service reads models it cannot change, and owns only its state and logs.
    for path, user, mode in (
        (settings.model_dir, "root", "750"),
        (settings.state_dir, settings.user, "700"),
        (settings.log_dir, settings.user, "750"),
    ):
        files.directory(
            name=f"Directory {path}", path=path, user=user, group=settings.group, mode=mode, recursive=False
        )

    changes = [
        files.put(
            name="Service slice (memory ceiling, CPU weight, NVIDIA devices only)",
            src=StringIO(render_slice(settings)),
            dest=f"/etc/systemd/system/{settings.slice}",
            mode="644",
        )
    ]
    dropin = render_service_dropin(settings, profile)
    for unit in settings.service_units:
        changes.append(
            files.put(
                name=f"Hardening drop-in for {unit}",
                src=StringIO(dropin),
                dest=f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}",
                mode="644",
                create_remote_dir=True,
            )
        )
    systemd.daemon_reload(name="Reload systemd units", _if=any_changed(*changes))

    files.put(
        name="Seccomp profile for the kubelet (Localhost)",
        src=str(SECCOMP_PROFILE),
        dest=f"{settings.kubelet_seccomp_dir}/{SECCOMP_PROFILE.name}",
        mode="644",
        create_remote_dir=True,
    )
