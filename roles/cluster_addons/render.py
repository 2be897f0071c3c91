"""What the cluster add-ons are made of, rendered from one host's StackConfig, and every problem of it.

Each function receives the whole configuration (`config.kubernetes` for the pod subnet, the API server's
endpoint and the DNS domain; `config.cluster_addons` for the rest) and returns Helm releases (chart, pinned
version, repository, values) or Kubernetes objects as dicts; `problems` validates all of it: built-in kinds by
kubernetes-validate's strict schemas, custom resources by the closed schemas of `models_crd`, Helm values by
`models`, the Corefile by `render_corefile.problems`. The Cloudflare token is only ever an argument of
`cloudflare_token_secret`; nothing else renders it.
"""

from __future__ import annotations

import base64
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ironserve import manifests
from ironserve.manifests import Manifest
from roles.cluster_addons import models_crd, render_corefile
from roles.cluster_addons.models import (
    CertManagerValues,
    CiliumValues,
    EnvoyGatewayValues,
    LinkerdControlPlaneValues,
    LinkerdCrdsValues,
    values_problems,
)
from roles.cluster_addons.settings import ClusterAddonsSettings
from roles.inference.settings import InferenceSettings
from roles.kubernetes.settings import KubernetesSettings
from roles.security.settings import SecuritySettings

# The service's namespace and the names the catalog gives (k8s-ai-service-objects, ingress-tls-secret,
# cert-cloudflare-token-secret); the lead's inference role owns namespace ai and Service ai-service.
AI_NAMESPACE = "ai"
AI_SERVICE = "ai-service"
TLS_SECRET = "tls-secret"
CLOUDFLARE_SECRET = "cloudflare-api-token"
CLOUDFLARE_SECRET_KEY = "api-token"  # the key cert-manager's Cloudflare docs use (the seed names none)
CERT_MANAGER_NAMESPACE = "cert-manager"
CLUSTER_ISSUER = "letsencrypt"
ACME_ACCOUNT_KEY_SECRET = "letsencrypt-account-key"
GATEWAY_CLASS = "eg"  # the name Envoy Gateway's quickstart gives its GatewayClass
GATEWAY_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
GATEWAY = "ai-gateway"
HTTPS_LISTENER = "https"
HTTPS_PORT = 443
# Envoy's HTTP/2 default of concurrent streams per connection, set explicitly so the HCM carries
# http2_protocol_options (ingress-envoy-http2; Envoy Gateway HTTP2Settings: "the default value is 100").
HTTP2_MAX_CONCURRENT_STREAMS = 100
RUNTIME_CLASS = "nvidia"  # containerd's runtime of that name (roles/container_runtime/render.py)
# A stand-in for the token where the Secret's shape is checked at inventory load; the real one is never read then.
TOKEN_STAND_IN = "stand-in-for-the-cloudflare-api-token"

GATEWAY_API = "gateway.networking.k8s.io/v1"
ENVOY_GATEWAY_API = "gateway.envoyproxy.io/v1alpha1"
CERT_MANAGER_API = "cert-manager.io/v1"
# The custom resource kinds rendered here: each one is validated against the schemas of crd-schemas.lock.
CUSTOM_KINDS = (
    (GATEWAY_API, "GatewayClass"),
    (GATEWAY_API, "Gateway"),
    (GATEWAY_API, "HTTPRoute"),
    (GATEWAY_API, "GRPCRoute"),
    (ENVOY_GATEWAY_API, "ClientTrafficPolicy"),
    (CERT_MANAGER_API, "ClusterIssuer"),
    (CERT_MANAGER_API, "Certificate"),
)


class AddonsConfig(Protocol):
    """What the renderers read of the StackConfig."""

    @property
    def kubernetes(self) -> KubernetesSettings: ...

    @property
    def cluster_addons(self) -> ClusterAddonsSettings: ...

    @property
    def inference(self) -> InferenceSettings: ...

    @property
    def security(self) -> SecuritySettings: ...

    @property
    def clear_immutable(self) -> bool: ...


def service_port(config: AddonsConfig) -> int:
    """The port of Service ai-service, which the HTTPRoute sends to: the service settings' listen port, read
    from the inference role's settings (the same value its Service is rendered with)."""
    security = config.security
    return config.inference.service_settings(security.model_dir, security.group, security.slice).swap.listen_port


@dataclass(frozen=True)
class HelmRelease:
    """One `helm upgrade --install NAME CHART --repo REPO --version VERSION -n NAMESPACE -f values`."""

    name: str
    namespace: str
    chart: str
    repo: str
    version: str
    values: dict[str, Any]


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "ironserve"}
    return {"name": name, "namespace": namespace, "labels": labels} if namespace else {"name": name, "labels": labels}


def api_server(config: AddonsConfig) -> tuple[str, int]:
    """(host, port) cilium reaches the API servers at without kube-proxy: kubernetes_control_plane_endpoint, else
    this control plane's kubernetes_advertise_address; ValueError when neither is set."""
    endpoint = config.kubernetes.client_endpoint
    if endpoint is None:
        raise ValueError(
            "cluster_addons: cilium replaces kube-proxy and needs the API server's address: set "
            "kubernetes_control_plane_endpoint (or kubernetes_advertise_address on the first control plane)"
        )
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


# --- cilium ---------------------------------------------------------------------------------------------------


def cilium_values(config: AddonsConfig) -> dict[str, Any]:
    """cni-cilium-ipam-cluster-pool, cni-cilium-routing-mode; kube-proxy replaced (kubernetes_kube_proxy false)."""
    addons, kubernetes = config.cluster_addons, config.kubernetes
    host, port = api_server(config)
    values: dict[str, Any] = {
        "ipam": {
            "mode": "cluster-pool",
            "operator": {
                "clusterPoolIPv4PodCIDRList": [kubernetes.pod_subnet],
                "clusterPoolIPv4MaskSize": addons.cilium_pod_cidr_mask_size,
            },
        },
        "routingMode": addons.cilium_routing_mode,
        "kubeProxyReplacement": True,
        "k8sServiceHost": host,
        "k8sServicePort": port,
        # Linkerd's proxies redirect by iptables in the pod: cilium's socket LB must leave pods' service
        # connections to them (docs.cilium.io kube-proxy-free guide, "Socket LoadBalancer Bypass in Pod Namespace").
        "socketLB": {"hostNamespaceOnly": True},
    }
    if addons.cilium_routing_mode == "tunnel":
        values["tunnelProtocol"] = addons.cilium_tunnel_protocol
    else:
        values["autoDirectNodeRoutes"] = True
        values["ipv4NativeRoutingCIDR"] = addons.cilium_native_routing_cidr or kubernetes.pod_subnet
    return CiliumValues.model_validate(values).document()


# --- linkerd, cert-manager, Envoy Gateway -----------------------------------------------------------------------


def trust_anchors_pem(settings: ClusterAddonsSettings) -> str:
    """The trust anchor certificate's PEM text (cluster_addons_linkerd_trust_anchor); ValueError when unset."""
    if settings.linkerd_trust_anchor is None:
        raise ValueError("cluster_addons: linkerd needs cluster_addons_linkerd_trust_anchor (a PEM certificate)")
    return Path(settings.linkerd_trust_anchor).expanduser().read_text()


def linkerd_control_plane_values(trust_anchors: str) -> dict[str, Any]:
    """The site's trust anchor; the issuer certificate is an external CA's (Secret linkerd-identity-issuer,
    kubernetes.io/tls with ca.crt), so no private key passes through ironserve."""
    values = {
        "identityTrustAnchorsPEM": trust_anchors,
        "identity": {"externalCA": True, "issuer": {"scheme": "kubernetes.io/tls"}},
    }
    return LinkerdControlPlaneValues.model_validate(values).document()


def helm_releases(config: AddonsConfig, trust_anchors: str) -> tuple[HelmRelease, ...]:
    """The Helm releases in install order: the CNI first (nodes stay NotReady without it), then the rest."""
    addons = config.cluster_addons
    # Envoy Gateway's chart installs the Gateway API CRDs; linkerd-crds must not install them a second time.
    linkerd_crds = LinkerdCrdsValues.model_validate({"installGatewayAPI": False}).document()
    cert_manager = CertManagerValues.model_validate({"crds": {"enabled": True}}).document()
    return (
        HelmRelease("cilium", "kube-system", "cilium", addons.cilium_chart_repo, addons.cilium_version,
                    cilium_values(config)),
        HelmRelease("cert-manager", CERT_MANAGER_NAMESPACE, "cert-manager", addons.cert_manager_chart_repo,
                    f"v{addons.cert_manager_version}", cert_manager),
        HelmRelease("eg", "envoy-gateway-system", "gateway-helm", addons.envoy_gateway_chart_repo,
                    f"v{addons.envoy_gateway_version}", EnvoyGatewayValues().document()),
        HelmRelease("linkerd-crds", "linkerd", "linkerd-crds", addons.linkerd_chart_repo,
                    addons.linkerd_chart_version, linkerd_crds),
        HelmRelease("linkerd-control-plane", "linkerd", "linkerd-control-plane", addons.linkerd_chart_repo,
                    addons.linkerd_chart_version, linkerd_control_plane_values(trust_anchors)),
    )  # fmt: skip


# --- CoreDNS ----------------------------------------------------------------------------------------------------


def coredns_configmap(config: AddonsConfig) -> Manifest:
    """kube-system/coredns: kubeadm 1.31's Corefile with the site's forward targets."""
    text = render_corefile.corefile(config.kubernetes.dns_domain, config.cluster_addons.coredns_forward)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("coredns", "kube-system"),
            "data": {"Corefile": text}}  # fmt: skip


# --- Envoy Gateway: the Gateway API objects and the policies ----------------------------------------------------


def gateway_manifests(config: AddonsConfig, service_port: int) -> list[Manifest]:
    """GatewayClass, the HTTPS Gateway in namespace ai (certificate: Secret tls-secret), the HTTPRoute to
    ai-service:`service_port` without a request timeout, the ClientTrafficPolicy (HTTP/2 downstream, stream idle
    timeout) and, with cluster_addons_grpc_web_backend, a GRPCRoute (which makes the listener gRPC-Web capable)."""
    addons = config.cluster_addons
    parent = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": GATEWAY, "sectionName": HTTPS_LISTENER}
    objects: list[Manifest] = [
        {
            "apiVersion": GATEWAY_API,
            "kind": "GatewayClass",
            "metadata": _meta(GATEWAY_CLASS),
            "spec": {"controllerName": GATEWAY_CONTROLLER},
        },
        {
            "apiVersion": GATEWAY_API,
            "kind": "Gateway",
            "metadata": _meta(GATEWAY, AI_NAMESPACE),
            "spec": {
                "gatewayClassName": GATEWAY_CLASS,
                "listeners": [
                    {
                        "name": HTTPS_LISTENER,
                        "protocol": "HTTPS",
                        "port": HTTPS_PORT,
                        "tls": {
                            "mode": "Terminate",
                            "certificateRefs": [{"group": "", "kind": "Secret", "name": TLS_SECRET}],
                        },
                        "allowedRoutes": {"namespaces": {"from": "Same"}},
                    }
                ],
            },
        },
        {
            "apiVersion": GATEWAY_API,
            "kind": "HTTPRoute",
            "metadata": _meta(AI_SERVICE, AI_NAMESPACE),
            "spec": {
                "parentRefs": [dict(parent)],
                "hostnames": list(addons.tls_dns_names),
                "rules": [
                    {
                        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                        "backendRefs": [{"group": "", "kind": "Service", "name": AI_SERVICE, "port": service_port}],
                        # "0s" disables the route timeout (GEP-1742), which Envoy otherwise sets to 15 s: a long
                        # generation streams for minutes.
                        "timeouts": {"request": "0s"},
                    }
                ],
            },
        },
        {
            "apiVersion": ENVOY_GATEWAY_API,
            "kind": "ClientTrafficPolicy",
            "metadata": _meta(f"{GATEWAY}-clients", AI_NAMESPACE),
            "spec": {
                "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": GATEWAY}],
                "tls": {"alpnProtocols": ["h2", "http/1.1"]},
                "http2": {"maxConcurrentStreams": HTTP2_MAX_CONCURRENT_STREAMS},
                # The HCM's stream_idle_timeout, where it belongs (not the router filter's, as the seed has it).
                "timeout": {"http": {"streamIdleTimeout": f"{addons.stream_idle_timeout_s}s"}},
            },
        },
    ]
    grpc = addons.grpc_web_service
    if grpc is not None:
        objects.append(
            {
                "apiVersion": GATEWAY_API,
                "kind": "GRPCRoute",
                "metadata": _meta(f"{grpc[0]}-grpc", AI_NAMESPACE),
                "spec": {
                    "parentRefs": [dict(parent)],
                    "hostnames": list(addons.tls_dns_names),
                    "rules": [{"backendRefs": [{"group": "", "kind": "Service", "name": grpc[0], "port": grpc[1]}]}],
                },
            }
        )
    return objects


# --- cert-manager objects ---------------------------------------------------------------------------------------


def certificate_manifests(config: AddonsConfig) -> list[Manifest]:
    """The Let's Encrypt ClusterIssuer (DNS01 through Cloudflare) and the Certificate that fills ai/tls-secret."""
    addons = config.cluster_addons
    solver = {
        "selector": {"dnsZones": list(addons.dns_zones)},
        "dns01": {
            "cloudflare": {"apiTokenSecretRef": {"name": CLOUDFLARE_SECRET, "key": CLOUDFLARE_SECRET_KEY}},
        },
    }
    acme: dict[str, Any] = {
        "server": addons.acme_server,
        "privateKeySecretRef": {"name": ACME_ACCOUNT_KEY_SECRET},
        "solvers": [solver],
    }
    if addons.acme_email:
        acme["email"] = addons.acme_email
    return [
        {"apiVersion": CERT_MANAGER_API, "kind": "ClusterIssuer", "metadata": _meta(CLUSTER_ISSUER),
         "spec": {"acme": acme}},
        {
            "apiVersion": CERT_MANAGER_API,
            "kind": "Certificate",
            "metadata": _meta(TLS_SECRET, AI_NAMESPACE),
            "spec": {
                "secretName": TLS_SECRET,
                "dnsNames": list(addons.tls_dns_names),
                "issuerRef": {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": CLUSTER_ISSUER},
            },
        },
    ]  # fmt: skip


def cloudflare_token(settings: ClusterAddonsSettings, environ: Mapping[str, str] | None = None) -> str | None:
    """The token from the deploy machine's environment, None when the variable is unset or blank; ValueError naming
    the variable (never the value) when it holds whitespace."""
    name = settings.cloudflare_token_env
    token = (os.environ if environ is None else environ).get(name, "")
    if not token.strip():
        return None
    if any(c.isspace() for c in token.strip()) or token != token.strip():
        raise ValueError(f"cluster_addons: ${name} holds whitespace; a Cloudflare API token has none")
    return token


def cloudflare_token_secret(token: str) -> Manifest:
    """Secret cert-manager/cloudflare-api-token (Opaque) holding `token`: the only object with the credential.

    As `data` (base64), not `stringData`: the API server stores only `data`, so a re-apply of `stringData` is a
    write every time (seen on the lab's 1.20.2, docs/lab-kubernetes-node.md) and the apply is never idempotent."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(CLOUDFLARE_SECRET, CERT_MANAGER_NAMESPACE),
        "type": "Opaque",
        "data": {CLOUDFLARE_SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


# --- NVIDIA device plugin ---------------------------------------------------------------------------------------


def device_plugin_manifests(config: AddonsConfig) -> list[Manifest]:
    """RuntimeClass nvidia and NVIDIA's static device plugin DaemonSet of the pinned tag (deployments/static/
    nvidia-device-plugin.yml), run with that RuntimeClass so it sees the GPUs; no GPU reset initContainer
    (k8s-gpu-reset-initcontainer is dubious: a reset kills in-flight work)."""
    addons = config.cluster_addons
    labels = {"name": "nvidia-device-plugin-ds"}
    container = {
        "name": "nvidia-device-plugin-ctr",
        "image": f"{addons.device_plugin_image}:{addons.device_plugin_version}",
        "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
    }
    return [
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": _meta(RUNTIME_CLASS),
         "handler": RUNTIME_CLASS},
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": _meta("nvidia-device-plugin-daemonset", "kube-system"),
            "spec": {
                "selector": {"matchLabels": labels},
                "updateStrategy": {"type": "RollingUpdate"},
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "runtimeClassName": RUNTIME_CLASS,
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "priorityClassName": "system-node-critical",
                        "containers": [container],
                        "volumes": [
                            {"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}
                        ],
                    },
                },
            },
        },
    ]  # fmt: skip


# --- all of it, and its problems ---------------------------------------------------------------------------------


def built_in_manifests(config: AddonsConfig) -> list[Manifest]:
    """The objects of kinds every API server serves (CoreDNS's ConfigMap, the RuntimeClass, the device plugin's
    DaemonSet): the ones the deploy applies; the custom resources wait for their charts' CRDs."""
    return [coredns_configmap(config), *device_plugin_manifests(config)]


def custom_manifests(config: AddonsConfig, service_port: int) -> list[Manifest]:
    """The custom resources (cert-manager's, Gateway API's, Envoy Gateway's): their kinds are served once the
    charts installed their CRDs."""
    return [*certificate_manifests(config), *gateway_manifests(config, service_port)]


def manifests_of(config: AddonsConfig, service_port: int) -> list[Manifest]:
    """Every object but the token's Secret, in apply order (CoreDNS, device plugin, certificates, gateway)."""
    return [*built_in_manifests(config), *custom_manifests(config, service_port)]


def problems(
    config: AddonsConfig,
    service_port: int,
    trust_anchors: str,
    token: str = TOKEN_STAND_IN,
    schemas_root: Path | None = None,
) -> list[str]:
    """Every problem of what this configuration renders, one line each; [] when it may be applied."""
    found: list[str] = []
    try:
        releases = helm_releases(config, trust_anchors)
    except ValueError as exc:  # a pydantic ValidationError is a ValueError too
        return [str(exc).splitlines()[0]]
    for release in releases:
        found += values_problems(release.chart, release.values)
    objects = [*manifests_of(config, service_port), cloudflare_token_secret(token)]
    custom = models_crd.custom_validators(CUSTOM_KINDS, schemas_root)
    found += manifests.problems(objects, config.kubernetes.version, custom=custom)
    found += render_corefile.problems(
        coredns_configmap(config)["data"]["Corefile"],
        config.kubernetes.dns_domain,
        config.cluster_addons.coredns_forward,
    )
    return found


def _within(
    inner: ipaddress.IPv4Network | ipaddress.IPv6Network, outer: ipaddress.IPv4Network | ipaddress.IPv6Network
) -> bool:
    return inner.version == outer.version and inner.network_address in outer and inner.prefixlen >= outer.prefixlen


def network_problems(config: AddonsConfig) -> list[str]:
    """Cilium's cluster pool cut into per-node slices of cluster_addons_cilium_pod_cidr_mask_size: a slice as large
    as the pod subnet leaves no second node any pod address; native routing must cover every pod address."""
    addons = config.cluster_addons
    pods = ipaddress.ip_network(config.kubernetes.pod_subnet)
    found = []
    if pods.version == 4 and addons.cilium_pod_cidr_mask_size <= pods.prefixlen:
        found.append(
            f"cluster_addons_cilium_pod_cidr_mask_size /{addons.cilium_pod_cidr_mask_size} is not longer than "
            f"kubernetes_pod_subnet {pods}: one node takes the whole pool and no second node gets pod addresses; "
            f"accepted: a mask from /{pods.prefixlen + 1} to /28"
        )
    routed = addons.cilium_native_routing_cidr
    network = ipaddress.ip_network(routed) if routed else None
    if addons.cilium_routing_mode == "native" and network is not None and not _within(pods, network):
        found.append(
            f"cluster_addons_cilium_native_routing_cidr {routed} does not contain kubernetes_pod_subnet {pods}: "
            "pods outside it are masqueraded or unreachable; accepted: a CIDR containing the pod subnet"
        )
    return found


def missing_keys(config: AddonsConfig) -> list[str]:
    """The keys this role cannot render without, with what each one is for."""
    addons, missing = config.cluster_addons, []
    if addons.acme_email is None:
        missing.append("cluster_addons_acme_email (ACME contact)")
    if not addons.dns_zones:
        missing.append("cluster_addons_dns_zones (DNS01 zones)")
    if not addons.tls_dns_names:
        missing.append("cluster_addons_tls_dns_names (ai/tls-secret's names)")
    if addons.linkerd_trust_anchor is None:
        missing.append("cluster_addons_linkerd_trust_anchor (the mesh's trust anchor)")
    if addons.helm_sha256 is None:
        missing.append("cluster_addons_helm_sha256 (Helm's tarball)")
    if ipaddress.ip_network(config.kubernetes.pod_subnet).version != 4:
        missing.append("an IPv4 kubernetes_pod_subnet (cilium's cluster-pool IPAM is rendered for IPv4)")
    return missing
