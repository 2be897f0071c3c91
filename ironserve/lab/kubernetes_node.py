"""The lab's real Kubernetes node: a 1.20.2 control plane on this machine, its kubelet in a lab VM.

Kubernetes 1.20.2 is the release Debian 12 ships as source; scripts/build-kubernetes.sh builds it once into
the cache. It is the lab's oracle for how a real API server, scheduler and kubelet treat what ironserve
renders (kubelet configuration, cgroup driver, seccomp Localhost profiles, CNI), never the version ironserve
pins for sites.

- The control plane runs on this machine (kubernetes_control_plane.py), recorded for `ironserve lab down`.
- The kubelet runs inside the VM (it writes kernel sysctls, cgroups and iptables, so never on this machine),
  on the VM's containerd (what roles/container_runtime deployed), on a CNI bridge, with the API server at
  10.0.2.2. The API server cannot reach the kubelet, so results are read from the API (pod status,
  termination messages) or over SSH.
- Its images are built here without a registry or docker: the pause program from the same source package,
  and a static test program (files/kubernetes-probe.c), each as a docker archive `ctr images import` reads.
- Before the kubelet is started, ironserve's own check (roles.kubernetes.checks.cgroup_driver_problem)
  compares its configuration with the VM's real containerd config.toml; a mismatch starts nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
import time
import tomllib
import urllib.error
from pathlib import Path
from typing import Any

from ironserve.lab import remote
from ironserve.lab.kubernetes_control_plane import VERSION, ControlPlane, build_dir
from ironserve.lab.state import LabHost
from roles.kubernetes.checks import CRI_PLUGIN, cgroup_driver_problem

PROBE_SOURCE = Path(__file__).resolve().parent / "files" / "kubernetes-probe.c"
PROBE_IMAGE = "lab.ironserve.invalid/kubernetes-probe:1"
POD_CIDR = "10.244.0.0/24"  # host-local's range on the node's bridge
CNI_BRIDGE = "cni0"
CNI_PLUGINS = ("bridge", "host-local", "loopback")  # what the conflist uses: no masquerade, no port maps
READY_TIMEOUT_S = 300.0

# In the VM: kubeadm's layout, the kubelet outside /usr/bin (the kubernetes role's packages own that), and a
# unit name no package owns.
GUEST_KUBELET = "/usr/local/bin/kubelet"
GUEST_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
GUEST_CA = "/etc/kubernetes/pki/ca.crt"
GUEST_KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
GUEST_IMAGES = "/var/tmp/ironserve-lab-images"
KUBELET_UNIT = "lab-kubelet.service"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"


class KubeletRefused(RuntimeError):
    """The kubelet configuration failed ironserve's check against the VM's containerd; nothing was started."""


# --- images -----------------------------------------------------------------------------------------------


def docker_archive(tag: str, files: dict[str, bytes], entrypoint: list[str]) -> bytes:
    """A one-layer image as `docker save` writes it: executables at `files` paths, run as `entrypoint`."""
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(content), 0o755
            layer.addfile(info, io.BytesIO(content))
    layer_bytes = layer_buffer.getvalue()
    layer_digest = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        }
    ).encode()
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": [f"{layer_digest}/layer.tar"]}])
    archive_buffer = io.BytesIO()
    with tarfile.open(fileobj=archive_buffer, mode="w") as archive:
        for name, content in (
            (f"{layer_digest}/layer.tar", layer_bytes),
            (config_name, config),
            ("manifest.json", manifest.encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return archive_buffer.getvalue()


def probe_binary() -> bytes:
    """The test program, compiled static so its image needs no libraries."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "probe"
        subprocess.run(["gcc", "-Os", "-static", "-o", str(out), str(PROBE_SOURCE)], check=True)
        return out.read_bytes()


def cni_plugins() -> dict[str, bytes]:
    """The CNI plugins the node uses, from Debian's containernetworking-plugins (fetched by the build)."""
    deb = next((build_dir() / "debs").glob("containernetworking-plugins_*.deb"))
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(["dpkg-deb", "-x", str(deb), scratch], check=True)
        return {name: (Path(scratch) / "usr/lib/cni" / name).read_bytes() for name in CNI_PLUGINS}


# --- the kubelet in the VM --------------------------------------------------------------------------------


def containerd_config(host: LabHost) -> str:
    return remote.run(host, f"cat {CONTAINERD_CONFIG}")


def cri_settings(host: LabHost) -> dict[str, Any]:
    """containerd's CRI plugin settings as in force (defaults included): sandbox image, CNI directories."""
    dumped = tomllib.loads(remote.run(host, "containerd config dump"))
    cri: dict[str, Any] = dumped["plugins"][CRI_PLUGIN]
    return cri


def bridge_conflist() -> str:
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": "ironserve-lab",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": CNI_BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
            ],
        },
        indent=2,
    )


def kubelet_unit(node_name: str) -> str:
    # The 1.20 kubelet takes the runtime through flags (its config file has no containerRuntimeEndpoint yet:
    # it decodes ironserve's file leniently and logs the unknown field); lab-only values are flags too, so the
    # rendered config file stays as ironserve renders it. No --pod-infra-container-image: with a remote
    # runtime the kubelet ignores it (and says so); the sandbox image is containerd's sandbox_image.
    flags = [
        f"--config={GUEST_KUBELET_CONFIG}",
        f"--kubeconfig={GUEST_KUBECONFIG}",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{CONTAINERD_SOCKET}",
        f"--hostname-override={node_name}",
    ]
    return (
        "[Unit]\n"
        f"Description=Kubernetes {VERSION} kubelet of the ironserve lab node\n"
        "Requires=containerd.service\nAfter=containerd.service\n\n"
        # No restart: a kubelet that stops shows in the test instead of looping.
        f"[Service]\nExecStart={GUEST_KUBELET} {' '.join(flags)}\nRestart=no\n"
    )


def start_kubelet(host: LabHost, plane: ControlPlane, kubelet_config: str) -> None:
    """Check `kubelet_config` against the VM's containerd, then install the node's files and start the kubelet.

    Raises KubeletRefused, having changed nothing in the VM, when ironserve's cgroup driver check fails, and
    ValueError for a container host: the kubelet writes kernel-global sysctls, cgroups and iptables, so it
    needs a real kernel of its own (a lab VM). A container host's control plane has no node.
    """
    if host.kind != "vm":
        raise ValueError(f"{host.name} is a {host.kind}: the kubelet needs a real kernel (a lab VM)")
    problem = cgroup_driver_problem(containerd_config(host), kubelet_config)
    if problem:
        raise KubeletRefused(problem)
    cri = cri_settings(host)
    sandbox_image = str(cri["sandbox_image"])
    bin_dir, conf_dir = str(cri["cni"]["bin_dir"]), str(cri["cni"]["conf_dir"])
    binaries = build_dir() / "bin"
    pause = (binaries / "pause").read_bytes()
    files: dict[str, tuple[bytes, int]] = {
        GUEST_KUBELET: ((binaries / "kubelet").read_bytes(), 0o755),
        GUEST_KUBECONFIG: ((plane.directory / "kubelet.conf").read_bytes(), 0o600),
        # Where a kubeadm node has it (a KubeletConfiguration's clientCAFile names it).
        GUEST_CA: ((plane.directory / "pki" / "ca.crt").read_bytes(), 0o644),
        GUEST_KUBELET_CONFIG: (kubelet_config.encode(), 0o644),
        f"/etc/systemd/system/{KUBELET_UNIT}": (kubelet_unit(host.name).encode(), 0o644),
        # The lab is the network add-on that fills containerd's CNI directories.
        f"{conf_dir}/10-ironserve-lab.conflist": (bridge_conflist().encode(), 0o644),
        **{f"{bin_dir}/{name}": (content, 0o755) for name, content in cni_plugins().items()},
        f"{GUEST_IMAGES}/pause.tar": (docker_archive(sandbox_image, {"/pause": pause}, ["/pause"]), 0o644),
        f"{GUEST_IMAGES}/probe.tar": (docker_archive(PROBE_IMAGE, {"/probe": probe_binary()}, ["/probe"]), 0o644),
    }  # fmt: skip
    copy_files(host, files)
    remote.run(
        host,
        f"for image in {GUEST_IMAGES}/*.tar; do ctr -n k8s.io images import $image >/dev/null; done"
        f" && rm -rf {GUEST_IMAGES} && systemctl daemon-reload && systemctl start {KUBELET_UNIT}",
        timeout=300,
    )


def copy_files(host: LabHost, files: dict[str, tuple[bytes, int]]) -> None:
    """Write absolute paths -> (content, mode) on `host` in one SSH stream (tar, root-owned)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path, (content, mode) in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(content), mode, int(time.time())
            archive.addfile(info, io.BytesIO(content))
    subprocess.run(
        [*remote.ssh_argv(host), "tar -x --no-same-owner -C /"], input=buffer.getvalue(), check=True, timeout=600
    )


def kubelet_pid(host: LabHost) -> int:
    """The running kubelet's pid; 0 when it does not run."""
    return int(remote.run(host, f"systemctl show --property MainPID --value {KUBELET_UNIT}").strip() or 0)


# --- reading the node through the API ---------------------------------------------------------------------


def node_ready(plane: ControlPlane, name: str) -> bool:
    try:
        node = plane.request("GET", f"/api/v1/nodes/{name}")
    except urllib.error.HTTPError as error:
        if error.code == 404:  # not registered yet
            return False
        raise
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_for_node_ready(plane: ControlPlane, name: str, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not node_ready(plane, name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {name} not Ready within {timeout:.0f} s")
        time.sleep(2)


def probe_pod(name: str, args: list[str], seccomp: dict[str, str], restart: str = "Never") -> dict[str, Any]:
    """A pod running the probe image with `args` under the seccomp profile `seccomp` (securityContext form)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": restart,
            "automountServiceAccountToken": False,
            "securityContext": {"seccompProfile": seccomp},
            "containers": [
                {
                    "name": "probe",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": args,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
        },
    }


def create_pod(plane: ControlPlane, pod: dict[str, Any]) -> None:
    plane.request("POST", "/api/v1/namespaces/default/pods", pod)


def wait_for_pod(plane: ControlPlane, name: str, phases: set[str], timeout: float = 180) -> dict[str, Any]:
    """The pod once its phase is one of `phases` (and, for Running, its container is ready)."""
    deadline = time.monotonic() + timeout
    while True:
        pod = plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        status = pod.get("status", {})
        phase = status.get("phase")
        running = phase == "Running" and all(c.get("ready") for c in status.get("containerStatuses", []))
        if phase in phases and (phase != "Running" or running):
            return pod
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pod {name} not {'/'.join(sorted(phases))} within {timeout:.0f} s: {json.dumps(status)}"
            )
        time.sleep(2)


def termination_message(pod: dict[str, Any]) -> str:
    terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated", {})
    return str(terminated.get("message", "")).strip()
