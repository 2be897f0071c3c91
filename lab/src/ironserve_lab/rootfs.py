"""Debootstrapped Debian 12 root file systems, built once and cached outside the repository.

The mirror is read from this machine's own apt configuration, so the lab uses
whatever Debian mirror the machine already trusts (no host name is written here).
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ironserve.paths import cache_dir

SUITE = "bookworm"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
APT_SOURCES = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]


def debian_mirror(sources: list[Path] = APT_SOURCES) -> str:
    """The first Debian (not security) mirror URI in this machine's apt sources."""
    for path in sources:
        if not path.exists():
            continue
        text = path.read_text()
        # deb822: "URIs: http://mirror/debian"; one-line: "deb http://mirror/debian bookworm main"
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            if "security" not in uri:
                return str(uri)
    raise RuntimeError(f"no Debian mirror found in {', '.join(map(str, sources))}")


def cached_rootfs(flavour: str, packages: list[str]) -> Path:
    """Return a debootstrapped root file system with `packages`, building it on first use.

    The cache key is the flavour plus the package list, so a changed list builds anew.
    Concurrent callers wait on a lock instead of building twice.
    """
    digest = hashlib.sha256(" ".join(sorted(packages)).encode()).hexdigest()[:12]
    root = cache_dir() / "rootfs"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{SUITE}-{flavour}-{digest}"
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".ironserve-complete").exists():
            return target
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        print(f"lab: building {flavour} root file system (debootstrap, once; cached in {root})", file=sys.stderr)
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--keyring={KEYRING}",
                f"--include={','.join(sorted(packages))}",
                SUITE,
                str(staging),
                debian_mirror(),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        (target / ".ironserve-complete").touch()
        return target
