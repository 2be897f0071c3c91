"""Exact-version packages with apt, as every role that pins a set uses them: preferences, install, hold.

A pinned set is package -> version. `preferences` pins each at a priority above 1000, so apt also
downgrades to it (apt_preferences(5), "APT's Default Priority Assignments"); `pinned_install` installs the
whole set at once (dependent packages move together) only when a version differs; `held` marks it so
`apt upgrade` and unattended-upgrades leave it alone, and `unattended_blacklist` says the same to
unattended-upgrades by name.

A set pinned with `closed=True` is first closed under exact-version dependencies by the host's own apt metadata
(`closed_pins`, ironserve/aptindex.py): the packages a pinned meta-package depends on with `=` (tensorrt's
libnvinfer* siblings) are pinned, installed and held with it. The closure is read when each operation runs, so
on a first deploy it sees the repository the deploy has just configured; `repository_offers` proves, before any
package moves, that the repository carries the whole set and that apt resolves it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from pyinfra.api.operation import operation
from pyinfra.context import host, state

from ironserve.aptindex import Closure, Index, Lookup, exact_closure
from ironserve.facts import (
    AptCandidates,
    AptMadison,
    AptPackageFiles,
    AptProviders,
    AptShow,
    AptSimulation,
    DpkgHealth,
    DpkgPackages,
)
from ironserve.operations import Commands, failing, report
from ironserve.reads import Read, read, reading_operation

# Seconds to wait for dpkg's lock when another apt holds it (an apt left running by a dropped SSH session,
# unattended-upgrades): apt waits itself with DPkg::Lock::Timeout and says who holds the lock (apt.conf(5)).
LOCK_WAIT_S = 600
APT_GET = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
    f" -o DPkg::Lock::Timeout={LOCK_WAIT_S}"
)
# apt-get update takes the lists lock, which DPkg::Lock::Timeout does not cover (apt 2.6): retry while apt's
# message says another process holds it, printing that message, and fail at once on any other error.
APT_UPDATE = (
    "waited=0; until out=$(apt-get update -q 2>&1); do "
    'case "$out" in *"Could not get lock"*) ;; *) echo "$out" >&2; exit 1;; esac; '
    f'if [ "$waited" -ge {LOCK_WAIT_S} ]; then echo "$out" >&2; exit 1; fi; '
    'echo "apt-get update waits: $(echo "$out" | grep -m1 "Could not get lock")" >&2; '
    "sleep 5; waited=$((waited + 5)); done"
)


def metadata_lookup(
    show: Callable[[tuple[str, ...]], list[str]], providers: Callable[[tuple[str, ...]], Mapping[str, Any]]
) -> Lookup:
    """The closure's lookup from a host's apt: `show` answers AptShow's command for name=version specs, and
    `providers` AptProviders' for the names it knows no real package of (virtual names). The deploy answers them
    with facts, the acceptance gate with testinfra's commands: both derive the same set."""

    def lookup(wanted: dict[str, str]) -> Index:
        index = Index.parse(show(tuple(f"{n}={v}" for n, v in sorted(wanted.items()))))
        absent = tuple(sorted(name for name, version in wanted.items() if index.get(name, version) is None))
        if absent:
            for virtual, provided in providers(absent).items():
                index.providers.setdefault(virtual, set()).update((name, version) for name, version in provided)
        return index

    return lookup


def exact_closure_on_host(pins: dict[str, str]) -> Closure:
    """`pins` closed as `aptindex.exact_closure` closes them, from the host's apt metadata read now (one
    `apt-cache show` a depth, and `apt-cache showpkg` where a relation names a virtual package)."""
    lookup = metadata_lookup(lambda specs: read(AptShow, packages=specs), lambda names: read(AptProviders, names=names))
    return exact_closure(pins, lookup)


def closed_pins(pins: dict[str, str]) -> dict[str, str]:
    """`pins` and every package their exact-version dependencies reach, at the version they require."""
    return exact_closure_on_host(pins).pins


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


@reading_operation(
    reads=lambda pins, **_: [Read(DpkgPackages, {"patterns": tuple(pins)}), Read(DpkgHealth, {"packages": tuple(pins)})]
)
def pinned_install(pins: dict[str, str], recommends: bool = True, closed: bool = False) -> Commands:
    """Install exactly `pins` (package -> version), downgrading or replacing held packages when they drifted;
    `closed`: with every package their exact-version dependencies reach."""
    pins = closed_pins(pins) if closed else pins
    installed = read(DpkgPackages, patterns=tuple(pins))
    wrong = {n: v for n, v in pins.items() if n not in installed or installed[n].version != v}
    health = read(DpkgHealth, packages=tuple(n for n in pins if n not in wrong))
    if not wrong and not health.damaged and not health.interrupted:
        host.noop("installed at their pinned versions, every file in place: " + ", ".join(pins))
        return
    if health.interrupted:  # apt refuses to install until the interrupted run is completed
        report("dpkg was interrupted (a run cut off mid-install): completing it with dpkg --configure -a")
        yield "DEBIAN_FRONTEND=noninteractive dpkg --force-confdef --force-confold --configure -a"
    if wrong or health.damaged:
        yield APT_UPDATE
    if wrong:
        # The whole set at once: dependent packages (libcudnn8-dev = libcudnn8) move together.
        wanted = " ".join(shlex.quote(f"{name}={version}") for name, version in pins.items())
        options = "" if recommends else " --no-install-recommends"
        yield f"{APT_GET} --allow-downgrades --allow-change-held-packages{options} install {wanted}"
    if health.damaged:
        for name, paths in health.damaged.items():
            report(f"{name} lacks {', '.join(paths[:3])}: reinstalling it")
        again = " ".join(shlex.quote(f"{name}={pins[name]}") for name in health.damaged)
        yield f"{APT_GET} --allow-change-held-packages --reinstall install {again}"


@reading_operation(reads=lambda pins, **_: [Read(AptCandidates, {"packages": tuple(pins)})])
def pins_in_force(
    pins: dict[str, str], own_file: str, priority_key: str | None = None, closed: bool = False
) -> Commands:
    """Stop this host when apt would not install the pinned versions although they are pinned: another
    preferences entry outranks `own_file` (a site's pin of a newer driver). Overriding it would undo an admin's
    deliberate choice, so the host stops naming the setting that outranks it. Read when the deploy runs, after
    `own_file` is restored."""
    if not state.is_executing:
        host.noop(f"apt's candidates checked against {own_file} when the deploy runs")
        return
    pins = closed_pins(pins) if closed else pins
    candidates = read(AptCandidates, packages=tuple(pins))
    outranked = {n: candidates[n] for n, v in pins.items() if candidates.get(n) not in {v, None, "(none)"}}
    if not outranked:
        host.noop(f"apt's candidates are the pinned versions ({own_file} in force)")
        return
    shown = ", ".join(f"{name} {found} (pinned {pins[name]})" for name, found in outranked.items())
    raise_it = f", or raise {priority_key} above its priority" if priority_key else ""
    yield failing(
        f"apt would install {shown}: an apt preferences entry other than {own_file} outranks ironserve's pin "
        f"(see `apt-cache policy {' '.join(outranked)}`). Remove that entry{raise_it}"
    )


@operation()
def apt_updated() -> Commands:
    """apt-get update (waiting for another apt's lock), for a source or key that just changed."""
    yield APT_UPDATE


def same_repository(url: str) -> str:
    """A repository URL as apt-cache policy prints it: no trailing slash, and `file:/path` for `file:///path`."""
    if url.startswith("file:"):
        url = "file:/" + url.removeprefix("file:").lstrip("/")
    return url.rstrip("/")


@reading_operation(reads=lambda **_: [Read(AptPackageFiles)])
def repository_fetched(url: str) -> Commands:
    """apt-get update when apt has no index of the repository at `url` (its source restored, its lists cleaned)."""
    if same_repository(url) in {same_repository(fetched) for fetched in read(AptPackageFiles)}:
        host.noop(f"apt has fetched {url}")
        return
    yield APT_UPDATE


@reading_operation(reads=lambda packages, **_: [Read(DpkgPackages, {"patterns": tuple(packages)})])
def installed(packages: list[str], recommends: bool = True) -> Commands:
    """Install the packages dpkg lacks (any version), updating apt's lists first."""
    have = read(DpkgPackages, patterns=tuple(packages))
    missing = [name for name in packages if name not in have]
    if not missing:
        host.noop("installed: " + ", ".join(packages))
        return
    yield APT_UPDATE
    options = "" if recommends else " --no-install-recommends"
    yield f"{APT_GET}{options} install " + " ".join(shlex.quote(name) for name in missing)


@reading_operation(reads=lambda names, **_: [Read(DpkgPackages, {"patterns": tuple(names)})])
def held(names: list[str], closed_from: dict[str, str] | None = None) -> Commands:
    """`apt-mark hold` every installed package of `names` that is not held; with `closed_from` (the pins `names`
    come from), also every package their exact-version dependencies reach."""
    names = list(closed_pins(closed_from)) if closed_from is not None else names
    installed = read(DpkgPackages, patterns=tuple(names))
    loose = [n for n in names if n in installed and not installed[n].held]
    if not loose:
        host.noop("held: " + ", ".join(names))
        return
    yield "apt-mark hold " + " ".join(shlex.quote(n) for n in loose)


def _problems(closure: Closure) -> list[str]:
    problems = []
    for name, version in closure.missing.items():
        why = f"required by {closure.reached_by[name]} (= {version})" if name in closure.reached_by else "pinned"
        problems.append(f"{name} {version} ({why}) is not offered")
    return problems + closure.clashes


@reading_operation(
    reads=lambda pins, **_: [Read(AptShow, {"packages": tuple(f"{n}={v}" for n, v in sorted(pins.items()))})]
)
def repository_offers(pins: dict[str, str], repository: str) -> Commands:
    """Stop this host before any package of the set moves when `repository` does not carry every pinned version
    and every version their exact-version dependencies require, or when apt cannot install them together
    (`apt-get install --simulate` of the whole closed set, with the pins in force). The message gives apt's own
    reasons, the versions missing and what the repositories do offer of them. Read when the deploy runs, after
    the repository is configured and fetched; nothing to prove while every package is installed at its pin."""
    if not state.is_executing:
        host.noop(f"{repository} is checked against the lock when the deploy runs")
        return
    closure = exact_closure_on_host(pins)
    installed = read(DpkgPackages, patterns=tuple(closure.pins))
    if closure.ok and all(n in installed and installed[n].version == v for n, v in closure.pins.items()):
        host.noop(f"every one of the {len(closure.pins)} locked packages is installed at its pin")
        return
    simulation = read(AptSimulation, packages=tuple(f"{n}={v}" for n, v in closure.pins.items()))
    if closure.ok and simulation.ok:
        host.noop(f"apt resolves the whole set of {len(closure.pins)} packages from {repository}")
        return
    problems = _problems(closure) + [f"apt: {reason}" for reason in simulation.reasons]
    if not problems:
        problems = ["apt-get install --simulate failed without a reason"]
    missing = sorted(closure.missing)
    offers = read(AptMadison, packages=tuple(missing)) if missing else {}
    offered = "; ".join(
        f"{name}: {', '.join(offers[name][:5]) if offers.get(name) else 'no version at all'}" for name in missing
    )
    yield failing(
        f"the lock cannot be installed from {repository}, so no package was changed: {'; '.join(problems)}"
        + (f". The repositories offer {offered}" if offered else "")
        + f" (see `apt-cache policy {' '.join(missing or list(pins))}`)"
    )
