"""Facts of the kubernetes role, with pure `process()`: what kubeadm left on a node, what containerd runs with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from pyinfra.api.facts import FactBase

from ironserve.kubectl import ADMIN_KUBECONFIG

KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
APISERVER_MANIFEST = "/etc/kubernetes/manifests/kube-apiserver.yaml"


class NodeState(TypedDict):
    admin_conf: bool  # `kubeadm init` ran here: this host is a control plane of a cluster
    kubelet_conf: bool  # the kubelet has joined a cluster (init or join)
    apiserver_version: str | None  # the version the local API server's static pod runs, as its image tag says


class KubeadmNode(FactBase[NodeState]):
    """What `kubeadm init`/`join` wrote: its kubeconfigs and the API server's static pod image tag."""

    @staticmethod
    def default() -> NodeState:
        return {"admin_conf": False, "kubelet_conf": False, "apiserver_version": None}

    def command(self) -> str:
        return (
            f"for f in {ADMIN_KUBECONFIG} {KUBELET_CONF}; do if [ -s $f ]; then echo file $f; fi; done; "
            f"sed -n 's/^ *image: *[^ ]*kube-apiserver:\\(v[^ ]*\\) *$/apiserver \\1/p' {APISERVER_MANIFEST} "
            "2>/dev/null | head -n 1; true"
        )

    def process(self, output: Iterable[str]) -> NodeState:
        node = self.default()
        for line in output:
            kind, _, value = line.strip().partition(" ")
            if kind == "file":
                node["admin_conf"] |= value == ADMIN_KUBECONFIG
                node["kubelet_conf"] |= value == KUBELET_CONF
            elif kind == "apiserver":
                node["apiserver_version"] = value.removeprefix("v")
        return node


class ContainerdConfigInForce(FactBase[str | None]):
    """containerd's configuration as the running daemon reads it (`containerd config dump`: its config file, the
    file's imports and containerd's defaults), None when containerd is not installed. The file is the one the
    daemon's own command line names (a `systemctl edit` drop-in can start it with another `--config`), else the
    default, also when containerd is not running."""

    def command(self) -> str:
        # --config PATH, -c PATH or --config=PATH in /proc/<MainPID>/cmdline (NUL-separated arguments).
        return (
            "command -v containerd >/dev/null || { echo __absent__; exit 0; }; "
            "pid=$(systemctl show -p MainPID --value containerd.service 2>/dev/null); config=; "
            'if [ -n "$pid" ] && [ "$pid" != 0 ]; then '
            "config=$(tr '\\0' '\\n' < /proc/$pid/cmdline | "
            "sed -n -e '/^--config=/{s/^--config=//p;q;}' -e '/^\\(--config\\|-c\\)$/{n;p;q;}'); fi; "
            'containerd ${config:+--config "$config"} config dump'
        )

    def process(self, output: Iterable[str]) -> str | None:
        lines = list(output)
        return None if lines == ["__absent__"] else "\n".join(lines) + "\n"
