"""Operations of the kubernetes role: the cluster's start, a node's join, the checks before the kubelet starts."""

from __future__ import annotations

import io
import re
import shlex
from typing import Any

from pyinfra.api.command import FunctionCommand, QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import State
from pyinfra.context import host, state

from ironserve.operations import Commands, failing, report
from ironserve.reboot import read_on
from ironserve.speed.reads import Read, read, reading_operation
from roles.kubernetes.checks import cgroup_driver_problem
from roles.kubernetes.facts import ContainerdConfigInForce, KubeadmNode
from roles.kubernetes.render import join_configuration
from roles.kubernetes.settings import KubernetesSettings

# A bootstrap token lives 15 minutes: long enough for one join, useless soon after (kubeadm's default is 24 h).
JOIN_TOKEN_TTL = "15m0s"
TOKEN = re.compile(r"[a-z0-9]{6}\.[a-z0-9]{16}")
CERTIFICATE_KEY = re.compile(r"[0-9a-f]{64}")
# The discovery hash of the cluster CA's public key, as `kubeadm join` checks it (kubeadm join docs,
# "Token-based discovery with CA pinning").
CA_HASH_COMMAND = (
    "openssl x509 -pubkey -noout -in /etc/kubernetes/pki/ca.crt | openssl pkey -pubin -outform der | sha256sum"
)
# The join config holds the token: written into a root-only folder, removed whether the join succeeds or not.
JOIN_DIR = "/etc/kubernetes/ironserve-join"
JOIN_FILE = f"{JOIN_DIR}/join.yaml"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@reading_operation(reads=lambda **_: [Read(KubeadmNode)])
def cluster_version_kept(pinned: str) -> Commands:
    """Report a pin that moved away from the version the local control plane runs; stop the host before the
    packages move when the minor changed (kubeadm upgrade is a deliberate step of its own, not a deploy's)."""
    running = read(KubeadmNode)["apiserver_version"]
    if running is None:
        host.noop("no local API server (no cluster yet, or a worker)")
    elif running == pinned:
        host.noop(f"the control plane runs v{running}, the pinned version")
    elif _minor(running) != _minor(pinned):
        yield failing(
            f"the control plane runs v{running} and kubernetes_version pins {pinned}: a minor upgrade is `kubeadm "
            f"upgrade apply v{pinned}` on this host (drained, one minor at a time), which ironserve does not do; "
            f"packages left as they are"
        )
    else:
        report(
            f"the control plane runs v{running}, kubernetes_version pins {pinned}: the packages move to the pin; "
            f"run `kubeadm upgrade apply v{pinned}` to move the control plane (ironserve does not upgrade clusters)"
        )
        host.noop(f"control plane v{running}, pin {pinned}: reported")


@reading_operation(reads=lambda **_: [Read(ContainerdConfigInForce)])
def cgroup_drivers_agree(kubelet_config: str) -> Commands:
    """Stop this host before the kubelet starts when its cgroup driver is not the one containerd's runtimes use,
    read from `containerd config dump` when the deploy runs (after container_runtime restored its config)."""
    if not state.is_executing:
        host.noop("the kubelet's cgroup driver is checked against containerd's config in force when the deploy runs")
        return
    in_force = read(ContainerdConfigInForce)
    if in_force is None:
        yield failing("containerd is not installed: the kubelet needs its CRI (the container_runtime role installs it)")
        return
    problem = cgroup_driver_problem(in_force, kubelet_config)
    if problem:
        yield failing(problem)
        return
    host.noop("the kubelet and every containerd runtime use one cgroup driver")


@reading_operation(reads=lambda **_: [Read(KubeadmNode)])
def cluster_initialised(config_path: str) -> Commands:
    """`kubeadm init --config` on the first control plane, only while no cluster exists on it."""
    node = read(KubeadmNode)
    if node["admin_conf"]:
        host.noop("the cluster exists (/etc/kubernetes/admin.conf): kubeadm init is not run again")
        return
    if node["kubelet_conf"]:
        yield failing(
            "this host's kubelet belongs to a cluster (/etc/kubernetes/kubelet.conf) that it did not start: it cannot "
            "be the first control plane; `kubeadm reset` it, or list the cluster's first control plane first"
        )
        return
    yield StringCommand("kubeadm", "init", "--config", QuoteString(config_path), "--skip-token-print")


@reading_operation(reads=lambda **_: [Read(KubeadmNode)])
def node_joined(
    settings: KubernetesSettings, socket: str, control_plane: str, endpoint: str, as_control_plane: bool
) -> Commands:
    """`kubeadm join` with a bootstrap token the first control plane makes for it in this run (never stored in the
    inventory, never on a command line or in the output), only while this node is in no cluster."""
    if read(KubeadmNode)["kubelet_conf"]:
        host.noop("joined (/etc/kubernetes/kubelet.conf): kubeadm join is not run again")
        return
    if state.is_executing:
        report(
            f"joining the cluster of {control_plane} at {endpoint}{' as a control plane' if as_control_plane else ''}"
        )
    yield FunctionCommand(_join, (settings, socket, control_plane, endpoint, as_control_plane), {})


# pyinfra passes (state, host) to a FunctionCommand only when its parameters carry exactly those names.
def _join(
    state: State,
    host: Any,
    settings: KubernetesSettings,
    socket: str,
    control_plane: str,
    endpoint: str,
    as_control_plane: bool,
) -> bool:
    first = state.inventory.get_host(control_plane, default=None)
    if first is None or first not in state.activated_hosts or first in state.failed_hosts:
        raise OperationError(
            f"the first control plane {control_plane} is not part of this run (limited out, unreachable or failed): "
            "a join needs a token from it"
        )
    description = shlex.quote(f"ironserve: join {host.name}")
    token = read_on(first, f"kubeadm token create --ttl {JOIN_TOKEN_TTL} --description {description}").splitlines()[-1]
    if not TOKEN.fullmatch(token):
        raise OperationError(f"kubeadm token create on {control_plane} printed no bootstrap token")
    digest = read_on(first, CA_HASH_COMMAND).split()[0]
    certificate_key = None
    if as_control_plane:
        certificate_key = read_on(first, "kubeadm init phase upload-certs --upload-certs").splitlines()[-1]
        if not CERTIFICATE_KEY.fullmatch(certificate_key):
            raise OperationError(f"kubeadm init phase upload-certs on {control_plane} printed no certificate key")
    secrets = (token, token.split(".")[1]) + ((certificate_key,) if certificate_key else ())
    content = join_configuration(settings, socket, endpoint, token, f"sha256:{digest}", certificate_key)
    read_on(host, f"rm -rf {JOIN_DIR} && install -d -m 700 -o root -g root {JOIN_DIR}")
    try:
        if not host.put_file(io.BytesIO(content.encode()), JOIN_FILE, print_output=False, print_input=False):
            raise OperationError(f"could not write {JOIN_FILE} on {host.name}")
        read_on(host, f"kubeadm join --config {JOIN_FILE}", secrets)
    finally:
        read_on(host, f"rm -rf {JOIN_DIR}")
    return True
