"""The lab Kubernetes node's control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

They run on this machine, bound to 127.0.0.1 on free ports, as children of one supervisor
(`python -m ironserve.lab.kubernetes_control_plane serve`). It stops them when it is stopped, when the VM's
qemu is gone, or when one of them dies; a SIGKILLed supervisor takes them along (PR_SET_PDEATHSIG). Its pid
is in the VM host's `extra`, so `ironserve lab down` stops it. They write only under the lab directory.
The certificates and kubeconfigs are the real kubeadm's. See kubernetes_node.py for the whole node.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ironserve.lab import servers, state
from ironserve.lab.state import LabHost
from ironserve.paths import REPO_ROOT, cache_dir, lab_dir

VERSION = "1.20.2"
MODULE = "ironserve.lab.kubernetes_control_plane"  # how the supervisor is started, and recognised by its command line
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-kubernetes.sh"
# This machine's 127.0.0.1 as a VM on qemu's user network sees it.
HOST_LOOPBACK_FROM_VM = "10.0.2.2"
SERVICE_CIDR = "10.96.0.0/12"
START_TIMEOUT_S = 180.0  # the API server's /readyz on 2 cores shared with a TCG VM
STOP_TIMEOUT_S = 4.0  # within servers.stop's 5 s before it SIGKILLs the supervisor
RECORDED_KEYS = ("kubernetes_pid", "kubernetes_dir", "kubernetes_api")  # in the VM host's `extra`


def build_dir() -> Path:
    return cache_dir() / f"kubernetes-{VERSION}"


def ensure_built() -> Path:
    """The directory of the built binaries, building them first where the cache has none (about 10 minutes)."""
    if not (build_dir() / ".built").exists():
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, env={**os.environ, "IRONSERVE_CACHE": str(cache_dir())})
    return build_dir() / "bin"


@dataclass(frozen=True)
class ControlPlane:
    """A running control plane: where its files are and how to call its API as the cluster admin."""

    directory: Path
    api_port: int
    pid: int

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One API call as system:masters; raises urllib.error.HTTPError with the server's answer on failure."""
        data = json.dumps(body).encode() if body is not None else None
        call = urllib.request.Request(self.api_url + path, data=data, method=method)
        call.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(call, context=_admin_tls(self.directory), timeout=30) as answer:
            result: dict[str, Any] = json.loads(answer.read() or b"{}")
            return result

    def ready(self) -> bool:
        try:
            context = _admin_tls(self.directory)
            with urllib.request.urlopen(self.api_url + "/readyz", context=context, timeout=5) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False


def _admin_tls(directory: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(directory / "pki" / "ca.crt"))
    context.load_cert_chain(str(directory / "admin.crt"), str(directory / "admin.key"))
    return context


def attach(host: LabHost) -> ControlPlane:
    """Start a control plane for the VM `host` (its hostname is the node's name) and record it for `lab down`."""
    if host.kind != "vm":
        raise ValueError(f"{host.name} is a {host.kind}: the kubelet needs a real kernel (a lab VM)")
    if host.extra.get("kubernetes_pid"):
        raise RuntimeError(f"{host.name} has a control plane already (pid {host.extra['kubernetes_pid']})")
    binaries = ensure_built()
    directory = lab_dir() / "kubernetes" / host.name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    api_port, etcd_client_port, etcd_peer_port = _three_free_ports()
    _write_pki(directory, binaries / "kubeadm", host.name, api_port)
    argv = [sys.executable, "-m", MODULE, "serve", "--directory", str(directory), "--binaries", str(binaries)]
    argv += ["--api-port", str(api_port), "--etcd-ports", str(etcd_client_port), str(etcd_peer_port)]
    argv += ["--watch-pid", str(host.pids[0])]
    log = directory / "supervisor.log"
    with open(log, "wb") as out:
        supervisor = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    plane = ControlPlane(directory, api_port, supervisor.pid)
    recorded = {"kubernetes_pid": str(supervisor.pid), "kubernetes_dir": str(directory)}
    recorded["kubernetes_api"] = f"https://{HOST_LOOPBACK_FROM_VM}:{api_port}"
    _record(host, recorded)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not plane.ready():
        if supervisor.poll() is not None or time.monotonic() > deadline:
            detach(host)
            raise RuntimeError(f"the lab control plane did not become ready; see {directory}/*.log")
        time.sleep(1)
    return plane


def detach(host: LabHost) -> None:
    """Stop the host's control plane (only the supervisor this module started, by its recorded pid).

    Its directory stays for post-mortems (logs); the next `attach` of this host replaces it.
    """
    pid = host.extra.get("kubernetes_pid")
    if not pid:
        return
    servers.stop(int(pid), MODULE)
    _record(host, {})


def _record(host: LabHost, values: dict[str, str]) -> None:
    """Set (or, when empty, remove) the control plane's keys in the host's `extra`, here and in the state."""
    with state.locked() as current:
        for extra in [host.extra, *(known.extra for known in current.hosts if known.name == host.name)]:
            for key in RECORDED_KEYS:
                extra.pop(key, None)
            extra.update(values)


def _three_free_ports() -> tuple[int, int, int]:
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(servers.free_port())
    first, second, third = sorted(ports)
    return first, second, third


def _write_pki(directory: Path, kubeadm: Path, node_name: str, api_port: int) -> None:
    """The real kubeadm's certificates and kubeconfigs, written under `directory` only (no /etc).

    The API server's certificate names 127.0.0.1 (the control plane's own clients) and 10.0.2.2 (the
    kubelet in the VM); the kubelet's kubeconfig holds the node's client certificate (system:node:<name>).
    """
    pki = ["--cert-dir", str(directory / "pki")]
    version = ["--kubernetes-version", f"v{VERSION}"]
    sans = ["--apiserver-advertise-address", HOST_LOOPBACK_FROM_VM, "--apiserver-cert-extra-sans", "127.0.0.1"]
    # Each phase takes its own flags (kubeadm refuses the others).
    _kubeadm(kubeadm, ["certs", "ca", *pki, *version])
    _kubeadm(kubeadm, ["certs", "apiserver", *pki, *version, *sans, "--service-cidr", SERVICE_CIDR])
    _kubeadm(kubeadm, ["certs", "apiserver-kubelet-client", *pki, *version])
    _kubeadm(kubeadm, ["certs", "sa", *pki])
    # kubeadm refuses a loopback advertise address; the endpoint is what the admin's and the kubelet's
    # kubeconfigs name (kubeadm writes the advertise address into the controller-manager's and scheduler's:
    # they get `--master` instead).
    to_dir = [
        "--kubeconfig-dir",
        str(directory),
        "--apiserver-advertise-address",
        HOST_LOOPBACK_FROM_VM,
        *pki,
        *version,
    ]
    for phase in ("admin", "controller-manager", "scheduler"):
        _kubeadm(kubeadm, ["kubeconfig", phase, *to_dir, "--control-plane-endpoint", f"127.0.0.1:{api_port}"])
    node = ["--control-plane-endpoint", f"{HOST_LOOPBACK_FROM_VM}:{api_port}", "--node-name", node_name]
    _kubeadm(kubeadm, ["kubeconfig", "kubelet", *to_dir, *node])
    # The admin's client certificate as files, for this module's own API calls (urllib, no kubectl needed).
    user = yaml.safe_load((directory / "admin.conf").read_text())["users"][0]["user"]
    (directory / "admin.crt").write_bytes(base64.b64decode(user["client-certificate-data"]))
    (directory / "admin.key").write_bytes(base64.b64decode(user["client-key-data"]))
    (directory / "admin.key").chmod(0o600)


def _kubeadm(kubeadm: Path, phase_args: list[str]) -> None:
    result = subprocess.run([str(kubeadm), "init", "phase", *phase_args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"kubeadm init phase {' '.join(phase_args[:2])}: {result.stderr.strip()}")


def _component_argv(
    directory: Path, binaries: Path, api_port: int, etcd_ports: tuple[int, int]
) -> dict[str, list[str]]:
    """Each control plane process's command line, in start order."""
    pki = directory / "pki"
    client, peer = (f"http://127.0.0.1:{port}" for port in etcd_ports)

    def api_client(binary: str, kubeconfig: str) -> list[str]:
        """What the controller manager and the scheduler share: the API server, their kubeconfig, no ports."""
        conf = str(directory / kubeconfig)
        return [
            str(binaries / binary), "--kubeconfig", conf, "--master", f"https://127.0.0.1:{api_port}",
            "--authentication-kubeconfig", conf, "--authorization-kubeconfig", conf,
            "--bind-address", "127.0.0.1", "--port", "0", "--secure-port", "0", "--leader-elect=false",
        ]  # fmt: skip

    return {
        "etcd": [
            "etcd", "--name", "lab", "--data-dir", str(directory / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"lab={peer}",
        ],
        "kube-apiserver": [
            str(binaries / "kube-apiserver"), "--etcd-servers", client,
            "--bind-address", "127.0.0.1", "--secure-port", str(api_port), "--insecure-port", "0",
            # Published in the `kubernetes` Service's endpoints, which nothing in the lab uses.
            "--advertise-address", HOST_LOOPBACK_FROM_VM, "--endpoint-reconciler-type", "none",
            "--client-ca-file", str(pki / "ca.crt"),
            "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
            "--kubelet-client-certificate", str(pki / "apiserver-kubelet-client.crt"),
            "--kubelet-client-key", str(pki / "apiserver-kubelet-client.key"),
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
        ],
        "kube-controller-manager": [
            *api_client("kube-controller-manager", "controller-manager.conf"),
            "--service-account-private-key-file", str(pki / "sa.key"), "--root-ca-file", str(pki / "ca.crt"),
            "--cluster-signing-cert-file", str(pki / "ca.crt"), "--cluster-signing-key-file", str(pki / "ca.key"),
            "--use-service-account-credentials",
        ],
        "kube-scheduler": api_client("kube-scheduler", "scheduler.conf"),
    }  # fmt: skip


def _die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the supervisor dies, however it dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def serve(directory: Path, binaries: Path, api_port: int, etcd_ports: tuple[int, int], watch_pid: int | None) -> None:
    """In the supervisor: run the control plane until SIGTERM, until `watch_pid` is gone or one part exits."""
    children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def stop_all(*_: object) -> None:
        for _name, child in reversed(children):
            with contextlib.suppress(ProcessLookupError):
                child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for _name, child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop_all)
    for name, argv in _component_argv(directory, binaries, api_port, etcd_ports).items():
        with open(directory / f"{name}.log", "wb") as log:
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent
            )
        children.append((name, child))
        if name == "etcd":
            _wait_for_port(etcd_ports[0], child, name)
    servers.exit_with(watch_pid, stop_all)
    while True:
        for name, child in children:
            if child.poll() is not None:
                print(f"{name} exited with {child.returncode}; stopping the control plane", file=sys.stderr)
                stop_all()
        time.sleep(1)


def _wait_for_port(port: int, child: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start") from None
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=MODULE)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_command = commands.add_parser("serve", help="run the control plane (started by attach)")
    serve_command.add_argument("--directory", type=Path, required=True)
    serve_command.add_argument("--binaries", type=Path, required=True)
    serve_command.add_argument("--api-port", type=int, required=True)
    serve_command.add_argument("--etcd-ports", type=int, nargs=2, required=True, metavar=("CLIENT", "PEER"))
    serve_command.add_argument("--watch-pid", type=int, help="exit when this process (the VM's qemu) is gone")
    args = parser.parse_args(argv)
    serve(args.directory, args.binaries, args.api_port, tuple(args.etcd_ports), args.watch_pid)


if __name__ == "__main__":
    main()
