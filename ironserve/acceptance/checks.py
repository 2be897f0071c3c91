"""Checks several roles' gate tests make: the files that decide what runs as root (an apt source, key or pin, a unit,
containerd's config, a sysctl or module file; a writable one hands root to whoever can write it), the modprobe
rules in force that keep a module the stack needs out, and the admin's drop-ins in force on a managed unit."""

from __future__ import annotations

import shlex
from typing import Any

from ironserve.modprobe import blocks


def not_root_only(host: Any, paths: list[str]) -> dict[str, str]:
    """Each of `paths` that is not a root:root regular file or directory writable by root alone (a directory
    another user may write lets that user replace the files in it) -> `kind user:group mode`."""
    quoted = " ".join(shlex.quote(path) for path in paths)
    out = host.run(f'for p in {quoted}; do echo "$p|$(stat -c "%F|%U:%G|%a" "$p" 2>/dev/null || echo missing)"; done')
    wrong = {}
    for line in out.stdout.splitlines():
        path, _, shape = line.partition("|")
        kind, _, rest = shape.partition("|")
        owner, _, mode = rest.partition("|")
        if kind not in {"regular file", "directory"} or owner != "root:root" or int(mode or "0", 8) & 0o022:
            wrong[path] = shape.replace("|", " ")
    return wrong


def modprobe_blocks(host: Any, modules: list[str]) -> list[str]:
    """The rules in force (`modprobe --showconfig`: every modprobe.d file, later ones winning) that keep one of
    `modules` out: `blacklist M`, or `install M` running false or true instead of loading it."""
    shown = host.run("modprobe --showconfig")
    assert shown.rc == 0, f"modprobe --showconfig failed: {shown.stderr.strip()}"
    return [line for line in shown.stdout.splitlines() if blocks(line, modules)]


def admin_dropins(host: Any, unit: str) -> list[str]:
    """The drop-ins systemd applies to `unit` (DropInPaths: what is in force, from every unit path) that are neither
    the distribution's (/usr/lib, /lib: a package's, such as kubeadm's 10-kubeadm.conf) nor ironserve's own."""
    shown = host.run(f"systemctl show -p DropInPaths --value {shlex.quote(unit)}").stdout.split()
    return [p for p in shown if not p.startswith(("/usr/lib/", "/lib/")) and "ironserve" not in p.rsplit("/", 1)[-1]]
