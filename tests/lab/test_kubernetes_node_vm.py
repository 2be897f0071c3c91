"""A real Kubernetes node in the lab: the 1.20.2 control plane on this machine, its kubelet in a lab VM.

The VM gets host_tuning (cgroup v2, one reboot), security (the seccomp profile in the kubelet's directory) and
container_runtime (containerd with SystemdCgroup = true) as a site would; then the kubelet, configured with
roles/kubernetes's rendered KubeletConfiguration, joins the control plane (ironserve/lab/kubernetes_node.py).
What only a real node shows: it becomes Ready on cgroup v2, a pod confined by ironserve's seccomp profile
(Localhost) gets EPERM from a syscall the profile refuses while the runtime's default profile lets it through,
pods land under the systemd slice kubepods.slice, pods reach each other and the node over the CNI bridge, and
ironserve's cgroup driver check refuses a kubelet on cgroupfs before anything of it is started.

The module has its own VM (the kubelet changes sysctls, iptables and links that later VM tests do not expect);
the last test takes it and the control plane down and checks that the machine is as it was.
What it costs: docs/lab-kubernetes-node.md.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ironserve.lab import kubernetes_control_plane, kubernetes_node, manager, remote, state
from ironserve.lab.deploying import deploy
from ironserve.lab.hardware import DEFAULT_PROFILE
from ironserve.lab.kubernetes_control_plane import ControlPlane
from ironserve.lab.state import LabHost
from roles.kubernetes.render import kubelet_configuration_yaml
from roles.kubernetes.settings import KubernetesSettings
from roles.security.seccomp import SECCOMP_PROFILE
from roles.security.settings import SecuritySettings
from tests.lab.conftest_vm import require_vm
from tests.lab.machine_snapshot import Snapshot, differences, snapshot

pytestmark = pytest.mark.vm
NODE_ROLES = ("host_tuning", "security", "container_runtime")  # deploy order; host_tuning reboots once
SERVER_PORT = 8080
SERVER_POD = "probe-server"


@dataclass
class LabNode:
    host: LabHost
    plane: ControlPlane
    machine_before: Snapshot
    hosts_before: set[str]


class Steps:
    """Prints how long each step of the node's start took (TCG is slow; CI's log shows where time goes)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        print(f"lab node: {what} after {now - self.last:.0f} s", file=sys.stderr)
        self.last = now


def kubelet_config(cgroup_driver: str) -> str:
    """The KubeletConfiguration ironserve renders for a site with default settings."""
    settings = KubernetesSettings.model_validate({})
    return kubelet_configuration_yaml(settings, cgroup_driver, kubernetes_node.CONTAINERD_SOCKET)


def localhost_profile() -> str:
    """The pod's localhostProfile: the security role's file, relative to the kubelet's seccomp root."""
    directory = SecuritySettings.model_validate({}).kubelet_seccomp_dir
    return f"{directory.removeprefix('/var/lib/kubelet/seccomp/')}/{SECCOMP_PROFILE.name}"


@pytest.fixture(scope="module")
def node() -> Iterator[LabNode]:
    """The module's own VM with the three roles, the control plane and the kubelet, once the node is Ready.

    Skips, saying why, where VMs cannot start; IRONSERVE_REQUIRE_VM=1 (CI) turns that into a failure.
    """
    require_vm()
    kubernetes_control_plane.ensure_built()  # once per machine (minutes); nothing when cached
    before = snapshot()
    hosts_before = {h.name for h in state.load().hosts}
    hosts: list[LabHost] = []
    try:
        steps = Steps()
        hosts = manager.up(1, use_vm=True, hardware_profile=DEFAULT_PROFILE)
        host = hosts[0]
        steps.done("VM up")
        deployed = deploy([host], roles=NODE_ROLES)
        assert deployed.returncode == 0, deployed.output
        steps.done("roles deployed (one reboot)")
        plane = kubernetes_control_plane.attach(host)
        steps.done("control plane ready")
        kubernetes_node.start_kubelet(host, plane, kubelet_config("systemd"))
        steps.done("kubelet installed and started")
        kubernetes_node.wait_for_node_ready(plane, host.name)
        steps.done("node Ready")
        yield LabNode(host, plane, before, hosts_before)
    finally:
        # After a failed start, the lab-vm hosts recorded since are ours (manager.up names them so).
        mine = {h.name for h in hosts} or {
            h.name for h in state.load().hosts if h.name.startswith("lab-vm")
        } - hosts_before
        manager.down(mine)  # nothing left to stop after test_lab_down_leaves_the_machine_unchanged


@pytest.fixture(scope="module")
def server(node: LabNode) -> dict[str, Any]:
    """A running pod serving "hello from probe-server" on TCP 8080, confined by ironserve's profile."""
    profile = {"type": "Localhost", "localhostProfile": localhost_profile()}
    pod = kubernetes_node.probe_pod(SERVER_POD, ["serve", str(SERVER_PORT)], profile, restart="Always")
    kubernetes_node.create_pod(node.plane, pod)
    return kubernetes_node.wait_for_pod(node.plane, SERVER_POD, {"Running"})


def run_to_completion(node: LabNode, name: str, args: list[str], seccomp: dict[str, str]) -> dict[str, Any]:
    kubernetes_node.create_pod(node.plane, kubernetes_node.probe_pod(name, args, seccomp))
    return kubernetes_node.wait_for_pod(node.plane, name, {"Succeeded", "Failed"})


@pytest.mark.invariant("k8s-not-k3s", "cri-containerd")
def test_node_is_ready_on_the_real_kubelet_and_containerd(node: LabNode) -> None:
    """k8s-not-k3s, cri-containerd: a full kubelet on containerd registers and turns Ready."""
    info = node.plane.request("GET", f"/api/v1/nodes/{node.host.name}")["status"]["nodeInfo"]
    assert info["kubeletVersion"] == f"v{kubernetes_control_plane.VERSION}"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    version = node.plane.request("GET", "/version")["gitVersion"]
    assert version == f"v{kubernetes_control_plane.VERSION}" and "k3s" not in version
    assert kubernetes_node.node_ready(node.plane, node.host.name)


@pytest.mark.invariant("kernel-cgroup-v2")
def test_node_runs_on_cgroup_v2(node: LabNode) -> None:
    """kernel-cgroup-v2: the 1.20 kubelet runs on the unified hierarchy host_tuning switched the VM to."""
    assert remote.run(node.host, "stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs"
    assert remote.run(node.host, f"systemctl is-active {kubernetes_node.KUBELET_UNIT}").strip() == "active"


@pytest.mark.invariant("sec-seccomp-profile")
def test_localhost_profile_refuses_a_blocked_syscall_with_eperm(node: LabNode) -> None:
    """sec-seccomp-profile: under ironserve's profile (Localhost, the security role's file) ptrace gets EPERM."""
    installed = remote.run(node.host, f"cat /var/lib/kubelet/seccomp/{localhost_profile()}")
    assert installed == SECCOMP_PROFILE.read_text()
    profile = {"type": "Localhost", "localhostProfile": localhost_profile()}
    pod = run_to_completion(node, "probe-seccomp-localhost", ["ptrace"], profile)
    assert pod["status"]["phase"] == "Succeeded"
    assert kubernetes_node.termination_message(pod) == "ptrace: EPERM (errno 1)"


def test_runtime_default_profile_lets_the_same_syscall_through(node: LabNode) -> None:
    """The control: without ironserve's profile the same call reaches the kernel (ESRCH: nothing traces it)."""
    pod = run_to_completion(node, "probe-seccomp-runtime-default", ["ptrace"], {"type": "RuntimeDefault"})
    assert pod["status"]["phase"] == "Succeeded"
    assert kubernetes_node.termination_message(pod) == "ptrace: ESRCH (errno 3)"


@pytest.mark.invariant("cri-systemd-cgroup")
def test_pod_cgroup_is_under_the_kubepods_slice(node: LabNode, server: dict[str, Any]) -> None:
    """cri-systemd-cgroup: with cgroupDriver systemd the container's cgroup is a scope in kubepods.slice."""
    container_id = server["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = remote.run(node.host, "ctr -n k8s.io tasks ls")
    pid = next(line.split()[1] for line in tasks.splitlines() if line.startswith(container_id))
    cgroup = remote.run(node.host, f"cat /proc/{pid}/cgroup").strip()
    pod_slice = "kubepods-besteffort-pod" + server["metadata"]["uid"].replace("-", "_") + ".slice"
    expected = f"0::/kubepods.slice/kubepods-besteffort.slice/{pod_slice}/cri-containerd-{container_id}.scope"
    assert cgroup == expected


def test_pod_address_is_host_locals_on_the_cni_bridge(node: LabNode, server: dict[str, Any]) -> None:
    """The pod's address comes from host-local's range, whose gateway is the bridge the plugin made."""
    assert ipaddress.ip_address(server["status"]["podIP"]) in ipaddress.ip_network(kubernetes_node.POD_CIDR)
    bridge = remote.run(node.host, f"ip -4 -o addr show dev {kubernetes_node.CNI_BRIDGE}")
    assert re.search(r"inet 10\.244\.0\.1/24 ", bridge), bridge


def test_a_pod_reaches_another_pod_over_the_cni_bridge(node: LabNode, server: dict[str, Any]) -> None:
    args = ["connect", server["status"]["podIP"], str(SERVER_PORT)]
    client = run_to_completion(node, "probe-client", args, {"type": "RuntimeDefault"})
    assert kubernetes_node.termination_message(client) == f"connect: hello from {SERVER_POD}"


def test_the_node_reaches_a_pod_over_the_cni_bridge(node: LabNode, server: dict[str, Any]) -> None:
    address = server["status"]["podIP"]
    answer = remote.run(node.host, f"timeout 10 bash -c 'exec 3<>/dev/tcp/{address}/{SERVER_PORT}; head -n1 <&3'")
    assert answer.strip() == f"hello from {SERVER_POD}"


@pytest.mark.invariant("cri-systemd-cgroup")
def test_kubelet_on_the_wrong_cgroup_driver_is_refused_before_it_starts(node: LabNode) -> None:
    """cri-systemd-cgroup: ironserve's check reads the VM's real config.toml and refuses a cgroupfs kubelet;
    nothing of that kubelet reaches the VM (the running kubelet and its config file are untouched)."""
    running = kubernetes_node.kubelet_pid(node.host)
    config_before = remote.run(node.host, f"cat {kubernetes_node.GUEST_KUBELET_CONFIG}")
    with pytest.raises(kubernetes_node.KubeletRefused, match="cgroupfs"):
        kubernetes_node.start_kubelet(node.host, node.plane, kubelet_config("cgroupfs"))
    assert kubernetes_node.kubelet_pid(node.host) == running != 0
    assert remote.run(node.host, f"cat {kubernetes_node.GUEST_KUBELET_CONFIG}") == config_before
    assert "cgroupDriver: systemd" in config_before


def test_lab_down_leaves_the_machine_unchanged(node: LabNode) -> None:
    """Last: `lab down` of the node's VM stops the control plane (every process of it) and the VM, and the
    machine's sysctls, links, firewall and processes are as before the module started."""
    supervisor = int(node.host.extra["kubernetes_pid"])
    children = [int(p) for p in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()]
    assert len(children) == 4  # etcd, kube-apiserver, kube-controller-manager, kube-scheduler
    manager.down({node.host.name})
    time.sleep(1)
    assert [pid for pid in [supervisor, *children] if os.path.exists(f"/proc/{pid}")] == []
    assert node.host.name not in {h.name for h in state.load().hosts}
    others = node.hosts_before | {h.name for h in state.load().hosts}
    assert differences(node.machine_before, snapshot(), others) == []
