"""Stand-in kubeadm, kubelet, kubectl, crictl and CNI plugins: the ironserve lab stand-ins of pkgs.k8s.io's packages.

Lab edge only. The lab mirror's Kubernetes repository (aptrepo.py) ships this file in each of its
packages, as /usr/lib/ironserve-lab/<package>/kubernetes.py, with the real programs' paths as small wrappers that
name the tool and the package's version (IRONSERVE_STANDIN_KUBERNETES_VERSION). Why stand-ins: a lab host has no
container images, no container runtime able to run a control plane and no kernel of its own; the product runs the
same commands as on an R740 and reads the same files. Standard library only (a lab host has python3, not PyYAML).

What is simulated, with the real tools' output (captures cited where the strings are):
- `kubeadm version [-o short|json|yaml]`, `kubelet --version`, `kubectl version --client [-o json|yaml]`,
  `crictl --version`, and a CNI plugin's `CNI_COMMAND=VERSION`.
- kubelet run as the service: without its --config file it fails like the real one (so it crash-loops until kubeadm
  writes the file); with it, it stays running and does nothing (no pods, no sysctls, no cgroups).
- `kubeadm init --config FILE [--skip-token-print] [--upload-certs]`: preflight refuses existing static Pod
  manifests; otherwise a real CA (openssl, CN kubernetes), the kubeconfigs with client certificates it signs, the
  static Pod manifests, /var/lib/kubelet/{config.yaml,kubeadm-flags.env}, the phase lines and the closing text.
- `kubeadm token create [--ttl D]` (needs /etc/kubernetes/admin.conf, like the real one).
- `kubeadm join --config FILE`: validates the bootstrap token and CA pin, refuses an existing kubelet.conf, writes the
  node's files and records what it joined with (token id, never the secret) in /var/lib/ironserve-lab/kubeadm-join.log:
  no control plane answers, so a lab test compares that record with the control plane's tokens and CA.
The stand-in's own state (the bootstrap tokens a real API server would keep) is in /etc/kubernetes/.ironserve-lab/.
Anything else exits 2 with "ironserve lab stand-in: <args> is not simulated".

IRONSERVE_STANDIN_KUBERNETES_ROOT (unit tests only) puts every path under a folder and leaves systemctl alone.
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("IRONSERVE_STANDIN_KUBERNETES_ROOT", "/"))
VERSION = os.environ.get("IRONSERVE_STANDIN_KUBERNETES_VERSION", "0.0.0")  # set by each program's wrapper
STACK_HINT = "To see the stack trace of this error execute with --v=5 or higher"

# Build fields of the real v1.31.4 linux/amd64 binaries: kubeadm's from a captured `kubeadm version` after
# `apt-get install kubeadm=1.31.4-1.1` from pkgs.k8s.io, kubectl's from a captured `kubectl version -o yaml` (the
# windows/amd64 build of the same release, whose build date is the one shown). The decoys (1.31.9, 1.32.0) are never
# run by a converged host; their build fields are zeros, not real values.
BUILD = {
    "1.31.4": {
        "gitCommit": "a78aa47129b8539636eb86a9d00e31b2720fe06b",
        "kubeadm": "2024-12-10T11:42:09Z",
        "kubectl": "2024-12-10T11:43:21Z",
        "goVersion": "go1.22.9",
    },
}
NOT_CAPTURED = {
    "gitCommit": "0" * 40,
    "kubeadm": "1970-01-01T00:00:00Z",
    "kubectl": "1970-01-01T00:00:00Z",
    "goVersion": "go0.0.0",
}
# kubectl 1.31.4 prints Kustomize Version: v5.4.2 (the same capture); kubectl 1.32 embeds kustomize v5.5.0.
KUSTOMIZE = {"1.31": "v5.4.2", "1.32": "v5.5.0"}
ETCD_IMAGE_TAG = "3.5.15-0"  # kubeadm 1.31's etcd, as `kubeadm upgrade plan` v1.31.4 lists it
PAUSE_IMAGE_TAG = "3.10"  # kubeadm 1.31's sandbox image (its preflight warns about any other)
DEFAULT_CRI_SOCKET = "unix:///var/run/containerd/containerd.sock"
CNI_SUPPORTED = ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]  # CNI spec versions of plugins 1.5/1.6
BOOTSTRAP_TOKEN = re.compile(r"^([a-z0-9]{6})\.([a-z0-9]{16})$")  # kubeadm's bootstrap token format
CA_PIN = re.compile(r"^sha256:[0-9a-f]{64}$")


class Refused(Exception):
    """What the real tool prints on stderr before exiting 1."""


def not_simulated(tool: str, args: Sequence[str]) -> int:
    print(f"ironserve lab stand-in: {' '.join([tool, *args])} is not simulated", file=sys.stderr)
    return 2


def path(absolute: str) -> Path:
    return ROOT / absolute.lstrip("/")


def _build(field: str) -> str:
    return BUILD.get(VERSION, NOT_CAPTURED)[field]


def version_info(binary: str) -> dict[str, str]:
    """k8s.io/apimachinery's version.Info, the fields in the order Go prints them."""
    major, minor = VERSION.split(".")[:2]
    return {
        "major": major,
        "minor": minor,
        "gitVersion": f"v{VERSION}",
        "gitCommit": _build("gitCommit"),
        "gitTreeState": "clean",
        "buildDate": _build(binary),
        "goVersion": _build("goVersion"),
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def _yaml_lines(data: dict[str, Any], indent: str = "") -> list[str]:
    """What sigs.k8s.io/yaml prints for string maps: keys sorted, strings that look like numbers or dates quoted."""
    lines = []
    for key in sorted(data):
        value = data[key]
        if isinstance(value, dict):
            lines += [f"{indent}{key}:", *_yaml_lines(value, indent + "  ")]
        else:
            quoted = re.fullmatch(r"[0-9.]+|[0-9-]+T[0-9:]+Z", value)
            lines.append(f'{indent}{key}: "{value}"' if quoted else f"{indent}{key}: {value}")
    return lines


class NotSimulated(Exception):
    """A request the stand-in does not simulate (exit 2)."""


def take_option(args: list[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V`, removed from `args`; None when absent."""
    for index, arg in enumerate(args):
        if arg.startswith(name + "="):
            del args[index]
            return arg.split("=", 1)[1]
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
            del args[index : index + 2]
            return value
    return None


def take_flag(args: list[str], name: str) -> bool:
    if name in args:
        args.remove(name)
        return True
    return False


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def rfc3339(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- a YAML subset: what kubeadm configuration files hold (block maps and lists, plain and quoted scalars) ---------


class YamlError(ValueError):
    pass


KEY = re.compile(r"^([^\s:'\"#][^:]*?|\"[^\"]*\"|'[^']*'):(?:\s+(.*))?$")


def _strip_comment(line: str) -> str:
    quote, index = "", 0
    while index < len(line):
        char = line[index]
        index += 1
        if quote == "'" and line[index - 1 : index + 1] == "''":
            index += 1  # '' is a quote inside a single-quoted scalar
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"" and (index == 1 or line[index - 2] in " :-[,{"):
            quote = char
        elif char == "#" and (index == 1 or line[index - 2] == " "):
            return line[: index - 1].rstrip()
    return line.rstrip()


def _scalar(text: str) -> Any:
    text = text.strip()
    if text[:1] in ("|", ">"):
        raise YamlError("block scalars are not simulated")
    if text.startswith('"'):
        return json.loads(text)  # the double-quoted scalars of a kubeadm file are JSON strings
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_scalar(item) for item in inner.split(",")] if inner else []
    if text == "{}":
        return {}
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "~", ""):
        return None
    if re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    return text


def _is_item(text: str) -> bool:
    return text == "-" or text.startswith("- ")


def _node(lines: list[list[Any]], index: int, indent: int) -> tuple[Any, int]:
    text = lines[index][1]
    if _is_item(text):
        return _sequence(lines, index, indent)
    if KEY.match(text):
        return _mapping(lines, index, indent)
    return _scalar(text), index + 1


def _nested(lines: list[list[Any]], index: int, indent: int) -> tuple[Any, int]:
    """The value on the lines after a `key:` or a bare `-` at `indent`, None when there is none."""
    deeper = index < len(lines) and lines[index][0] > indent
    sibling_list = index < len(lines) and lines[index][0] == indent and _is_item(lines[index][1])
    if deeper or sibling_list:
        return _node(lines, index, lines[index][0])
    return None, index


def _mapping(lines: list[list[Any]], index: int, indent: int) -> tuple[dict[Any, Any], int]:
    result: dict[Any, Any] = {}
    while index < len(lines) and lines[index][0] == indent and not _is_item(lines[index][1]):
        match = KEY.match(lines[index][1])
        if not match:
            raise YamlError(f"cannot read {lines[index][1]!r} as `key: value`")
        key, rest = _scalar(match[1]), match[2]
        if rest:
            result[key], index = _scalar(rest), index + 1
        else:
            result[key], index = _nested(lines, index + 1, indent)
    return result, index


def _sequence(lines: list[list[Any]], index: int, indent: int) -> tuple[list[Any], int]:
    result = []
    while index < len(lines) and lines[index][0] == indent and _is_item(lines[index][1]):
        item = lines[index][1][1:].lstrip()
        if item:  # `- key: value` starts a mapping whose keys line up with `key`
            lines[index] = [indent + len(lines[index][1]) - len(item), item]
            value, index = _node(lines, index, lines[index][0])
        else:
            value, index = _nested(lines, index + 1, indent)
        result.append(value)
    return result, index


def parse_yaml(text: str) -> Any:
    lines: list[list[Any]] = []
    for raw in text.splitlines():
        content = _strip_comment(raw)
        if content.strip():
            if "\t" in content[: len(content) - len(content.lstrip())]:
                raise YamlError("found a tab character that violates indentation")
            lines.append([len(content) - len(content.lstrip()), content.strip()])
    if not lines:
        return None
    value, end = _node(lines, 0, lines[0][0])
    if end != len(lines):
        raise YamlError(f"did not find expected key at {lines[end][1]!r}")
    return value


def documents(text: str) -> list[tuple[dict[str, Any], str]]:
    """Each YAML document of a multi-document file: parsed, and its own text."""
    found = []
    for chunk in re.split(r"^---[ \t]*$", text, flags=re.M):
        parsed = parse_yaml(chunk)
        if parsed is None:
            continue
        if not isinstance(parsed, dict):
            raise YamlError("a document is not a mapping")
        found.append((parsed, chunk.strip("\n") + "\n"))
    return found


# --- kubeadm's configuration file -------------------------------------------------------------------------------

KUBEADM_API = "kubeadm.k8s.io/v1beta4"
KUBELET_API = "kubelet.config.k8s.io/v1beta1"
KUBEADM_KINDS = ("InitConfiguration", "ClusterConfiguration", "JoinConfiguration")


def read_config(file: str) -> dict[str, tuple[dict[str, Any], str]]:
    """The file's documents by kind: kubeadm's v1beta4 kinds and the KubeletConfiguration."""
    try:
        text = Path(file).read_text()
    except FileNotFoundError:
        raise Refused(f"open {file}: no such file or directory") from None
    try:
        found = documents(text)
    except (YamlError, json.JSONDecodeError) as error:
        raise NotSimulated(f"{file}: {error}") from None
    by_kind: dict[str, tuple[dict[str, Any], str]] = {}
    for document, raw in found:
        api, kind = document.get("apiVersion"), document.get("kind")
        if kind in KUBEADM_KINDS and api != KUBEADM_API:
            raise NotSimulated(f"{file}: {api} {kind} (only {KUBEADM_API})")
        if (kind in KUBEADM_KINDS) or (kind == "KubeletConfiguration" and api == KUBELET_API):
            by_kind[str(kind)] = (document, raw)
        else:
            gvk = f"GroupVersionKind {api}, Kind={kind}"
            print(f"[config] WARNING: Ignored configuration document with {gvk}", file=sys.stderr)
    return by_kind


def get(document: dict[str, Any], dotted: str, default: Any = None) -> Any:
    value: Any = document
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return default if value is None else value


def extra_args(node_registration: dict[str, Any]) -> list[str]:
    """v1beta4's kubeletExtraArgs, a list of {name, value}, as the kubelet flags kubeadm writes."""
    return [f"--{arg['name']}={arg['value']}" for arg in get(node_registration, "kubeletExtraArgs", [])]


# --- what kubeadm writes ----------------------------------------------------------------------------------------

PKI = "/etc/kubernetes/pki"
MANIFESTS = "/etc/kubernetes/manifests"
KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
KUBELET_FLAGS = "/var/lib/kubelet/kubeadm-flags.env"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
ADMIN_KUBECONFIG = "/etc/kubernetes/admin.conf"
STATE_DIR = "/etc/kubernetes/.ironserve-lab"  # what a real cluster's API server would keep: the bootstrap tokens
TOKENS = f"{STATE_DIR}/bootstrap-tokens.json"
JOIN_LOG = "/var/lib/ironserve-lab/kubeadm-join.log"
CONTROL_PLANE_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


def write(absolute: str, content: str | bytes, mode: int = 0o644) -> None:
    target = path(absolute)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    target.write_bytes(data)
    target.chmod(mode)


def openssl(*args: str) -> bytes:
    return subprocess.run(["openssl", *args], check=True, capture_output=True).stdout


def make_ca(pki: Path) -> None:
    """A self-signed RSA CA like kubeadm's: CN kubernetes, ten years."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
        "-days", "3650", "-subj", "/CN=kubernetes", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign",
    )  # fmt: skip
    (pki / "ca.key").chmod(0o600)


def client_certificate(pki: Path, common_name: str, organization: str = "") -> tuple[bytes, bytes]:
    """(certificate, key) PEM of a client certificate the CA signs, as kubeadm makes for each kubeconfig."""
    with tempfile.TemporaryDirectory() as tmp:
        key, request, extensions = Path(tmp) / "key.pem", Path(tmp) / "req.pem", Path(tmp) / "ext.cnf"
        subject = (f"/O={organization}" if organization else "") + f"/CN={common_name}"
        openssl(
            "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(request), "-subj", subject
        )
        extensions.write_text("keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n")
        certificate = openssl(
            "x509", "-req", "-in", str(request), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
            "-set_serial", str(secrets.randbits(63)), "-days", "365", "-extfile", str(extensions),
        )  # fmt: skip
        return certificate, key.read_bytes()


def ca_cert_hash(ca_crt: Path) -> str:
    """kubeadm's CA pin: sha256 of the CA's DER SubjectPublicKeyInfo."""
    public = openssl("x509", "-pubkey", "-noout", "-in", str(ca_crt))
    with tempfile.NamedTemporaryFile() as pem:
        pem.write(public)
        pem.flush()
        der = openssl("pkey", "-pubin", "-in", pem.name, "-outform", "der")
    return "sha256:" + hashlib.sha256(der).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(cluster: str, server: str, ca: bytes, user: str, credentials: dict[str, str]) -> str:
    """A kubeconfig in client-go's layout (keys sorted), as kubeadm writes them."""
    lines = [
        "apiVersion: v1",
        "clusters:",
        "- cluster:",
        f"    certificate-authority-data: {b64(ca)}",
        f"    server: https://{server}",
        f"  name: {cluster}",
        "contexts:",
        "- context:",
        f"    cluster: {cluster}",
        f"    user: {user}",
        f"  name: {user}@{cluster}",
        f"current-context: {user}@{cluster}",
        "kind: Config",
        "preferences: {}",
        "users:",
        f"- name: {user}",
        "  user:",
        *(f"    {key}: {value}" for key, value in sorted(credentials.items())),
    ]
    return "\n".join(lines) + "\n"


def embedded(certificate: bytes, key: bytes) -> dict[str, str]:
    return {"client-certificate-data": b64(certificate), "client-key-data": b64(key)}


def static_pod(name: str, image: str, command: list[str]) -> str:
    """A minimal static Pod manifest of a control plane component (the stand-in runs no containers)."""
    lines = [
        "apiVersion: v1",
        "kind: Pod",
        "metadata:",
        "  labels:",
        f"    component: {name}",
        "    tier: control-plane",
        f"  name: {name}",
        "  namespace: kube-system",
        "spec:",
        "  containers:",
        "  - command:",
        *(f"    - {arg}" for arg in command),
        f"    image: {image}",
        f"    name: {name}",
        "  hostNetwork: true",
        "  priorityClassName: system-node-critical",
    ]
    return "\n".join(lines) + "\n"


def write_kubelet_files(node_registration: dict[str, Any], kubelet_config: str) -> None:
    print(f'[kubelet-start] Writing kubelet environment file with flags to file "{KUBELET_FLAGS}"')
    flags = [
        f"--container-runtime-endpoint={get(node_registration, 'criSocket', DEFAULT_CRI_SOCKET)}",
        f"--pod-infra-container-image=registry.k8s.io/pause:{PAUSE_IMAGE_TAG}",
        *extra_args(node_registration),
    ]
    name = get(node_registration, "name")
    if name and name != socket.gethostname().lower():  # kubeadm adds the flag only for a name not the hostname
        flags.insert(0, f"--hostname-override={name}")
    write(KUBELET_FLAGS, f'KUBELET_KUBEADM_ARGS="{" ".join(flags)}"\n')
    print(f'[kubelet-start] Writing kubelet configuration to file "{KUBELET_CONFIG}"')
    write(KUBELET_CONFIG, kubelet_config)
    print("[kubelet-start] Starting the kubelet")
    if Path("/") == ROOT:  # kubeadm restarts the kubelet so it reads the files it just got
        subprocess.run(["systemctl", "restart", "kubelet"], capture_output=True)


def wait_for_kubelet() -> None:
    print("[kubelet-check] Waiting for a healthy kubelet at http://127.0.0.1:10248/healthz. This can take up to 4m0s")
    print("[kubelet-check] The kubelet is healthy after 501.645131ms")  # the stand-in has no /healthz to time


# --- bootstrap tokens (the stand-in's state) ------------------------------------------------------------------


def load_tokens() -> list[dict[str, Any]]:
    state = path(TOKENS)
    return list(json.loads(state.read_text())) if state.exists() else []


def duration_seconds(text: str) -> float:
    """A Go time.Duration such as 24h0m0s or 10m."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if text == "0":
        return 0
    if not text or not match:
        raise Refused(f'invalid argument "{text}" for "--ttl" flag: time: invalid duration "{text}"')
    hours, minutes, seconds = (float(group) if group else 0.0 for group in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def record_token(token: str, ttl: str, usages: list[str], groups: list[str], description: str = "") -> None:
    seconds = duration_seconds(ttl)
    expires = rfc3339(now() + datetime.timedelta(seconds=seconds)) if seconds else None
    tokens = [*load_tokens(), {"token": token, "ttl": ttl, "expires": expires, "usages": usages, "groups": groups}]
    if description:
        tokens[-1]["description"] = description
    write(TOKENS, json.dumps(tokens, indent=1) + "\n", 0o600)


def new_token() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"  # kubeadm's bootstrap token characters
    token_id, secret = ("".join(secrets.choice(alphabet) for _ in range(length)) for length in (6, 16))
    return f"{token_id}.{secret}"


DEFAULT_USAGES = ["signing", "authentication"]
MINIMAL_KUBELET_CONFIG: tuple[dict[str, Any], str] = ({}, f"apiVersion: {KUBELET_API}\nkind: KubeletConfiguration\n")
DEFAULT_GROUPS = ["system:bootstrappers:kubeadm:default-node-token"]


# --- kubeadm --------------------------------------------------------------------------------------------------


def preflight(paths: list[str]) -> None:
    """kubeadm's FileAvailable checks: each path must not exist."""
    print("[preflight] Running pre-flight checks")
    taken = [absolute for absolute in paths if path(absolute).exists()]
    if taken:
        errors = "".join(
            f"\t[ERROR FileAvailable-{absolute.replace('/', '-')}]: {absolute} already exists\n" for absolute in taken
        )
        raise Refused(
            f"error execution phase preflight: [preflight] Some fatal errors occurred:\n{errors}"
            "[preflight] If you know what you are doing, you can make a check non-fatal with "
            "`--ignore-preflight-errors=...`"
        )


def default_address() -> str:
    """The address of the default route's interface, as kubeadm picks the advertise address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a UDP connect only chooses the route; nothing is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _endpoint(host: str, port: int) -> str:
    return host if re.search(r":\d+$", host) else f"{host}:{port}"


def write_control_plane(cluster: dict[str, Any], version: str, advertise: str, port: int, node: str) -> None:
    """The static Pod manifests of etcd and the control plane, with kubeadm's image tags."""
    repository = get(cluster, "imageRepository", "registry.k8s.io")
    print(f'[etcd] Creating static Pod manifest for local etcd in "{MANIFESTS}"')
    etcd = [
        "etcd", f"--advertise-client-urls=https://{advertise}:2379", "--data-dir=/var/lib/etcd", f"--name={node}",
        f"--listen-client-urls=https://127.0.0.1:2379,https://{advertise}:2379",
    ]  # fmt: skip
    write(f"{MANIFESTS}/etcd.yaml", static_pod("etcd", f"{repository}/etcd:{ETCD_IMAGE_TAG}", etcd), 0o600)
    print(f'[control-plane] Using manifest folder "{MANIFESTS}"')
    commands = {
        "kube-apiserver": [
            f"--advertise-address={advertise}", f"--secure-port={port}", f"--client-ca-file={PKI}/ca.crt",
            f"--service-cluster-ip-range={get(cluster, 'networking.serviceSubnet', '10.96.0.0/12')}",
        ],
        "kube-controller-manager": [
            "--kubeconfig=/etc/kubernetes/controller-manager.conf", f"--cluster-signing-cert-file={PKI}/ca.crt",
            f"--cluster-cidr={get(cluster, 'networking.podSubnet', '')}",
        ],
        "kube-scheduler": ["--kubeconfig=/etc/kubernetes/scheduler.conf"],
    }  # fmt: skip
    for component in CONTROL_PLANE_COMPONENTS:
        print(f'[control-plane] Creating static Pod manifest for "{component}"')
        image = f"{repository}/{component}:{version}"
        write(f"{MANIFESTS}/{component}.yaml", static_pod(component, image, [component, *commands[component]]), 0o600)


def write_kubeconfigs(names: list[str], cluster_name: str, endpoints: dict[str, str], node: str, ca: bytes) -> None:
    """/etc/kubernetes/<name>.conf, each with a client certificate the CA signs (kubelet.conf: the rotated pair)."""
    pki = path(PKI)
    users = {
        "admin.conf": ("kubernetes-admin", "kubeadm:cluster-admins"),
        "super-admin.conf": ("kubernetes-super-admin", "system:masters"),
        "kubelet.conf": (f"system:node:{node}", "system:nodes"),
        "controller-manager.conf": ("system:kube-controller-manager", ""),
        "scheduler.conf": ("system:kube-scheduler", ""),
    }
    print('[kubeconfig] Using kubeconfig folder "/etc/kubernetes"')
    for name in names:
        print(f'[kubeconfig] Writing "{name}" kubeconfig file')
        user, group = users[name]
        certificate, key = client_certificate(pki, user, group)
        kubelet = name == "kubelet.conf"
        credentials = rotated_kubelet_client(certificate, key) if kubelet else embedded(certificate, key)
        text = kubeconfig(cluster_name, endpoints.get(name, endpoints["default"]), ca, user, credentials)
        write(f"/etc/kubernetes/{name}", text, 0o600)


def rotated_kubelet_client(certificate: bytes, key: bytes) -> dict[str, str]:
    """Where kubelet.conf points after kubelet-finalize: the kubelet's own rotated client pair."""
    current = "/var/lib/kubelet/pki/kubelet-client-current.pem"
    dated = f"kubelet-client-{now().strftime('%Y-%m-%d-%H-%M-%S')}.pem"
    write(f"/var/lib/kubelet/pki/{dated}", certificate + key, 0o600)
    link = path(current)
    link.unlink(missing_ok=True)
    link.symlink_to(dated)
    return {"client-certificate": current, "client-key": current}


def kubeadm_init(args: list[str]) -> int:
    given = list(args)
    config = take_option(args, "--config")
    skip_token_print = take_flag(args, "--skip-token-print")
    upload_certs = take_flag(args, "--upload-certs")
    if config is None or args:
        return not_simulated("kubeadm", ["init", *given])
    by_kind = read_config(config)
    if "InitConfiguration" not in by_kind and "ClusterConfiguration" not in by_kind:
        raise Refused("no InitConfiguration or ClusterConfiguration kind was found in the YAML file")
    init = by_kind.get("InitConfiguration", ({}, ""))[0]
    cluster = by_kind.get("ClusterConfiguration", ({}, ""))[0]
    kubelet_config = by_kind.get("KubeletConfiguration", MINIMAL_KUBELET_CONFIG)
    version = "v" + str(get(cluster, "kubernetesVersion", VERSION)).removeprefix("v")
    node = get(init, "nodeRegistration.name", socket.gethostname().lower())
    advertise = get(init, "localAPIEndpoint.advertiseAddress", default_address())
    port = int(get(init, "localAPIEndpoint.bindPort", 6443))
    endpoint = _endpoint(get(cluster, "controlPlaneEndpoint", advertise), port)
    cluster_name = get(cluster, "clusterName", "kubernetes")

    print(f"[init] Using Kubernetes version: {version}")
    preflight([f"{MANIFESTS}/{name}.yaml" for name in (*CONTROL_PLANE_COMPONENTS, "etcd")])
    print("[preflight] Pulling images required for setting up a Kubernetes cluster")
    print("[preflight] This might take a minute or two, depending on the speed of your internet connection")
    print("[preflight] You can also perform this action beforehand using 'kubeadm config images pull'")
    pki = path(PKI)
    print(f'[certs] Using certificateDir folder "{PKI}"')
    if (pki / "ca.crt").exists() and (pki / "ca.key").exists():
        print("[certs] Using existing ca certificate authority")
    else:
        print('[certs] Generating "ca" certificate and key')
        make_ca(pki)
    ca = (pki / "ca.crt").read_bytes()
    local = f"{advertise}:{port}"
    write_kubeconfigs(
        ["admin.conf", "super-admin.conf", "kubelet.conf", "controller-manager.conf", "scheduler.conf"],
        cluster_name,
        {"default": endpoint, "controller-manager.conf": local, "scheduler.conf": local},
        node,
        ca,
    )
    write_control_plane(cluster, version, advertise, port, node)
    write_kubelet_files(get(init, "nodeRegistration", {}), kubelet_config[1])
    print(f"[wait-control-plane] Waiting for the kubelet to boot up the control plane as static Pods from directory "
          f'"{MANIFESTS}"')  # fmt: skip
    wait_for_kubelet()
    print("[api-check] Waiting for a healthy API server. This can take up to 4m0s")
    print("[api-check] The API server is healthy after 6.50128872s")  # kubespray#12468's v1.31.4 init
    print('[upload-config] Storing the configuration used in ConfigMap "kubeadm-config" in the "kube-system" Namespace')
    print('[kubelet] Creating a ConfigMap "kubelet-config" in namespace kube-system with the configuration for the '
          "kubelets in the cluster")  # fmt: skip
    certificate_key = get(init, "certificateKey", secrets.token_hex(32))
    if upload_certs:
        print('[upload-certs] Storing the certificates in Secret "kubeadm-certs" in the "kube-system" Namespace')
        print(f"[upload-certs] Using certificate key:\n{certificate_key}")
    else:
        print("[upload-certs] Skipping phase. Please see --upload-certs")
    print(f"[mark-control-plane] Marking the node {node} as control-plane by adding the labels: [node-role."
          "kubernetes.io/control-plane node.kubernetes.io/exclude-from-external-load-balancers]")  # fmt: skip
    print(f"[mark-control-plane] Marking the node {node} as control-plane by adding the taints "
          "[node-role.kubernetes.io/control-plane:NoSchedule]")  # fmt: skip
    tokens = []
    for index, entry in enumerate(get(init, "bootstrapTokens", [{}])):
        token = entry.get("token") or new_token()
        if not BOOTSTRAP_TOKEN.match(token):
            raise Refused(f'bootstrapTokens[{index}].token: Invalid value: "{token}": the bootstrap token is invalid')
        usages, groups = entry.get("usages", DEFAULT_USAGES), entry.get("groups", DEFAULT_GROUPS)
        record_token(token, entry.get("ttl", "24h0m0s"), usages, groups, entry.get("description", ""))
        tokens.append(token)
    first = tokens[0]
    if not skip_token_print:
        print(f"[bootstrap-token] Using token: {first}")
    print(INIT_BOOTSTRAP_TOKEN_LINES + INIT_DONE.format(kubeconfig=ADMIN_KUBECONFIG))
    shown_token = "<value withheld>" if skip_token_print else first
    pin = ca_cert_hash(pki / "ca.crt")
    join = f"kubeadm join {endpoint} --token {shown_token} \\\n\t--discovery-token-ca-cert-hash {pin} "
    if "controlPlaneEndpoint" in cluster:
        key = "<value withheld>" if skip_token_print else certificate_key
        if upload_certs:
            command = f"{join}\\\n\t--control-plane --certificate-key {key}"
            print(INIT_JOIN_CONTROL_PLANE_UPLOADED.format(command=command))
        else:
            print(INIT_JOIN_CONTROL_PLANE_COPIED.format(command=f"{join}\\\n\t--control-plane "))
    print(f"Then you can join any number of worker nodes by running the following on each as root:\n\n{join}")
    return 0


# kubeadm 1.31's init output after the token line (cmd/kubeadm/app/cmd/init.go and phases/bootstraptoken.go).
INIT_BOOTSTRAP_TOKEN_LINES = """\
[bootstrap-token] Configuring bootstrap tokens, cluster-info ConfigMap, RBAC Roles
[bootstrap-token] Configured RBAC rules to allow Node Bootstrap tokens to get nodes
[bootstrap-token] Configured RBAC rules to allow Node Bootstrap tokens to post CSRs in order for nodes to get long term certificate credentials
[bootstrap-token] Configured RBAC rules to allow the csrapprover controller automatically approve CSRs from a Node Bootstrap Token
[bootstrap-token] Configured RBAC rules to allow certificate rotation for all node client certificates in the cluster
[bootstrap-token] Creating the "cluster-info" ConfigMap in the "kube-public" namespace
[kubelet-finalize] Updating "/etc/kubernetes/kubelet.conf" to point to a rotatable kubelet client certificate and key
[addons] Applied essential addon: CoreDNS
[addons] Applied essential addon: kube-proxy
"""  # noqa: E501
INIT_DONE = """
Your Kubernetes control-plane has initialized successfully!

To start using your cluster, you need to run the following as a regular user:

  mkdir -p $HOME/.kube
  sudo cp -i {kubeconfig} $HOME/.kube/config
  sudo chown $(id -u):$(id -g) $HOME/.kube/config

Alternatively, if you are the root user, you can run:

  export KUBECONFIG=/etc/kubernetes/admin.conf

You should now deploy a pod network to the cluster.
Run "kubectl apply -f [podnetwork].yaml" with one of the options listed at:
  https://kubernetes.io/docs/concepts/cluster-administration/addons/
"""
INIT_JOIN_CONTROL_PLANE_UPLOADED = """\
You can now join any number of the control-plane node running the following command on each as root:

  {command}

Please note that the certificate-key gives access to cluster sensitive data, keep it secret!
As a safeguard, uploaded-certs will be deleted in two hours; If necessary, you can use
"kubeadm init phase upload-certs --upload-certs" to reload certs afterward.
"""
INIT_JOIN_CONTROL_PLANE_COPIED = """\
You can now join any number of control-plane nodes by copying certificate authorities
and service account keys on each node and then running the following as root:

  {command}
"""


def kubeadm_token(args: list[str]) -> int:
    given = list(args)
    if not args or args[0] != "create":
        return not_simulated("kubeadm", ["token", *given])
    args = args[1:]
    ttl = take_option(args, "--ttl") or "24h0m0s"
    description = take_option(args, "--description") or ""
    if args:
        return not_simulated("kubeadm", ["token", *given])
    duration_seconds(ttl)
    if not path(ADMIN_KUBECONFIG).exists():
        raise Refused(f"failed to load admin kubeconfig: open {ADMIN_KUBECONFIG}: no such file or directory")
    token = new_token()
    record_token(token, ttl, DEFAULT_USAGES, DEFAULT_GROUPS, description)
    print(token)
    return 0


def join_problems(bootstrap: dict[str, Any]) -> list[str]:
    """What kubeadm's JoinConfiguration validation says of the bootstrap token discovery: the token's and the
    missing pin's messages are kubeadm's; the others keep its field-error form with the stand-in's words."""
    field = "discovery.bootstrapToken"
    problems = []
    token = str(bootstrap.get("token", ""))
    if not BOOTSTRAP_TOKEN.match(token):
        problems.append(f'{field}.token: Invalid value: "{token}": the bootstrap token is invalid')
    if not bootstrap.get("apiServerEndpoint"):
        problems.append(f'{field}.apiServerEndpoint: Invalid value: "": discovery.bootstrapToken.apiServerEndpoint '
                        "or discovery.file.kubeConfigPath must be set")  # fmt: skip
    hashes = bootstrap.get("caCertHashes") or []
    if not hashes and not bootstrap.get("unsafeSkipCAVerification"):
        problems.append(f'{field}: Invalid value: "": using token-based discovery without caCertHashes can be '
                        "unsafe. Set unsafeSkipCAVerification as true in your kubeadm config file or pass "
                        "--discovery-token-unsafe-skip-ca-verification flag to continue")  # fmt: skip
    for pin in hashes:
        if not CA_PIN.match(str(pin)):
            problems.append(f'{field}.caCertHashes: Invalid value: "{pin}": invalid hash, expected '
                            '"sha256:<64 hex digits of the CA public key>"')  # fmt: skip
    return problems


def kubeadm_join(args: list[str]) -> int:
    given = list(args)
    config = take_option(args, "--config")
    if config is None or args:
        return not_simulated("kubeadm", ["join", *given])
    by_kind = read_config(config)
    if "JoinConfiguration" not in by_kind:
        raise Refused("no JoinConfiguration kind was found in the YAML file")
    join = by_kind["JoinConfiguration"][0]
    bootstrap = get(join, "discovery.bootstrapToken", {})
    problems = join_problems(bootstrap)
    if problems:  # one field error as it is, several as Kubernetes aggregates them
        raise Refused(problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]")
    control_plane = "controlPlane" in join
    node_registration = get(join, "nodeRegistration", {})
    node = get(node_registration, "name", socket.gethostname().lower())
    must_be_free = [KUBELET_CONF, f"{PKI}/ca.crt"]
    if control_plane:
        must_be_free += [f"{MANIFESTS}/{name}.yaml" for name in (*CONTROL_PLANE_COMPONENTS, "etcd")]
    preflight(must_be_free)
    print("[preflight] Reading configuration from the cluster...")
    print("[preflight] FYI: You can look at this config file with "
          "'kubectl -n kube-system get cm kubeadm-config -o yaml'")  # fmt: skip
    endpoint = str(bootstrap["apiServerEndpoint"])
    token_id = str(bootstrap["token"]).split(".")[0]
    hashes = ",".join(bootstrap.get("caCertHashes") or ["none (unsafeSkipCAVerification)"])
    entry = f"{rfc3339(now())} token-id={token_id} endpoint={endpoint} ca-cert-hashes={hashes} node={node}"
    log = path(JOIN_LOG)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(entry + (" control-plane=yes\n" if control_plane else "\n"))
    marker = (
        "ironserve lab stand-in: no control plane answers the lab's kubeadm join, so the cluster CA could not be\n"
        f"fetched from {endpoint}; the pin it was joined with is recorded in {JOIN_LOG}.\n"
    )
    write(f"{PKI}/ca.crt", marker)
    kubelet_config = by_kind.get("KubeletConfiguration", MINIMAL_KUBELET_CONFIG)
    credentials = {"client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem"}
    credentials["client-key"] = credentials["client-certificate"]
    write(KUBELET_CONF, kubeconfig("kubernetes", endpoint, marker.encode(), f"system:node:{node}", credentials), 0o600)
    if control_plane:
        advertise = get(join, "controlPlane.localAPIEndpoint.advertiseAddress", default_address())
        port = int(get(join, "controlPlane.localAPIEndpoint.bindPort", 6443))
        write_control_plane({}, f"v{VERSION}", advertise, port, node)
        lab_credentials = {"token": "ironserve-lab-stand-in-without-credentials"}
        users = {"admin.conf": "kubernetes-admin", "controller-manager.conf": "system:kube-controller-manager"}
        for name, user in {**users, "scheduler.conf": "system:kube-scheduler"}.items():
            text = kubeconfig("kubernetes", endpoint, marker.encode(), user, lab_credentials)
            write(f"/etc/kubernetes/{name}", text, 0o600)
    write_kubelet_files(node_registration, kubelet_config[1])
    wait_for_kubelet()
    print("[kubelet-start] Waiting for the kubelet to perform the TLS Bootstrap")
    print(JOIN_CONTROL_PLANE_DONE if control_plane else JOIN_DONE)
    return 0


# kubeadm 1.31's closing text of `kubeadm join` (cmd/kubeadm/app/cmd/join.go).
JOIN_DONE = """
This node has joined the cluster:
* Certificate signing request was sent to apiserver and a response was received.
* The Kubelet was informed of the new secure connection details.

Run 'kubectl get nodes' on the control-plane to see this node join the cluster.
"""
JOIN_CONTROL_PLANE_DONE = """
This node has joined the cluster and a new control plane instance was created:

* Certificate signing request was sent to apiserver and approval was received.
* The Kubelet was informed of the new secure connection details.
* Control plane label and taint were applied to the new node.
* The Kubernetes control plane instances scaled up.
* A new etcd member was added to the local/stacked etcd cluster.

To start administering your cluster from this node, you need to run the following as a regular user:

\tmkdir -p $HOME/.kube
\tsudo cp -i /etc/kubernetes/admin.conf $HOME/.kube/config
\tsudo chown $(id -u):$(id -g) $HOME/.kube/config

Run 'kubectl get nodes' to see this node join the cluster.
"""


def kubeadm_version(args: list[str]) -> int:
    output = take_option(args, "-o") or take_option(args, "--output") or ""
    if args or output not in ("", "short", "json", "yaml"):
        return not_simulated("kubeadm", ["version", *args])
    info = version_info("kubeadm")
    if output == "short":
        print(info["gitVersion"])
    elif output == "json":
        print(json.dumps({"clientVersion": info}, indent=2))
    elif output == "yaml":
        print("\n".join(["clientVersion:", *_yaml_lines(info, "  ")]))
    else:
        fields = ", ".join(f'{key[0].upper()}{key[1:]}:"{value}"' for key, value in info.items())
        print(f"kubeadm version: &version.Info{{{fields}}}")
    return 0


def kubeadm(args: list[str]) -> int:
    commands: dict[str, Callable[[list[str]], int]] = {
        "version": kubeadm_version,
        "init": kubeadm_init,
        "join": kubeadm_join,
        "token": kubeadm_token,
    }
    if args in (["--help"], ["-h"]):
        print(f"ironserve lab stand-in of kubeadm v{VERSION}: simulates {', '.join(commands)} (see {__file__})")
        return 0
    if not args or args[0] not in commands:
        return not_simulated("kubeadm", args)
    try:
        return commands[args[0]](args[1:])
    except Refused as refusal:
        print(f"{refusal}\n{STACK_HINT}", file=sys.stderr)
        return 1
    except NotSimulated as reason:
        print(f"ironserve lab stand-in: kubeadm {' '.join(args)} is not simulated: {reason}", file=sys.stderr)
        return 2


# --- kubelet --------------------------------------------------------------------------------------------------


def klog(severity: str, source: str, message: str) -> str:
    """A klog header line: Lmmdd hh:mm:ss.uuuuuu threadid file:line] msg."""
    stamp = datetime.datetime.now().strftime("%m%d %H:%M:%S.%f")
    return f"{severity}{stamp} {os.getpid():7d} {source}] {message}"


def kubelet(args: list[str]) -> int:
    if args == ["--version"]:
        print(f"Kubernetes v{VERSION}")
        return 0
    if args in (["--help"], ["-h"]):
        print(f"ironserve lab stand-in of kubelet v{VERSION}: --version, and the service's run (see {__file__})")
        return 0
    given = list(args)
    config = take_option(args, "--config")
    if config is None:
        return not_simulated("kubelet", given)
    try:
        text = path(config).read_text()
        problem = "" if "kind: KubeletConfiguration" in text else "ironserve lab stand-in: no KubeletConfiguration"
    except FileNotFoundError:
        # The real kubelet 1.31's error (a captured journal of kubelet 1.31 on Debian 12 before kubeadm init).
        problem = (
            f"failed to load Kubelet config file {config}, error failed to read kubelet config file "
            f'\\"{config}\\", error: open {config}: no such file or directory'
        )
    if problem:
        err = f"failed to load kubelet config file, path: {config}, error: {problem}"
        print(klog("E", "run.go:72", f'"command failed" err="{err}"'), file=sys.stderr)
        return 1
    print(f"ironserve lab stand-in kubelet v{VERSION}: {config} read; running no pods", file=sys.stderr)
    # Named kubelet like the real process (pgrep -x kubelet, ps -C kubelet), not python3: prctl(PR_SET_NAME).
    ctypes.CDLL(None).prctl(15, b"kubelet", 0, 0, 0)
    while True:  # like the service: runs until systemd stops it (SIGTERM ends the process)
        time.sleep(3600)


# --- kubectl, crictl, CNI plugins -----------------------------------------------------------------------------


def kubectl(args: list[str]) -> int:
    given = list(args)
    if args in (["--help"], ["-h"]):
        print(f"ironserve lab stand-in of kubectl v{VERSION}: version --client [-o json|yaml] (see {__file__})")
        return 0
    output = take_option(args, "-o") or take_option(args, "--output") or ""
    if args != ["version", "--client"] or output not in ("", "json", "yaml"):
        return not_simulated("kubectl", given)
    info = version_info("kubectl")
    kustomize = KUSTOMIZE.get(f"{info['major']}.{info['minor']}", "v5.4.2")
    if output == "json":
        print(json.dumps({"clientVersion": info, "kustomizeVersion": kustomize}, indent=2))
    elif output == "yaml":
        print("\n".join(["clientVersion:", *_yaml_lines(info, "  "), f"kustomizeVersion: {kustomize}"]))
    else:
        print(f"Client Version: {info['gitVersion']}\nKustomize Version: {kustomize}")
    return 0


def crictl(args: list[str]) -> int:
    if args in (["--version"], ["-v"]):
        print(f"crictl version v{VERSION}")
        return 0
    if args in (["--help"], ["-h"]):
        print(f"ironserve lab stand-in of crictl v{VERSION}: --version only (see {__file__})")
        return 0
    return not_simulated("crictl", args)


def cni_plugin(name: str, args: list[str]) -> int:
    """A reference CNI plugin: VERSION answers like the real one (CNI_COMMAND in the environment)."""
    command = os.environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        print(json.dumps({"cniVersion": CNI_SUPPORTED[-1], "supportedVersions": CNI_SUPPORTED}, separators=(",", ":")))
        return 0
    if not command and not args:  # what the real plugin says run by hand (containernetworking/cni's skel)
        supported = ", ".join(CNI_SUPPORTED)
        print(f"CNI {name} plugin v{VERSION}\nCNI protocol versions supported: {supported}", file=sys.stderr)
        return 0
    return not_simulated(f"CNI_COMMAND={command} {name}", args)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: kubernetes.py kubeadm|kubelet|kubectl|crictl|cni-<plugin> ARGS", file=sys.stderr)
        return 2
    tool, args = argv[0], argv[1:]
    programs: dict[str, Callable[[list[str]], int]] = {
        "kubeadm": kubeadm,
        "kubelet": kubelet,
        "kubectl": kubectl,
        "crictl": crictl,
    }
    if tool.startswith("cni-"):
        return cni_plugin(tool.removeprefix("cni-"), args)
    if tool not in programs:
        return not_simulated(tool, args)
    return programs[tool](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
