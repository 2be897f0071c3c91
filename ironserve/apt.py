"""Exact-version packages with apt, as every role that pins a set uses them: preferences, install, hold.

A pinned set is package -> version. `preferences` pins each at a priority above 1000, so apt also
downgrades to it (apt_preferences(5), "APT's Default Priority Assignments"); `pinned_install` installs the
whole set at once (dependent packages move together) only when a version differs; `held` marks it so
`apt upgrade` and unattended-upgrades leave it alone, and `unattended_blacklist` says the same to
unattended-upgrades by name.

A `ClosedSet` is a set closed by the host's own apt metadata (ironserve/aptindex.py): the packages a pinned
meta-package depends on with `=` (tensorrt's libnvinfer* siblings) and its same-build siblings are pinned,
installed and held with it. The metadata is the repository's fetched index at the lock's upstream versions, read in
one command (`RepositoryStanzas`, planned with the deploy's first facts, so a no-op run still reads each host in
two round trips); apt is asked further only for a required version that index lacks. The operations close the set
again when they run, so a first deploy sees the repository it has just configured; `repository_offers` proves,
before any package moves, that the repository carries the whole set and that apt resolves it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyinfra.api.operation import operation
from pyinfra.context import host, state

from ironserve.aptindex import Closure, Index, Lookup, exact_closure, upstream
from ironserve.facts import (
    AptCandidates,
    AptMadison,
    AptPackageFiles,
    AptProviders,
    AptShow,
    AptSimulation,
    DpkgHealth,
    DpkgPackages,
    RepositoryStanzas,
)
from ironserve.operations import Commands, failing, report
from ironserve.speed.reads import Read, read, reading_operation

# Seconds to wait for dpkg's lock when another apt holds it (an apt left running by a dropped SSH session,
# unattended-upgrades): apt waits itself with DPkg::Lock::Timeout and says who holds the lock (apt.conf(5)).
LOCK_WAIT_S = 600
APT_GET = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
    f" -o DPkg::Lock::Timeout={LOCK_WAIT_S}"
)
# Every way apt and dpkg say another process holds one of their locks: apt's, and dpkg's own (which dpkg and
# `apt-mark hold`, through dpkg --set-selections, print without waiting).
LOCK_MESSAGES = ("Could not get lock", "lock was locked by another process", "is locked by another process")


def lock_waiting(command: str) -> str:
    """`command` retried every 5 s while it fails saying another process holds apt's or dpkg's lock (dpkg,
    apt-mark and apt-get update do not wait as DPkg::Lock::Timeout makes apt-get install wait), for at most
    LOCK_WAIT_S, printing the holder; any other failure fails at once with its own message."""
    busy = "|".join(f'*"{message}"*' for message in LOCK_MESSAGES)
    return (
        f"waited=0; until out=$({command} 2>&1); do "
        f'case "$out" in {busy}) ;; *) echo "$out" >&2; exit 1;; esac; '
        f'if [ "$waited" -ge {LOCK_WAIT_S} ]; then echo "$out" >&2; exit 1; fi; '
        'echo "waiting for another apt or dpkg: $(echo "$out" | grep -m1 -i lock)" >&2; '
        'sleep 5; waited=$((waited + 5)); done; echo "$out"'
    )


# apt-get update takes the lists lock, which DPkg::Lock::Timeout does not cover (apt 2.6).
APT_UPDATE = lock_waiting("apt-get update -q")


def metadata_lookup(
    stanzas: list[str],
    show: Callable[[tuple[str, ...]], list[str]],
    providers: Callable[[tuple[str, ...]], Mapping[str, Any]],
) -> Lookup:
    """The closure's lookup on a host: `stanzas` are RepositoryStanzas' answer (the repository's own family at
    the lock's upstream versions, one read); only a required version it lacks is asked of apt, `show` answering
    AptShow's command and `providers` AptProviders' for names apt knows no real package of (virtual names). The
    deploy answers them with facts, the acceptance gate with testinfra's commands: both derive the same set."""
    family = Index.parsed(tuple(stanzas))

    def lookup(wanted: dict[str, str], required: frozenset[str]) -> Index:
        lacking = {n: v for n, v in wanted.items() if n in required and family.get(n, v) is None}
        if not lacking:
            return family
        index = Index.parse(show(tuple(f"{n}={v}" for n, v in sorted(lacking.items()))))
        index.providers = {name: set(found) for name, found in family.providers.items()}
        for versions in family.stanzas.values():
            for stanza in versions.values():
                index.stanzas.setdefault(stanza.name, {})[stanza.version] = stanza
        absent = tuple(sorted(name for name, version in lacking.items() if index.get(name, version) is None))
        if absent:
            for virtual, provided in providers(absent).items():
                index.providers.setdefault(virtual, set()).update((name, version) for name, version in provided)
        return index

    return lookup


@dataclass(frozen=True)
class ClosedSet:
    """A pinned set that is closed on the host (`aptindex.exact_closure`) by the metadata of the repositories
    under `base`: `roots` are the packages the lock asks for, `upstreams` the upstream versions whose stanzas
    are read in one command (every root's, and those of the other OS directories a profile names, so that the
    read is the same whichever directory the host uses)."""

    base: str
    roots: tuple[tuple[str, str], ...]
    upstreams: tuple[str, ...]

    @classmethod
    def of(cls, base: str, roots: Mapping[str, str], upstreams: Iterable[str] = ()) -> ClosedSet:
        every = sorted({upstream(v) for v in roots.values()} | set(upstreams))
        return cls(apt_uri(base), tuple(sorted(roots.items())), tuple(every))

    @classmethod
    def given(cls, value: ClosedSet | Mapping[str, Any]) -> ClosedSet:
        """An operation's argument as queued: the set itself, or its fields as plain data (an operation case)."""
        if isinstance(value, ClosedSet):
            return value
        return cls(value["base"], tuple(tuple(root) for root in value["roots"]), tuple(value["upstreams"]))

    def index_read(self) -> Read:
        return Read(RepositoryStanzas, {"base": self.base, "upstreams": self.upstreams})

    def closure(self) -> Closure:
        """The closure as the host's apt metadata states it, read now."""
        lookup = metadata_lookup(
            read(RepositoryStanzas, base=self.base, upstreams=self.upstreams),
            lambda specs: read(AptShow, packages=specs),
            lambda names: read(AptProviders, names=names),
        )
        return exact_closure(dict(self.roots), lookup)

    def pins(self) -> dict[str, str]:
        return self.closure().pins


def apt_uri(url: str) -> str:
    """A repository URL as apt records it (`apt-get indextargets`' REPO_URI): `file:/path/` for `file:///path`."""
    if url.startswith("file:"):
        url = "file:/" + url.removeprefix("file:").lstrip("/")
    return url if url.endswith("/") else url + "/"


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


def _closed_reads(closed: ClosedSet | Mapping[str, Any] | None) -> list[Read]:
    return [ClosedSet.given(closed).index_read()] if closed is not None else []


@reading_operation(
    reads=lambda pins, closed=None, **_: [
        *_closed_reads(closed),
        Read(DpkgPackages, {"patterns": tuple(pins)}),
        Read(DpkgHealth, {"packages": tuple(pins)}),
    ]
)
def pinned_install(pins: dict[str, str], recommends: bool = True, closed: ClosedSet | None = None) -> Commands:
    """Install exactly `pins` (package -> version), downgrading or replacing held packages when they drifted;
    with `closed`, its set as the host's metadata closes it when this runs (`pins`: that set as it was queued)."""
    pins = ClosedSet.given(closed).pins() if closed is not None else pins
    installed = read(DpkgPackages, patterns=tuple(pins))
    wrong = {n: v for n, v in pins.items() if n not in installed or installed[n].version != v}
    health = read(DpkgHealth, packages=tuple(n for n in pins if n not in wrong))
    if not wrong and not health.damaged and not health.interrupted:
        host.noop("installed at their pinned versions, every file in place: " + ", ".join(pins))
        return
    if health.interrupted:  # apt refuses to install until the interrupted run is completed
        report("dpkg was interrupted (a run cut off mid-install): completing it with dpkg --configure -a")
        yield lock_waiting("DEBIAN_FRONTEND=noninteractive dpkg --force-confdef --force-confold --configure -a")
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


@reading_operation(
    reads=lambda pins, closed=None, **_: [*_closed_reads(closed), Read(AptCandidates, {"packages": tuple(pins)})]
)
def pins_in_force(
    pins: dict[str, str], own_file: str, priority_key: str | None = None, closed: ClosedSet | None = None
) -> Commands:
    """Stop this host when apt would not install the pinned versions although they are pinned: another
    preferences entry outranks `own_file` (a site's pin of a newer driver). Overriding it would undo an admin's
    deliberate choice, so the host stops naming the setting that outranks it. Read when the deploy runs, after
    `own_file` is restored."""
    if not state.is_executing:
        host.noop(f"apt's candidates checked against {own_file} when the deploy runs")
        return
    pins = ClosedSet.given(closed).pins() if closed is not None else pins
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


@reading_operation(
    reads=lambda names, closed=None, **_: [*_closed_reads(closed), Read(DpkgPackages, {"patterns": tuple(names)})]
)
def held(names: list[str], closed: ClosedSet | None = None) -> Commands:
    """`apt-mark hold` every installed package of `names` that is not held; with `closed`, of its set as the
    host's metadata closes it when this runs."""
    names = list(ClosedSet.given(closed).pins()) if closed is not None else names
    installed = read(DpkgPackages, patterns=tuple(names))
    loose = [n for n in names if n in installed and not installed[n].held]
    if not loose:
        host.noop("held: " + ", ".join(names))
        return
    yield lock_waiting("apt-mark hold " + " ".join(shlex.quote(n) for n in loose))


def _problems(closure: Closure) -> list[str]:
    problems = []
    for name, version in closure.missing.items():
        why = f"required by {closure.reached_by[name]} (= {version})" if name in closure.reached_by else "pinned"
        problems.append(f"{name} {version} ({why}) is not offered")
    return problems + closure.clashes


@reading_operation(
    reads=lambda pins, closed, **_: [*_closed_reads(closed), Read(DpkgPackages, {"patterns": tuple(pins)})]
)
def repository_offers(pins: dict[str, str], closed: ClosedSet, repository: str) -> Commands:
    """Stop this host before any package of the set moves when `repository` does not carry every version of
    `closed`'s set (its roots and every version their relations require), or when apt cannot install them
    together (`apt-get install --simulate` of the whole set, with the pins in force). The message gives apt's own
    reasons, the versions missing and what the repositories do offer of them. Read when the deploy runs, after
    the repository is configured and fetched (`pins`: the set as it was queued); nothing to prove while every
    package is installed at its pin."""
    if not state.is_executing:
        host.noop(f"{repository} is checked against the lock when the deploy runs")
        return
    closure = ClosedSet.given(closed).closure()
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
