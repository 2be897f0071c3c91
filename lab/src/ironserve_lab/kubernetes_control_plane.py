"""The lab's Kubernetes 1.20.2 control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

They run on this machine on free ports (etcd on 127.0.0.1, the API server where the host reaches it: see
`api_address`), as children of one supervisor
(`python -m ironserve_lab.kubernetes_control_plane serve`). It stops them when it is stopped, when the lab
host's first process (a VM's qemu, a container host's supervisor) is gone, or when one of them dies; a
SIGKILLed supervisor takes them along (PR_SET_PDEATHSIG). Its pid is in the host's `extra`, so
`ironserve lab down` stops it. They write only under the lab directory. The certificates and kubeconfigs
are the real kubeadm's.

Two uses: a VM host gets a kubelet as well (kubernetes_node.py, the whole node); a container host is only
the control plane's lifetime, for API-only tests (server-side apply, the controllers, RBAC, subresources)
with no node at all; `install_admin_client` makes that host a control plane's host as the deploy and the gate
see one (the real kubectl, kubeadm's admin kubeconfig). ControlPlane's methods call the API with the standard
library only.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import io
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
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ironserve.kubectl import ADMIN_KUBECONFIG
from ironserve.paths import REPO_ROOT, cache_dir
from ironserve_lab import network, remote, servers, state
from ironserve_lab.paths import lab_dir
from ironserve_lab.state import LabHost

VERSION = "1.20.2"
MODULE = "ironserve_lab.kubernetes_control_plane"  # how the supervisor is started, and recognised by its command line
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-kubernetes.sh"
# This machine's 127.0.0.1 as a VM on qemu's user network sees it.
HOST_LOOPBACK_FROM_VM = "10.0.2.2"
SERVICE_CIDR = "10.96.0.0/12"
START_TIMEOUT_S = 180.0  # the API server's /readyz on 2 cores shared with a TCG VM
STOP_TIMEOUT_S = 4.0  # within servers.stop's 5 s before it SIGKILLs the supervisor
RECORDED_KEYS = ("kubernetes_pid", "kubernetes_dir", "kubernetes_api")  # in the host's `extra`
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; JSON is YAML, so the body is sent as JSON
WAIT_TIMEOUT_S = 120.0  # the controllers' first objects on 2 cores, their informers still syncing
KUBECTL_ON_HOST = "/usr/local/bin/kubectl"
TOKEN_EXPIRATION_S = 3600  # TokenRequest's default; the API server refuses less than 600

T = TypeVar("T")


def build_dir() -> Path:
    return cache_dir() / f"kubernetes-{VERSION}"


def ensure_built() -> Path:
    """The directory of the built binaries, building them first where the cache has none or an older set (about
    10 minutes); the script itself returns at once when its stamp names the components it builds."""
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, env={**os.environ, "IRONSERVE_CACHE": str(cache_dir())})
    return build_dir() / "bin"


@dataclass(frozen=True)
class ControlPlane:
    """A running control plane: where its files are and how to call its API as the cluster admin or as a token.

    Every call raises urllib.error.HTTPError on an error answer; its message ends with the server's own
    (the Status object's `message`) and `read()` still gives the whole answer.
    """

    directory: Path
    api_address: str  # where the API server listens on this machine (see api_address)
    api_port: int
    pid: int

    @property
    def api_url(self) -> str:
        return f"https://{self.api_address}:{self.api_port}"

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, content_type: str = JSON
    ) -> dict[str, Any]:
        """One API call as system:masters (the admin's client certificate)."""
        return _call(self.api_url + path, method, body, content_type, _admin_tls(self.directory), {})

    def request_as(
        self, token: str, method: str, path: str, body: dict[str, Any] | None = None, content_type: str = JSON
    ) -> dict[str, Any]:
        """One API call with `token` as its only credential (a bearer token; the server checked by the cluster CA)."""
        context = ssl.create_default_context(cafile=str(self.directory / "pki" / "ca.crt"))
        return _call(self.api_url + path, method, body, content_type, context, {"Authorization": f"Bearer {token}"})

    def ready(self) -> bool:
        try:
            context = _admin_tls(self.directory)
            with urllib.request.urlopen(self.api_url + "/readyz", context=context, timeout=5) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def resource_path(self, obj: dict[str, Any]) -> str:
        """The REST path of `obj` (apiVersion, kind, metadata.name and, where namespaced, metadata.namespace).

        The resource's plural and scope come from the API server's discovery of that group version, so any
        kind it serves works (CustomResourceDefinitions' kinds too, once established).
        """
        api_version, kind, metadata = obj["apiVersion"], obj["kind"], obj["metadata"]
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        served = self.request("GET", base)["resources"]
        found = [r for r in served if r["kind"] == kind and "/" not in r["name"]]  # not a subresource
        if not found:
            kinds = ", ".join(sorted({r["kind"] for r in served if "/" not in r["name"]}))
            raise LookupError(f"{api_version} serves no kind {kind} (it serves {kinds})")
        plural, namespaced = found[0]["name"], bool(found[0]["namespaced"])
        if not namespaced:
            return f"{base}/{plural}/{metadata['name']}"
        namespace = metadata.get("namespace")
        if not namespace:
            raise ValueError(f"{kind} {metadata['name']} is namespaced: set metadata.namespace")
        return f"{base}/namespaces/{namespace}/{plural}/{metadata['name']}"

    def apply(
        self, obj: dict[str, Any], field_manager: str = "ironserve", dry_run: bool = False, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply of `obj` as `field_manager`: the object as the server stored it, or (dry_run) as it
        would store it, with nothing stored. With `force` it takes over fields other managers own; without,
        such a field is a 409 Conflict naming them."""
        query = {"fieldManager": field_manager, "force": str(force).lower(), **({"dryRun": "All"} if dry_run else {})}
        path = f"{self.resource_path(obj)}?{urllib.parse.urlencode(query)}"
        return self.request("PATCH", path, obj, APPLY_PATCH)

    def service_account_token(self, namespace: str, name: str, expiration_s: int = TOKEN_EXPIRATION_S) -> str:
        """A token of the ServiceAccount, from its TokenRequest subresource (bound to the API server's audience).

        Not the token Secret 1.20's token controller writes: TokenRequest answers at once (no waiting for the
        controller), expires, and is the only way on 1.24 and newer, which write no such Secrets.
        """
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_s},
        }
        answer = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", request)
        return str(answer["status"]["token"])

    def can_i(
        self,
        user: str,
        verb: str,
        resource: str,
        *,
        group: str = "",
        subresource: str = "",
        namespace: str = "",
        name: str = "",
        groups: list[str] | None = None,
    ) -> bool:
        """Whether the API server's authorizers (Node, RBAC) allow `user` the request, by a SubjectAccessReview
        made as the admin. `groups` default to what the API server's authenticator gives `user`: a
        ServiceAccount's (see service_account_user) are system:serviceaccounts, system:serviceaccounts:<ns>."""
        attributes = {"verb": verb, "group": group, "resource": resource, "subresource": subresource}
        attributes |= {"namespace": namespace, "name": name}
        spec = {"user": user, "groups": authenticated_groups(user) if groups is None else groups}
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {**spec, "resourceAttributes": attributes},
        }
        answer = self.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        return bool(answer["status"].get("allowed"))

    def wait_for_object(
        self,
        path: str,
        condition: Callable[[dict[str, Any]], bool] = lambda _: True,
        timeout: float = WAIT_TIMEOUT_S,
    ) -> dict[str, Any]:
        """GET `path` (an object or a list, as the admin) until `condition` holds for the answer; a 404 counts as
        not yet. Raises TimeoutError with the last answer."""
        last: list[object] = ["nothing"]

        def check() -> dict[str, Any] | None:
            try:
                answer = self.request("GET", path)
            except urllib.error.HTTPError as error:
                if error.code != 404:
                    raise
                last[0] = str(error)
                return None
            last[0] = answer
            return answer if condition(answer) else None

        try:
            return wait_for(check, timeout, path)
        except TimeoutError as error:
            raise TimeoutError(f"{error}; last answer: {json.dumps(last[0])[:2000]}") from None


def service_account_user(namespace: str, name: str) -> str:
    """The user name a ServiceAccount's tokens authenticate as."""
    return f"system:serviceaccount:{namespace}:{name}"


def authenticated_groups(user: str) -> list[str]:
    """The groups the API server's authenticators give `user` (a ServiceAccount's tokens, anyone's certificate)."""
    if user.startswith("system:serviceaccount:"):
        namespace = user.split(":")[2]
        return ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"]
    return ["system:authenticated"]


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.5) -> T:
    """`check()`'s first truthy result, called every `interval` s; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not there within {timeout:.0f} s")
        time.sleep(interval)


def _call(
    url: str,
    method: str,
    body: dict[str, Any] | None,
    content_type: str,
    context: ssl.SSLContext,
    headers: dict[str, str],
) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    call = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type, **headers})
    try:
        with urllib.request.urlopen(call, context=context, timeout=30) as answer:
            result: dict[str, Any] = json.loads(answer.read() or b"{}")
            return result
    except urllib.error.HTTPError as error:
        raise _with_servers_message(error) from None


def _with_servers_message(error: urllib.error.HTTPError) -> urllib.error.HTTPError:
    """The same error, its message ending with the server's (a Status object's `message`), its answer readable."""
    answer = error.read()
    try:
        message = str(json.loads(answer).get("message", ""))
    except (ValueError, AttributeError):
        message = answer.decode(errors="replace")[:500]
    reason = f"{error.reason}: {message}" if message else str(error.reason)
    return urllib.error.HTTPError(error.url, error.code, reason, error.headers, io.BytesIO(answer))


def _admin_tls(directory: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(directory / "pki" / "ca.crt"))
    context.load_cert_chain(str(directory / "admin.crt"), str(directory / "admin.key"))
    return context


def api_address(host: LabHost) -> str:
    """Where the API server listens: a VM's kubelet reaches this machine's loopback through qemu's user network
    (10.0.2.2); a container host, in a network namespace of its own, reaches this machine only at the lab bridge's
    address, which exists for as long as the container lab does (network.py)."""
    return "127.0.0.1" if host.kind == "vm" else str(network.GATEWAY)


def attach(host: LabHost) -> ControlPlane:
    """Start a control plane for `host` and record it in the host's `extra` for `lab down`.

    Its supervisor watches the host's first process and stops with it. A VM host may then get a kubelet
    (kubernetes_node.start_kubelet; its host name is the node's name, in the kubelet's kubeconfig); on a
    container host it is an API server with controllers and no node.
    """
    if host.extra.get("kubernetes_pid"):
        raise RuntimeError(f"{host.name} has a control plane already (pid {host.extra['kubernetes_pid']})")
    binaries = ensure_built()
    directory = lab_dir() / "kubernetes" / host.name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    api_port, etcd_client_port, etcd_peer_port = _three_free_ports()
    address = api_address(host)
    _write_pki(directory, binaries / "kubeadm", host.name, address, api_port)
    argv = [sys.executable, "-m", MODULE, "serve", "--directory", str(directory), "--binaries", str(binaries)]
    argv += ["--api-address", address, "--api-port", str(api_port)]
    argv += ["--etcd-ports", str(etcd_client_port), str(etcd_peer_port)]
    argv += ["--watch-pid", str(host.pids[0])]
    log = directory / "supervisor.log"
    with open(log, "wb") as out:
        supervisor = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    plane = ControlPlane(directory, address, api_port, supervisor.pid)
    recorded = {"kubernetes_pid": str(supervisor.pid), "kubernetes_dir": str(directory)}
    # Where the host reaches it: a VM through qemu's user network, a container host at the bridge's address.
    reached_at = HOST_LOOPBACK_FROM_VM if host.kind == "vm" else address
    recorded["kubernetes_api"] = f"https://{reached_at}:{api_port}"
    _record(host, recorded)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not plane.ready():
        if supervisor.poll() is not None or time.monotonic() > deadline:
            detach(host)
            raise RuntimeError(f"the lab control plane did not become ready; see {directory}/*.log")
        time.sleep(1)
    return plane


def install_admin_client(host: LabHost, plane: ControlPlane) -> None:
    """The real kubectl 1.20.2 in /usr/local/bin and the admin kubeconfig at /etc/kubernetes/admin.conf (0600) on
    a container host, as a kubeadm control plane has them: the deploy's kubectl steps and the gate's cluster
    checks then run on the host against the real API server. /usr/local/bin comes before /usr/bin in PATH, so
    it shadows the stand-in kubectl of the lab's Kubernetes packages (which answers only `version --client`)."""
    if host.kind == "vm":
        raise ValueError(f"{host.name}: a VM's control plane is on this machine's loopback, not for its own clients")
    files = [
        (build_dir() / "bin" / "kubectl", KUBECTL_ON_HOST, "0755"),
        (plane.directory / "admin.conf", ADMIN_KUBECONFIG, "0600"),
    ]
    for source, target, mode in files:
        with source.open("rb") as content:
            command = f"install -D -m {mode} /dev/stdin {target}"
            subprocess.run([*remote.ssh_argv(host), command], stdin=content, check=True, capture_output=True)


def kubeadm_coredns(plane: ControlPlane) -> None:
    """CoreDNS as `kubeadm init` leaves it in a new cluster: the real kubeadm's addon phase against this API server
    (Deployment, Service, ConfigMap and RBAC in kube-system; its pods stay Pending where no node has joined)."""
    kubeconfig = ["--kubeconfig", str(plane.directory / "admin.conf")]
    cluster = ["--kubernetes-version", f"v{VERSION}", "--service-cidr", SERVICE_CIDR]
    _kubeadm(build_dir() / "bin" / "kubeadm", ["addon", "coredns", *kubeconfig, *cluster])


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


def _write_pki(directory: Path, kubeadm: Path, node_name: str, address: str, api_port: int) -> None:
    """The real kubeadm's certificates and kubeconfigs, written under `directory` only (no /etc).

    The API server's certificate names 127.0.0.1 and the lab bridge's address (where this machine's clients and
    a container host's reach it) and 10.0.2.2 (the kubelet in the VM); the admin's kubeconfig names `address`; the
    kubelet's holds the node's client certificate (system:node:<name>).
    """
    pki = ["--cert-dir", str(directory / "pki")]
    version = ["--kubernetes-version", f"v{VERSION}"]
    extra_sans = f"127.0.0.1,{network.GATEWAY}"
    sans = ["--apiserver-advertise-address", HOST_LOOPBACK_FROM_VM, "--apiserver-cert-extra-sans", extra_sans]
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
        _kubeadm(kubeadm, ["kubeconfig", phase, *to_dir, "--control-plane-endpoint", f"{address}:{api_port}"])
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
    directory: Path, binaries: Path, api_address: str, api_port: int, etcd_ports: tuple[int, int]
) -> dict[str, list[str]]:
    """Each control plane process's command line, in start order."""
    pki = directory / "pki"
    client, peer = (f"http://127.0.0.1:{port}" for port in etcd_ports)

    def api_client(binary: str, kubeconfig: str) -> list[str]:
        """What the controller manager and the scheduler share: the API server, their kubeconfig, no ports."""
        conf = str(directory / kubeconfig)
        return [
            str(binaries / binary), "--kubeconfig", conf, "--master", f"https://{api_address}:{api_port}",
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
            "--bind-address", api_address, "--secure-port", str(api_port), "--insecure-port", "0",
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


def serve(
    directory: Path,
    binaries: Path,
    api_address: str,
    api_port: int,
    etcd_ports: tuple[int, int],
    watch_pid: int | None,
) -> None:
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
    for name, argv in _component_argv(directory, binaries, api_address, api_port, etcd_ports).items():
        with open(directory / f"{name}.log", "wb") as log:
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent
            )
        children.append((name, child))
        if name == "etcd":
            _wait_for_port(etcd_ports[0], child, name)
        if name == "kube-apiserver":
            # The controller manager gives the API server 10 s to turn healthy and then exits; on a loaded
            # machine it needs longer, so the clients start once it is ready.
            _wait_for_api_server(ControlPlane(directory, api_address, api_port, os.getpid()), child)
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


def _wait_for_api_server(plane: ControlPlane, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not plane.ready():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kube-apiserver did not become ready")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=MODULE)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_command = commands.add_parser("serve", help="run the control plane (started by attach)")
    serve_command.add_argument("--directory", type=Path, required=True)
    serve_command.add_argument("--binaries", type=Path, required=True)
    serve_command.add_argument("--api-address", required=True)
    serve_command.add_argument("--api-port", type=int, required=True)
    serve_command.add_argument("--etcd-ports", type=int, nargs=2, required=True, metavar=("CLIENT", "PEER"))
    serve_command.add_argument("--watch-pid", type=int, help="exit when this process (the lab host's) is gone")
    args = parser.parse_args(argv)
    serve(args.directory, args.binaries, args.api_address, args.api_port, tuple(args.etcd_ports), args.watch_pid)


if __name__ == "__main__":
    main()
