"""Settings of the kubernetes role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ironserve.config import LOCAL_PATH, RoleSettings, prefixed
from ironserve.validators import BaseUrl, PackageVersion, check_binary_keyring, check_host
from roles.kubernetes.models import ClusterConfiguration, KubeletConfiguration

# kubeadm.k8s.io/v1beta4, which ironserve renders, is read by kubeadm 1.31 and newer (kubeadm-config.v1beta4).
OLDEST_MINOR = 31
VERSION = re.compile(r"1\.(?P<minor>[0-9]{2})\.(0|[1-9][0-9]{0,2})")
# ClusterConfiguration fields with a setting of their own: one source of truth for each value.
OWN_CLUSTER_FIELDS = {
    "kubernetes_version": "kubernetes_version",
    "control_plane_endpoint": "kubernetes_control_plane_endpoint",
    "networking": "kubernetes_pod_subnet, kubernetes_service_subnet and kubernetes_dns_domain",
    "image_repository": "kubernetes_image_repository",
    "cluster_name": "kubernetes_cluster_name",
    "proxy": "kubernetes_kube_proxy",
}
# KubeletConfiguration fields ironserve derives from container_runtime's settings (checked, not set, here).
DERIVED_KUBELET_FIELDS = ("cgroup_driver", "container_runtime_endpoint")


def _cidr(value: str) -> str:
    try:
        network = ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise ValueError(f"is not a network in CIDR form ({exc}); accepted: such as 10.244.0.0/16") from None
    if network.prefixlen > 24 and network.version == 4:
        raise ValueError("leaves fewer than 256 addresses; accepted: a /24 or larger, such as 10.244.0.0/16")
    return str(network)


def _endpoint(value: str) -> str:
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    host = host or value
    check_host(host.strip("[]"))
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not 1-65535; accepted: HOST or HOST:PORT such as k8s-api.example:6443")
    return value


class KubernetesSettings(RoleSettings):
    """Settings of roles/kubernetes."""

    model_config = ConfigDict(alias_generator=prefixed("kubernetes"))

    version: str = Field(
        "1.31.4",
        description="k8s-not-k3s: the pinned Kubernetes release, MAJOR.MINOR.PATCH from 1.31 on (kubeadm's v1beta4 "
        "config); kubeadm, kubelet and kubectl are installed at `<version>-<kubernetes_package_revision>`.",
    )
    package_revision: str = Field(
        "1.1",
        pattern=r"^[0-9]+(\.[0-9]+)*$",
        description="The Debian revision pkgs.k8s.io gives its packages (kubeadm 1.31.4-1.1).",
    )
    cri_tools_version: PackageVersion = Field(
        "1.31.1-1.1",
        description="cri-tools (crictl) at this exact version, from the same repository.",
    )
    cni_version: PackageVersion = Field(
        "1.5.1-1.1",
        description="kubernetes-cni (the reference CNI plugins in /opt/cni/bin) at this exact version.",
    )
    repo_url: BaseUrl = Field(
        "https://pkgs.k8s.io/core:/stable:",
        description="Base URL of the Kubernetes package repositories or the site's mirror of them; the role "
        "appends `/v<MAJOR.MINOR>/deb/` (pkgs.k8s.io's one repository per minor release).",
    )
    repo_key: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        min_length=1,
        description="Path on the deploy machine of the repository's signing key as a binary keyring (`gpg "
        "--dearmor` of the repository's Release.key); installed as /etc/apt/keyrings/kubernetes-apt-keyring.gpg. "
        "Required.",
    )
    role: Literal["control-plane", "worker"] = Field(
        "control-plane",
        description="control-plane: the first one runs `kubeadm init`, others join as control planes; worker: "
        "joins with a token the deploy obtains from the first control plane during the same run.",
    )
    control_plane_endpoint: str | None = Field(
        None,
        description="A stable HOST or HOST:PORT for the API servers (a load balancer or DNS name); required with "
        "more than one control plane. None: the first control plane's kubernetes_advertise_address.",
    )
    advertise_address: str | None = Field(
        None,
        description="The IP this host's API server advertises (control planes); None: kubeadm's choice, the "
        "default route's address. Workers join it when no endpoint is set.",
    )
    api_server_port: int = Field(6443, ge=1, le=65535, description="The API server's secure port.")
    node_name: str | None = Field(
        None,
        description="The Node object's name; None: the host's name as kubeadm reads it (the hostname).",
    )
    pod_subnet: str = Field(
        "10.244.0.0/16",
        description="Pods' addresses (ClusterConfiguration networking.podSubnet), a CIDR of /24 or larger.",
    )
    service_subnet: str = Field(
        "10.96.0.0/12",
        description="Services' cluster IPs (networking.serviceSubnet), a CIDR not overlapping the pod subnet.",
    )
    dns_domain: str = Field(
        "cluster.local",
        pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$",
        description="The cluster's DNS domain (networking.dnsDomain).",
    )
    cluster_name: str = Field(
        "kubernetes",
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="The cluster's name (ClusterConfiguration clusterName, and kubeconfigs' cluster entries).",
    )
    image_repository: str = Field(
        "registry.k8s.io",
        pattern=r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$",
        description="Where kubeadm pulls the control plane's images (the site's registry mirror).",
    )
    kube_proxy: bool = Field(
        False,
        description="false: no kube-proxy (skipPhases addon/kube-proxy), the CNI replaces it (cilium "
        "kubeProxyReplacement, cni-cilium-routing-mode); true: kubeadm installs it.",
    )
    kubelet: KubeletConfiguration = Field(
        default_factory=KubeletConfiguration,
        json_schema_extra={"default_shown": "`{}`"},
        description="KubeletConfiguration fields (upstream names, e.g. `{maxPods: 64, systemReserved: {cpu: "
        "'2'}}`), unknown ones refused; cgroupDriver and containerRuntimeEndpoint come from container_runtime.",
    )
    cluster: ClusterConfiguration = Field(
        default_factory=ClusterConfiguration,
        json_schema_extra={"default_shown": "`{}`"},
        description="More ClusterConfiguration fields (e.g. `{apiServer: {certSANs: [...]}}`), unknown ones "
        "refused; those with a kubernetes_* key of their own are set there.",
    )

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        bare = value.removeprefix("v")
        match = VERSION.fullmatch(bare)
        if not match:
            raise ValueError("is not a release; accepted: MAJOR.MINOR.PATCH such as 1.31.4")
        if value.startswith("v"):
            raise ValueError(f"is written with a v; accepted: {bare} (the package version is {bare}-<revision>)")
        if int(match["minor"]) < OLDEST_MINOR:
            raise ValueError(
                f"is older than 1.{OLDEST_MINOR}, whose kubeadm reads the v1beta4 config ironserve renders"
            )
        return value

    @field_validator("repo_key")
    @classmethod
    def _binary_keyring(cls, value: str | None) -> str | None:
        return None if value is None else check_binary_keyring(value)

    @field_validator("control_plane_endpoint")
    @classmethod
    def _control_plane_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else _endpoint(value)

    @field_validator("advertise_address")
    @classmethod
    def _advertise_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError("is not an IP address; accepted: the host's address such as 192.0.2.10") from None

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", value):
            raise ValueError("is not a Node name; accepted: lower-case a-z 0-9 . - (RFC 1123), such as r740-01")
        return value

    @field_validator("pod_subnet", "service_subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        return _cidr(value)

    @field_validator("cluster")
    @classmethod
    def _cluster_fields_with_own_keys(cls, value: ClusterConfiguration) -> ClusterConfiguration:
        fields = ClusterConfiguration.model_fields
        taken = [f"{fields[name].alias} (set with {key})" for name, key in OWN_CLUSTER_FIELDS.items()
                 if getattr(value, name) is not None]  # fmt: skip
        if taken:
            raise ValueError("sets fields that have keys of their own: " + ", ".join(taken))
        return value

    @model_validator(mode="after")
    def _subnets_apart(self) -> KubernetesSettings:
        pods, services = ipaddress.ip_network(self.pod_subnet), ipaddress.ip_network(self.service_subnet)
        if pods.version == services.version and pods.overlaps(services):
            raise ValueError(
                f"kubernetes_pod_subnet {pods} overlaps kubernetes_service_subnet {services}; accepted: two "
                "networks apart, such as 10.244.0.0/16 and 10.96.0.0/12"
            )
        return self

    @property
    def minor(self) -> str:
        """MAJOR.MINOR, the repository's and the Kubernetes version skew's unit."""
        return ".".join(self.version.split(".")[:2])

    def packages(self) -> dict[str, str]:
        """The exact versions the role installs and holds."""
        release = f"{self.version}-{self.package_revision}"
        return {
            "kubeadm": release,
            "kubelet": release,
            "kubectl": release,
            "cri-tools": self.cri_tools_version,
            "kubernetes-cni": self.cni_version,
        }

    @property
    def client_endpoint(self) -> str | None:
        """HOST:PORT of the API servers as clients reach them; None when kubeadm's own choice stands."""
        given = self.control_plane_endpoint
        if given:
            has_port = given.count(":") == 1 and given.rpartition(":")[2].isdigit()
            return given if has_port else f"{given}:{self.api_server_port}"
        if self.advertise_address:
            address = self.advertise_address
            return f"[{address}]:{self.api_server_port}" if ":" in address else f"{address}:{self.api_server_port}"
        return None
