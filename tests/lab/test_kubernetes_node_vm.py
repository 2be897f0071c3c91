"""A real Kubernetes node in the lab: the 1.20.2 control plane on this machine, its kubelet in a lab VM.

The VM gets host_tuning (cgroup v2, one reboot), security (the seccomp profile in the kubelet's directory) and
container_runtime (containerd with SystemdCgroup = true) as a site would; then the kubelet, configured with
roles/kubernetes's rendered KubeletConfiguration, joins the control plane (lab/src/ironserve_lab/kubernetes_node.py).
What only a real node shows: it becomes Ready on cgroup v2, a pod confined by ironserve's seccomp profile
(Localhost) gets EPERM from a syscall the profile refuses while the runtime's default profile lets it through,
pods land under the systemd slice kubepods.slice, pods reach each other and the node over the CNI bridge, and
ironserve's cgroup driver check refuses a kubelet on cgroupfs before anything of it is started.

The node's GPUs are the simulated edge: a stand-in of NVIDIA's device plugin (files/gpu-device-plugin, speaking
the kubelet's own device-plugin API) offers the hardware profile's four GPU UUIDs, and containerd's `nvidia` runtime
runs a stand-in nvidia-container-runtime that execs runc. The kubelet's allocatable nvidia.com/gpu, the scheduler's
placement and the exclusive allocation to containers are real.

Then the inference service in `inference_mode: kubernetes` on that node, with a stand-in of the engine image
(files/engine-standin.c at the engine's Python path: the launcher's markers and the exec probes' answers, no model,
no GPU, no completions; checked against ironserve_service's own probes on this machine first), each colour asking
for the profile's two serving GPUs on RuntimeClass nvidia: the deploy's objects applied, kube_swap run with the
ai-swap account's own token moves the Service from nothing to blue, then to green (on the two GPUs blue does not
hold; blue scaled to zero, its container exiting 0 on SIGTERM), and refuses at its ready gate a version whose
model directory the node lacks, scaled back, the selector untouched.

The module has its own VM (the kubelet changes sysctls, iptables and links that later VM tests do not expect);
the last test takes it and the control plane down and checks that the machine is as it was.
What it costs: docs/lab-kubernetes-node.md.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from ironserve_service.kube import KubeClient
from ironserve_service.kube_objects import (
    CONFIG_FILE,
    SCALER,
    SERVICE,
    SWAP_ACCOUNT,
    VERSION_ANNOTATION,
    config_map,
    deployment_name,
    pod_settings,
)
from ironserve_service.kube_swap import kube_swap
from ironserve_service.settings import Colour, ServiceSettings
from ironserve_service.swap import SwapResult

from ironserve_lab import kubernetes_control_plane, kubernetes_node, manager, remote, servers, state
from ironserve_lab.deploying import deploy
from ironserve_lab.hardware import DEFAULT_PROFILE, read_hardware_profile
from ironserve_lab.inference import model_versions
from ironserve_lab.kubernetes_control_plane import ControlPlane, service_account_user, wait_for
from ironserve_lab.state import LabHost
from roles import StackConfig, stack_config
from roles.cluster_addons.render import RUNTIME_CLASS, device_plugin_manifests
from roles.inference.render_kubernetes import deploy_objects, host_settings
from roles.kubernetes.render import kubelet_configuration_yaml
from roles.kubernetes.settings import KubernetesSettings
from roles.security.render import SECCOMP_PROFILE
from roles.security.settings import SecuritySettings
from tests.lab.conftest_vm import require_vm
from tests.lab.machine_snapshot import Snapshot, differences, snapshot
from tests.unit.test_inference_kubernetes import KUBERNETES_MODE

pytestmark = pytest.mark.vm
NODE_ROLES = ("host_tuning", "security", "container_runtime")  # deploy order; host_tuning reboots once
SERVER_PORT = 8080
SERVER_POD = "probe-server"
NAMESPACE = "ai"  # the service's (KubernetesServingSettings.namespace)
SERVING_GPUS = 2  # the default stack profile's (r740-a10: two x16 slots of four A10)
GPU = "nvidia.com/gpu"
# The swap's timeouts for a TCG node: a pod's start is seconds to tens of seconds here.
LAB_SWAP = {"ready_timeout_s": 240, "poll_interval_s": 0.5, "drain_idle_s": 1, "switch_timeout_s": 60}
REFUSED_READY_TIMEOUT_S = 30
PROBE_TIMEOUT_S = 10  # the pods' probes' timeoutSeconds (see standin_config)
MISSING_VERSION = "20991231-235959"  # a well-formed version whose directory is on no node
PLACEHOLDER_IMAGE = "lab.ironserve.invalid/placeholder@sha256:" + "0" * 64  # to read the settings before the import


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


def profile_gpus() -> list[str]:
    """The UUIDs of the VM's simulated GPUs (its hardware profile's, as the stand-in nvidia-smi reports them)."""
    return [gpu.uuid for gpu in read_hardware_profile(DEFAULT_PROFILE).gpus]


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
        kubernetes_node.start_gpu_device_plugin(host, profile_gpus())
        steps.done("stand-in device plugin started")
        yield LabNode(host, plane, before, hosts_before)
    finally:
        # After a failed start, the lab-vm hosts this session recorded since.
        mine = {h.name for h in hosts} or state.started_here("lab-vm") - hosts_before
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


@pytest.mark.invariant("k8s-nvidia-device-plugin")
def test_the_node_offers_the_profiles_gpus_through_the_device_plugin(node: LabNode) -> None:
    """k8s-nvidia-device-plugin: the kubelet took the stand-in's registration over the device-plugin API, so the
    node's capacity and allocatable nvidia.com/gpu are the profile's four GPUs (the node status follows within
    the kubelet's status update period)."""

    def offered() -> dict[str, str] | None:
        status = node.plane.request("GET", f"/api/v1/nodes/{node.host.name}")["status"]
        found = {"capacity": status["capacity"].get(GPU), "allocatable": status["allocatable"].get(GPU)}
        return found if None not in found.values() else None

    assert wait_for(offered, 60, "nvidia.com/gpu on the node") == {"capacity": "4", "allocatable": "4"}
    assert len(profile_gpus()) == 4


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


# --- the service's blue/green switch on the node, with the stand-in engine image ----------------------------


def standin_config(image: str, model_source: str = str(model_versions()["lab-v1"])) -> StackConfig:
    """The stack in `inference_mode: kubernetes` (tests/unit/test_inference_kubernetes.py's KUBERNETES_MODE) with
    what the lab node changes, each named here:

    - `image`: the stand-in engine image by digest (kubernetes_node.import_engine_standin);
    - cpu 100m and memory 64Mi instead of 8 and 24Gi (the VM has 2 CPUs and 1 GiB), still requests == limits;
    - the startup probe every 2 s instead of 10 (it stops once it succeeds), and every probe's timeout 10 s
      instead of 2 (`readiness.probe_timeout_s`): an exec probe is a runc exec, 0.6-2.5 s of the VM's emulated
      CPU, and more while a pod starts beside it; with 2 s the kubelet counted timeouts as failures and its
      liveness probe restarted a ready stand-in;
    - the swap's lab timeouts (LAB_SWAP).
    """
    kubernetes = {"image": image, "cpu": "100m", "memory": "64Mi", "startup_period_s": 2}
    service = {
        **KUBERNETES_MODE["inference_service"],
        "kubernetes": kubernetes,
        "readiness": {"probe_timeout_s": PROBE_TIMEOUT_S},
        "swap": LAB_SWAP,
    }
    data = {**KUBERNETES_MODE, "inference_model_source": model_source}
    return stack_config(f"{NAMESPACE}-lab-node", {**data, "inference_service": service})


@dataclass
class Serving:
    """The service's static objects applied to the node's cluster, its model store's versions made on the node."""

    config: StackConfig
    settings: ServiceSettings
    image: str
    api: KubeClient  # the ai-swap ServiceAccount's own token
    versions: tuple[str, str]


@dataclass
class Swapped:
    result: SwapResult
    log: list[str]


@pytest.fixture(scope="module")
def serving(node: LabNode, tmp_path_factory: pytest.TempPathFactory) -> Serving:
    """The stand-in engine image imported into the node's containerd, the deploy's objects applied as the admin
    (all but the scaler's Deployment: the stand-in has no `scale` command, so its pod would only crash-loop), the
    swap's Role in force, and two versions' directories on the node's model store."""
    steps = Steps()
    python = host_settings(standin_config(PLACEHOLDER_IMAGE)).engine.engine_python
    assert python is not None
    image = kubernetes_node.import_engine_standin(node.host, str(python))
    config = standin_config(image)
    settings = host_settings(config)
    assert (settings.kubernetes.gpus, settings.kubernetes.runtime_class) == (SERVING_GPUS, RUNTIME_CLASS)
    [runtime_class] = [o for o in device_plugin_manifests(config) if o["kind"] == "RuntimeClass"]
    node.plane.apply(runtime_class)  # roles/cluster_addons' (its deploy applies it from a control plane)
    for obj in deploy_objects(config):
        if (obj["kind"], obj["metadata"]["name"]) != ("Deployment", SCALER):
            node.plane.apply(obj)
    swap_user = service_account_user(NAMESPACE, SWAP_ACCOUNT)

    def in_force() -> bool | None:
        allowed = node.plane.can_i(swap_user, "patch", "services", namespace=NAMESPACE, name=SERVICE)
        return allowed or None

    wait_for(in_force, 30, "ai-swap's Role in force")
    versions = (config.inference.version(), standin_config(image, str(model_versions()["lab-v2"])).inference.version())
    gid = settings.kubernetes.run_as_group  # security_gid: the model store is root:<gid> 0750
    assert gid is not None
    for version in versions:
        kubernetes_node.make_model_dir(node.host, str(settings.swap.models_root / version), gid)
    token = tmp_path_factory.mktemp("swap") / f"{SWAP_ACCOUNT}.token"
    token.write_text(node.plane.service_account_token(NAMESPACE, SWAP_ACCOUNT))
    client = KubeClient(node.plane.api_url, token, node.plane.directory / "pki" / "ca.crt", timeout_s=10)
    steps.done("stand-in engine image imported, the service's objects applied")
    return Serving(config, settings, image, client, versions)


def swap_to(serving: Serving, version: str, settings: ServiceSettings | None = None) -> Swapped:
    """kube_swap as the ai-swap account, its log and timings printed (CI's log shows what each step took)."""
    lines: list[str] = []
    result = kube_swap(settings or serving.settings, serving.api, version, log=lines.append)
    timings = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in result.timings.items())
    print(f"lab node: kube_swap {version}: {result.gate} ({result.detail}); {timings}", file=sys.stderr)
    for line in lines:
        print(f"lab node:   {line}", file=sys.stderr)
    return Swapped(result, lines)


def pods_of(node: LabNode, colour: str) -> dict[str, Any]:
    """The colour's pods (a PodList, its resourceVersion the list's)."""
    return node.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=colour%3D{colour}")


def ready_pods(node: LabNode, colour: str) -> list[dict[str, Any]]:
    def ready(pod: dict[str, Any]) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    return [pod for pod in pods_of(node, colour)["items"] if ready(pod)]


def selector(node: LabNode) -> dict[str, str]:
    service = node.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/services/{SERVICE}")
    found: dict[str, str] = service["spec"].get("selector", {})
    return found


def endpoint_addresses(node: LabNode) -> list[dict[str, Any]]:
    """The Service's ready addresses ({ip, targetRef: the pod}) with its port, as the endpoints controller wrote."""
    endpoints = node.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/endpoints/{SERVICE}")
    return [
        {**address, "port": subset["ports"][0]["port"]}
        for subset in endpoints.get("subsets") or []
        for address in subset.get("addresses") or []
    ]


def deployment_of(node: LabNode, colour: Colour) -> dict[str, Any]:
    return node.plane.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment_name(colour)}")


@pytest.fixture(scope="module")
def first_swap(node: LabNode, serving: Serving) -> Swapped:
    """The first swap (no colour active yet): version A onto blue, the Service pointed at it."""
    return swap_to(serving, serving.versions[0])


@dataclass
class SecondSwap(Swapped):
    blue_pod: str
    blue_exit: dict[str, Any]  # containerd's task exit of blue's container (its init process)
    blue_killed_at: datetime  # the kubelet's Killing event of blue's container
    blue_gone_s: float  # from the swap's return until blue's pod was deleted
    blue_gpus: set[str]  # the GPUs the device plugin allocated to blue's container


@pytest.fixture(scope="module")
def second_swap(node: LabNode, serving: Serving, first_swap: Swapped) -> SecondSwap:
    """Version B onto green, the Service moved to it, blue scaled to zero; containerd's task exits recorded in the
    VM across the swap, until blue's pod is deleted."""
    (pod,) = pods_of(node, "blue")["items"]
    blue_pod = pod["metadata"]["name"]
    blue_gpus = visible_gpus(node, pod)
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    recorder = kubernetes_node.record_task_exits(node.host)
    swapped = swap_to(serving, serving.versions[1])
    returned = time.monotonic()
    wait_for(lambda: not pods_of(node, "blue")["items"], 150, "blue's pod deleted")
    gone = time.monotonic() - returned
    print(f"lab node: blue's pod {blue_pod} deleted {gone:.1f} s after the swap returned", file=sys.stderr)
    exits = kubernetes_node.task_exits(node.host, recorder)
    (blue_exit,) = [e for e in exits if e["container_id"] == e["id"] == container_id]
    (killing,) = [e for e in kubernetes_node.events_of(node.plane, NAMESPACE, blue_pod) if e["reason"] == "Killing"]
    killed_at = timestamp(killing["lastTimestamp"])
    return SecondSwap(swapped.result, swapped.log, blue_pod, blue_exit, killed_at, gone, blue_gpus)


def timestamp(text: str) -> datetime:
    """An RFC 3339 time of the API or of containerd (nanoseconds cut to microseconds)."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", text.replace("Z", "+00:00")))


@pytest.fixture(scope="module")
def refused_swap(node: LabNode, serving: Serving, second_swap: SecondSwap) -> Swapped:
    """A swap to a version whose directory is not on the node: the hostPath volume (type Directory) cannot be
    mounted, so the idle colour's pod never starts; the ready gate's timeout is REFUSED_READY_TIMEOUT_S."""
    settings = serving.settings.model_copy(
        update={"swap": serving.settings.swap.model_copy(update={"ready_timeout_s": REFUSED_READY_TIMEOUT_S})}
    )
    assert remote.run(node.host, f"test -e {settings.swap.models_root / MISSING_VERSION} || echo absent") == "absent\n"
    return swap_to(serving, MISSING_VERSION, settings)


@dataclass
class LocalStandin:
    """The stand-in compiled on this machine with a colour's config as the pod gets it (kube_objects.config_map),
    its markers and model store in a scratch directory and its port a free one."""

    program: Path
    config: Path
    settings: ServiceSettings  # the pod's (kube_objects.pod_settings)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.program), *args], capture_output=True, text=True, timeout=30)

    def probe(self, kind: str, program: str | None = None) -> tuple[int, str]:
        """`probe kind` of the stand-in, or of the real ironserve_service with program=sys.executable."""
        argv = [program or str(self.program), "-m", "ironserve_service", "probe", kind, "--config", str(self.config)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return result.returncode, result.stdout

    def launch(self) -> subprocess.Popen[str]:
        argv = [str(self.program), "-m", "ironserve_service", "launch", "--config", str(self.config)]
        launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = self.settings.readiness.ready_marker
        wait_for(lambda: ready.exists() or launcher.poll() is not None, 10, "the stand-in's ready marker")
        return launcher


@pytest.fixture
def local_standin(tmp_path: Path) -> LocalStandin:
    program = tmp_path / "python"
    program.write_bytes(kubernetes_node.static_binary(kubernetes_node.ENGINE_STANDIN_SOURCE))
    program.chmod(0o755)
    base = host_settings(standin_config(PLACEHOLDER_IMAGE))
    markers = {"loading_marker": tmp_path / "model_loading", "ready_marker": tmp_path / "model_ready"}
    swap = {"models_root": tmp_path / "models", "blue_port": servers.free_port()}
    settings = base.model_copy(
        update={"readiness": base.readiness.model_copy(update=markers), "swap": base.swap.model_copy(update=swap)}
    )
    version = "20260101-000000"
    (settings.swap.models_root / version).mkdir(parents=True)
    config = tmp_path / CONFIG_FILE
    config.write_text(config_map(settings, "blue", version)["data"][CONFIG_FILE])
    return LocalStandin(program, config, pod_settings(settings, "blue", version))


def test_the_standins_marker_and_probe_answers_are_the_real_launchers(local_standin: LocalStandin) -> None:
    """On this machine: the marker holds the launcher's pid as launcher.write_marker writes it, the loading marker
    is gone once ready, and `probe ready|live` answer what ironserve_service's own probes answer on the same
    config and markers (live: its /health on the colour's port)."""
    launcher = local_standin.launch()
    try:
        readiness = local_standin.settings.readiness
        assert readiness.ready_marker.read_bytes() == f"{launcher.pid}\n".encode()
        assert not readiness.loading_marker.exists()
        for kind in ("ready", "live"):
            assert local_standin.probe(kind) == local_standin.probe(kind, sys.executable), kind
        assert local_standin.probe("ready") == (0, f"model ready (launcher {launcher.pid})\n")
    finally:
        launcher.terminate()
        launcher.wait(10)


def test_the_standin_removes_its_marker_on_sigterm_and_exits_0(local_standin: LocalStandin) -> None:
    """The real launcher's drain order: the ready marker first (the probe fails from then on), exit 0."""
    launcher = local_standin.launch()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(10) == 0
    ready_marker = local_standin.settings.readiness.ready_marker
    assert launcher.stderr is not None
    assert launcher.stderr.read().splitlines()[-1] == f"received signal 15: draining; {ready_marker} removed"
    assert not ready_marker.exists()
    assert (
        local_standin.probe("ready")
        == local_standin.probe("ready", sys.executable)
        == (
            1,
            f"{ready_marker} absent: model not ready\n",
        )
    )


def test_the_standins_probe_calls_a_marker_of_a_gone_launcher_stale(local_standin: LocalStandin) -> None:
    ready_marker = local_standin.settings.readiness.ready_marker
    gone = subprocess.Popen(["true"])
    gone.wait()
    ready_marker.write_text(f"{gone.pid}\n")
    assert (
        local_standin.probe("ready")
        == local_standin.probe("ready", sys.executable)
        == (
            1,
            f"{ready_marker} is stale: launcher {gone.pid} is gone\n",
        )
    )


def test_the_standin_refuses_any_other_command_line(local_standin: LocalStandin) -> None:
    """It stands in for `launch` and `probe` only: `scale` (the scaler's Deployment) is a usage error."""
    result = local_standin.run("-m", "ironserve_service", "scale", "--config", str(local_standin.config))
    assert result.returncode == 2 and "the lab's stand-in" in result.stderr


def test_the_standin_image_is_named_in_containerd_by_its_digest(node: LabNode, serving: Serving) -> None:
    """The digest reference the Deployment names is an image name in the kubelet's containerd namespace, with
    the same target as the tag the archive carried."""
    repository, digest = serving.image.split("@")
    assert repository == kubernetes_node.ENGINE_STANDIN_REPOSITORY and re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    assert {serving.image, kubernetes_node.ENGINE_STANDIN_TAG} <= kubernetes_node.image_names(node.host)
    assert kubernetes_node.image_digest(node.host, kubernetes_node.ENGINE_STANDIN_TAG) == digest


def test_the_digest_is_the_manifest_containerd_writes_for_the_archive(serving: Serving) -> None:
    """containerd 1.6 turns the docker archive into a Docker schema 2 manifest of its blobs: the digest can be
    computed here from the archive's bytes (which are the same for the same program: mtime 0, root's)."""
    python = str(serving.settings.engine.engine_python)
    expected = kubernetes_node.manifest_digest(kubernetes_node.engine_standin_archive(python))
    assert serving.image == f"{kubernetes_node.ENGINE_STANDIN_REPOSITORY}@{expected}"


def test_before_the_first_swap_the_service_has_no_endpoints_object(node: LabNode, serving: Serving) -> None:
    """The deploy's Service has no selector, and 1.20's endpoints controller writes Endpoints only for a Service
    with one: until the first swap sets it, reading them is a 404 (which kube_swap's switch gate waits through)."""
    with pytest.raises(urllib.error.HTTPError) as absent:
        node.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/endpoints/{SERVICE}")
    assert absent.value.code == 404


def test_the_first_swap_passes_every_gate_onto_blue(first_swap: Swapped) -> None:
    result = first_swap.result
    assert (result.ok, result.gate, result.colour, result.previous_colour) == (True, "done", "blue", None)
    assert set(result.timings) == {"apply", "ready", "switch", "total"}  # no old colour: nothing drained


def test_after_the_first_swap_blues_pod_is_ready(node: LabNode, first_swap: Swapped) -> None:
    """Ready: the kubelet's exec probes ran the stand-in's `probe ready` in the container and it found the
    launcher's marker naming a live pid."""
    assert len(ready_pods(node, "blue")) == 1
    assert deployment_of(node, "blue")["status"]["readyReplicas"] == 1


def test_after_the_first_swap_the_service_selects_blue(node: LabNode, first_swap: Swapped) -> None:
    assert selector(node) == {"app": "ai-service", "colour": "blue"}


def test_after_the_first_swap_the_endpoints_list_blues_pod(node: LabNode, first_swap: Swapped) -> None:
    (pod,) = ready_pods(node, "blue")
    addresses = endpoint_addresses(node)
    assert [(a["targetRef"]["name"], a["ip"], a["port"]) for a in addresses] == [
        (pod["metadata"]["name"], pod["status"]["podIP"], 8000)  # swap.blue_port, the container's `http` port
    ]


def test_blues_endpoint_answers_on_its_port_from_the_node(node: LabNode, first_swap: Swapped) -> None:
    """The stand-in listens on the colour's port from its config (engine.port, 0.0.0.0): the address the
    Endpoints list answers /health over the CNI bridge (no kube-proxy: the ClusterIP is not routed)."""
    (address,) = endpoint_addresses(node)
    request = 'printf "GET /health HTTP/1.0\\r\\n\\r\\n" >&3; head -n1 <&3'
    answer = remote.run(
        node.host, f"timeout 10 bash -c 'exec 3<>/dev/tcp/{address['ip']}/{address['port']}; {request}'"
    )
    assert answer.strip() == "HTTP/1.1 200 OK"


def test_the_kubelet_runs_the_digest_reference_from_the_local_image(
    node: LabNode, serving: Serving, first_swap: Swapped
) -> None:
    """No pull policy is rendered; 1.20 defaults a reference without `:latest` to IfNotPresent, and the kubelet
    finds the image under that name locally ("already present on machine", no Pulling event). containerd
    reports the digest reference as the container's imageID."""
    (pod,) = pods_of(node, "blue")["items"]
    container = pod["spec"]["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == (serving.image, "IfNotPresent")
    assert pod["status"]["containerStatuses"][0]["imageID"] == serving.image
    kubelet = [e for e in kubernetes_node.events_of(node.plane, NAMESPACE, pod["metadata"]["name"])
               if e["source"].get("component") == "kubelet"]  # fmt: skip
    assert {e["reason"] for e in kubelet} >= {"Pulled", "Created", "Started"} and "Pulling" not in {
        e["reason"] for e in kubelet
    }
    assert [e["message"] for e in kubelet if e["reason"] == "Pulled"] == [
        f'Container image "{serving.image}" already present on machine'
    ]


def container_info(node: LabNode, pod: dict[str, Any]) -> dict[str, Any]:
    """containerd's record of the pod's container (`ctr containers info`): its runtime and OCI spec."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    info: dict[str, Any] = json.loads(remote.run(node.host, f"ctr -n k8s.io containers info {container_id}"))
    return info


def visible_gpus(node: LabNode, pod: dict[str, Any]) -> set[str]:
    env = container_info(node, pod)["Spec"]["process"]["env"]
    (value,) = [e.removeprefix("NVIDIA_VISIBLE_DEVICES=") for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    return set(value.split(","))


@pytest.mark.invariant("k8s-nvidia-device-plugin")
def test_blues_container_got_two_of_the_nodes_gpus_on_the_nvidia_runtime(node: LabNode, first_swap: Swapped) -> None:
    """The pod asks for the serving GPUs (requests == limits); the kubelet's device manager allocated that many of
    the plugin's devices and put the plugin's NVIDIA_VISIBLE_DEVICES in the container, and containerd created it
    with the `nvidia` runtime's binary (RuntimeClass nvidia, handler nvidia: the stand-in's log of its calls)."""
    (pod,) = pods_of(node, "blue")["items"]
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["requests"][GPU] == resources["limits"][GPU] == str(SERVING_GPUS)
    assert pod["spec"]["runtimeClassName"] == RUNTIME_CLASS
    gpus = visible_gpus(node, pod)
    assert len(gpus) == SERVING_GPUS and gpus <= set(profile_gpus())
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    calls = remote.run(node.host, f"cat {kubernetes_node.NVIDIA_RUNTIME_LOG}").splitlines()
    assert [call for call in calls if " create " in f" {call} " and container_id in call], calls


def test_the_second_swap_passes_every_gate_onto_green(second_swap: SecondSwap) -> None:
    result = second_swap.result
    assert (result.ok, result.gate, result.colour, result.previous_colour) == (True, "done", "green", "blue")
    assert set(result.timings) == {"apply", "ready", "switch", "drain", "total"}


def test_after_the_second_swap_the_service_selects_green(node: LabNode, second_swap: SecondSwap) -> None:
    assert selector(node) == {"app": "ai-service", "colour": "green"}


def test_after_the_second_swap_the_endpoints_list_only_greens_pod(node: LabNode, second_swap: SecondSwap) -> None:
    (pod,) = ready_pods(node, "green")
    addresses = endpoint_addresses(node)
    assert [(a["targetRef"]["name"], a["port"]) for a in addresses] == [(pod["metadata"]["name"], 8001)]


def test_after_the_second_swap_blue_is_scaled_to_zero_and_its_pod_is_gone(
    node: LabNode, serving: Serving, second_swap: SecondSwap
) -> None:
    blue = deployment_of(node, "blue")
    assert blue["spec"]["replicas"] == 0
    assert blue["metadata"]["annotations"][VERSION_ANNOTATION] == serving.versions[0]  # still version A, idle
    assert pods_of(node, "blue")["items"] == []


def test_blues_container_exited_0_seconds_after_sigterm(serving: Serving, second_swap: SecondSwap) -> None:
    """containerd's task exit of blue's container (`ctr events` in the VM across the swap): exit status 0, a few
    seconds after the kubelet's Killing event (SIGTERM), far inside the grace period: the stand-in's SIGTERM
    handler ran (ready marker removed first, then exit 0). As PID 1 without that handler the SIGTERM would be
    ignored and the kubelet would SIGKILL it at the grace period's end (137). The API never shows this exit:
    the 1.20 kubelet removes the exited container within seconds and then reports it as waiting
    (ContainerCreating) until the pod is deleted."""
    grace_s = int(serving.settings.readiness.drain_timeout_s) + 30  # the pods' terminationGracePeriodSeconds
    exited = timestamp(second_swap.blue_exit["exited_at"])
    print(f"lab node: blue's container exited {second_swap.blue_exit} after Killing at {second_swap.blue_killed_at}")
    assert second_swap.blue_exit["exit_status"] == 0
    assert -1 <= (exited - second_swap.blue_killed_at).total_seconds() < grace_s / 4  # Killing: whole seconds


def test_green_started_on_the_two_gpus_blue_did_not_hold(node: LabNode, second_swap: SecondSwap) -> None:
    """While both colours ran, each held its own two of the node's four GPUs: the device manager allocates
    exclusively, so a blue/green swap needs twice the serving GPUs free (the profile's four A10, two serving)."""
    (pod,) = pods_of(node, "green")["items"]
    assert visible_gpus(node, pod) == set(profile_gpus()) - second_swap.blue_gpus


def test_greens_container_never_restarted(node: LabNode, second_swap: SecondSwap) -> None:
    """The liveness probe (`probe live`: the stand-in's /health on the colour's port) held through both swaps."""
    (pod,) = pods_of(node, "green")["items"]
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_a_swap_to_a_version_missing_on_the_node_is_refused_at_the_ready_gate(refused_swap: Swapped) -> None:
    result = refused_swap.result
    assert (result.ok, result.gate, result.colour, result.previous_colour) == (False, "ready", "blue", "green")
    assert result.detail.startswith(f"ai-service-blue not ready within {REFUSED_READY_TIMEOUT_S} s: 0/1 ready")


def test_the_refused_pod_never_started_its_model_volume_failed_to_mount(
    node: LabNode, serving: Serving, refused_swap: Swapped
) -> None:
    """The kubelet's hostPath check (type Directory) refused the missing version's directory: the container was
    never created, so the stand-in's readiness could not be the reason."""
    path = serving.settings.swap.models_root / MISSING_VERSION
    events = node.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector=reason%3DFailedMount")
    messages = {e["message"] for e in events["items"] if e["involvedObject"]["name"].startswith("ai-service-blue-")}
    assert f'MountVolume.SetUp failed for volume "model" : hostPath type check failed: {path} is not a directory' in (
        messages
    )


def test_after_the_refused_swap_blue_is_scaled_back_to_zero(node: LabNode, refused_swap: Swapped) -> None:
    blue = deployment_of(node, "blue")
    assert blue["spec"]["replicas"] == 0
    assert blue["metadata"]["annotations"][VERSION_ANNOTATION] == MISSING_VERSION


def test_after_the_refused_swap_the_service_still_selects_green(node: LabNode, refused_swap: Swapped) -> None:
    assert selector(node) == {"app": "ai-service", "colour": "green"}
    assert {a["targetRef"]["name"].rsplit("-", 2)[0] for a in endpoint_addresses(node)} == {"ai-service-green"}


def test_the_swaps_timings_are_recorded(first_swap: Swapped, second_swap: SecondSwap) -> None:
    """kube_swap's timings (seconds since the swap started, but `switch`: the selector to the Endpoints, alone),
    printed for the docs' table."""
    for swapped in (first_swap, second_swap):
        timings = swapped.result.timings
        print(f"lab node: kube_swap timings {timings}", file=sys.stderr)
        assert 0 < timings["apply"] <= timings["ready"] <= timings["total"]
        assert timings["switch"] <= timings["total"] - timings["ready"]


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
