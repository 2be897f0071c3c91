"""`ironserve lock --check-repo`: a profile's lock against a repository's own index, from the admin's machine.

Before any deploy, the same question the deploy asks each host's apt: does the repository (NVIDIA's, or a site's
mirror of it) carry every pinned version, and every version their exact-version dependencies require? The index
is read from `<URL>/<directory>/x86_64/Packages.gz` (or `Packages`) for each OS the profile supports, or from a
local `Packages` file that an admin copied from the mirror (one OS, named with `--os`).
"""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ironserve.aptindex import Index, repository_problems
from ironserve.packages import pinned_packages
from ironserve.profiles import Profile

# Seconds to wait for a repository's index: a site mirror on the admin's network answers well within this.
FETCH_TIMEOUT_S = 60
INDEX_NAMES = ("Packages.gz", "Packages")


@dataclass(frozen=True)
class RepositoryCheck:
    os_key: str
    where: str  # the index read: a URL or a file
    pins: dict[str, str]  # the lock's packages for this OS, closed under exact-version dependencies
    added: dict[str, str]  # of those, what the closure added
    problems: list[str]


def index_location(source: str, directory: str) -> str:
    """The URL of the directory's flat repository under a base URL (NVIDIA's layout <dir>/x86_64/)."""
    return f"{source.rstrip('/')}/{directory}/x86_64/"


def read_index(source: str, directory: str) -> tuple[str, str]:
    """(where, text) of the index: a local Packages[.gz] file as given, else the repository's index under the
    base URL `source`. Raises ValueError saying what could not be read."""
    if "://" not in source:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{source}: no such Packages file (give a repository base URL or a Packages file)")
        data = path.read_bytes()
        return str(path), (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()
    base = index_location(source, directory)
    failures = []
    for name in INDEX_NAMES:
        url = base + name
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as exc:
            failures.append(f"{url}: {getattr(exc, 'reason', exc)}")
            continue
        return url, (gzip.decompress(data) if name.endswith(".gz") else data).decode()
    raise ValueError("no index could be read: " + "; ".join(failures))


def check_repository(profile: Profile, source: str, os_keys: list[str]) -> list[RepositoryCheck]:
    """The lock of each OS in `os_keys` checked against the repository's index; an index that cannot be read is
    that OS's problem (ValueError: an OS the profile does not support)."""
    checks = []
    for os_key in os_keys:
        directory = profile.repository_for(os_key)
        roots = pinned_packages(profile.packages, directory)
        try:
            where, text = read_index(source, directory)
        except ValueError as unread:  # this OS's directory is not there: a problem of this OS, the others go on
            checks.append(RepositoryCheck(os_key, source, roots, {}, [str(unread)]))
            continue
        closure, problems = repository_problems(roots, Index.parse(text))
        checks.append(RepositoryCheck(os_key, where, closure.pins, closure.added, problems))
    return checks


def report(profile: Profile, checks: list[RepositoryCheck]) -> list[str]:
    lines = []
    for check in checks:
        directory = profile.repository_for(check.os_key)
        verdict = "ok" if not check.problems else f"{len(check.problems)} problem(s)"
        lines.append(f"{check.os_key} ({directory}, {check.where}): {verdict}")
        lines.append(f"  {len(check.pins)} packages, {len(check.added)} reached by exact-version dependencies")
        lines += [f"  + {name} {version}" for name, version in sorted(check.added.items())]
        lines += [f"  ! {problem}" for problem in check.problems]
    return lines
