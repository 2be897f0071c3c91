"""roles/container_runtime on a real lab container host: containerd pinned, configured and answering;
a misspelt key that containerd itself accepts silently is caught by ironserve's schema.

containerd runs inside a lab container host (overlayfs snapshotter ok, CRI plugin up). Kernel
modules and swap belong to the machine there: the role reports them; the VM test covers loading.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost
from roles import stack_config
from roles.container_runtime.render import ContainerdConfigError, check_config, render_config
from tests.lab.conftest import lab_containers

# Only the two roles under test: their own convergence and zero-change re-run.
SECURITY_RUNTIME = ("security", "container_runtime")
pytestmark = pytest.mark.lab
CONFIG = "/etc/containerd/config.toml"
SETTINGS = stack_config("lab", {}).container_runtime
PACKAGES = SETTINGS.packages_for("debian12")  # the lab hosts are Debian 12: Debian's own containerd and runc


@pytest.fixture(scope="module")
def converged() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        first = deploy(hosts, roles=SECURITY_RUNTIME)
        assert first.returncode == 0, first.output
        assert first.changed > 0, first.output
        yield hosts[0]


def test_second_deploy_reports_zero_changes(converged: LabHost) -> None:
    again = deploy([converged], roles=SECURITY_RUNTIME)
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


@pytest.mark.invariant("cri-containerd", "cri-systemd-cgroup", "cri-nvidia-runtime")
def test_containerd_pinned_running_and_answering(converged: LabHost) -> None:
    assert remote.run(converged, "systemctl is-active containerd").strip() == "active"
    assert "Server:" in remote.run(converged, "ctr version")
    assert remote.run(converged, f"cat {CONFIG}") == render_config(SETTINGS)
    dump = remote.run(converged, "containerd config dump")
    assert dump.count("SystemdCgroup = true") == 2  # runc and nvidia
    assert f'BinaryName = "{SETTINGS.nvidia_binary}"' in dump
    versions = remote.run(converged, "dpkg-query -W -f '${Package} ${Version}\\n' containerd runc").split("\n")
    assert sorted(filter(None, versions)) == sorted(f"{k} {v}" for k, v in PACKAGES.items())
    assert set(remote.run(converged, "apt-mark showhold").split()) >= set(PACKAGES)
    assert "Pin: version " + PACKAGES["containerd"] in remote.run(converged, "cat /etc/apt/preferences.d/*containerd")


def test_kernel_prerequisites_reported_not_forced_in_a_container(converged: LabHost) -> None:
    assert remote.run(converged, "cat /etc/modules-load.d/ironserve-containers.conf").split() == [
        "overlay",
        "br_netfilter",
    ]
    assert remote.run(converged, "cat /proc/sys/net/ipv4/ip_forward").strip() == "1"  # per network namespace: set live
    assert "net.bridge.bridge-nf-call-iptables = 1" in remote.run(
        converged, "cat /etc/sysctl.d/91-ironserve-containers.conf"
    )


def test_misspelt_key_accepted_by_containerd_refused_by_ironserve(converged: LabHost) -> None:
    remote.run(
        converged, f"sed -i 's/SystemdCgroup = true/SystemdCgrup = true/' {CONFIG} && systemctl restart containerd"
    )
    try:
        assert remote.run(converged, "systemctl is-active containerd").strip() == "active"  # containerd: no complaint
        dump = remote.run(converged, "containerd config dump")
        assert "SystemdCgrup = true" in dump and "SystemdCgroup = true" not in dump  # kept silently, driver lost
        with pytest.raises(ContainerdConfigError, match="SystemdCgrup: Extra inputs are not permitted"):
            check_config(remote.run(converged, f"cat {CONFIG}"))
    finally:
        assert deploy([converged], roles=SECURITY_RUNTIME).returncode == 0
