"""Container lab hosts: systemd as PID 1, real SSH, kernel settings isolated, reboot, clean `lab down`."""

from __future__ import annotations

import pytest
import yaml

from ironserve_lab import container, remote, state
from ironserve_lab.deploying import HOST_ROLES, deploy
from ironserve_lab.state import LabHost
from tests.lab.conftest import lab_containers, skip_without_container_lab
from tests.lab.machine_snapshot import differences, snapshot
from tests.lab.ssh import ssh_run

pytestmark = pytest.mark.lab


def test_systemd_runs_the_host(container_hosts: list[LabHost]) -> None:
    host = container_hosts[0]
    rc, out, err = ssh_run(host, "systemctl is-system-running --wait")
    assert out.strip() in ("running", "degraded"), (rc, out, err, ssh_run(host, "systemctl --failed")[1])
    assert ssh_run(host, "systemctl restart systemd-logind && systemctl is-active systemd-logind")[1] == "active\n"


def test_host_knows_its_name_and_that_it_is_a_container(container_hosts: list[LabHost]) -> None:
    host = container_hosts[0]
    assert ssh_run(host, "hostname")[1].strip() == host.name
    rc, out, _ = ssh_run(host, "systemd-detect-virt --container")
    assert rc == 0, out


def test_hardware_profile_is_in_the_host(container_hosts: list[LabHost]) -> None:
    host = container_hosts[0]
    profile = yaml.safe_load(ssh_run(host, "cat /etc/ironserve-lab/hardware.yaml")[1])
    assert profile["name"] == host.hardware_profile


def test_kernel_settings_are_read_only_except_the_hosts_network(container_hosts: list[LabHost]) -> None:
    host = container_hosts[0]
    rc, _, err = ssh_run(host, "echo 10 > /proc/sys/vm/swappiness")
    assert rc != 0 and "Read-only file system" in err
    knob = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"
    original = ssh_run(host, f"cat {knob}")[1].strip()
    flipped = "0" if original == "1" else "1"
    rc, out, err = ssh_run(host, f"echo {flipped} > {knob} && cat {knob} && echo {original} > {knob}")
    assert (rc, out.strip()) == (0, flipped), err


def test_each_host_has_its_own_identity(container_hosts: list[LabHost]) -> None:
    identity = "cat /etc/machine-id /etc/ssh/ssh_host_ed25519_key.pub /proc/sys/kernel/random/boot_id"
    identities = [ssh_run(host, identity)[1] for host in container_hosts]
    assert len(set(identities)) == len(container_hosts)


def test_host_reaches_the_debian_mirror(container_hosts: list[LabHost]) -> None:
    rc, out, err = ssh_run(container_hosts[0], "apt-get update", timeout=300)
    assert rc == 0, out + err


def test_deploy_reboot_and_lab_down_leave_the_machine_as_it_was() -> None:
    """Boot a host of its own, deploy to it, reboot it from inside, stop it, and compare the machine.

    Run alone, this covers all that `lab down` undoes (bridge, NAT, forwarding); next to other
    lab hosts (a session fixture, someone's lab) it stops only its own host and checks its traces.
    Lab hosts that others run meanwhile (the machine may be shared) are left out of the comparison.
    """
    skip_without_container_lab()
    before = snapshot()
    names_before = {h.name for h in state.load().hosts}
    with lab_containers(1) as [host]:
        deployed = deploy([host], roles=HOST_ROLES)
        assert deployed.returncode == 0, deployed.output
        old_boot = remote.boot_id(host)
        new_boot = remote.reboot(host, timeout=60, still_running=lambda: container.is_running(host))
        assert new_boot != old_boot
        assert ssh_run(host, "systemctl is-system-running --wait")[1].strip() in ("running", "degraded")
    others = (names_before | {h.name for h in state.load().hosts}) - {host.name}
    assert differences(before, snapshot(), others) == []
