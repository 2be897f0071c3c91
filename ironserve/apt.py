"""Exact-version packages with apt, as every role that pins a set uses them: preferences, install, hold.

A pinned set is package -> version. `preferences` pins each at a priority above 1000, so apt also
downgrades to it (apt_preferences(5), "APT's Default Priority Assignments"); `pinned_install` installs the
whole set at once (dependent packages move together) only when a version differs; `held` marks it so
`apt upgrade` and unattended-upgrades leave it alone, and `unattended_blacklist` says the same to
unattended-upgrades by name.
"""

from __future__ import annotations

import re
import shlex

from pyinfra.api.operation import operation
from pyinfra.context import host

from ironserve.facts import DpkgPackages
from ironserve.operations import Commands

APT_GET = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
)


def preferences(pins: dict[str, str], priority: int, owner: str) -> str:
    """apt preferences pinning each package to its exact version; above 1000 apt also downgrades."""
    stanzas = [f"Package: {name}\nPin: version {version}\nPin-Priority: {priority}\n" for name, version in pins.items()]
    head = f"# Managed by ironserve ({owner}): exact versions.\n\n"
    return head + "\n".join(stanzas)


def unattended_blacklist(names: list[str], owner: str) -> str:
    """unattended-upgrades never touches these packages (entries are regular expressions)."""
    entries = "".join(f'    "{re.escape(name)}$";\n' for name in names)
    head = f"// Managed by ironserve ({owner}): unattended-upgrades never moves these pinned packages.\n"
    return head + "Unattended-Upgrade::Package-Blacklist {\n" + entries + "};\n"


@operation()
def pinned_install(pins: dict[str, str], recommends: bool = True) -> Commands:
    """Install exactly `pins` (package -> version), downgrading or replacing held packages when they drifted."""
    installed = host.get_fact(DpkgPackages, patterns=tuple(pins))
    wrong = {n: v for n, v in pins.items() if n not in installed or installed[n].version != v}
    if not wrong:
        host.noop("installed at their pinned versions: " + ", ".join(pins))
        return
    yield "apt-get update -q"
    # The whole set at once: dependent packages (libcudnn8-dev = libcudnn8) move together.
    wanted = " ".join(shlex.quote(f"{name}={version}") for name, version in pins.items())
    options = "" if recommends else " --no-install-recommends"
    yield f"{APT_GET} --allow-downgrades --allow-change-held-packages{options} install {wanted}"


@operation()
def held(names: list[str]) -> Commands:
    """`apt-mark hold` every installed package of `names` that is not held."""
    installed = host.get_fact(DpkgPackages, patterns=tuple(names))
    loose = [n for n in names if n in installed and not installed[n].held]
    if not loose:
        host.noop("held: " + ", ".join(names))
        return
    yield "apt-mark hold " + " ".join(shlex.quote(n) for n in loose)
