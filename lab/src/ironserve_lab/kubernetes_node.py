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
  a static test program (files/kubernetes-probe.c), and the stand-in of the engine image (files/engine-standin.c
  at the engine's Python path: the launcher's readiness markers and probes, no model), each as a docker archive
  `ctr images import` reads. The stand-in is named in containerd by digest too (repo@sha256:<manifest>), the
  form the service's Deployments name their image in.
- Before the kubelet is started, ironserve's own check (roles.kubernetes.checks.cgroup_driver_problem)
  compares its configuration with the VM's real containerd config.toml; a mismatch starts nothing.
- The GPUs are the simulated edge, as the stand-in nvidia-smi is: a stand-in of NVIDIA's device plugin
  (files/gpu-device-plugin, built against the kubelet's own device-plugin API) offers the hardware profile's GPU
  UUIDs as `nvidia.com/gpu`, and containerd's `nvidia` runtime runs a stand-in nvidia-container-runtime that hands
  its arguments to runc (no GPU to inject). What the kubelet, the scheduler and containerd do with them is real.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shlex
import subprocess
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.parse
from pathlib import Path, PurePosixPath
from typing import Any

from ironserve_lab import remote
from ironserve_lab.kubernetes_control_plane import VERSION, ControlPlane, build_dir
from ironserve_lab.state import LabHost
from roles.kubernetes.checks import CRI_PLUGIN, cgroup_driver_problem

FILES = Path(__file__).resolve().parent / "files"
PROBE_SOURCE = FILES / "kubernetes-probe.c"
PROBE_IMAGE = "lab.ironserve.invalid/kubernetes-probe:1"
ENGINE_STANDIN_SOURCE = FILES / "engine-standin.c"
ENGINE_STANDIN_REPOSITORY = "lab.ironserve.invalid/engine-standin"
ENGINE_STANDIN_TAG = f"{ENGINE_STANDIN_REPOSITORY}:1"
IMAGES_NAMESPACE = "k8s.io"  # containerd's namespace of the CRI plugin (the kubelet's images)
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
TASK_EVENTS = "/var/tmp/ironserve-lab-task-events.log"  # record_task_exits' file
KUBELET_UNIT = "lab-kubelet.service"
GUEST_GPU_PLUGIN = "/usr/local/bin/lab-gpu-device-plugin"
GPU_PLUGIN_UNIT = "lab-gpu-device-plugin.service"
NVIDIA_RUNTIME_LOG = "/var/log/ironserve-lab-nvidia-runtime.log"  # the stand-in runtime's command lines
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"


class KubeletRefused(RuntimeError):
    """The kubelet configuration failed ironserve's check against the VM's containerd; nothing was started."""


# --- images -----------------------------------------------------------------------------------------------


def docker_archive(
    tag: str, files: dict[str, bytes], entrypoint: list[str], directories: dict[str, int] | None = None
) -> bytes:
    """A one-layer image as `docker save` writes it: executables at `files` paths, run as `entrypoint`.

    `directories`: paths -> mode of directories the layer holds (e.g. a world-writable /tmp); the files' parent
    directories are in it too, 0755. Every entry is root's with mtime 0, so the same input gives the same bytes
    (and the same digests, the image's manifest digest included).
    """
    wanted = {str(parent): 0o755 for path in files for parent in PurePosixPath(path).parents if str(parent) != "/"}
    wanted |= directories or {}
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for directory, mode in sorted(wanted.items()):
            info = tarfile.TarInfo(directory.strip("/"))
            info.type, info.mode = tarfile.DIRTYPE, mode
            layer.addfile(info)
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


def static_binary(source: Path) -> bytes:
    """`source` (C) compiled static, so that its image needs no libraries."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / source.stem
        subprocess.run(["gcc", "-Os", "-static", "-o", str(out), str(source)], check=True)
        return out.read_bytes()


def probe_binary() -> bytes:
    """The test program, compiled static so its image needs no libraries."""
    return static_binary(PROBE_SOURCE)


def engine_standin_archive(engine_python: str) -> bytes:
    """The stand-in engine image: files/engine-standin.c at `engine_python` (the interpreter the service's
    Deployment runs: `launch` and the `probe ready|live` exec probes), and /tmp (1777) for the launcher's markers:
    the pod runs as the service account's uid, which owns nothing in the image."""
    binary = static_binary(ENGINE_STANDIN_SOURCE)
    return docker_archive(ENGINE_STANDIN_TAG, {engine_python: binary}, [engine_python], {"/tmp": 0o1777})


def import_engine_standin(host: LabHost, engine_python: str) -> str:
    """Import the stand-in engine image into the node's containerd, named by its tag and by digest; returns the
    digest reference, `lab.ironserve.invalid/engine-standin@sha256:<64 hex>`, for
    `inference_service.kubernetes.image`.

    The CRI plugin resolves a reference by image name, and `ctr images import` of a docker archive names the
    image by its tag only: the Deployment's digest reference would not be found locally, and the kubelet's
    default pull policy for it (IfNotPresent) would try the registry. `--digests --base-name <repository>` makes
    containerd add the name `<repository>@<manifest digest>` itself (the manifest is the one it writes for the
    archive, see manifest_digest); the digest returned is the one containerd lists for that name.
    """
    archive = f"{GUEST_IMAGES}/engine-standin.tar"
    copy_files(host, {archive: (engine_standin_archive(engine_python), 0o644)})
    ctr = f"ctr -n {IMAGES_NAMESPACE} images"
    imported = f"{ctr} import --digests --base-name {ENGINE_STANDIN_REPOSITORY} {archive} >/dev/null"
    remote.run(host, f"{imported} && rm -f {archive}", timeout=300)
    reference = f"{ENGINE_STANDIN_REPOSITORY}@{image_digest(host, ENGINE_STANDIN_TAG)}"
    if image_digest(host, reference) != reference.split("@")[1]:
        raise LookupError(f"containerd names no image {reference}")
    return reference


def manifest_digest(archive: bytes) -> str:
    """The digest of the manifest containerd 1.6 writes when it imports the docker archive `archive`: a Docker
    schema 2 manifest of the archive's config and layer blobs (uncompressed), as Go's encoding/json writes it
    (compact, fields in this order). A docker archive carries no manifest of its own."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        (entry,) = json.loads(_member(opened, "manifest.json"))

        def descriptor(media_type: str, name: str) -> dict[str, Any]:
            blob = _member(opened, name)
            return {"mediaType": media_type, "digest": f"sha256:{hashlib.sha256(blob).hexdigest()}", "size": len(blob)}

        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": descriptor("application/vnd.docker.container.image.v1+json", entry["Config"]),
            "layers": [descriptor("application/vnd.docker.image.rootfs.diff.tar", name) for name in entry["Layers"]],
        }
    return f"sha256:{hashlib.sha256(json.dumps(manifest, separators=(',', ':')).encode()).hexdigest()}"


def _member(archive: tarfile.TarFile, name: str) -> bytes:
    member = archive.extractfile(name)
    if member is None:
        raise LookupError(f"{name} is not a file in the archive")
    return member.read()


def image_digest(host: LabHost, name: str) -> str:
    """The target (manifest) digest containerd records for the image `name` (`ctr images ls`' DIGEST column)."""
    listing = remote.run(host, f"ctr -n {IMAGES_NAMESPACE} images ls name=={name}")
    rows = [line.split() for line in listing.splitlines()[1:] if line.split() and line.split()[0] == name]
    if len(rows) != 1 or not re.fullmatch(r"sha256:[0-9a-f]{64}", rows[0][2]):
        raise LookupError(f"containerd has no single image {name}: {listing!r}")
    return rows[0][2]


def image_names(host: LabHost) -> set[str]:
    """The names of the images in the kubelet's containerd namespace."""
    return set(remote.run(host, f"ctr -n {IMAGES_NAMESPACE} images ls -q").split())


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


def gpu_device_plugin_unit(uuids: list[str]) -> str:
    return (
        "[Unit]\n"
        "Description=ironserve lab stand-in of NVIDIA's device plugin (the hardware profile's GPUs)\n"
        f"After={KUBELET_UNIT}\n\n"
        f"[Service]\nExecStart={GUEST_GPU_PLUGIN} --devices {','.join(uuids)}\nRestart=no\n"
    )


def start_gpu_device_plugin(host: LabHost, uuids: list[str]) -> None:
    """The stand-in device plugin offering `uuids` as nvidia.com/gpu, registered with the running kubelet, and the
    stand-in nvidia-container-runtime at containerd's `nvidia` runtime's BinaryName (roles/container_runtime's
    default), so pods on RuntimeClass nvidia start through it (each call logged in NVIDIA_RUNTIME_LOG)."""
    binary = str(cri_settings(host)["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"])
    runc = remote.run(host, "command -v runc").strip()
    shim = (
        f"#!/bin/sh\n# ironserve lab stand-in of {binary}: no GPU to inject, so runc as is; each call logged\n"
        f'echo "$*" >>{NVIDIA_RUNTIME_LOG}\nexec {runc} "$@"\n'
    )
    files = {
        GUEST_GPU_PLUGIN: ((build_dir() / "bin" / "lab-gpu-device-plugin").read_bytes(), 0o755),
        f"/etc/systemd/system/{GPU_PLUGIN_UNIT}": (gpu_device_plugin_unit(uuids).encode(), 0o644),
        binary: (shim.encode(), 0o755),
    }
    copy_files(host, files)
    remote.run(host, f"systemctl daemon-reload && systemctl start {GPU_PLUGIN_UNIT}")


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


def make_model_dir(host: LabHost, path: str, gid: int) -> None:
    """A version's directory on the node's model store as the inference role leaves it: root:<gid> 0750 (the
    pods' hostPath volume, type Directory, read by the service account's group)."""
    remote.run(host, f"install -d -o root -g {gid} -m 0750 {shlex.quote(path)}")


def record_task_exits(host: LabHost, limit_s: int = 900) -> int:
    """Start recording containerd's events in the VM (`ctr events` of the kubelet's namespace, stopped after
    `limit_s` at the latest); returns the recorder's pid for task_exits."""
    command = f"timeout {limit_s} ctr -n {IMAGES_NAMESPACE} events >{TASK_EVENTS} 2>&1 </dev/null"
    return int(remote.run(host, f"nohup {command} & echo $!").strip())


def task_exits(host: LabHost, recorder: int) -> list[dict[str, Any]]:
    """Stop the recorder record_task_exits started and return the task exits it saw, as containerd publishes
    them ({container_id, id (the container's id for its init process, the exec id for an exec), pid, exit_status,
    exited_at}); containerd's JSON omits a zero exit_status, filled in here."""
    text = remote.run(host, f"kill {recorder} 2>/dev/null; sleep 0.5; cat {TASK_EVENTS}; rm -f {TASK_EVENTS}")
    topic = f" {IMAGES_NAMESPACE} /tasks/exit "
    return [{"exit_status": 0, **json.loads(line.split(topic, 1)[1])} for line in text.splitlines() if topic in line]


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


def events_of(plane: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    """The events whose involved object is named `name` in `namespace` (the kubelet's, the controllers')."""
    selector = urllib.parse.quote(f"involvedObject.name={name}")
    items: list[dict[str, Any]] = plane.request(
        "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector={selector}"
    )["items"]
    return items
