"""The files the kubernetes role writes, rendered from one host's settings through the typed models.

The kubelet's cgroup driver and runtime endpoint are derived from container_runtime's settings (one source of
truth, as Kubespray and DeepOps derive them): a kubelet on a driver containerd does not use restarts its pods in a
loop (kubernetes/kubernetes#110177, #43805).
"""

from __future__ import annotations

from typing import Any

from roles.kubernetes.models import (
    ClusterConfiguration,
    InitConfiguration,
    JoinConfiguration,
    KubeletConfiguration,
    yaml_documents,
)
from roles.kubernetes.settings import KubernetesSettings

# kubeadm's phase that installs kube-proxy (`kubeadm init --help`): skipped when the CNI replaces it.
KUBE_PROXY_PHASE = "addon/kube-proxy"
KUBEADM_CONFIG = "/etc/kubernetes/kubeadm-config.yaml"
KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"


def runtime_endpoint(socket: str) -> str:
    return f"unix://{socket}"


def kubelet_configuration(settings: KubernetesSettings, cgroup_driver: str, socket: str) -> KubeletConfiguration:
    """The site's kubelet fields with the driver and endpoint containerd uses (an inventory value that
    disagrees is refused at load: roles.kubernetes.kubernetes_deployable)."""
    fields = settings.kubelet.document()
    fields.update(cgroupDriver=cgroup_driver, containerRuntimeEndpoint=runtime_endpoint(socket))
    return KubeletConfiguration.model_validate(fields)


def kubelet_configuration_yaml(settings: KubernetesSettings, cgroup_driver: str, socket: str) -> str:
    head = "# Managed by ironserve (roles/kubernetes): cgroupDriver and containerRuntimeEndpoint from containerd.\n"
    return head + yaml_documents(kubelet_configuration(settings, cgroup_driver, socket))


def _node_registration(settings: KubernetesSettings, socket: str) -> dict[str, Any]:
    registration: dict[str, Any] = {"criSocket": runtime_endpoint(socket)}
    if settings.node_name:
        registration["name"] = settings.node_name
    return registration


def cluster_configuration(settings: KubernetesSettings) -> ClusterConfiguration:
    fields = settings.cluster.document()
    fields.update(
        kubernetesVersion=f"v{settings.version}",
        clusterName=settings.cluster_name,
        imageRepository=settings.image_repository,
        networking={
            "podSubnet": settings.pod_subnet,
            "serviceSubnet": settings.service_subnet,
            "dnsDomain": settings.dns_domain,
        },
    )
    if settings.control_plane_endpoint:
        fields["controlPlaneEndpoint"] = settings.client_endpoint
    return ClusterConfiguration.model_validate(fields)


def init_configuration(settings: KubernetesSettings, socket: str) -> InitConfiguration:
    fields: dict[str, Any] = {"nodeRegistration": _node_registration(settings, socket)}
    endpoint: dict[str, Any] = {"bindPort": settings.api_server_port}
    if settings.advertise_address:
        endpoint["advertiseAddress"] = settings.advertise_address
    fields["localAPIEndpoint"] = endpoint
    if not settings.kube_proxy:
        fields["skipPhases"] = [KUBE_PROXY_PHASE]
    return InitConfiguration.model_validate(fields)


def kubeadm_config_yaml(settings: KubernetesSettings, cgroup_driver: str, socket: str) -> str:
    """/etc/kubernetes/kubeadm-config.yaml: what `kubeadm init --config` reads (Init, Cluster, Kubelet)."""
    head = "# Managed by ironserve (roles/kubernetes): `kubeadm init --config` reads it once, at the cluster's start.\n"
    return head + yaml_documents(
        init_configuration(settings, socket),
        cluster_configuration(settings),
        kubelet_configuration(settings, cgroup_driver, socket),
    )


def join_configuration(
    settings: KubernetesSettings,
    socket: str,
    endpoint: str,
    token: str,
    ca_hash: str,
    certificate_key: str | None = None,
) -> str:
    """The JoinConfiguration of one `kubeadm join` (it holds a bootstrap token: written 0600, removed after)."""
    fields: dict[str, Any] = {
        "nodeRegistration": _node_registration(settings, socket),
        "discovery": {"bootstrapToken": {"apiServerEndpoint": endpoint, "token": token, "caCertHashes": [ca_hash]}},
    }
    if certificate_key is not None:
        local: dict[str, Any] = {"bindPort": settings.api_server_port}
        if settings.advertise_address:
            local["advertiseAddress"] = settings.advertise_address
        fields["controlPlane"] = {"localAPIEndpoint": local, "certificateKey": certificate_key}
    return yaml_documents(JoinConfiguration.model_validate(fields))
