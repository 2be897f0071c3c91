"""A pinned apt set checked against package metadata: its exact-version closure, and what a repository offers.

NVIDIA's meta-packages pin their siblings with `=` on the full version: `tensorrt 8.6.1.6-1+cuda11.8` depends on
`libnvinfer-bin (= 8.6.1.6-1+cuda11.8)` and a dozen more, `nvidia-driver-525` on its `-525` siblings, Debian's
`nvidia-driver` on `nvidia-driver-libs (= X-1)`. apt installs a dependency at its candidate version only, so a
pin of the meta-package alone fails as soon as a newer sibling is published (`tensorrt : Depends: libnvinfer-bin
(= 8.6.1.6-1+cuda12.0) but 10.0.0.6-1+cuda12.4 is to be installed`, NVIDIA/TensorRT#3774). `exact_closure`
therefore follows every exact-version relation from the pinned roots through the metadata itself, and every other
relation to a sibling of the same build (published at the requiring package's own version, as a real package or
through a virtual name it provides), so the whole set is pinned, held and verified together. The metadata comes
from a repository's `Packages` index (`ironserve lock --check-repo`) or from the host's own apt (`apt-cache show
name=version`, which prints the same stanzas, and `apt-cache showpkg` for virtual names).

Stanzas are read with python-debian (`debian.deb822`), Debian's own parser of these files, and versions compared
with its implementation of dpkg's ordering.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from debian.deb822 import Packages, PkgRelation
from debian.debian_support import Version, version_compare


def upstream(version: str) -> str:
    """A Debian version's upstream part, no epoch and no revision (Debian policy 5.6.12): 525.85.12 of 525.85.12-1,
    8.6.1.6 of 8.6.1.6-1+cuda11.8; what a package family's siblings of one build share."""
    return str(Version(version).upstream_version)


# Fields whose relations apt must satisfy before or when it installs a package (deb-control(5)).
INSTALL_RELATIONS = ("Pre-Depends", "Depends")


@dataclass(frozen=True)
class Stanza:
    """One package version as an index describes it: its relations that must hold when it is installed."""

    name: str
    version: str
    relations: tuple[tuple[tuple[str, str | None, str | None], ...], ...]  # OR groups of (name, op, version)
    provides: tuple[str, ...] = ()  # the virtual package names it provides

    def other_targets(self) -> list[str]:
        """The names its relations reach without an exact version: the first alternative of every other group."""
        return [group[0][0] for group in self.relations if group[0][1] != "="]

    def exact_requirements(self) -> list[tuple[str, str, bool]]:
        """(name, version, alone) for each OR group whose first alternative is `name (= version)`: apt tries the
        first alternative first; `alone` says the group offers no other way to satisfy it."""
        found = []
        for group in self.relations:
            name, op, version = group[0]
            if op == "=" and version is not None:
                found.append((name, version, len(group) == 1))
        return found


def _relations(paragraph: Mapping[str, str]) -> tuple[tuple[tuple[str, str | None, str | None], ...], ...]:
    groups = []
    for field_name in INSTALL_RELATIONS:
        text = paragraph.get(field_name, "").strip()
        for group in PkgRelation.parse_relations(text) if text else []:
            alternatives = []
            for alternative in group:
                op, version = alternative.get("version") or (None, None)
                alternatives.append((alternative["name"], op, version))
            if alternatives:
                groups.append(tuple(alternatives))
    return tuple(groups)


def _provides(paragraph: Mapping[str, str]) -> tuple[str, ...]:
    text = paragraph.get("Provides", "").strip()
    return tuple(group[0]["name"] for group in PkgRelation.parse_relations(text)) if text else ()


@dataclass
class Index:
    """Package stanzas by name and version, from a `Packages` file or `apt-cache show` output, and which real
    package versions provide each virtual name (`providers`: from the stanzas' Provides, or from the host's
    `apt-cache showpkg`)."""

    stanzas: dict[str, dict[str, Stanza]] = field(default_factory=dict)
    providers: dict[str, set[tuple[str, str]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | Iterable[str]) -> Index:
        index = cls()
        sequence = text.splitlines() if isinstance(text, str) else list(text)
        for paragraph in Packages.iter_paragraphs(sequence, use_apt_pkg=False):
            name, version = paragraph.get("Package"), paragraph.get("Version")
            if name and version:
                stanza = Stanza(name, version, _relations(paragraph), _provides(paragraph))
                index.stanzas.setdefault(name, {})[version] = stanza
                for virtual in stanza.provides:
                    index.providers.setdefault(virtual, set()).add((name, version))
        return index

    def provider_at(self, name: str, version: str) -> str | None:
        """The real package that provides the virtual `name` at exactly `version`, when one does."""
        found = sorted(provider for provider, at in self.providers.get(name, set()) if at == version)
        return found[0] if found else None

    def get(self, name: str, version: str) -> Stanza | None:
        return self.stanzas.get(name, {}).get(version)

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def parsed(lines: tuple[str, ...]) -> Index:
        """`parse` of the same lines once per process: a deploy closes one host's set in several operations, each
        from the same fact's answer (25 ms a parse of the lab's whole index). The result is shared: not to be
        changed."""
        return Index.parse(lines)

    def versions(self, name: str) -> list[str]:
        """Every version of `name` the index carries, newest first (dpkg's ordering)."""
        return sorted(self.stanzas.get(name, {}), key=Version, reverse=True)


@dataclass(frozen=True)
class Closure:
    """A pinned set closed under exact-version dependencies, or what keeps it from closing."""

    pins: dict[str, str]  # roots and every package an exact-version relation reaches -> version
    reached_by: dict[str, str]  # package the closure added -> the package whose relation reached it
    missing: dict[str, str]  # package -> version that the metadata does not carry (a root, or a sole alternative)
    clashes: list[str]  # one package asked for at two versions, each naming who asks

    @property
    def added(self) -> dict[str, str]:
        return {name: self.pins[name] for name in self.reached_by}

    @property
    def ok(self) -> bool:
        return not self.missing and not self.clashes


# The stanzas of these exact versions (absent ones left out); the second argument names those the closure requires
# (a root, or a sole exact alternative), the rest being same-build siblings it only probes for.
Lookup = Callable[[dict[str, str], frozenset[str]], Index]


def exact_closure(roots: Mapping[str, str], lookup: Lookup, max_rounds: int = 16) -> Closure:
    """Follow the relations that tie a package to one version of another, from `roots` (package -> version),
    through the metadata `lookup` returns; it is asked for every newly reached version at once, one round per depth
    (on a host, `apt.metadata_lookup` answers from the repository's index read once, and asks apt only for a
    required version that index lacks).

    Two kinds of relation are followed:
    - exact: `dep (= v)` as the sole alternative, or the first one of a group where the metadata carries v (apt
      satisfies the group through another alternative otherwise);
    - same build: any other relation whose first alternative is published at the requiring package's own version,
      as a real package or through a provider of that virtual name (nvidia-kernel-dkms X-1 depends on the virtual
      `nvidia-kernel-support--v1`, which nvidia-kernel-support X-1 provides; cuda-toolkit-11-8 11.8.0-1 on
      `cuda-compiler-11-8 (>= 11.8.0)`, published at 11.8.0-1). apt would take that sibling's newest build, whose
      own `=` relations then clash with the pins, so it is pinned at the build the requiring package came with.
    """
    pins, reached_by, missing, clashes = dict(roots), {}, {}, []
    # package -> (version, the package whose relation asks for it or None for a root, whether it is required)
    frontier: dict[str, tuple[str, str | None, bool]] = {name: (version, None, True) for name, version in roots.items()}
    seen: set[tuple[str, str]] = set()  # (package, version) asked for
    for _ in range(max_rounds):
        if not frontier:
            break
        found = lookup(
            {name: version for name, (version, _, _) in frontier.items()},
            frozenset(name for name, (_, _, required) in frontier.items() if required),
        )
        following: dict[str, tuple[str, str | None, bool]] = {}
        for name, (version, asker, required) in frontier.items():
            seen.add((name, version))
            stanza = found.get(name, version)
            if stanza is None and not required:
                provider = found.provider_at(name, version)
                if asker is not None and provider is not None and provider not in pins:
                    following.setdefault(provider, (version, asker, False))
                continue
            if asker is not None:
                pins[name], reached_by[name] = version, asker
            if stanza is None:
                missing[name] = version
                continue
            for dependency, exact, alone in stanza.exact_requirements():
                queued = following.get(dependency)
                held = pins.get(dependency) or (queued[0] if queued else None)
                if held is None:
                    following[dependency] = (exact, name, alone)
                elif held != exact:
                    owner = reached_by.get(dependency) or (queued[1] if queued else None) or "the lock"
                    clashes.append(f"{name} {version} needs {dependency} (= {exact}); {owner} asks for {held}")
                elif queued and alone and not queued[2]:
                    following[dependency] = (exact, queued[1], True)
            for sibling in stanza.other_targets():
                if sibling not in pins and sibling not in following and (sibling, version) not in seen:
                    following[sibling] = (version, name, False)
        frontier = {name: entry for name, entry in following.items() if (name, entry[0]) not in seen}
    return Closure(pins, reached_by, missing, clashes)


# dpkg's relation operators (deb-control(5)) as comparisons of version_compare(installed, required).
_SATISFIES: dict[str, Callable[[int], bool]] = {
    "=": lambda c: c == 0,
    ">=": lambda c: c >= 0,
    "<=": lambda c: c <= 0,
    ">>": lambda c: c > 0,
    "<<": lambda c: c < 0,
}


def _satisfied(version: str, op: str | None, wanted: str | None) -> bool:
    return op is None or _SATISFIES[op](version_compare(version, wanted or ""))


def offered(index: Index, name: str, shown: int = 5) -> str:
    """What the metadata offers of `name`, newest first, for a message."""
    versions = index.versions(name)
    if not versions:
        return f"no {name} at all"
    more = f" and {len(versions) - shown} older" if len(versions) > shown else ""
    return f"{name} {', '.join(versions[:shown])}{more}"


def unmet_within(pins: Mapping[str, str], index: Index) -> list[str]:
    """Relations among the pinned packages themselves that their pinned versions break (a `>=` sibling pinned
    below what the other needs): a set that cannot be installed together, whatever else the OS offers."""
    problems = []
    for name, version in pins.items():
        stanza = index.get(name, version)
        if stanza is None:
            continue
        for group in stanza.relations:
            inside = [(dep, op, want) for dep, op, want in group if dep in pins]
            if not inside or len(inside) != len(group):
                continue  # an alternative outside the set may satisfy it: the OS's apt decides
            if not any(_satisfied(pins[dep], op, want) for dep, op, want in inside):
                shown = " | ".join(f"{dep} ({op} {want})" if op else dep for dep, op, want in group)
                pinned = ", ".join(f"{dep} {pins[dep]}" for dep, _, _ in inside)
                problems.append(f"{name} {version} depends on {shown}, but the set pins {pinned}")
    return problems


def repository_problems(roots: Mapping[str, str], index: Index) -> tuple[Closure, list[str]]:
    """The closure of `roots` in `index`, and one line per problem: a pinned version the repository does not
    carry (with what it does offer), a package asked for at two versions, a relation the set breaks."""
    closure = exact_closure(roots, lambda wanted, required: index)
    problems = []
    for name, version in closure.missing.items():
        why = "pinned by the lock" if name in roots else f"required by {closure.reached_by[name]} (= {version})"
        problems.append(f"{name} {version} ({why}) is not in the repository; it offers {offered(index, name)}")
    problems += closure.clashes
    problems += unmet_within(closure.pins, index)
    return closure, problems
