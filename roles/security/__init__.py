"""Security boundary of the inference service: service account, owned directories, cgroup v2 slice,
the hardening drop-in of every service unit (non-root, CAP_SYS_NICE only, seccomp allow-list) and
the same seccomp profile as a kubelet Localhost profile.

The drop-in and slice are rendered by roles/security/render.py from files/ai-service.json, so
systemd and the container runtime enforce one syscall list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.facts.server import Groups
from pyinfra.operations import server, systemd
from pyinfra.operations.util import any_changed

from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.operations import Commands, failing, report
from ironserve.owned import backed_up, owned_directory, owned_file
from ironserve.run import HostRun
from ironserve.speed.reads import Read, read, reading_operation
from roles.security.facts import (
    SUDOERS,
    AccountShape,
    GroupNumber,
    PasswordState,
    SudoAllows,
    SudoGrants,
    SupplementaryGroups,
)
from roles.security.render import (
    DROPIN_NAME,
    SECCOMP_PROFILE,
    read_seccomp_profile,
    render_service_dropin,
    render_slice,
)

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig


@reading_operation(reads=lambda user, **_: [Read(PasswordState, {"user": user})])
def locked_password(user: str) -> Commands:
    """Lock the account's password (no password login, ever), unless it already is."""
    state = read(PasswordState, user=user)
    if state == "locked":
        host.noop(f"{user}: password locked")
    else:
        yield StringCommand("usermod", "--lock", QuoteString(user))


@reading_operation(reads=lambda user, **_: [Read(SupplementaryGroups, {"user": user})])
def only_own_group(user: str) -> Commands:
    """The account belongs to no group beyond its own: a group (sudo, docker, disk) would hand the service its
    rights, and pyinfra's server.user leaves groups it was not told about."""
    extra = read(SupplementaryGroups, user=user)
    if not extra:
        host.noop(f"{user}: no group beyond its own")
        return
    report(f"{user} was in {', '.join(extra)}: removed")
    for group in extra:
        yield StringCommand("gpasswd", "--delete", QuoteString(user), QuoteString(group))


@reading_operation(
    reads=lambda user, group, **_: [Read(SudoGrants, {"user": user, "group": group}), Read(SudoAllows, {"user": user})]
)
def no_sudo_grants(user: str, group: str) -> Commands:
    """Move every /etc/sudoers.d file that names the service account or its group (a rule or a User_Alias) into
    BACKUP_DIR: sudo for the account hands root to whatever the service runs. A grant in /etc/sudoers itself stops
    the host instead (editing that file is visudo's job, one mistake locks every admin out), and so does a right
    sudo lists for the account that no file names it for (an ALL rule, a group alias)."""
    grants = read(SudoGrants, user=user, group=group)
    allowed = read(SudoAllows, user=user)
    if SUDOERS in grants:
        yield failing(
            f"{SUDOERS} grants the service account sudo ({'; '.join(grants[SUDOERS])}): remove it with visudo; "
            "the service account never gets sudo"
        )
        return
    for path, lines in grants.items():
        yield from backed_up(path, f"names the service account ({'; '.join(lines)}); other lines in it are kept there")
    if allowed and not grants:
        yield failing(
            f"sudo -l -U {user} says: {'; '.join(allowed)}; yet no sudoers file names {user} or %{group} (a right "
            "through ALL or an alias of a group it is in, or rules sudo cannot read): fix it with visudo; the service "
            "account never gets sudo"
        )
    elif not grants:
        host.noop(f"sudo allows {user} nothing" if allowed == [] else f"no sudoers file names {user} or %{group}")


# A system account's uids (Debian policy 9.2.2, login.defs SYS_UID_MIN/MAX), as security_uid allows them.
SYSTEM_UIDS = (100, 999)
RENUMBER = "renumbering is a migration (usermod -u / groupmod -g, then chown the files): do it by hand, or set"


def _group_reads(group: str, gid: int | None = None, **_: object) -> list[Read]:
    return [Read(Groups), *([Read(GroupNumber, {"group": group})] if gid is not None else [])]


@reading_operation(reads=_group_reads)
def service_group(group: str, gid: int | None = None) -> Commands:
    """A system group (with `gid` when given): pyinfra's server.group, run only when the group is missing; one
    with another number stops the host."""
    if group not in read(Groups):
        yield from server.group._inner(group=group, system=True, gid=gid)
        return
    found = read(GroupNumber, group=group) if gid is not None else None
    if found is not None and found != gid:
        yield failing(f"group {group} is gid {found}, security_gid is {gid}: {RENUMBER} security_gid {found}")
        return
    host.noop(f"group {group} exists" + (f" (gid {gid})" if gid is not None else ""))


@reading_operation(reads=lambda user, **_: [Read(AccountShape, {"user": user})])
def service_account(user: str, group: str, shell: str, home: str, uid: int | None = None) -> Commands:
    """A system account with this primary group, shell and home (never created: the service writes its state
    there), and `uid` when given: pyinfra's server.user, run only when the account differs; one with another
    uid, or a uid outside the system range, stops the host. Other groups: only_own_group."""
    existing = read(AccountShape, user=user)
    if existing and not SYSTEM_UIDS[0] <= existing.uid <= SYSTEM_UIDS[1]:
        yield failing(
            f"account {user} is uid {existing.uid}, outside the system range {SYSTEM_UIDS[0]}-{SYSTEM_UIDS[1]} "
            f"(`usermod -u`?): renumbering is a migration (usermod -u / groupmod -g, then chown the files): "
            f"do it by hand back to a system uid (security_uid pins which)"
        )
        return
    if existing and uid is not None and existing.uid != uid:
        shown = f"account {user} is uid {existing.uid}, security_uid is {uid}"
        yield failing(f"{shown}: {RENUMBER} security_uid {existing.uid}")
        return
    if existing and (existing.group, existing.shell, existing.home) == (group, shell, home):
        host.noop(f"account {user}: group {group}, shell {shell}, home {home}")
        return
    yield from server.user._inner(
        user=user, group=group, shell=shell, home=home, system=True, create_home=False, ensure_home=False, uid=uid
    )


@deploy("Security")
def security(config: StackConfig, run: HostRun) -> None:
    settings = config.security
    profile = read_seccomp_profile()

    service_group(name="Service group", group=settings.group, gid=settings.gid)
    service_account(
        name="Service account (no login shell)",
        user=settings.user,
        group=settings.group,
        shell=settings.shell,
        home=settings.state_dir,
        uid=settings.uid,
    )
    locked_password(name="Service account password locked", user=settings.user)
    only_own_group(name="Service account in no other group", user=settings.user)
    no_sudo_grants(name="Service account without sudo", user=settings.user, group=settings.group)
    frozen = config.clear_immutable

    # Least privilege: the service reads models it cannot change, and owns only its state and logs.
    for path, user, mode in (
        (settings.model_dir, "root", "750"),
        (settings.state_dir, settings.user, "700"),
        (settings.log_dir, settings.user, "750"),
    ):
        owned_directory(
            name=f"Directory {path}", path=path, user=user, group=settings.group, mode=mode, clear_immutable=frozen
        )

    changes = [
        owned_file(
            name="Service slice (memory ceiling, CPU weight, NVIDIA devices only)",
            path=f"/etc/systemd/system/{settings.slice}",
            content=render_slice(settings),
            clear_immutable=frozen,
        )
    ]
    dropin = render_service_dropin(settings, profile)
    for unit in settings.service_units:
        owned_directory(
            name=f"Drop-in directory of {unit}", path=f"/etc/systemd/system/{unit}.d", clear_immutable=frozen
        )
        changes.append(
            owned_file(
                name=f"Hardening drop-in for {unit}",
                path=f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}",
                content=dropin,
                clear_immutable=frozen,
            )
        )
    changes.append(
        foreign_dropins_moved_aside(
            name="No foreign drop-in on the hardened units",
            units=[settings.slice, *settings.service_units],
            own=[f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}" for unit in settings.service_units],
            why="overrides a unit ironserve hardens (set it through security_*)",
        )
    )
    systemd.daemon_reload(name="Reload systemd units", _if=any_changed(*changes))

    owned_directory(name="Kubelet seccomp directory", path=settings.kubelet_seccomp_dir, clear_immutable=frozen)
    owned_file(
        name="Seccomp profile for the kubelet (Localhost)",
        path=settings.kubelet_seccomp_profile,
        content=SECCOMP_PROFILE.read_bytes(),
        clear_immutable=frozen,
    )
