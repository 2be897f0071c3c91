"""Paths a role owns (a file, a link, a directory, a unit), restored from whatever shape drift left them in.

pyinfra's files.put/link/directory stop with "exists and is not a file" when an admin or a script left a
directory, a link or a device where a file belongs, and write through a symlink instead of replacing it.
These operations read one fact of the path itself (never following a link), move a wrongly shaped path
aside into BACKUP_DIR (kept, never deleted) and write the desired one. An immutable path (chattr +i) is a
deliberate freeze: it is restored only when the inventory sets ironserve_clear_immutable, else that host
stops with the setting's name (a failing command, so the other hosts go on).
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from pyinfra.api.command import FileUploadCommand, QuoteString, StringCommand
from pyinfra.api.facts import FactBase
from pyinfra.api.util import get_template
from pyinfra.context import host
from pyinfra.operations import files

from ironserve.apt import installed
from ironserve.operations import Commands, failing, report
from ironserve.speed.reads import Read, read, reading_operation

BACKUP_DIR = "/var/backups/ironserve"
CLEAR_IMMUTABLE_KEY = "ironserve_clear_immutable"


@dataclass(frozen=True)
class PathShape:
    kind: str  # file, directory, link, other (a device, a fifo, a socket) or absent
    mode: str = ""  # permission bits in octal as stat prints them (644), the link itself for a link
    user: str = ""
    group: str = ""
    immutable: bool = False
    sha256: str = ""  # a regular file's content
    target: str = ""  # a link's target, as written

    @property
    def absent(self) -> bool:
        return self.kind == "absent"


class OwnedPath(FactBase[PathShape]):
    """What is at `path` itself (a link is not followed): kind, mode, owner, immutable flag, content hash."""

    def command(self, path: str) -> str:
        p = shlex.quote(path)
        return (
            f"p={p}; "
            'if [ -L "$p" ]; then k=link; elif [ -d "$p" ]; then k=directory; elif [ -f "$p" ]; then k=file; '
            'elif [ -e "$p" ]; then k=other; else k=absent; fi; '
            'if [ "$k" = absent ]; then echo absent; else '
            's=$(stat -c "%a|%U|%G" "$p"); i=-; h=; t=; '
            'if [ "$k" = file ] || [ "$k" = directory ]; then '
            'case "$(lsattr -d "$p" 2>/dev/null | cut -d" " -f1)" in *i*) i=i;; esac; fi; '
            'if [ "$k" = file ]; then h=$(sha256sum < "$p" | cut -d" " -f1); fi; '
            'if [ "$k" = link ]; then t=$(readlink "$p"); fi; '
            'echo "$k|$s|$i|$h|$t"; fi'
        )

    def process(self, output: Iterable[str]) -> PathShape:
        return parse_path_shape(list(output))


def parse_path_shape(lines: list[str]) -> PathShape:
    """The fact's one line `kind|mode|user|group|i|sha256|target` -> PathShape (a target may hold `|`)."""
    line = "\n".join(lines).strip()
    if line in {"", "absent"}:
        return PathShape("absent")
    kind, mode, user, group, immutable, sha256, target = line.split("|", 6)
    return PathShape(kind, mode, user, group, immutable == "i", sha256, target)


def render_template(path: Path, **context: Any) -> str:
    """A role's jinja2 template (ironserve.layout.role_template) rendered as pyinfra's files.template does, for
    owned_file's content."""
    return get_template(str(path)).render(**context)


def backup_path(path: str) -> str:
    return posixpath.join(BACKUP_DIR, path.lstrip("/"))


def backed_up(path: str, why: str, keep_original: bool = False) -> Commands:
    """Move `path` into BACKUP_DIR (copy it with `keep_original`), earlier backups kept as .~N~, and say why."""
    backup = backup_path(path)
    report(f"{path} {why}: {'copied' if keep_original else 'moved'} to {backup}")
    yield StringCommand("mkdir", "-p", QuoteString(posixpath.dirname(backup)))
    if keep_original:
        yield StringCommand("cp", "--backup=numbered", QuoteString(path), QuoteString(backup))
    else:
        yield StringCommand("mv", "-T", "--backup=numbered", QuoteString(path), QuoteString(backup))


def _moved_aside(path: str, shape: PathShape) -> Commands:
    yield from backed_up(path, f"was a {shape.kind}, not what ironserve owns there")


def _thawed(path: str, shape: PathShape, clear_immutable: bool, what: str) -> Generator[Any, None, bool]:
    """chattr -i an immutable path when the inventory allows it, else a failing command that stops this host
    naming the setting; False when the operation must stop there."""
    if not shape.immutable:
        return True
    if not clear_immutable:
        yield failing(
            f"{path} is immutable (chattr +i) and {what}: an admin froze it, so ironserve leaves it. "
            f"Set {CLEAR_IMMUTABLE_KEY}: true to let ironserve clear the flag and restore it (it is set again "
            f"after), or run `chattr -i {path}` yourself"
        )
        return False
    yield StringCommand("chattr", "-i", QuoteString(path))
    return True


def _refrozen(path: str, shape: PathShape) -> Commands:
    if shape.immutable:
        yield StringCommand("chattr", "+i", QuoteString(path))


def _ownership(path: str, shape: PathShape, mode: str, user: str, group: str, fresh: bool) -> Commands:
    if fresh or (shape.user, shape.group) != (user, group):
        yield StringCommand("chown", QuoteString(f"{user}:{group}"), QuoteString(path))
    if fresh or shape.mode != mode.lstrip("0"):
        yield StringCommand("chmod", mode, QuoteString(path))


@reading_operation(reads=lambda path, **_: [Read(OwnedPath, {"path": path})])
def owned_file(
    path: str,
    content: str | bytes | Callable[[], str | bytes],
    mode: str = "644",
    user: str = "root",
    group: str = "root",
    clear_immutable: bool = False,
) -> Commands:
    """`path` is a regular file with exactly `content`, `mode` and owner, whatever was there before. A callable
    `content` is computed when the operation runs (from facts that an earlier operation of the deploy changes)."""
    content = content() if callable(content) else content
    data = content.encode() if isinstance(content, str) else content
    shape = read(OwnedPath, path=path)
    wrong_shape = shape.kind not in {"file", "absent"}
    rewrite = wrong_shape or shape.sha256 != hashlib.sha256(data).hexdigest()
    reown = (shape.user, shape.group, shape.mode) != (user, group, mode.lstrip("0"))
    if not rewrite and not reown:
        host.noop(f"{path}: as ironserve writes it")
        return
    if not (yield from _thawed(path, shape, clear_immutable, "differs from what ironserve writes")):
        return
    if wrong_shape:
        yield from _moved_aside(path, shape)
    if shape.absent or wrong_shape:
        yield StringCommand("mkdir", "-p", QuoteString(posixpath.dirname(path)))
    if rewrite:
        yield FileUploadCommand(BytesIO(data), path, remote_temp_filename=host.get_temp_filename(path))
    yield from _ownership(path, shape, mode, user, group, fresh=rewrite)
    if not wrong_shape:
        yield from _refrozen(path, shape)


@reading_operation(reads=lambda path, **_: [Read(OwnedPath, {"path": path})])
def owned_link(path: str, target: str, clear_immutable: bool = False) -> Commands:
    """`path` is a symbolic link to `target`; a directory or file in its place is moved aside."""
    shape = read(OwnedPath, path=path)
    if shape.kind == "link" and shape.target == target:
        host.noop(f"{path} -> {target}")
        return
    if shape.kind not in {"link", "absent"}:
        if not (
            yield from _thawed(path, shape, clear_immutable, f"is a {shape.kind} where a link to {target} belongs")
        ):
            return
        yield from _moved_aside(path, shape)
    if shape.absent:
        yield StringCommand("mkdir", "-p", QuoteString(posixpath.dirname(path)))
    yield StringCommand("ln", "-sfnT", QuoteString(target), QuoteString(path))


@reading_operation(reads=lambda path, **_: [Read(OwnedPath, {"path": path})])
def owned_directory(
    path: str, mode: str = "755", user: str = "root", group: str = "root", clear_immutable: bool = False
) -> Commands:
    """`path` is a directory with `mode` and owner; a file or link in its place is moved aside."""
    shape = read(OwnedPath, path=path)
    if shape.kind == "directory" and (shape.user, shape.group, shape.mode) == (user, group, mode.lstrip("0")):
        host.noop(f"{path}: directory {mode} {user}:{group}")
        return
    fresh = shape.kind != "directory"
    if not (yield from _thawed(path, shape, clear_immutable, f"should be a directory {mode} {user}:{group}")):
        return
    if fresh and not shape.absent:
        yield from _moved_aside(path, shape)
    if fresh:
        yield StringCommand("mkdir", "-p", QuoteString(path))
    yield from _ownership(path, shape, mode, user, group, fresh=fresh)
    if not fresh:
        yield from _refrozen(path, shape)


@reading_operation(reads=lambda path, **_: [Read(OwnedPath, {"path": path})])
def owned_absent(path: str, clear_immutable: bool = False) -> Commands:
    """Nothing at `path` (a file ironserve no longer writes there), whatever its shape; a directory is kept
    in BACKUP_DIR rather than deleted."""
    shape = read(OwnedPath, path=path)
    if shape.absent:
        host.noop(f"{path}: absent")
        return
    if not (yield from _thawed(path, shape, clear_immutable, "should not exist")):
        return
    if shape.kind == "directory":
        yield from _moved_aside(path, shape)
    else:
        yield StringCommand("rm", "-f", QuoteString(path))


class UnitLoadState(FactBase[str]):
    """systemd's LoadState of a unit: loaded, not-found, masked, bad-setting, error."""

    def command(self, unit: str) -> str:
        return f"systemctl show --property=LoadState --value {shlex.quote(unit)}"

    def process(self, output: Iterable[str]) -> str:
        return " ".join(output).strip()


@reading_operation(reads=lambda unit, **_: [Read(UnitLoadState, {"unit": unit})])
def unmasked(unit: str) -> Commands:
    """`systemctl unmask` a unit an admin or a cleanup masked (a link to /dev/null), so it can be enabled and
    its files written."""
    if read(UnitLoadState, unit=unit) != "masked":
        host.noop(f"{unit} is not masked")
        return
    report(f"{unit} was masked: unmasking it")
    yield StringCommand("systemctl", "unmask", QuoteString(unit))


DOWNLOADS = "/var/cache/ironserve"  # what roles download before installing it: tarballs, installers


def downloads_ready(clear_immutable: bool = False) -> None:
    """curl (pyinfra's files.download runs it on the host) and DOWNLOADS, the folder `downloaded` writes into."""
    installed(name="curl (for downloads)", packages=["curl"])
    owned_directory(name=f"{DOWNLOADS} exists", path=DOWNLOADS, clear_immutable=clear_immutable)


@reading_operation(reads=lambda dest, **_: [Read(OwnedPath, {"path": dest})])
def downloaded(src: str, dest: str, sha256: str) -> Commands:
    """`dest` is a regular file with SHA-256 `sha256`: pyinfra's files.download (which checks the sum), run only
    when the file differs."""
    shape = read(OwnedPath, path=dest)
    if shape.kind == "file" and shape.sha256 == sha256.lower():
        host.noop(f"{dest}: SHA-256 {sha256}")
        return
    yield from files.download._inner(src=src, dest=dest, sha256sum=sha256)
