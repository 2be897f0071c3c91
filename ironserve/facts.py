"""Facts several roles read: sysctls, the container kind, the OS, dpkg's packages and holds, systemd units.

Small and typed, each with a pure `process()` tested on output captured on real machines.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from ironserve.packages import distro_key

# A section marker a fact's command prints between the commands it chains: `echo '== name'`.
SECTION_MARKER = re.compile(r"^== (?P<name>[\w.-]+)\s*$")


def sections(lines: Iterable[str]) -> dict[str, list[str]]:
    """Output of commands chained with `echo '== name'` markers -> each name's lines, verbatim and in order.

    Lines before the first marker belong to no section and are dropped; a name that appears again continues
    its section. A marker of a section whose command printed nothing still names an empty section.
    """
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        marker = SECTION_MARKER.match(line)
        if marker:
            current = found.setdefault(marker["name"], [])
        elif current is not None:
            current.append(line)
    return found


@dataclass(frozen=True)
class SysctlEntry:
    value: str | None  # as /proc/sys shows it, fields joined by a tab; None when the key does not exist
    writable: bool  # False on a read-only /proc/sys or a kernel-global key inside a container


def grep_files(globs: Iterable[str], pattern: str, invert: bool = False) -> str:
    """The shell command printing `path:line` (grep -H) for each line of the files of `globs` that matches the ERE
    `pattern` (or does not, with `invert`). Globs left unquoted so the shell expands them; one that matches nothing
    stays literal and -f drops it."""
    flags = "-H -v -E" if invert else "-H -E"
    return f'for f in {" ".join(globs)}; do [ -f "$f" ] && grep {flags} {shlex.quote(pattern)} "$f"; done; true'


def lines_by_file(output: Iterable[str]) -> dict[str, list[str]]:
    """`path:line` as grep -H prints them -> path -> its lines, stripped (the paths read here hold no colon)."""
    files: dict[str, list[str]] = {}
    for line in output:
        path, colon, text = line.partition(":")
        if colon:
            files.setdefault(path, []).append(text.strip())
    return files


def _proc_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


class SysctlState(FactBase[dict[str, SysctlEntry]]):
    """Current value and writability of each sysctl key, read straight from /proc/sys."""

    def command(self, keys: Iterable[str]) -> str:
        lines = [
            f"k={shlex.quote(key)}; p={shlex.quote(_proc_path(key))}; "
            'if [ -e "$p" ]; then v=$(tr -s " \\t" "\\t" < "$p"); '
            'if [ -w "$p" ]; then w=rw; else w=ro; fi; else v=-; w=absent; fi; '
            'printf "%s|%s|%s\\n" "$k" "$w" "$v"'
            for key in keys
        ]
        return "; ".join(lines)

    def process(self, output: Iterable[str]) -> dict[str, SysctlEntry]:
        entries = {}
        for line in output:
            key, access, value = line.split("|", 2)
            entries[key] = SysctlEntry(value=None if access == "absent" else value, writable=access == "rw")
        return entries


class ContainerKind(FactBase[str | None]):
    """The container technology the host runs in (systemd-detect-virt), or None on metal or a VM."""

    def command(self) -> str:
        return "systemd-detect-virt --container || true"

    def process(self, output: Iterable[str]) -> str | None:
        kind = " ".join(output).strip()
        return None if kind in {"", "none"} else kind


class OsDistro(FactBase[str]):
    """`debian12`, `ubuntu2204`: the host's OS as NVIDIA's repositories name their directories."""

    def command(self) -> str:
        return '. /etc/os-release && echo "$ID $VERSION_ID"'

    def process(self, output: Iterable[str]) -> str:
        return parse_os_release(list(output))


# NVIDIA names these distributions' repository directories by the major version alone (rhel9 for RHEL 9.6):
# https://developer.download.nvidia.com/compute/cuda/repos/ lists rhel8, rhel9 beside debian12 and ubuntu2204.
MAJOR_ONLY = {"rhel"}


def parse_os_release(lines: list[str]) -> str:
    """`ID VERSION_ID` as the fact's command echoes them -> `debian12`; only the ID when there is no VERSION_ID
    (Debian testing and sid), which no profile pins packages for."""
    os_id, version, *_ = [*" ".join(lines).split(), "", ""]
    if os_id in MAJOR_ONLY:
        version = version.split(".")[0]
    return distro_key(os_id, version)


@dataclass(frozen=True)
class DpkgEntry:
    version: str
    held: bool


class DpkgPackages(FactBase[dict[str, DpkgEntry]]):
    """Installed packages among `patterns` (names or dpkg-query globs): name -> version, hold."""

    @staticmethod
    def default() -> dict[str, DpkgEntry]:  # no output: none installed
        return {}

    def command(self, patterns: Iterable[str]) -> str:
        quoted = " ".join(shlex.quote(p) for p in patterns)
        return f"dpkg-query -W -f='${{Package}}\\t${{Version}}\\t${{db:Status-Abbrev}}\\n' {quoted} 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> dict[str, DpkgEntry]:
        return parse_dpkg_query(output)


def parse_dpkg_query(lines: Iterable[str]) -> dict[str, DpkgEntry]:
    """Lines `name<TAB>version<TAB>status` -> installed packages (status `ii`, or `hi` when held)."""
    packages = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) < 3 or len(parts[2]) < 2 or parts[2][1] != "i":
            continue  # known to dpkg but not installed (removed, config files only, never installed)
        packages[parts[0]] = DpkgEntry(version=parts[1], held=parts[2][0] == "h")
    return packages


@dataclass(frozen=True)
class DpkgHealthState:
    interrupted: bool  # dpkg stopped mid-run: apt refuses to install until `dpkg --configure -a`
    damaged: dict[str, list[str]]  # installed package -> its files that are gone from disk


class DpkgHealth(FactBase[DpkgHealthState]):
    """Whether dpkg was interrupted, and which files of `packages` are missing on disk.

    Checked against each package's md5sums list (every file dpkg installed except its conffiles), by existence
    only: a stat per file, fast on a CUDA toolkit's thousands of files, where checksumming would read gigabytes.
    Files that dpkg's path-exclude filters keep off disk (minimal images drop /usr/share/doc) are not missing.
    Pending updates while a dpkg or apt runs are that run's, not an interrupted one.
    """

    @staticmethod
    def default() -> DpkgHealthState:  # no output: nothing interrupted, nothing missing
        return DpkgHealthState(False, {})

    def command(self, packages: Iterable[str]) -> str:
        checks = "".join(
            f'n={shlex.quote(p)}; f=$(dpkg-query --control-path "$n" md5sums 2>/dev/null); '
            '[ -n "$f" ] && cut -c35- "$f" | while IFS= read -r x; do '
            '[ -e "/$x" ] || [ -L "/$x" ] || echo "missing $n /$x"; done; '
            for p in packages
        )
        return (
            "ls -A /var/lib/dpkg/updates 2>/dev/null | grep -q . && ! pgrep -x 'dpkg|apt-get|apt|unattended-upgr' "
            ">/dev/null 2>&1 && echo interrupted; "
            "cat /etc/dpkg/dpkg.cfg /etc/dpkg/dpkg.cfg.d/* 2>/dev/null | grep -E '^path-(exclude|include)[= ]' | "
            "sed 's/^/filter /'; "
            f"{checks}true"
        )

    def process(self, output: Iterable[str]) -> DpkgHealthState:
        interrupted, damaged, filters = False, dict[str, list[str]](), list[tuple[bool, str]]()
        for line in output:
            if line.strip() == "interrupted":
                interrupted = True
            elif line.startswith("filter path-"):
                kind, _, pattern = line.removeprefix("filter path-").partition("=" if "=" in line else " ")
                filters.append((kind.strip() == "exclude", pattern.strip()))
            elif line.startswith("missing "):
                _, name, path = line.split(" ", 2)
                if not excluded_by_dpkg(path, filters):
                    damaged.setdefault(name, []).append(path)
        return DpkgHealthState(interrupted, damaged)


def excluded_by_dpkg(path: str, filters: list[tuple[bool, str]]) -> bool:
    """Whether dpkg's --path-exclude/--path-include filters (dpkg(1): glob patterns, the last that matches
    decides) keep `path` off disk."""
    excluded = False
    for exclude, pattern in filters:
        if fnmatch.fnmatchcase(path, pattern):
            excluded = exclude
    return excluded


class AptCandidates(FactBase[dict[str, str]]):
    """The version apt would install of each of `packages` (`apt-cache policy`'s Candidate), as its preferences
    in force decide: every file of /etc/apt/preferences.d and the repositories it has fetched."""

    @staticmethod
    def default() -> dict[str, str]:
        return {}

    def command(self, packages: Iterable[str]) -> str:
        return "apt-cache policy " + " ".join(shlex.quote(p) for p in packages) + " 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> dict[str, str]:
        candidates, package = {}, None
        for line in output:
            if line and not line[0].isspace() and line.rstrip().endswith(":"):
                package = line.rstrip()[:-1]
            elif package and line.strip().startswith("Candidate:"):
                candidates[package] = line.split(":", 1)[1].strip()
        return candidates


# The stanza fields the exact-version closure reads (ironserve/aptindex.py): the rest of `apt-cache show` is dropped
# on the host, so a round carries a few lines per package.
SHOWN_FIELDS = "^(Package|Version|Provides|Pre-Depends|Depends):|^$"


class AptShow(FactBase[list[str]]):
    """`apt-cache show name=version ...` of the versions apt knows, cut to the fields of their relations; a
    version apt does not know is left out (apt-cache prints nothing for it). Parsed by `aptindex.Index`."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self, packages: Iterable[str]) -> str:
        wanted = " ".join(shlex.quote(p) for p in packages)
        return f"apt-cache show {wanted} 2>/dev/null | grep -E '{SHOWN_FIELDS}' || true"

    def process(self, output: Iterable[str]) -> list[str]:
        return list(output)


class RepositoryStanzas(FactBase[list[str]]):
    """The stanzas of the repositories under `base` (every directory of it) that apt has fetched, at the upstream
    versions `upstreams` (a version's part before its revision: 525.85.12 of 525.85.12-1, 8.6.1.6 of
    8.6.1.6-1+cuda11.8), cut to their relation fields: a pinned set's own family and its same-build siblings,
    read from apt's lists in one command (`apt-get indextargets`, `apt-helper cat-file` for compressed lists)."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self, base: str, upstreams: Iterable[str]) -> str:
        wanted = " " + " ".join(upstreams) + " "
        lists = "apt-get indextargets --format '$(REPO_URI) $(FILENAME)' 'Identifier: Packages' 2>/dev/null"
        keep = (
            '/^(Package|Version|Provides|Pre-Depends|Depends): / { s = s $0 "\\n" } '
            '/^Version: / { v = $2; sub(/^[0-9]+:/, "", v); sub(/-[^-]*$/, "", v); '
            'if (index(w, " " v " ")) k = 1 } '
            '/^$/ { if (k) printf "%s\\n", s; s = ""; k = 0 } END { if (k) printf "%s\\n", s }'
        )
        return (
            f'{lists} | while read -r uri file; do case "$uri" in {shlex.quote(base)}*) '
            '[ -e "$file" ] && /usr/lib/apt/apt-helper cat-file "$file";; esac; done 2>/dev/null | '
            f"awk -v w={shlex.quote(wanted)} {shlex.quote(keep)}"
        )

    def process(self, output: Iterable[str]) -> list[str]:
        return list(output)


# apt-cache showpkg's lines a provider lookup reads: each package's name, its Reverse Provides heading and entries.
SHOWPKG_LINES = "^Package: |^Reverse Provides:|^[^ ]+ [^ ]+ [(]"


# apt-cache showpkg's lines a provider lookup reads: each package's name, its Reverse Provides heading and entries.
SHOWPKG_LINES = "^Package: |^Reverse Provides:|^[^ ]+ [^ ]+ [(]"


class AptProviders(FactBase[dict[str, list[tuple[str, str]]]]):
    """The real package versions that provide each of the virtual `names` (`apt-cache showpkg`'s Reverse Provides:
    `provider version (= )` lines under each `Package:`), as the host's repositories offer them."""

    @staticmethod
    def default() -> dict[str, list[tuple[str, str]]]:
        return {}

    def command(self, names: Iterable[str]) -> str:
        wanted = " ".join(shlex.quote(n) for n in names)
        return f"apt-cache showpkg {wanted} 2>/dev/null | grep -E '{SHOWPKG_LINES}' || true"

    def process(self, output: Iterable[str]) -> dict[str, list[tuple[str, str]]]:
        providers: dict[str, set[tuple[str, str]]] = {}
        name, reverse = None, False
        for line in output:
            if line.startswith("Package: "):
                name, reverse = line.split()[1], False
            elif line.startswith("Reverse Provides:"):
                reverse = True
            elif reverse and name:
                provider, version, *_ = line.split()
                providers.setdefault(name, set()).add((provider, version))
        return {name: sorted(found) for name, found in providers.items()}


@dataclass(frozen=True)
class Simulation:
    ok: bool
    reasons: list[str]  # apt's own lines saying why not: unmet dependencies and errors


# The lines of apt-get's answer that say why a set cannot be installed (apt-get(8) prints them after this heading).
UNMET_HEADING = "The following packages have unmet dependencies:"


class AptSimulation(FactBase[Simulation]):
    """Whether `apt-get install --simulate` of exactly `packages` (name=version), with the preferences in force,
    succeeds: nothing is installed, apt's resolver only says whether the whole set resolves together."""

    def command(self, packages: Iterable[str]) -> str:
        wanted = " ".join(shlex.quote(p) for p in packages)
        return (
            "LC_ALL=C apt-get install --simulate -q --allow-downgrades --allow-change-held-packages "
            f'{wanted} 2>&1; echo "apt-get exit $?"'
        )

    def process(self, output: Iterable[str]) -> Simulation:
        return parse_simulation(list(output))


def parse_simulation(lines: list[str]) -> Simulation:
    """apt-get's output and the closing `apt-get exit N` line -> whether it resolved, and apt's reasons."""
    status = next((line.split()[-1] for line in reversed(lines) if line.startswith("apt-get exit ")), "1")
    reasons, unmet = [], False
    for line in lines:
        if line.startswith(UNMET_HEADING):
            unmet = True
        elif line.startswith(("E: ", "W: Unable")):
            reasons.append(line)
        elif unmet and line.startswith(" ") and line.strip():
            reasons.append(" ".join(line.split()))
        elif unmet:
            unmet = False
    return Simulation(ok=status == "0", reasons=reasons)


class AptMadison(FactBase[dict[str, list[str]]]):
    """Every version of `packages` the host's repositories offer (`apt-cache madison`), in apt's order."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def command(self, packages: Iterable[str]) -> str:
        return "apt-cache madison " + " ".join(shlex.quote(p) for p in packages) + " 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        versions: dict[str, list[str]] = {}
        for line in output:
            parts = [part.strip() for part in line.split("|")]
            if len(parts) >= 3 and parts[0] and parts[1] and parts[1] not in versions.get(parts[0], []):
                versions.setdefault(parts[0], []).append(parts[1])
        return versions


class AptPackageFiles(FactBase[list[str]]):
    """The repositories apt has fetched an index of (`apt-cache policy`'s package files), as URLs: what apt
    will install from, whatever sources.list.d says."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self) -> str:
        return "apt-cache policy 2>/dev/null | sed -n 's|^ *[0-9-]* \\([a-z+]*:[^ ]*\\).*|\\1|p' || true"

    def process(self, output: Iterable[str]) -> list[str]:
        return [line.strip().rstrip("/") for line in output if line.strip()]


# --- systemd ---------------------------------------------------------------------------------------------------


class StaleUnits(FactBase[list[str]]):
    """Units active since before their newest input file changed (they run an older unit or config)."""

    def command(self, inputs: dict[str, list[str]]) -> str:
        return "; ".join(
            f"echo {shlex.quote(unit)} "
            f"$(systemctl show --property=ActiveEnterTimestamp --timestamp=unix --value {shlex.quote(unit)}) "
            f"$(stat -c %Y {' '.join(map(shlex.quote, paths))} 2>/dev/null | sort -n | tail -1)"
            for unit, paths in inputs.items()
        )

    def process(self, output: Iterable[str]) -> list[str]:
        stale = []
        for line in output:
            fields = line.split()  # unit, @<active since>, <newest mtime>; no @ when the unit never ran
            if len(fields) == 3 and fields[1].startswith("@") and int(fields[1][1:]) < int(fields[2]):
                stale.append(fields[0])
        return stale


class UnitsNeedingReload(FactBase[list[str]]):
    """Units whose file on disk changed since systemd loaded it (NeedDaemonReload)."""

    def command(self, units: list[str]) -> str:
        return "; ".join(
            f"echo {shlex.quote(u)} $(systemctl show --property=NeedDaemonReload --value {shlex.quote(u)})"
            for u in units
        )

    def process(self, output: Iterable[str]) -> list[str]:
        return [fields[0] for line in output if len(fields := line.split()) == 2 and fields[1] == "yes"]
