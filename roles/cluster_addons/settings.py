"""Settings of the cluster_addons role: its public API, every inventory key it reads with its default.

The Cloudflare API token is never an inventory value: the deploy reads it from the environment variable that
`cluster_addons_cloudflare_token_env` names, and `cluster_addons_cloudflare_api_token` exists only to refuse a
token written into the inventory with a message that says where it belongs.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

from ironserve.config import LOCAL_PATH, RoleSettings, prefixed
from ironserve.secrets import credentials_refused
from ironserve.validators import BaseUrl, PlainHttpUrl, Sha256, plain_http_refused

SEMVER = r"^[0-9]+\.[0-9]+\.[0-9]+$"
# A chart repository or mirror: https://, oci:// (Helm OCI registries) or file:// for a local copy.
CHART_REPO = r"^(https?|oci|file)://\S+[^/]$"
ChartRepo = Annotated[str, StringConstraints(pattern=CHART_REPO)]
DNS_NAME = re.compile(r"(\*\.)?[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+")
ENV_NAME = r"^[A-Z_][A-Z0-9_]*$"
PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
# Let's Encrypt's staging directory: its certificates chain to "(STAGING) Pretend Pear X1", which no client trusts
# (letsencrypt.org/docs/staging-environment).
ACME_STAGING_HOST = "acme-staging-v02.api.letsencrypt.org"
CHART_OVER_HTTP = (
    "Helm fetches the chart and its index from it with nothing checked, so anyone on the path changes what the "
    "control planes install with cluster-admin rights"
)


def _dns_names(values: tuple[str, ...], example: str) -> tuple[str, ...]:
    for value in values:
        if not DNS_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a lower-case DNS name; accepted: such as {example}")
    return values


def _in_zone(name: str, zone: str) -> bool:
    return name == zone or name.endswith("." + zone)


class ClusterAddonsSettings(RoleSettings):
    """Settings of roles/cluster_addons."""

    model_config = ConfigDict(alias_generator=prefixed("cluster_addons"))

    allow_plain_http: tuple[PlainHttpUrl, ...] = Field(
        (),
        description="Opt-in: http:// URLs cluster_addons_helm_base_url and the *_chart_repo keys may be, each "
        "exactly as given there (nothing checks a chart fetched over it: for a lab or an isolated network).",
    )
    # --- Helm -----------------------------------------------------------------------------------------------
    helm_version: str = Field(
        "3.17.3",
        pattern=SEMVER,
        description="The Helm client the control planes install the charts with (Helm 3.17 supports Kubernetes "
        "1.29-1.32; helm.sh version skew policy).",
    )
    helm_base_url: BaseUrl = Field(
        "https://get.helm.sh",
        description="Where helm-v<version>-linux-amd64.tar.gz is downloaded from: Helm's release server or the "
        "site's mirror of it.",
    )
    helm_sha256: Sha256 | None = Field(
        None,
        description="SHA-256 of helm-v<version>-linux-amd64.tar.gz (Helm publishes it beside the tarball as "
        ".sha256sum); the download is refused on any other. Required.",
    )
    # --- cilium ---------------------------------------------------------------------------------------------
    cilium_version: str = Field(
        "1.18.3",
        pattern=SEMVER,
        description="cni-cilium: the cilium chart's version (Cilium 1.18 lists Kubernetes 1.30-1.33, so 1.31 "
        "is supported; docs.cilium.io system requirements).",
    )
    cilium_chart_repo: ChartRepo = Field(
        "https://helm.cilium.io",
        description="Helm repository of the cilium chart, or the site's mirror of it.",
    )
    cilium_routing_mode: Literal["tunnel", "native"] = Field(
        "tunnel",
        description="cni-cilium-routing-mode: tunnel (VXLAN, works on any network) or native (nodes on one L2: "
        "autoDirectNodeRoutes and ipv4NativeRoutingCIDR); `tunnel=disabled` was removed in Cilium 1.15.",
    )
    cilium_tunnel_protocol: Literal["vxlan", "geneve"] = Field(
        "vxlan",
        description="The encapsulation of routingMode tunnel (cilium's default, vxlan).",
    )
    cilium_native_routing_cidr: str | None = Field(
        None,
        description="ipv4NativeRoutingCIDR of routingMode native: the network routed without encapsulation; "
        "None: kubernetes_pod_subnet.",
    )
    cilium_pod_cidr_mask_size: int = Field(
        24,
        ge=16,
        le=28,
        description="ipam.operator.clusterPoolIPv4MaskSize: each node's slice of the pod subnet (cilium's "
        "default /24: 254 pods a node).",
    )
    # --- CoreDNS --------------------------------------------------------------------------------------------
    coredns_forward: tuple[str, ...] = Field(
        ("1.1.1.1", "8.8.8.8"),
        min_length=1,
        description="dns-corefile-forward: the resolvers CoreDNS forwards non-cluster names to, IP addresses "
        "(the seed's 1.1.1.1 and 8.8.8.8; the only line of kubeadm's Corefile that changes).",
    )
    # --- Envoy Gateway ---------------------------------------------------------------------------------------
    envoy_gateway_version: str = Field(
        "1.6.7",
        pattern=SEMVER,
        description="ingress-envoy: the gateway-helm chart's version (Envoy Gateway 1.6 supports Kubernetes "
        "1.30-1.33 and bundles Gateway API v1.4.0; gateway.envoyproxy.io compatibility matrix).",
    )
    envoy_gateway_chart_repo: ChartRepo = Field(
        "oci://docker.io/envoyproxy",
        description="The OCI registry holding the gateway-helm chart, or the site's mirror of it.",
    )
    stream_idle_timeout_s: int = Field(
        300,
        ge=1,
        le=86400,
        description="ingress-envoy-stream-idle-timeout: seconds a stream may stay idle (the HCM's "
        "stream_idle_timeout, set by a ClientTrafficPolicy); requests themselves have no timeout.",
    )
    grpc_web_backend: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?:[0-9]{1,5}$",
        description="ingress-grpc-web: SERVICE:PORT of a gRPC Service in namespace ai to route by a GRPCRoute; "
        "Envoy Gateway adds the grpc_web filter to a listener a GRPCRoute attaches to. None: no gRPC route.",
    )
    # --- linkerd --------------------------------------------------------------------------------------------
    linkerd_chart_version: str = Field(
        "2024.11.8",
        pattern=r"^[0-9]{4}\.[0-9]{1,2}\.[0-9]{1,2}$",
        description="mesh-linkerd: the linkerd-crds and linkerd-control-plane chart version (edge-24.11.8; the "
        "Linkerd project publishes edge releases only).",
    )
    linkerd_chart_repo: ChartRepo = Field(
        "https://helm.linkerd.io/edge",
        description="Helm repository of the linkerd charts, or the site's mirror of it.",
    )
    linkerd_trust_anchor: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        min_length=1,
        description="Path on the deploy machine of the mesh's trust anchor certificate (PEM, certificate only, "
        "never its key); linkerd-control-plane's identityTrustAnchorsPEM. Required.",
    )
    # --- cert-manager ---------------------------------------------------------------------------------------
    cert_manager_version: str = Field(
        "1.19.4",
        pattern=SEMVER,
        description="cert-manager-dns01-cloudflare: the cert-manager chart's version (1.19 supports Kubernetes "
        "1.31-1.35; cert-manager.io supported releases).",
    )
    cert_manager_chart_repo: ChartRepo = Field(
        "https://charts.jetstack.io",
        description="Helm repository of the cert-manager chart, or the site's mirror of it.",
    )
    acme_staging: bool = Field(
        False,
        description="Opt-in: a cluster_addons_acme_server on Let's Encrypt's staging directory, whose certificates "
        "no client trusts (for testing the issuance, never for serving).",
    )
    acme_server: str = Field(
        "https://acme-v02.api.letsencrypt.org/directory",
        pattern=r"^https://\S+$",
        description="cert-no-self-signed: the ACME directory of the ClusterIssuer (Let's Encrypt production; "
        "its staging directory issues untrusted certificates).",
    )
    acme_email: str | None = Field(
        None,
        pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$",
        description="The ACME account's contact address (expiry notices). Required.",
    )
    dns_zones: tuple[str, ...] = Field(
        (),
        json_schema_extra={"default_shown": "required"},
        description="The Cloudflare zones the DNS01 solver answers for (its selector.dnsZones), such as "
        "`[example.com]`. Required.",
    )
    tls_dns_names: tuple[str, ...] = Field(
        (),
        json_schema_extra={"default_shown": "required"},
        description="cert-ingress-tls-secret: the names of the certificate in Secret ai/tls-secret, and the "
        "HTTPRoute's hostnames, such as `[llm.example.com]`. Required.",
    )
    cloudflare_token_env: str = Field(
        "IRONSERVE_CLOUDFLARE_API_TOKEN",
        pattern=ENV_NAME,
        description="cert-cloudflare-token-secret: the environment variable of the deploy machine holding the "
        "Cloudflare API token (Zone:DNS:Edit) put into Secret cert-manager/cloudflare-api-token; unset, the Secret "
        "is left as the cluster has it.",
    )
    cloudflare_api_token: None = Field(
        None,
        description="Refused whatever its value: the token is a credential, read from the variable "
        "cluster_addons_cloudflare_token_env names, never from the inventory.",
    )
    # --- NVIDIA device plugin -------------------------------------------------------------------------------
    device_plugin_version: str = Field(
        "v0.17.0",
        pattern=r"^v[0-9]+\.[0-9]+\.[0-9]+$",
        description="k8s-nvidia-device-plugin: the NVIDIA device plugin's image tag (its static manifest "
        "deployments/static/nvidia-device-plugin.yml of the same tag is what is rendered).",
    )
    device_plugin_image: str = Field(
        "nvcr.io/nvidia/k8s-device-plugin",
        pattern=r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+$",
        description="The device plugin's image without tag, from NVIDIA's registry or the site's mirror.",
    )

    @field_validator("cloudflare_api_token", mode="before")
    @classmethod
    def _no_token_here(cls, value: object) -> None:
        if value is not None:
            raise ValueError(
                "is a credential and never an inventory value: export it on the deploy machine as "
                "IRONSERVE_CLOUDFLARE_API_TOKEN (or the variable cluster_addons_cloudflare_token_env names)"
            )
        return None

    @field_validator("cilium_chart_repo", "envoy_gateway_chart_repo", "linkerd_chart_repo", "cert_manager_chart_repo")
    @classmethod
    def _repo_without_credentials(cls, value: str, info: ValidationInfo) -> str:
        credentials_refused(value, "give the mirror's credentials to Helm on the control planes (helm registry login)")
        plain_http_refused(
            value, info.data.get("allow_plain_http", ()), "cluster_addons_allow_plain_http", CHART_OVER_HTTP
        )
        return value

    @field_validator("helm_base_url")
    @classmethod
    def _download_without_credentials(cls, value: str, info: ValidationInfo) -> str:
        credentials_refused(value, "give them to curl on the control planes (root's ~/.netrc)")
        plain_http_refused(
            value,
            info.data.get("allow_plain_http", ()),
            "cluster_addons_allow_plain_http",
            "the tarball is checked against cluster_addons_helm_sha256, but anyone on the path sees and can "
            "withhold the download, and the charts' URLs on the same mirror are as open",
        )
        return value

    @field_validator("acme_server")
    @classmethod
    def _production_acme(cls, value: str, info: ValidationInfo) -> str:
        host = value.removeprefix("https://").partition("/")[0].partition(":")[0].lower()
        if host == ACME_STAGING_HOST and not info.data.get("acme_staging"):
            raise ValueError(
                "is Let's Encrypt's staging directory, whose certificates no browser or client trusts; accepted: "
                "https://acme-v02.api.letsencrypt.org/directory, or cluster_addons_acme_staging: true to test issuance"
            )
        return value

    @field_validator("cilium_native_routing_cidr")
    @classmethod
    def _native_cidr(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            network = ipaddress.ip_network(value, strict=True)
        except ValueError as exc:
            raise ValueError(f"is not a network in CIDR form ({exc}); accepted: such as 10.244.0.0/16") from None
        if network.version != 4:
            raise ValueError("is not an IPv4 network; accepted: such as 10.244.0.0/16 (ipv4NativeRoutingCIDR)")
        return str(network)

    @field_validator("coredns_forward")
    @classmethod
    def _forward_ips(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            try:
                address = ipaddress.ip_address(value)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not an IP address; accepted: resolver addresses such as 1.1.1.1 8.8.8.8 "
                    "(a name would need the resolver it replaces)"
                ) from None
            # Loopback inside the CoreDNS pod is CoreDNS itself, whose loop plugin stops it (coredns.io/plugins/loop).
            if address.is_loopback or address.is_unspecified:
                raise ValueError(
                    f"{value} is the CoreDNS pod itself, not a resolver: CoreDNS would forward to itself and stop; "
                    "accepted: resolvers the pods reach, such as the site's or 1.1.1.1 8.8.8.8"
                )
        if len(set(values)) != len(values):
            raise ValueError("lists a resolver twice")
        return values

    @field_validator("dns_zones")
    @classmethod
    def _zones(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return _dns_names(values, "example.com")

    @field_validator("tls_dns_names")
    @classmethod
    def _tls_names(cls, values: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        _dns_names(values, "llm.example.com")
        zones = info.data.get("dns_zones") or ()
        # cert-manager's DNS01 solver answers only for names in its selector.dnsZones (or below them).
        outside = [v for v in values if zones and not any(_in_zone(v.removeprefix("*."), z) for z in zones)]
        if outside:
            raise ValueError(
                f"names outside the zones the DNS01 solver serves ({', '.join(zones)}): {', '.join(outside)}; their "
                "certificate would never be issued; accepted: names in cluster_addons_dns_zones, or their zone there"
            )
        return values

    @field_validator("linkerd_trust_anchor")
    @classmethod
    def _trust_anchor(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            raise ValueError("names no readable PEM file on this machine") from None
        if "PRIVATE KEY" in text:
            raise ValueError(f"{path} holds a private key; give the trust anchor's certificate only")
        if PEM_CERTIFICATE not in text:
            raise ValueError(f"{path} holds no PEM certificate ({PEM_CERTIFICATE})")
        return value

    @field_validator("grpc_web_backend")
    @classmethod
    def _grpc_port(cls, value: str | None) -> str | None:
        if value is not None and not 1 <= int(value.rpartition(":")[2]) <= 65535:
            raise ValueError("has a port outside 1-65535; accepted: SERVICE:PORT such as ai-grpc:9000")
        return value

    @property
    def grpc_web_service(self) -> tuple[str, int] | None:
        """(Service, port) of cluster_addons_grpc_web_backend, or None."""
        if self.grpc_web_backend is None:
            return None
        name, _, port = self.grpc_web_backend.partition(":")
        return name, int(port)

    def secret_variables(self) -> dict[str, tuple[str | None, str]]:
        key = "cluster_addons_cloudflare_token_env"
        return {self.cloudflare_token_env: (key, "the Cloudflare API token (put into a cluster Secret)")}
