"""Value grammars every role's settings model shares: paths, package names and versions, sysctls.

One definition each, so two roles can never disagree on what a sysctl key or an absolute path is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field

ABS_PATH = r"^(/[\w.@+-]+)+$"
# Debian policy 5.6.1 (package names) and 5.6.12 (versions: [epoch:]upstream[-revision]).
DEBIAN_PACKAGE = r"^[a-z0-9][a-z0-9+.-]+$"
DEBIAN_VERSION = r"^[0-9][A-Za-z0-9.+~:-]*$"
SHA256 = r"^[0-9a-f]{64}$"
PackageName = Annotated[str, Field(pattern=DEBIAN_PACKAGE)]
PackageVersion = Annotated[str, Field(pattern=DEBIAN_VERSION)]

SYSCTL_KEY = re.compile(r"^[a-z0-9_]+(\.[A-Za-z0-9_-]+)+$")
# Keys whose value is a pair of ports, low before high.
PORT_RANGE_KEYS = frozenset({"net.ipv4.ip_local_port_range"})
# Keys whose value is a word (an algorithm name), not a number.
WORD_KEYS = frozenset({"net.ipv4.tcp_congestion_control", "net.core.default_qdisc"})


def sysctl_value(key: str, value: object) -> str:
    """Canonical text of a sysctl value, as `sysctl -n` prints it (fields separated by a tab)."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: a boolean is not a sysctl value; use 0 or 1")
    if key in WORD_KEYS:
        if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9_]+", value):
            raise ValueError(f"{key}: expected a single word such as 'bbr', got {value!r}")
        return value
    if key in PORT_RANGE_KEYS:
        fields = str(value).split()
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise ValueError(f"{key}: expected two port numbers 'LOW HIGH', got {value!r}")
        low, high = (int(f) for f in fields)
        if not 1024 <= low < high <= 65535:
            raise ValueError(f"{key}: expected 1024 <= LOW < HIGH <= 65535, got {value!r}")
        return f"{low}\t{high}"
    # Integers, or their text (a validated config re-validates its own canonical form).
    if (isinstance(value, int) and value >= 0) or (isinstance(value, str) and value.isdigit()):
        return str(value)
    raise ValueError(f"{key}: expected a non-negative integer, got {value!r}")


def canonical_sysctls(raw: object) -> dict[str, str]:
    """A mapping of sysctl key to value, each key checked and each value in `sysctl -n` form."""
    if not isinstance(raw, Mapping):
        raise ValueError("expected a mapping of sysctl key to value")
    canonical = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not SYSCTL_KEY.match(key):
            raise ValueError(f"{key!r} is not a sysctl key such as net.core.rmem_max")
        canonical[key] = sysctl_value(key, value)
    return canonical
