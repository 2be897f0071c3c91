"""Secrets stay out of inventory values, messages, pyinfra's output and world-readable files on a host.

- `userinfo_problem(url)`: why a URL setting carries a credential (`user[:password]@` in its authority, also
  written with look-alike `@`/`/` characters, backslashes, missing slashes, or a `?token=` parameter), or None.
- `redact(url)` and `redact_text(text)`: the same text with every credential replaced by `***`
  (`https://root:calvin@idrac/x` -> `https://***@idrac/x`); `redact_value(key, value)` for a message that
  shows an inventory value: also `***` for the whole value of a key named *password*, *token*, *secret* or
  *credential*, in nested mappings and lists too.
- `private_file(path)`: a file on the admin machine that holds a secret: a regular file outside the
  repository, owned by the admin (or root), neither group- nor world-accessible (0600).
- `secret_upload`: the pyinfra operation that installs such a file (or a secret's bytes) on a host as
  root:root 0600, or root:GROUP 0640 for a service's group, without
  ever showing its content (pyinfra's files.put prints both sides of a changed file with `--diff`);
  `private_upload`, its commands that write a secret to a root-only file, for other operations.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import unicodedata
from collections.abc import Generator, Mapping
from io import BytesIO
from pathlib import Path, PurePosixPath
from typing import IO, Any

from pyinfra.api.command import FileUploadCommand, QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.context import host, state
from pyinfra.facts.files import File, Sha256File

from ironserve.paths import REPO_ROOT
from ironserve.speed.reads import Read, read, reading_operation

MASK = "***"
# A key whose whole value is a secret (or names where one is).
SECRET_KEY = re.compile(r"pass(word|wd)|token|secret|credential", re.IGNORECASE)
# A query parameter that carries a secret (`?private_token=...`, `&X-Amz-Signature=...`).
SECRET_PARAMETER = re.compile(
    r"pass(word|wd)?|pwd|token|secret|credential|api[-_]?key|access[-_]?key|auth|sig(nature)?", re.IGNORECASE
)
# A value shaped like a credential whatever key carries it: an API key (OpenAI's `sk-`, GitHub's `ghp_`/
# `github_pat_`, GitLab's `glpat-`, Slack's `xox?-`, AWS access key ids), an HTTP Authorization value, a JWT, a
# private key in PEM (to its END line, or to the end of the text when cut).
SECRET_SHAPE = re.compile(
    r"\b(?:sk|rk|pk)-[A-Za-z0-9_-]{8,}|\bgh[pousr]_[A-Za-z0-9]{16,}|\bgithub_pat_[A-Za-z0-9_]{16,}"
    r"|\bglpat-[A-Za-z0-9_-]{16,}|\bxox[abprs]-[A-Za-z0-9-]{8,}|\bA[KS]IA[0-9A-Z]{16}\b"
    r"|\b(?:Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_QUERY_PAIR = re.compile(r"([^&;=#\s]*)=([^&;#\s]*)")


def _plain(char: str) -> str:
    """The character a URL parser may take `char` for (NFKC: FULLWIDTH COMMERCIAL AT is `@`, FULLWIDTH SOLIDUS `/`)."""
    return unicodedata.normalize("NFKC", char)


def _is(char: str, *plain: str) -> bool:
    return any(p in _plain(char) for p in plain)


def _authority(text: str, start: int) -> tuple[int, int, bool]:
    """(begin, end, after slashes) of the authority of a URL written from `start`: after the scheme and any
    slashes or backslashes, up to the first path, query or fragment delimiter (whitespace does not end it).

    `word:` is a scheme only before a slash: in `https:user:pw@host` or `user:pw@host` all before the `@`
    is taken for the userinfo (the most a parser could read as a credential)."""
    scheme = _SCHEME.match(text, start)
    slashed = scheme is not None and scheme.end() < len(text) and _is(text[scheme.end()], "/", "\\")
    position = scheme.end() if scheme and slashed else start
    while position < len(text) and _is(text[position], "/", "\\"):
        position += 1
    end = position
    while end < len(text) and not _is(text[end], "/", "\\", "?", "#"):
        end += 1
    return position, end, position > start and _is(text[position - 1], "/", "\\")


def _userinfo(text: str, start: int = 0, slashed: bool = False) -> tuple[int, int] | None:
    """(begin, end) of the userinfo of the URL written from `start` (up to its last `@`), or None.

    Userinfo is what precedes an `@` in an authority written after `//` (`https://token@host`), or, without
    the slashes, a `user:password@` (so `ai-service@blue.service` or `root@host` is none)."""
    begin, end, after_slashes = _authority(text, start)
    ats = [i for i in range(begin, end) if _is(text[i], "@")]
    if not ats:
        return None
    if slashed or after_slashes or any(_is(c, ":") for c in text[begin : ats[-1]]):
        return begin, ats[-1]
    return None


def _secret_parameters(text: str) -> list[tuple[int, int]]:
    """Spans of the values of query parameters named like a secret."""
    query = next((i for i, c in enumerate(text) if _is(c, "?")), None)
    if query is None:
        return []
    return [
        (m.start(2), m.end(2))
        for m in _QUERY_PAIR.finditer(text, query + 1)
        if SECRET_PARAMETER.search(m.group(1)) and m.group(2)
    ]


def userinfo_problem(url: str) -> str | None:
    """Why `url` carries a credential, in words that do not repeat it; None when it carries none."""
    if _userinfo(url) is not None:
        return "carries credentials (user:password@)"
    if _secret_parameters(url):
        return "carries a secret in its query (token=, password=, signature=...)"
    return None


def has_userinfo(value: object) -> bool:
    """Whether `value`, or any string inside a mapping or list of it, carries a credential in a URL."""
    if isinstance(value, str):
        return userinfo_problem(value) is not None or redact_text(value) != value
    if isinstance(value, Mapping):
        return any(has_userinfo(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(has_userinfo(v) for v in value)
    return False


def _masked(text: str, spans: list[tuple[int, int]]) -> str:
    for begin, end in sorted(spans, reverse=True):
        text = text[:begin] + MASK + text[end:]
    return text


def redact(url: str) -> str:
    """`url` with its userinfo and secret query values replaced: `https://***@host/path?token=***`."""
    spans = _secret_parameters(url)
    userinfo = _userinfo(url)
    if userinfo is not None:
        spans = [s for s in spans if s[0] >= userinfo[1]] + [userinfo]
    return _masked(url, spans)


def redact_text(text: str) -> str:
    """`text` (a message, a command line) with the credentials of every URL in it, and every value shaped like a
    credential (SECRET_SHAPE), replaced by `***`."""
    spans: list[tuple[int, int]] = [m.span() for m in SECRET_SHAPE.finditer(text)]
    for token in re.finditer(r"\S+", text):
        word = token.group()
        # Where a URL may begin: the word itself, and right after each `//` (`--index=https://u:p@h`).
        starts = {0} | {i + 2 for i in range(len(word) - 1) if _is(word[i], "/", "\\") and _is(word[i + 1], "/", "\\")}
        for start in sorted(starts):
            found = _userinfo(word, start, slashed=start > 0)
            if found is not None:
                spans.append((token.start() + found[0], token.start() + found[1]))
        spans += [(token.start() + b, token.start() + e) for b, e in _secret_parameters(word)]
    # Overlapping spans (one URL found from two starts): keep the widest of each overlap.
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return _masked(text, merged)


def redact_value(key: object, value: Any) -> Any:
    """`value` of inventory key `key` as a message may show it: `***` for a key named like a secret,
    credentials in URLs redacted (a URL as a whole value, whitespace included, and URLs inside text),
    mappings and lists redacted item by item (a mapping's items by their own keys)."""
    if isinstance(key, str) and SECRET_KEY.search(key):
        return MASK
    if isinstance(value, str):
        return redact_text(redact(value))
    if isinstance(value, Mapping):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(key, v) for v in value)
    if isinstance(value, set | frozenset):
        return sorted((redact_value(key, v) for v in value), key=repr)
    return value


def credential_paths(value: object, trail: str = "") -> list[str]:
    """The dotted paths (`swap.etcd_url`, `engine.extra_args[2]`) of the strings inside `value` that carry a
    credential in a URL."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in credential_paths(v, f"{trail}.{k}" if trail else str(k))]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in credential_paths(v, f"{trail}[{i}]")]
    return [trail or "(value)"] if has_userinfo(value) else []


def credentials_refused(url: object, where: str) -> None:
    """Raise ValueError when a URL setting carries a credential; `where` says where it goes instead."""
    if isinstance(url, str):
        problem = userinfo_problem(url)
        if problem is not None:
            raise ValueError(f"{problem}; credentials are never inventory values: {where}")


def private_file(path: str | Path) -> Path:
    """The absolute path of a file on this machine that holds a secret, or ValueError saying why not.

    Refused: no such file (the text given is not repeated: it may be the secret itself), a file inside the
    repository (it would be committed), not a regular file, not owned by this user or root, or readable or
    writable by group or others (anything but 0600/0400).
    """
    given = Path(path).expanduser()
    resolved = given.resolve()
    try:
        info = resolved.stat()
    except OSError:
        raise ValueError("names no file on this machine (the value is not shown: it may be a secret)") from None
    if resolved.is_relative_to(REPO_ROOT) or given.absolute().is_relative_to(REPO_ROOT):
        raise ValueError(f"{given} is inside the repository; keep secrets outside it (e.g. in ~/.config/ironserve/)")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{given} is not a regular file")
    if info.st_uid not in {os.geteuid(), 0}:
        raise ValueError(f"{given} is owned by uid {info.st_uid}, neither you (uid {os.geteuid()}) nor root")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ValueError(f"{given} has mode {mode:04o}, readable or writable by group or others: `chmod 600 {given}`")
    if not os.access(resolved, os.R_OK):
        raise ValueError(f"{given} cannot be read by this user")
    return resolved


# --- the upload -----------------------------------------------------------------------------------------------

Commands = Generator[Any, None, None]
PRIVILEGE_ARGUMENTS = ("_sudo", "_su_user", "_doas", "_dzdo")


@reading_operation(reads=lambda dest, **_: [Read(File, {"path": dest}), Read(Sha256File, {"path": dest})])
def secret_upload(src: str | bytes, dest: str, group: str = "root") -> Commands:
    """Install the private file `src` (this machine), or these bytes, as `dest`, root-owned, only when it differs:
    0600, or 0640 when `group` (a service's own group, e.g. prometheus) must read it.

    Compares SHA-256 digests, never contents, and prints neither (with `--diff` it says only that the
    secret changes). The file is created empty with mode 0600 first and filled over SFTP, so it is never
    readable by anyone else, not even for a moment, then given to `group` and moved into place atomically.
    Refused under `_sudo`/`_su_user`/`_doas`/`_dzdo`: pyinfra would stage the content in a world-readable
    temporary file.
    """
    refuse_escalation(dest)
    data = src if isinstance(src, bytes) else Path(src).read_bytes()
    mode = 600 if group == "root" else 640
    digest = hashlib.sha256(data).hexdigest()
    remote = read(File, path=dest)
    if remote and read(Sha256File, path=dest) == digest:
        if remote["mode"] == mode and remote["user"] == "root" and remote["group"] == group:
            host.noop(f"{dest} holds the secret, root:{group} {mode:04d} (content not shown)")
            return
        yield StringCommand("chmod", str(mode), QuoteString(dest))
        yield StringCommand("chown", f"root:{group}", QuoteString(dest))
        return
    if state.config.DIFF:
        host.log(f"Will {'modify' if remote else 'create'} {dest}: a secret, content not shown")
    staged = f"{dest}.ironserve-new"
    yield StringCommand("mkdir", "-p", QuoteString(str(PurePosixPath(dest).parent)))
    yield from private_upload(BytesIO(data) if isinstance(src, bytes) else src, staged)
    if group != "root":
        yield StringCommand("chown", f"root:{group}", QuoteString(staged), "&&", "chmod", "640", QuoteString(staged))
    yield StringCommand("mv", "-f", QuoteString(staged), QuoteString(dest))


def refuse_escalation(dest: str) -> None:
    """OperationError when the operation runs under `_sudo`/`_su_user`/`_doas`/`_dzdo`: pyinfra would stage the
    secret for `dest` in a world-readable temporary file."""
    arguments: Mapping[str, object] = host.current_op_global_arguments or {}
    escalation = [name for name in PRIVILEGE_ARGUMENTS if arguments.get(name)]
    if escalation:
        raise OperationError(
            f"{dest} holds a secret: not uploaded with {escalation[0]}, which stages files in a world-readable "
            "temporary file; connect as root (ssh_user: root)"
        )


def private_upload(src: str | IO[bytes], path: str) -> Commands:
    """The commands that write `src` (a file on this machine, or its bytes) to `path` as root:root 0600: created
    empty with that mode first and filled over SFTP (which keeps an existing file's mode), so no one else can read
    it, not even for a moment; the content is in no command."""
    yield StringCommand(
        "rm", "-f", QuoteString(path), "&&", "umask", "077", "&&",
        "install", "-m", "600", "-o", "root", "-g", "root", "/dev/null", QuoteString(path),
    )  # fmt: skip
    yield FileUploadCommand(src, path, remote_temp_filename=host.get_temp_filename(path))
