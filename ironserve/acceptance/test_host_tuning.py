"""Acceptance: roles/host_tuning (catalog areas kernel_cgroup and network_tuning)."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest

from ironserve.acceptance.checks import admin_dropins, not_root_only
from ironserve.facts import parse_os_release
from ironserve.sysctl_boot import SysctlBootOrder, boot_overrides
from roles import StackConfig

SYSCTLS = [
    pytest.param("net.core.rmem_max", marks=pytest.mark.invariant("sysctl-rmem-max")),
    pytest.param("net.core.wmem_max", marks=pytest.mark.invariant("sysctl-wmem-max")),
    pytest.param("net.ipv4.tcp_slow_start_after_idle", marks=pytest.mark.invariant("sysctl-tcp-slow-start-after-idle")),
    pytest.param("net.ipv4.ip_local_port_range", marks=pytest.mark.invariant("net-ip-local-port-range")),
]
CGROUP_ARG = "systemd.unified_cgroup_hierarchy=1"
# GRUB_CMDLINE_LINUX as update-grub computes it: /etc/default/grub, then each /etc/default/grub.d/*.cfg may override it.
EFFECTIVE_GRUB_CMDLINE = (
    'sh -c \'{ . /etc/default/grub; for f in /etc/default/grub.d/*.cfg; do if [ -e "$f" ]; then . "$f"; fi; done; }'
    ' >/dev/null; echo "$GRUB_CMDLINE_LINUX"\''
)


def _wanted(config: StackConfig, key: str) -> str:
    return config.host_tuning.sysctls[key]


@pytest.mark.invariant(
    "sysctl-rmem-max", "sysctl-wmem-max", "sysctl-tcp-slow-start-after-idle", "net-ip-local-port-range"
)
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, config: StackConfig, observe: Any) -> None:
    # systemd-sysctl applies the file as root at every boot.
    wrong = not_root_only(host, [config.host_tuning.sysctl_file])
    observe(wrong or "root:root, writable by root alone")
    assert wrong == {}


@pytest.mark.parametrize("key", SYSCTLS)
def test_sysctl_persisted(host: Any, config: StackConfig, key: str, observe: Any) -> None:
    content = host.file(config.host_tuning.sysctl_file).content_string
    lines = {k.strip(): v.split() for k, _, v in (ln.partition("=") for ln in content.splitlines() if "=" in ln)}
    observe(lines.get(key))
    assert lines.get(key) == _wanted(config, key).split()


@pytest.mark.invariant(
    "sysctl-rmem-max", "sysctl-wmem-max", "sysctl-tcp-slow-start-after-idle", "net-ip-local-port-range"
)
def test_sysctl_file_is_a_root_owned_regular_file(host: Any, config: StackConfig, observe: Any) -> None:
    # A symlink or a writable file would let whoever owns its target decide the host's sysctls at boot.
    shown = host.run(f"stat -c '%F %a %U:%G' {shlex.quote(config.host_tuning.sysctl_file)}").stdout.strip()
    observe(shown)
    assert shown == "regular file 644 root:root"


@pytest.mark.parametrize("key", SYSCTLS)
def test_sysctl_wins_at_boot(host: Any, config: StackConfig, key: str, observe: Any) -> None:
    # What systemd-sysctl applies at boot: a later-sorting file (99-zzz.conf, /etc/sysctl.conf) would win.
    fact = SysctlBootOrder()
    order = fact.process(host.run(fact.command()).stdout.splitlines())
    beating = boot_overrides(order, config.host_tuning.sysctl_file, {key: _wanted(config, key)})
    observe([f"{a.file}: {a.line}" for a in beating])
    assert beating == []


@pytest.mark.parametrize("key", SYSCTLS)
def test_sysctl_live(host: Any, config: StackConfig, key: str, container_kind: str | None, observe: Any) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    live = host.file(path).content_string.split()
    observe(" ".join(live))
    if live != _wanted(config, key).split() and container_kind and not host.run(f"test -w {path}").succeeded:
        pytest.skip(
            f"{key} is kernel-global and read-only in a {container_kind} container; persisted, live on VM hosts"
        )
    assert live == _wanted(config, key).split()


@pytest.mark.invariant("kernel-cgroup-v2")
def test_grub_carries_cgroup_v2(host: Any, container_kind: str | None, observe: Any) -> None:
    if container_kind:
        pytest.skip("a container has no bootloader; the GRUB argument is asserted on VM hosts")
    effective = host.run(EFFECTIVE_GRUB_CMDLINE).stdout.split()
    observe(" ".join(effective))
    assert CGROUP_ARG in effective
    assert CGROUP_ARG in host.file("/boot/grub/grub.cfg").content_string


@pytest.mark.invariant("kernel-cgroup-v2")
def test_running_kernel_uses_cgroup_v2(host: Any, container_kind: str | None, observe: Any) -> None:
    fs_type = host.run("stat -fc %T /sys/fs/cgroup").stdout.strip()
    observe(fs_type)
    assert fs_type == "cgroup2fs"
    if not container_kind:
        assert CGROUP_ARG in host.file("/proc/cmdline").content_string


@pytest.mark.invariant("kernel-entropy-avail")
def test_kernel_crng_initialised(host: Any, observe: Any) -> None:
    # Sound form of the seed's entropy_avail >= 1000: getrandom() without blocking succeeds once the CRNG is ready.
    probe = host.run("python3 -c 'import os; os.getrandom(16, os.GRND_NONBLOCK); print(\"crng ready\")'")
    observe(probe.stdout.strip() or probe.stderr.strip())
    assert probe.succeeded


@pytest.mark.invariant("kernel-time-sync")
def test_time_sync_service_enabled(host: Any, observe: Any) -> None:
    service = host.service("systemd-timesyncd")
    dropins = admin_dropins(host, "systemd-timesyncd.service")
    observe(f"enabled={service.is_enabled} admin drop-ins={dropins or 'none'}")
    assert service.is_enabled
    assert dropins == []  # an override outranks the servers host_tuning_ntp_servers writes


@pytest.mark.invariant("kernel-time-sync")
def test_clock_synchronised(host: Any, container_kind: str | None, observe: Any) -> None:
    synced = host.run("timedatectl show -p NTPSynchronized --value").stdout.strip()
    observe(synced)
    if container_kind:
        pytest.skip("a container shares the machine's clock; its synchronisation is the machine's")
    assert synced == "yes"


@pytest.mark.invariant("os-ubuntu-2204")
def test_supported_os(host: Any, config: StackConfig, observe: Any) -> None:
    """The host's OS is one the profile's lock is published for (its `platforms`), read from /etc/os-release."""
    os_key = parse_os_release(host.run(". /etc/os-release && echo $ID $VERSION_ID").stdout.split())
    observe(f"{os_key or 'unknown'}; profile {config.profile_name} supports {config.profile.supported()}")
    assert os_key in config.profile.platforms


@pytest.mark.invariant("net-retransmit-threshold")
def test_tcp_retransmit_rate(host: Any, observe: Any) -> None:
    sample = host.run(
        "a=$(awk '/^Tcp:/ && $13 ~ /^[0-9]+$/ {print $13}' /proc/net/snmp); sleep 2; "
        "b=$(awk '/^Tcp:/ && $13 ~ /^[0-9]+$/ {print $13}' /proc/net/snmp); echo $((b - a))"
    ).stdout.strip()
    observe(f"{sample} retransmitted segments in 2 s")
    assert re.fullmatch(r"\d+", sample)
    assert int(sample) / 2 <= 0.5
