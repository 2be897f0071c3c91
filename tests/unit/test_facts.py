"""Pure parsers of the custom facts on hand-made output; tests/facts holds the recorded cases (test_fact_data)."""

from __future__ import annotations

import subprocess

from ironserve.apt import repository_fetched
from ironserve.facts import (
    AptPackageFiles,
    ContainerKind,
    DpkgHealth,
    DpkgHealthState,
    SysctlEntry,
    SysctlState,
    excluded_by_dpkg,
    parse_os_release,
    sections,
)
from roles.host_tuning.facts import (
    PREVIOUS,
    GrubCmdlineLinux,
    KernelCmdline,
    cmdline_after,
    missing_kernel_args,
    with_kernel_args,
)
from tests.unit.operation_harness import FakeHost, fact_key, run_operation


def test_sysctl_state_parses_values_writability_and_absence() -> None:
    output = [
        "net.core.rmem_max|ro|4194304",
        "net.ipv4.ip_local_port_range|rw|32768\t60999",
        "net.bogus.key|absent|-",
    ]
    assert SysctlState().process(output) == {
        "net.core.rmem_max": SysctlEntry("4194304", writable=False),
        "net.ipv4.ip_local_port_range": SysctlEntry("32768\t60999", writable=True),
        "net.bogus.key": SysctlEntry(None, writable=False),
    }


def test_grub_cmdline_composes_the_files_in_order() -> None:
    sources = GrubCmdlineLinux().process(
        ["/etc/default/grub\tquiet", f"/etc/default/grub.d/lab.cfg\t{PREVIOUS} console=ttyS0"]
    )
    assert sources is not None
    assert cmdline_after(sources) == ["quiet", "console=ttyS0"]
    assert cmdline_after(sources[1:], ["a=1"]) == ["a=1", "console=ttyS0"]
    assert GrubCmdlineLinux().process(["ABSENT"]) is None


def test_kernel_args_replace_same_key_and_keep_others() -> None:
    current = ["quiet", "systemd.unified_cgroup_hierarchy=0", "systemd.unified_cgroup_hierarchy=0"]
    assert with_kernel_args(current, ["systemd.unified_cgroup_hierarchy=1"]) == [
        "quiet",
        "systemd.unified_cgroup_hierarchy=1",
    ]
    assert with_kernel_args(["quiet"], ["a=1"]) == ["quiet", "a=1"]
    assert with_kernel_args(["quiet", "a=1"], ["a=1"]) == ["quiet", "a=1"]


def test_running_cmdline_and_missing_args() -> None:
    running = KernelCmdline().process(["BOOT_IMAGE=/boot/vmlinuz-6.1.0-28-amd64 root=UUID=x ro quiet"])
    assert missing_kernel_args(running, ["quiet", "systemd.unified_cgroup_hierarchy=1"]) == [
        "systemd.unified_cgroup_hierarchy=1"
    ]


def test_container_kind() -> None:
    assert ContainerKind().process(["none"]) is None
    assert ContainerKind().process(["container-other"]) == "container-other"


def test_sections_split_marked_command_output_verbatim() -> None:
    output = ["ignored before any marker", "== version", "nvidia-installer:  version 525.85.12", "", "== log"]
    output += ["nvidia-installer command line:", "    --silent", "== empty", "== log", "appended"]
    assert sections(output) == {
        "version": ["nvidia-installer:  version 525.85.12", ""],
        "log": ["nvidia-installer command line:", "    --silent", "appended"],
        "empty": [],
    }
    assert sections(["== not a marker because of this", "=== nor this", "==x"]) == {}
    assert sections([]) == {}


def test_os_release_keys_name_nvidia_repository_directories() -> None:
    assert parse_os_release(["debian 12"]) == "debian12"
    assert parse_os_release(["ubuntu 22.04"]) == "ubuntu2204"
    assert parse_os_release(["rhel 9.6"]) == "rhel9"  # NVIDIA's repos/rhel9 serves every RHEL 9 minor
    assert parse_os_release(["debian"]) == "debian"  # testing and sid have no VERSION_ID


# dpkg(1) --path-exclude/--path-include, as a minimal image's /etc/dpkg/dpkg.cfg.d/excludes sets them. Checked with
# the real dpkg 1.21.22 (--root=<scratch> -i of a .deb with a changelog and a copyright under /usr/share/doc): in
# this order the changelog stays off disk and the copyright is installed; given the other way round, neither is.
DOC_FILTERS = [(True, "/usr/share/doc/*"), (False, "/usr/share/doc/*/copyright")]


def test_excluded_by_dpkg_the_last_matching_filter_decides() -> None:
    assert excluded_by_dpkg("/usr/share/doc/libcudnn8/changelog.Debian.gz", DOC_FILTERS)
    assert not excluded_by_dpkg("/usr/share/doc/libcudnn8/copyright", DOC_FILTERS)
    assert excluded_by_dpkg("/usr/share/doc/libcudnn8/copyright", DOC_FILTERS[::-1])
    # dpkg's globs are fnmatch(3) without FNM_PATHNAME: `*` crosses `/`.
    assert excluded_by_dpkg("/usr/share/doc/libcudnn8/examples/mnist/README", DOC_FILTERS)
    assert not excluded_by_dpkg("/usr/lib/x86_64-linux-gnu/libcudnn.so.8.6.0", DOC_FILTERS)
    assert not excluded_by_dpkg("/usr/share/doc/libcudnn8/changelog.Debian.gz", [])
    assert not excluded_by_dpkg("/usr/share/doc-base/libcudnn8", DOC_FILTERS)


def test_dpkg_health_reads_filters_in_either_config_form() -> None:
    """dpkg.cfg lines are `option=value` or `option value` (dpkg(1), "Configuration files")."""
    output = [
        "filter path-exclude /usr/share/man/*",
        "filter path-exclude=/usr/share/doc/*",
        "filter path-include=/usr/share/doc/*/copyright",
        "missing cuda-nvcc-11-8 /usr/share/man/man1/nvcc.1.gz",
        "missing cuda-nvcc-11-8 /usr/share/doc/cuda-nvcc-11-8/changelog.Debian.gz",
        "missing cuda-nvcc-11-8 /usr/share/doc/cuda-nvcc-11-8/copyright",
        "missing cuda-nvcc-11-8 /usr/local/cuda-11.8/bin/nvcc",
    ]
    assert DpkgHealth().process(output) == DpkgHealthState(
        False,
        {"cuda-nvcc-11-8": ["/usr/share/doc/cuda-nvcc-11-8/copyright", "/usr/local/cuda-11.8/bin/nvcc"]},
    )


def test_a_fetched_file_repository_is_a_noop() -> None:
    """nvidia_repo_url may be file://. apt-cache policy prints such a repository as `file:/...` (apt 2.6.1, real
    output after apt-get update of a scratch flat repository `deb [trusted=yes] file:///tmp/<scratch>/debian12/
    x86_64/ /`, its folder renamed /srv/mirror here): the same repository, so no apt-get update."""
    policy = (
        "Package files:\n"
        " 100 /var/lib/dpkg/status\n"
        "     release a=now\n"
        " 500 file:/srv/mirror/debian12/x86_64  Packages\n"
        "     release c=\n"
        "Pinned packages:\n"
    )
    run = AptPackageFiles().command().replace("apt-cache policy 2>/dev/null", "cat")
    printed = subprocess.run(["sh", "-c", run], input=policy, capture_output=True, text=True, check=True).stdout
    fetched = AptPackageFiles().process(printed.splitlines())
    host = FakeHost({fact_key(AptPackageFiles): fetched})
    assert run_operation(repository_fetched, host, url="file:///srv/mirror/debian12/x86_64/") == []
