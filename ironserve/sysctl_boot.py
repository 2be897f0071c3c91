"""Sysctls as they will be in force at boot: which file's assignment systemd-sysctl applies last.

A role writes its own file in /etc/sysctl.d and sets the live value, but at every boot systemd-sysctl reads all
sysctl.d files in one order, and a later assignment of a key wins. sysctl.d(5): files in /etc/sysctl.d,
/run/sysctl.d, /usr/local/lib/sysctl.d and /usr/lib/sysctl.d (and /lib/sysctl.d on split-usr systems) are merged
by file name, a file in an earlier directory of that list masking a same-named file in a later one, and then read
in lexicographic order of their names. So a hardening baseline's /etc/sysctl.d/99-zzz.conf, or Debian's
/etc/sysctl.d/99-sysctl.conf (a link to /etc/sysctl.conf), overrides a role's 90-ironserve.conf at each boot.

`SysctlBootOrder` reads that order from systemd itself (`systemd-analyze cat-config sysctl.d`),
`boot_overrides` finds the assignments that would beat a role's file, and `boot_sysctls_win` comments them out.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve.operations import Commands, failing
from ironserve.speed.reads import Read, read, reading_operation

# sysctl.d(5)'s directories, highest precedence first: a file name found in an earlier one masks the later ones.
SYSCTL_DIRS = ("/etc/sysctl.d", "/run/sysctl.d", "/usr/local/lib/sysctl.d", "/usr/lib/sysctl.d", "/lib/sysctl.d")
# Files there an admin owns and may edit in place; the others belong to packages and are masked by a copy in /etc.
EDITABLE_DIRS = ("/etc/sysctl.d", "/run/sysctl.d")
MASKING_DIR = "/etc/sysctl.d"
CAT_CONFIG_MARKER = "== cat-config"
OVERRIDE_MARKER = "# ironserve: overridden by {own_file}: "


@dataclass(frozen=True)
class SysctlAssignment:
    file: str  # the sysctl.d file as systemd-sysctl reads it (a link's path, not its target)
    key: str  # in dot form, as sysctl.d(5) normalises `net/ipv4/ip_forward`; may be a glob
    value: str | None  # stripped; None for a `-key` line without `=`, which only excludes the key from globs
    line: str  # the line as written, stripped, to find it again in the file


def dotted_key(written: str) -> str:
    """A key as written -> its dot form: sysctl.d(5) reads a key whose first separator is `/` as a path (dots
    inside names, `net/ipv4/conf/eth0.1/rp_filter`), which in dot form swaps the two separators."""
    first = re.search(r"[./]", written)
    if first and first.group() == "/":
        written = written.translate(str.maketrans("./", "/."))
    return ".".join(part for part in written.split(".") if part)  # systemd drops empty path components too


def parse_assignment(file: str, line: str) -> SysctlAssignment | None:
    """One line of a sysctl.d file as systemd-sysctl parses it, or None for a blank, a comment or no assignment."""
    text = line.strip()
    if not text or text[0] in "#;":
        return None
    key, equals, value = text.partition("=")
    key = key.strip()
    if key.startswith("-"):  # ignore failures to write it; without `=`, a key excluded from globs
        key = key[1:].strip()
    elif not equals:
        return None  # systemd-sysctl warns "Line is not an assignment" and skips it
    if not key:
        return None
    return SysctlAssignment(file=file, key=dotted_key(key), value=value.strip() if equals else None, line=text)


def printed_files(listed: Iterable[str]) -> set[str]:
    """The sysctl.d files systemd reads (a header of cat-config's output each): per file name, the one in the
    directory of highest precedence (sysctl.d(5))."""
    winners: dict[str, tuple[int, str]] = {}
    for path in listed:
        directory, name = posixpath.split(path)
        if directory in SYSCTL_DIRS and name.endswith(".conf"):
            rank = SYSCTL_DIRS.index(directory)
            if name not in winners or rank < winners[name][0]:
                winners[name] = (rank, path)
    return {path for _, path in winners.values()}


def parse_listing(lines: Iterable[str]) -> dict[str, int | None]:
    """Lines `<number of lines> <path>` -> path -> its number of lines (None when it could not be read)."""
    listed: dict[str, int | None] = {}
    for line in lines:
        count, _, path = line.partition(" ")
        if path:
            listed[path] = int(count) if count.isdigit() else None
    return listed


def parse_cat_config(lines: list[str], listed: Mapping[str, int | None]) -> list[SysctlAssignment]:
    """`systemd-analyze cat-config sysctl.d` -> every assignment in the order systemd-sysctl applies them.

    It prints each file as a line `# <path>` and the file's content, a blank line between files. Content can
    look like a header (/etc/sysctl.conf begins `# /etc/sysctl.conf - Configuration file ...`), so a header is
    the first line or one after a blank, naming exactly a file systemd reads and not seen yet, and its file's
    known number of lines is taken as content whatever they hold.
    """
    headers = {f"# {path}": path for path in printed_files(listed)}
    assignments: list[SysctlAssignment] = []
    current: str | None = None
    after_blank = True
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if after_blank and line in headers:
            current = headers.pop(line)
            length = listed[current]
            if length is not None:
                content = lines[index : index + length]
                assignments.extend(a for text in content if (a := parse_assignment(current, text)))
                index += length
                after_blank = False
                continue
        elif current is not None and (assignment := parse_assignment(current, line)):
            assignments.append(assignment)
        after_blank = not line.strip()
    return assignments


class SysctlBootOrder(FactBase[list[SysctlAssignment]]):
    """Every sysctl assignment of the sysctl.d files, in the order systemd-sysctl applies them at boot.

    Each file that exists is listed first with its number of lines (awk counts a last line without a newline,
    as systemd does), to tell cat-config's headers from content that looks like one. No systemd-analyze (no
    systemd): no assignments.
    """

    @staticmethod
    def default() -> list[SysctlAssignment]:
        return []

    def command(self) -> str:
        globs = " ".join(f"{directory}/*.conf" for directory in SYSCTL_DIRS)
        # Colours and hyperlinks off: systemd adds them to headers when it thinks a terminal reads them.
        return (
            f'for f in {globs}; do [ -e "$f" ] && '
            'printf \'%s %s\\n\' "$(awk \'END { print NR }\' "$f" 2>/dev/null)" "$f"; done; '
            f"echo '{CAT_CONFIG_MARKER}'; "
            "SYSTEMD_COLORS=0 SYSTEMD_URLIFY=0 systemd-analyze --no-pager cat-config sysctl.d || true"
        )

    def process(self, output: Iterable[str]) -> list[SysctlAssignment]:
        lines = list(output)
        if CAT_CONFIG_MARKER not in lines:
            return []
        # Split at the first marker only: a file's content is printed verbatim after it and could hold anything.
        split = lines.index(CAT_CONFIG_MARKER)
        return parse_cat_config(lines[split + 1 :], parse_listing(lines[:split]))


def same_value(written: str | None, wanted: str) -> bool:
    """Values as the kernel reads them: `1024 65000`, `1024\t65000` and `1024  65000` are one port range."""
    return written is not None and written.split() == wanted.split()


def boot_overrides(
    assignments: Iterable[SysctlAssignment], own_file: str, wanted: Mapping[str, str]
) -> list[SysctlAssignment]:
    """The assignments that beat `own_file` at boot for the keys of `wanted`, in boot order.

    Only files whose names sort after own_file's count (sysctl.d(5); a same-named file is own_file or masked
    by it), judged by name so that an own_file not written yet is placed right. When the last of them sets a
    key to another value (or excludes it with `-key`), each of them that does must go: once the last is gone
    the one before it would win. A glob (`net.ipv4.conf.*.rp_filter`) never beats an explicit key:
    systemd-sysctl skips every key some file sets by name ("Not setting ... (explicit setting exists)").
    """
    own_name = posixpath.basename(own_file)
    later = [a for a in assignments if posixpath.basename(a.file) > own_name]
    beating: set[int] = set()
    for written, value in wanted.items():
        key = dotted_key(written)
        setting = [i for i, a in enumerate(later) if a.key == key]
        if setting and not same_value(later[setting[-1]].value, value):
            beating.update(i for i in setting if not same_value(later[i].value, value))
    return [a for i, a in enumerate(later) if i in beating]


# --- commenting the overriding lines out ------------------------------------------------------------------------


def sed_regex(text: str) -> str:
    """`text` matched literally in a sed basic regular expression delimited by `/`."""
    return re.sub(r"([\\.*\[\]^$/])", r"\\\1", text)


def sed_replacement(text: str) -> str:
    """`text` inserted literally by a sed `s/.../.../` replacement."""
    return re.sub(r"([\\&/])", r"\\\1", text)


def comment_out_script(lines: Iterable[str], own_file: str) -> list[str]:
    """sed expressions that prefix each of these lines (however indented) with ironserve's marker."""
    marker = sed_replacement(OVERRIDE_MARKER.format(own_file=own_file))
    return [f"/^[[:space:]]*{sed_regex(line)}[[:space:]]*$/s/^/{marker}/" for line in dict.fromkeys(lines)]


def under(path: str, directories: Iterable[str]) -> bool:
    return posixpath.dirname(path) in directories


def comment_out_command(file: str, lines: list[str], own_file: str) -> str:
    """The shell command that takes `lines` of `file` out of the boot order."""
    expressions = " ".join(f"-e {shlex.quote(e)}" for e in comment_out_script(lines, own_file))
    if under(file, EDITABLE_DIRS):
        # --follow-symlinks: Debian's 99-sysctl.conf links to ../sysctl.conf, which is edited; the link stays.
        return f"sed -i --follow-symlinks {expressions} {shlex.quote(file)}"
    # A vendor file is left to its package: a same-named copy in /etc masks it (sysctl.d(5)). Another role's
    # operation may have made the copy earlier in this deploy (facts are read before any runs): then it is edited.
    copy = posixpath.join(MASKING_DIR, posixpath.basename(file))
    partial = copy + ".ironserve-new"  # not *.conf: never read by systemd-sysctl half-written
    note = f"# ironserve: copy of {file}, masking it; lines it sets against {own_file} commented out"
    header = "-e " + shlex.quote("1i " + note.replace("\\", "\\\\"))  # sed's i text reads backslash escapes
    return (
        f"if [ -e {shlex.quote(copy)} ]; then sed -i {expressions} {shlex.quote(copy)}; "
        f"else sed {header} {expressions} {shlex.quote(file)} > {shlex.quote(partial)} && "
        f"mv -f {shlex.quote(partial)} {shlex.quote(copy)}; fi"
    )


@reading_operation(reads=lambda **_: [Read(SysctlBootOrder)])
def boot_sysctls_win(own_file: str, sysctls: dict[str, str]) -> Commands:
    """Make `own_file`'s sysctls the ones in force at boot: comment out each assignment of a later sysctl.d
    file (sysctl.d(5)'s order) that sets one of them to another value.

    Boot order only: live values are live_sysctl's. A line in /etc or /run is commented out in place; a vendor
    file (/usr/lib, /lib, /usr/local/lib) is masked by a copy in /etc/sysctl.d with the line commented out,
    which then no longer follows the package's updates of that file.
    """
    assignments = read(SysctlBootOrder)
    overrides = boot_overrides(assignments, own_file, sysctls)
    if not overrides:
        seen = "" if assignments else " (no sysctl.d configuration read: is systemd-analyze there?)"
        host.noop(f"sysctls at boot: {own_file} wins for {', '.join(sorted(sysctls))}{seen}")
        return
    by_file: dict[str, list[str]] = {}
    for override in overrides:
        if "ironserve" in posixpath.basename(override.file):
            # Two ironserve files disagree: editing one would be undone by the role that writes it, each run.
            yield failing(
                f"{override.file} sets {override.key} to {override.value!r} at boot, after {own_file}'s "
                f"{sysctls.get(override.key)!r}: two roles manage this key; set it in one of them"
            )
            return
        if not under(override.file, SYSCTL_DIRS):  # only the fact's parsing guarantees it: sed edits nothing else
            yield failing(f"{override.file} is in no sysctl.d directory: not edited")
            return
        by_file.setdefault(override.file, []).append(override.line)
    for file, lines in by_file.items():
        yield comment_out_command(file, lines, own_file)
