"""Helm values of the add-ons as typed models of the keys ironserve sets, anything else refused.

Helm passes a misspelt value to the templates, which ignore it (`kubeProxyReplacment: true` leaves kube-proxy's
work undone), and no registry this project reaches ships the charts' values.schema.json. So each chart's values
are a model of the subset rendered here, aliases being the charts' own keys as their values.yaml names them:
cilium 1.18 (install/kubernetes/cilium/values.yaml), cert-manager 1.19 (deploy/charts/cert-manager/values.yaml),
linkerd-crds and linkerd-control-plane (charts/*/values.yaml of linkerd2 edge-24.11.8). A key a site would add
needs its field here first.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError


class Values(BaseModel):
    """A part of a chart's values: the chart's key names, anything else refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class CiliumIpamOperator(Values):
    cluster_pool_ipv4_pod_cidr_list: tuple[str, ...] = Field(alias="clusterPoolIPv4PodCIDRList", min_length=1)
    cluster_pool_ipv4_mask_size: StrictInt = Field(alias="clusterPoolIPv4MaskSize", ge=16, le=28)


class CiliumIpam(Values):
    mode: Literal["cluster-pool"]
    operator: CiliumIpamOperator


class CiliumSocketLB(Values):
    host_namespace_only: StrictBool = Field(alias="hostNamespaceOnly")


class CiliumValues(Values):
    ipam: CiliumIpam
    routing_mode: Literal["tunnel", "native"] = Field(alias="routingMode")
    tunnel_protocol: Literal["vxlan", "geneve"] | None = Field(None, alias="tunnelProtocol")
    auto_direct_node_routes: StrictBool | None = Field(None, alias="autoDirectNodeRoutes")
    ipv4_native_routing_cidr: str | None = Field(None, alias="ipv4NativeRoutingCIDR")
    kube_proxy_replacement: StrictBool = Field(alias="kubeProxyReplacement")
    k8s_service_host: str = Field(alias="k8sServiceHost", min_length=1)
    k8s_service_port: StrictInt = Field(alias="k8sServicePort", ge=1, le=65535)
    socket_lb: CiliumSocketLB | None = Field(None, alias="socketLB")


class CertManagerCrds(Values):
    enabled: StrictBool
    keep: StrictBool | None = None


class CertManagerValues(Values):
    crds: CertManagerCrds


class LinkerdCrdsValues(Values):
    install_gateway_api: StrictBool = Field(alias="installGatewayAPI")


class LinkerdIssuer(Values):
    scheme: Literal["linkerd.io/tls", "kubernetes.io/tls"]


class LinkerdIdentity(Values):
    external_ca: StrictBool = Field(alias="externalCA")
    issuer: LinkerdIssuer


class LinkerdControlPlaneValues(Values):
    identity_trust_anchors_pem: str = Field(alias="identityTrustAnchorsPEM", min_length=1)
    identity: LinkerdIdentity


class EnvoyGatewayValues(Values):
    """gateway-helm runs with its chart defaults; ironserve sets none of its values."""


CHART_VALUES: dict[str, type[Values]] = {
    "cilium": CiliumValues,
    "cert-manager": CertManagerValues,
    "linkerd-crds": LinkerdCrdsValues,
    "linkerd-control-plane": LinkerdControlPlaneValues,
    "gateway-helm": EnvoyGatewayValues,
}


def values_problems(chart: str, values: dict[str, Any]) -> list[str]:
    """The problems of `values` for `chart`, one line each (`chart: path: message`)."""
    try:
        CHART_VALUES[chart].model_validate(values)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(top)"
            message = (
                "unknown key, which the chart would ignore" if error["type"] == "extra_forbidden" else error["msg"]
            )
            lines.append(f"{chart} values: {where}: {message}")
        return lines
    return []
