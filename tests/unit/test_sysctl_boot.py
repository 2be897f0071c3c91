"""Sysctls at boot (ironserve/sysctl_boot.py): systemd-sysctl's order, what beats a role's file, and the sed
commands that comment the winners out, run on real files and, where systemd-analyze is installed, read back
through systemd's own `cat-config --root`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ironserve.sysctl_boot import (
    SysctlAssignment,
    SysctlBootOrder,
    boot_overrides,
    boot_sysctls_win,
    dotted_key,
    parse_assignment,
    parse_cat_config,
    printed_files,
)
from tests.unit.operation_harness import FakeHost, fact_key, run_operation

HOST_TUNING_FILE = "/etc/sysctl.d/90-ironserve.conf"
CONTAINERS_FILE = "/etc/sysctl.d/91-ironserve-containers.conf"
HOST_TUNING = {
    "net.core.rmem_max": "26214400",
    "net.core.wmem_max": "26214400",
    "net.ipv4.ip_local_port_range": "1024\t65000",
    "net.ipv4.tcp_slow_start_after_idle": "0",
}
CONTAINERS = {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"}

# A Debian 12 host after both roles ran, with a hardening baseline (99-zzz), a runtime file, a vendor file that
# turns forwarding off, an admin's mask of a vendor file, and additions to /etc/sysctl.conf: real paths -> content
# (a str) or a symlink's target (a Path).
HOST_TREE: dict[str, str | Path] = {
    "usr/lib/sysctl.d/50-pid-max.conf": "# Bump the numeric PID range.\nkernel.pid_max = 4194304\n",
    "usr/lib/sysctl.d/95-vendor-forward.conf": (
        "# a vendor's router package\nnet.ipv4.ip_forward = 0\nnet.core.wmem_max = 212992\nkernel.x = 1\n"
    ),
    "usr/lib/sysctl.d/99-protect-links.conf": "fs.protected_fifos = 1\nfs.protected_regular = 2\n",
    "etc/sysctl.d/50-pid-max.conf": Path("/dev/null"),
    "etc/sysctl.d/90-ironserve.conf": (
        "# Managed by ironserve (roles/host_tuning).\nnet.core.rmem_max = 26214400\nnet.core.wmem_max = 26214400\n"
        "net.ipv4.ip_local_port_range = 1024 65000\nnet.ipv4.tcp_slow_start_after_idle = 0\n"
    ),
    "etc/sysctl.d/91-ironserve-containers.conf": (
        "# Managed by ironserve (roles/container_runtime): pod networking.\nnet.ipv4.ip_forward = 1\n"
        "net.bridge.bridge-nf-call-iptables = 1\n"
    ),
    "run/sysctl.d/95-runtime.conf": "net.ipv4.tcp_slow_start_after_idle = 0\n",
    "etc/sysctl.d/99-sysctl.conf": Path("../sysctl.conf"),
    "etc/sysctl.conf": (
        "#\n# /etc/sysctl.conf - Configuration file for setting system variables\n"
        "# See /etc/sysctl.d/ for additional system variables.\n#\n\n#net.ipv4.ip_forward=1\n\n"
        "# /etc/sysctl.d/99-zzz.conf\n"  # a comment naming the next file, after a blank: still content
        "net.core.wmem_max=4194304\n  net/ipv4/tcp_slow_start_after_idle = 1\n"
    ),
    "etc/sysctl.d/99-zzz.conf": (
        "# hardening baseline\nnet.ipv4.ip_forward = 0\nnet.ipv4.conf.*.rp_filter = 1\n-net.ipv4.conf.all.rp_filter\n"
        "-net.core.rmem_max = 212992\nnet/ipv4/ip_local_port_range = 1024\t65000\n; kernel.sysrq = 0\nkernel.sysrq=0\n"
    ),
}


def write_tree(root: Path, tree: dict[str, str | Path]) -> None:
    for relative, content in tree.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content)
        else:
            path.write_text(content)


def assignment(file: str, line: str) -> SysctlAssignment:
    parsed = parse_assignment(file, line)
    assert parsed is not None
    return parsed


# --- parsing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "dotted"),
    [
        ("net.ipv4.ip_forward", "net.ipv4.ip_forward"),
        ("net/ipv4/ip_forward", "net.ipv4.ip_forward"),
        ("/net/ipv4/ip_forward", "net.ipv4.ip_forward"),
        ("net/ipv4/conf/eth0.1/rp_filter", "net.ipv4.conf.eth0/1.rp_filter"),  # a VLAN's dot stays in its name
        ("net.ipv4.conf.eth0/1.rp_filter", "net.ipv4.conf.eth0/1.rp_filter"),
        ("net..core.rmem_max", "net.core.rmem_max"),
    ],
)
def test_keys_normalise_as_systemd_does(written: str, dotted: str) -> None:
    assert dotted_key(written) == dotted


def test_lines_parse_as_systemd_sysctl_reads_them() -> None:
    f = "/etc/sysctl.d/99-zzz.conf"
    assert parse_assignment(f, "  net.core.rmem_max=212992 ") == SysctlAssignment(
        f, "net.core.rmem_max", "212992", "net.core.rmem_max=212992"
    )
    assert parse_assignment(f, "-net.core.rmem_max = 212992") == SysctlAssignment(
        f, "net.core.rmem_max", "212992", "-net.core.rmem_max = 212992"
    )
    assert parse_assignment(f, "-net.ipv4.conf.all.rp_filter") == SysctlAssignment(
        f, "net.ipv4.conf.all.rp_filter", None, "-net.ipv4.conf.all.rp_filter"
    )
    assert parse_assignment(f, "net.ipv4.ip_local_port_range = 1024\t 65000").value == "1024\t 65000"  # type: ignore[union-attr]
    for skipped in ["", "   ", "# net.core.rmem_max = 1", "; net.core.rmem_max = 1", "no assignment", "= 1"]:
        assert parse_assignment(f, skipped) is None


def test_a_name_in_an_earlier_directory_masks_the_later() -> None:
    listed = [
        "/etc/sysctl.d/50-pid-max.conf",
        "/usr/lib/sysctl.d/50-pid-max.conf",
        "/lib/sysctl.d/50-pid-max.conf",
        "/lib/sysctl.d/99-protect-links.conf",
        "/usr/lib/sysctl.d/99-protect-links.conf",
        "/run/sysctl.d/99-protect-links.conf",
        "/usr/local/lib/sysctl.d/10-local.conf",
        "/lib/sysctl.d/10-local.conf",
        "/etc/sysctl.d/README.sysctl",
    ]
    assert printed_files(listed) == {
        "/etc/sysctl.d/50-pid-max.conf",
        "/run/sysctl.d/99-protect-links.conf",
        "/usr/local/lib/sysctl.d/10-local.conf",
    }


def test_content_that_looks_like_a_header_stays_content() -> None:
    """A file's known length decides where it ends, even when a line in it names the next file after a blank."""
    sysctl_conf = ["#", "# /etc/sysctl.conf - Configuration file", "", "# /etc/sysctl.d/99-zzz.conf", "a.b = 1"]
    lines = ["# /etc/sysctl.d/99-sysctl.conf", *sysctl_conf, "", "# /etc/sysctl.d/99-zzz.conf", "a.b = 0"]
    listed = {"/etc/sysctl.d/99-sysctl.conf": len(sysctl_conf), "/etc/sysctl.d/99-zzz.conf": 1}
    assert [(a.file, a.value) for a in parse_cat_config(lines, listed)] == [
        ("/etc/sysctl.d/99-sysctl.conf", "1"),
        ("/etc/sysctl.d/99-zzz.conf", "0"),
    ]
    # A file whose length could not be read: its content runs to the next header after a blank line.
    unknown = dict.fromkeys(listed, None)
    assert [(a.file, a.value) for a in parse_cat_config(lines, unknown)] == [
        ("/etc/sysctl.d/99-zzz.conf", "1"),  # the look-alike header wins here: why the lengths are listed
        ("/etc/sysctl.d/99-zzz.conf", "0"),
    ]
    # A header of a file not listed (not one systemd reads) is a comment.
    assert parse_cat_config(["# /etc/sysctl.d/x.conf", "a.b = 1"], {}) == []


# --- what wins at boot -----------------------------------------------------------------------------------------


def test_a_later_file_beats_own_file_and_an_earlier_one_does_not() -> None:
    assignments = [
        assignment("/usr/lib/sysctl.d/50-default.conf", "net.ipv4.ip_forward = 0"),
        assignment(CONTAINERS_FILE, "net.ipv4.ip_forward = 1"),
        assignment("/etc/sysctl.d/99-zzz.conf", "net.ipv4.ip_forward = 0"),
    ]
    assert boot_overrides(assignments, CONTAINERS_FILE, CONTAINERS) == [assignments[2]]
    assert boot_overrides(assignments[:2], CONTAINERS_FILE, CONTAINERS) == []


def test_own_file_not_written_yet_is_placed_by_its_name() -> None:
    """Facts are read before the deploy writes the role's file: its name alone says where it will be read."""
    assignments = [
        assignment("/usr/lib/sysctl.d/90-ironserve.conf", "net.ipv4.ip_forward = 0"),  # masked by ours
        assignment("/etc/sysctl.d/99-sysctl.conf", "net.ipv4.ip_forward = 0"),
    ]
    assert boot_overrides(assignments, "/etc/sysctl.d/90-ironserve.conf", CONTAINERS) == [assignments[1]]


def test_values_compare_as_the_kernel_reads_them() -> None:
    later = [assignment("/etc/sysctl.d/99-zzz.conf", "net/ipv4/ip_local_port_range = 1024   65000")]
    assert boot_overrides(later, HOST_TUNING_FILE, HOST_TUNING) == []
    later = [assignment("/etc/sysctl.d/99-zzz.conf", "net/ipv4/ip_local_port_range = 32768 60999")]
    assert boot_overrides(later, HOST_TUNING_FILE, HOST_TUNING) == later


def test_only_the_last_assignment_counts_but_each_differing_one_goes() -> None:
    wanted = {"net.ipv4.ip_forward": "1"}
    forward = "/etc/sysctl.d/95-forward.conf"
    baseline = "/etc/sysctl.d/99-baseline.conf"
    zero_one = [assignment(forward, "net.ipv4.ip_forward = 0"), assignment(baseline, "net.ipv4.ip_forward=1")]
    assert boot_overrides(zero_one, CONTAINERS_FILE, wanted) == []  # the baseline sets it back: ours at boot
    one_zero = [assignment(forward, "net.ipv4.ip_forward = 1"), assignment(baseline, "net.ipv4.ip_forward=0")]
    assert boot_overrides(one_zero, CONTAINERS_FILE, wanted) == one_zero[1:]
    zero_zero = [assignment(forward, "net.ipv4.ip_forward = 0"), assignment(baseline, "net.ipv4.ip_forward=0")]
    assert boot_overrides(zero_zero, CONTAINERS_FILE, wanted) == zero_zero  # 95's would win once 99's is gone


def test_a_glob_never_beats_an_explicit_key_but_an_exclusion_of_the_key_does() -> None:
    """systemd-sysctl skips a glob's match that some file sets by name; `-key` alone replaces our assignment
    with an exclusion, so the key keeps the kernel's default at boot."""
    wanted = {"net.ipv4.conf.all.rp_filter": "2"}
    glob = assignment("/etc/sysctl.d/99-zzz.conf", "net.ipv4.conf.*.rp_filter = 1")
    exclusion = assignment("/etc/sysctl.d/99-zzz.conf", "-net.ipv4.conf.all.rp_filter")
    assert boot_overrides([glob], HOST_TUNING_FILE, wanted) == []
    assert boot_overrides([glob, exclusion], HOST_TUNING_FILE, wanted) == [exclusion]


# --- the operation's commands on real files --------------------------------------------------------------------

SYSCTL_PATHS = re.compile(r"(?<![\\\w])/(etc|run|usr/lib|usr/local/lib|lib)/sysctl\.d/")


def run_on_tree(commands: list[str], root: Path) -> None:
    """Run the operation's shell commands with every sysctl.d path moved under `root`."""
    for command in commands:
        moved = SYSCTL_PATHS.sub(lambda m: f"{root}{m.group(0)}", command)
        subprocess.run(["sh", "-c", moved], check=True, capture_output=True, text=True)


def overrides_on(root: Path, assignments: list[SysctlAssignment], own_file: str, wanted: dict[str, str]) -> list[str]:
    host = FakeHost({fact_key(SysctlBootOrder): assignments})
    commands = run_operation(boot_sysctls_win, host, own_file=own_file, sysctls=wanted)
    assert all(isinstance(c, str) for c in commands)
    run_on_tree([str(c) for c in commands], root)
    return host.noops


@pytest.mark.skipif(shutil.which("sed") is None, reason="needs sed")
def test_sed_comments_out_lines_in_place_and_masks_vendor_files(tmp_path: Path) -> None:
    awkward = "net.ipv4.conf.eth0/1.rp_filter = [0].*^$&\\x"  # every character sed would read as special
    write_tree(
        tmp_path,
        {
            "etc/sysctl.d/99-sysctl.conf": Path("../sysctl.conf"),
            "etc/sysctl.conf": f"# keep\n  net.ipv4.ip_forward=0 \nnet.ipv4.ip_forward=0\n{awkward}\nkernel.x = 1\n",
            "usr/lib/sysctl.d/95-vendor.conf": "# vendor\nnet.ipv4.ip_forward = 0\nkernel.y = 1\n",
        },
    )
    wanted = {"net.ipv4.ip_forward": "1", "net.ipv4.conf.eth0/1.rp_filter": "2"}
    assignments = [
        assignment("/usr/lib/sysctl.d/95-vendor.conf", "net.ipv4.ip_forward = 0"),
        assignment("/etc/sysctl.d/99-sysctl.conf", "net.ipv4.ip_forward=0"),
        assignment("/etc/sysctl.d/99-sysctl.conf", awkward),
    ]
    overrides_on(tmp_path, assignments, CONTAINERS_FILE, wanted)
    marker = f"# ironserve: overridden by {CONTAINERS_FILE}: "
    assert (tmp_path / "etc/sysctl.d/99-sysctl.conf").is_symlink()  # the link kept, its target edited
    assert (tmp_path / "etc/sysctl.conf").read_text() == (
        f"# keep\n{marker}  net.ipv4.ip_forward=0 \n{marker}net.ipv4.ip_forward=0\n{marker}{awkward}\nkernel.x = 1\n"
    )
    vendor = (tmp_path / "usr/lib/sysctl.d/95-vendor.conf").read_text()
    assert vendor == "# vendor\nnet.ipv4.ip_forward = 0\nkernel.y = 1\n"  # the package's file untouched
    copy = (tmp_path / "etc/sysctl.d/95-vendor.conf").read_text().splitlines()
    assert copy[0].startswith("# ironserve: copy of ") and copy[0].endswith("commented out")
    assert copy[1:] == ["# vendor", f"{marker}net.ipv4.ip_forward = 0", "kernel.y = 1"]
    assert sorted(p.name for p in (tmp_path / "etc/sysctl.d").iterdir()) == ["95-vendor.conf", "99-sysctl.conf"]


def fact_output(root: Path) -> list[str]:
    """The fact's command on a tree under `root` (systemd-analyze --root), as if the tree were the host's."""
    command = SysctlBootOrder().command()
    command = SYSCTL_PATHS.sub(lambda m: f"{root}{m.group(0)}", command)
    command = command.replace("systemd-analyze ", f"systemd-analyze --root={root} ")
    stdout = subprocess.run(["sh", "-c", command], check=True, capture_output=True, text=True).stdout
    return [line.replace(str(root), "") for line in stdout.splitlines()]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (systemd)")
def test_systemd_reads_our_files_last_after_the_fix(tmp_path: Path) -> None:
    """Read by systemd's own cat-config: both roles' files beaten, fixed, then beaten by nothing."""
    write_tree(tmp_path, HOST_TREE)
    before = SysctlBootOrder().process(fact_output(tmp_path))
    assert [a.file for a in before if a.key == "kernel.pid_max"] == []  # masked by /etc's link to /dev/null
    assert [(a.file, a.line) for a in boot_overrides(before, HOST_TUNING_FILE, HOST_TUNING)] == [
        ("/usr/lib/sysctl.d/95-vendor-forward.conf", "net.core.wmem_max = 212992"),  # both roles' lines there
        ("/etc/sysctl.d/99-sysctl.conf", "net.core.wmem_max=4194304"),
        ("/etc/sysctl.d/99-sysctl.conf", "net/ipv4/tcp_slow_start_after_idle = 1"),
        ("/etc/sysctl.d/99-zzz.conf", "-net.core.rmem_max = 212992"),
    ]
    assert [(a.file, a.line) for a in boot_overrides(before, CONTAINERS_FILE, CONTAINERS)] == [
        ("/usr/lib/sysctl.d/95-vendor-forward.conf", "net.ipv4.ip_forward = 0"),
        ("/etc/sysctl.d/99-zzz.conf", "net.ipv4.ip_forward = 0"),
    ]
    overrides_on(tmp_path, before, HOST_TUNING_FILE, HOST_TUNING)
    overrides_on(tmp_path, before, CONTAINERS_FILE, CONTAINERS)
    after = SysctlBootOrder().process(fact_output(tmp_path))
    copy = (tmp_path / "etc/sysctl.d/95-vendor-forward.conf").read_text().splitlines()
    assert copy[2:] == [
        f"# ironserve: overridden by {CONTAINERS_FILE}: net.ipv4.ip_forward = 0",
        f"# ironserve: overridden by {HOST_TUNING_FILE}: net.core.wmem_max = 212992",
        "kernel.x = 1",
    ]  # the second role's operation edited the copy the first made, both before any fact was read again
    assert "/etc/sysctl.d/95-vendor-forward.conf" in {a.file for a in after}  # the copy masks the vendor file
    assert "/usr/lib/sysctl.d/95-vendor-forward.conf" not in {a.file for a in after}
    assert overrides_on(tmp_path, after, HOST_TUNING_FILE, HOST_TUNING) == [
        f"sysctls at boot: {HOST_TUNING_FILE} wins for {', '.join(sorted(HOST_TUNING))}"
    ]
    assert overrides_on(tmp_path, after, CONTAINERS_FILE, CONTAINERS)[0].startswith("sysctls at boot: ")
    assert os.readlink(tmp_path / "etc/sysctl.d/99-sysctl.conf") == "../sysctl.conf"
