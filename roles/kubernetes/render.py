"""The files the kubernetes role writes, rendered from one host's settings through the typed models.

The kubelet's cgroup driver and runtime endpoint are derived from container_runtime's settings (one source of
truth, as Kubespray and DeepOps derive them): a kubelet on a driver containerd does not use restarts its pods in a
loop (kubernetes/kubernetes#110177, #43805).

The KubeletConfiguration is the one kubeadm itself writes to /var/lib/kubelet/config.yaml for this cluster's
settings (its defaults, below) with the site's fields on top: the role rewrites that file after `kubeadm init`/`join`,
and a file of the site's fields alone would drop the control plane's static pods (staticPodPath), the pods' DNS
(clusterDNS) and the API server's client CA (clientCAFile: `kubectl logs/exec` refused by the kubelet).
"""

from __future__ import annotations

import ipaddress
import posixpath
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


# What kubeadm sets in every node's KubeletConfiguration: kubernetes/kubernetes cmd/kubeadm/app/componentconfigs/
# kubelet.go, (*kubeletConfig).Default (read at commit 046d201c45cebd19eb1fc4612426761c64802825), with kubeadm's
# constants (DefaultManifestsDir, DefaultCertificatesDir, CACertName ca.crt, KubeletHealthzPort 10248). A real
# kubeadm-written file: tests/data/realworld/kubernetes/kubelet-config-kubeadm-1.29-node-madness-blog.txt.
MANIFESTS_DIR = "/etc/kubernetes/manifests"
CERTIFICATES_DIR = "/etc/kubernetes/pki"
DNS_SERVICE_INDEX = 10  # constants.GetDNSIP: CoreDNS's Service IP, the 10th address of the service subnet
HEALTHZ_BIND_ADDRESS = "127.0.0.1"  # kubeadm waits for the kubelet on http://127.0.0.1:10248/healthz
HEALTHZ_PORT = 10248


def cluster_dns(settings: KubernetesSettings) -> str:
    """The cluster DNS Service's IP kubeadm gives CoreDNS and every kubelet: 10.96.0.0/12 -> 10.96.0.10."""
    return str(ipaddress.ip_network(settings.service_subnet)[DNS_SERVICE_INDEX])


def kubeadm_kubelet_defaults(settings: KubernetesSettings) -> dict[str, Any]:
    """The fields kubeadm's Default() sets for this cluster's settings (upstream names). resolvConf is left out:
    kubeadm sets /run/systemd/resolve/resolv.conf only where systemd-resolved runs on the node; a site with it
    sets resolvConf in kubernetes_kubelet. readOnlyPort 0 is kubeadm's expected value (it warns on any other)."""
    certificates = settings.cluster.certificates_dir or CERTIFICATES_DIR
    return {
        "authentication": {
            "x509": {"clientCAFile": posixpath.join(certificates, "ca.crt")},
            "webhook": {"enabled": True},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [cluster_dns(settings)],
        "clusterDomain": settings.dns_domain,
        "staticPodPath": MANIFESTS_DIR,
        "healthzBindAddress": HEALTHZ_BIND_ADDRESS,
        "healthzPort": HEALTHZ_PORT,
        "rotateCertificates": True,
        "readOnlyPort": 0,
    }


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, mappings merged key by key (the site's `authentication.webhook.cacheTTL` keeps
    kubeadm's `authentication.webhook.enabled`); any other value of `over` replaces base's."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        merged[key] = _merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def kubelet_configuration(settings: KubernetesSettings, cgroup_driver: str, socket: str) -> KubeletConfiguration:
    """kubeadm's KubeletConfiguration for this cluster, the site's kubelet fields on top, and the driver and endpoint
    containerd uses (an inventory value that disagrees is refused at load: roles.kubernetes.kubernetes_deployable).
    The one rendering of both the kubeadm config's KubeletConfiguration and /var/lib/kubelet/config.yaml."""
    fields = _merged(kubeadm_kubelet_defaults(settings), settings.kubelet.document())
    fields.update(cgroupDriver=cgroup_driver, containerRuntimeEndpoint=runtime_endpoint(socket))
    return KubeletConfiguration.model_validate(fields)


def kubelet_configuration_yaml(settings: KubernetesSettings, cgroup_driver: str, socket: str) -> str:
    head = (
        "# Managed by ironserve (roles/kubernetes): kubeadm's KubeletConfiguration for this cluster, with\n"
        "# kubernetes_kubelet on top and cgroupDriver and containerRuntimeEndpoint from containerd.\n"
    )
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
