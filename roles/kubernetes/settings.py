"""Settings of the kubernetes role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ironserve.config import LOCAL_PATH, Listener, RoleSettings, prefixed
from ironserve.secrets import credentials_refused
from ironserve.validators import (
    BaseUrl,
    PackageVersion,
    PlainHttpUrl,
    check_binary_keyring,
    check_host,
    plain_http_refused,
)
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

# What each setting kubernetes_allow_insecure may name opens. Left out, the secure value stands: the kubelet's
# config file defaults to anonymous off, authorization Webhook and readOnlyPort 0 (kubelet.config.k8s.io/v1beta1
# reference, KubeletConfiguration), and kubeadm runs the API server with --authorization-mode=Node,RBAC and etcd on
# https:// only (kubeadm implementation details, "Static Pod manifest for the API server" and "for local etcd").
INSECURE = {
    "kubelet-anonymous-auth": "the kubelet's API on port 10250 (the node's pods, their logs, exec into them) to "
    "requests with no credentials, as system:anonymous",
    "kubelet-always-allow": "the kubelet's API on port 10250 to every client it authenticates, without asking the "
    "API server: RBAC no longer decides who may exec into the node's pods",
    "kubelet-read-only-port": "a plain-http port with no authentication that lists the node's pods with their "
    "specs and environment",
    "apiserver-always-allow": "the whole cluster, Secrets included, to every request the API server "
    "authenticates, anonymous ones too (kube-apiserver --anonymous-auth defaults to true): RBAC is bypassed",
    "etcd-plain-http": "the cluster's datastore, Secrets included, to anyone who reaches the port, with neither "
    "TLS nor a client certificate",
}
InsecureName = Literal[
    "kubelet-anonymous-auth",
    "kubelet-always-allow",
    "kubelet-read-only-port",
    "apiserver-always-allow",
    "etcd-plain-http",
]
# kube-controller-manager's --node-cidr-mask-size(-ipv4|-ipv6) defaults (kube-controller-manager reference): each
# node's slice of the pod subnet, which kubeadm turns on with --allocate-node-cidrs when the pod subnet is set.
NODE_CIDR_MASK = {4: 24, 6: 64}
FLAG = re.compile(r"\s*-*(?P<name>[A-Za-z0-9-]+)\s*(=|\s)\s*(?P<value>.*)", re.DOTALL)
TRUE = {"true", "1", "yes", "on"}


def _get(raw: object, *path: str) -> object:
    """raw[path...], each key matched whatever its case (a misspelt case is refused later as an unknown field)."""
    for key in path:
        if not isinstance(raw, Mapping):
            return None
        raw = next((v for k, v in raw.items() if str(k).lower() == key.lower()), None)
    return raw


def _true(value: object) -> bool:
    return value is True or str(value).strip().lower() in TRUE


def extra_args(raw: object) -> list[tuple[str, str]]:
    """(flag name, value) of extraArgs in every spelling: v1beta4's `[{name, value}]`, v1beta3's `{name: value}` and
    flags (`--name=value`, `--name value`); names without dashes and in lower case."""
    if isinstance(raw, Mapping):
        items = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, list | tuple):
        items = []
        for item in raw:
            if isinstance(item, Mapping):
                items.append((str(_get(item, "name") or ""), _get(item, "value")))
            elif isinstance(item, str) and (flag := FLAG.fullmatch(item)):
                items.append((flag["name"], flag["value"]))
    else:
        return []
    return [(name.strip().lstrip("-").lower(), str(value).strip()) for name, value in items]


def _kubelet_openings(raw: object) -> list[tuple[str, str]]:
    """(allowance name, the setting) of what the kubelet mapping opens."""
    found = []
    if _true(_get(raw, "authentication", "anonymous", "enabled")):
        found.append(("kubelet-anonymous-auth", "authentication.anonymous.enabled true"))
    if str(_get(raw, "authorization", "mode")).strip().lower() == "alwaysallow":
        found.append(("kubelet-always-allow", "authorization.mode AlwaysAllow"))
    port = _get(raw, "readOnlyPort")
    if port is not None and str(port).strip() not in {"0", "False"}:
        found.append(("kubelet-read-only-port", f"readOnlyPort {port}"))
    return found


def _cluster_openings(raw: object) -> list[tuple[str, str]]:
    """(allowance name, the setting) of what the ClusterConfiguration mapping's extraArgs open."""
    found = []
    for name, value in extra_args(_get(raw, "apiServer", "extraArgs")):
        modes = {mode.strip().lower() for mode in value.split(",")}
        if name == "authorization-mode" and "alwaysallow" in modes:
            found.append(("apiserver-always-allow", f"apiServer extraArgs authorization-mode={value}"))
    for name, value in extra_args(_get(raw, "etcd", "local", "extraArgs")):
        if name in {"listen-client-urls", "advertise-client-urls"} and "http://" in value.lower():
            found.append(("etcd-plain-http", f"etcd.local extraArgs {name}={value}"))
    return found


def _insecure_refused(found: list[tuple[str, str]], allowed: tuple[str, ...]) -> None:
    problems = [
        f"{setting} opens {INSECURE[name]}; accepted: leave it out, or name {name} in kubernetes_allow_insecure"
        for name, setting in found
        if name not in allowed
    ]
    if problems:
        raise ValueError("; ".join(problems))


def _address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address, local_allowed: bool) -> str | None:
    """Why other nodes and pods cannot reach the API server at `address`, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        return (
            "has an IPv6 zone (%), which kubeadm's address parsing (Go's net.ParseIP) refuses; accepted: a global "
            "address without a zone, such as 2001:db8::10"
        )
    if address.is_unspecified or address.is_multicast:
        return (
            "is no one host's address; accepted: the host's address on the cluster network, or none (kubeadm's choice)"
        )
    if (address.is_loopback or address.is_link_local) and not local_allowed:
        kind = "loopback" if address.is_loopback else "link-local"
        return (
            f"is {kind}: no other node reaches it, and the API server's Service endpoint at it is, inside a pod, the "
            "pod itself or nothing; accepted: the host's address on the cluster network, or "
            "kubernetes_allow_local_address: true for a cluster of one host"
        )
    return None


def _endpoint_ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a HOST or HOST:PORT endpoint, None for a name."""
    host = value.rpartition(":")[0] if value.count(":") == 1 or value.startswith("[") else value
    try:
        return ipaddress.ip_address((host or value).strip("[]"))
    except ValueError:
        return None


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
    allow_plain_http: tuple[PlainHttpUrl, ...] = Field(
        (),
        description="Opt-in: an http:// kubernetes_repo_url, exactly as given there (apt checks the index's "
        "signature, but anyone on the path sees what the hosts install and can serve an older signed index).",
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
    allow_local_address: bool = Field(
        False,
        description="Opt-in: a loopback or link-local kubernetes_advertise_address or control-plane endpoint, for a "
        "cluster of one host (other nodes cannot reach it; pods reach the API server only where it is not loopback).",
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
        description="The Node object's name; None: the host's name as kubeadm reads it (the hostname). "
        "`ironserve rollout` cordons and drains the Node of this name, or of the host's inventory name when unset.",
    )
    # Kubespray's drain_timeout (roles/remove_node/pre_remove/defaults/main.yml: 360s).
    drain_timeout_s: int = Field(
        360,
        gt=0,
        description="How long `ironserve rollout` lets `kubectl drain` evict the node's pods (PodDisruptionBudgets "
        "respected) before it gives up, uncordons the node and stops; the rollout's --drain-timeout wins.",
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
    allow_insecure: tuple[InsecureName, ...] = Field(
        (),
        description="Opt-in, by name, to each setting of kubernetes_kubelet or kubernetes_cluster that opens the "
        "host: kubelet-anonymous-auth, kubelet-always-allow (authorization.mode AlwaysAllow), kubelet-read-only-port "
        "(readOnlyPort not 0), apiserver-always-allow (authorization-mode AlwaysAllow), etcd-plain-http (http:// "
        "client URLs); the README says what each opens.",
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

    @field_validator("repo_url")
    @classmethod
    def _repo_url(cls, value: str, info: ValidationInfo) -> str:
        credentials_refused(value, "give them to apt on the hosts (/etc/apt/auth.conf.d/)")
        plain_http_refused(
            value,
            info.data.get("allow_plain_http", ()),
            "kubernetes_allow_plain_http",
            "apt checks the index's signature, but anyone on the path sees what the hosts install and can serve "
            "them an older signed index that holds back fixes",
        )
        return value

    @field_validator("repo_key")
    @classmethod
    def _binary_keyring(cls, value: str | None) -> str | None:
        return None if value is None else check_binary_keyring(value)

    @field_validator("control_plane_endpoint")
    @classmethod
    def _control_plane_endpoint(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        address = _endpoint_ip(_endpoint(value))
        problem = None if address is None else _address_problem(address, info.data.get("allow_local_address", False))
        if problem:
            raise ValueError(f"{address} {problem}")
        return value

    @field_validator("advertise_address")
    @classmethod
    def _advertise_address(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("is not an IP address; accepted: the host's address such as 192.0.2.10") from None
        problem = _address_problem(address, info.data.get("allow_local_address", False))
        if problem:
            raise ValueError(problem)
        return str(address)

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

    @field_validator("kubelet", mode="before")
    @classmethod
    def _kubelet_secure(cls, raw: object, info: ValidationInfo) -> object:
        _insecure_refused(_kubelet_openings(raw), info.data.get("allow_insecure", ()))
        return raw

    @field_validator("cluster", mode="before")
    @classmethod
    def _cluster_secure(cls, raw: object, info: ValidationInfo) -> object:
        _insecure_refused(_cluster_openings(raw), info.data.get("allow_insecure", ()))
        return raw

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
        hosts = {"kubernetes_advertise_address": self.advertise_address}
        if self.control_plane_endpoint:
            hosts["kubernetes_control_plane_endpoint"] = str(_endpoint_ip(self.control_plane_endpoint) or "")
        for key, subnet in (("kubernetes_pod_subnet", pods), ("kubernetes_service_subnet", services)):
            for host_key, value in hosts.items():
                if value and ipaddress.ip_address(value) in subnet:
                    raise ValueError(
                        f"{key} {subnet} contains {host_key} {value}: traffic to the host would be routed to pods "
                        "or Services instead; accepted: a subnet apart from the hosts' network"
                    )
        if self.node_cidrs < 2:
            raise ValueError(
                f"kubernetes_pod_subnet {pods} has room for one node at the node CIDR mask /{self.node_cidr_mask} "
                "(kube-controller-manager --node-cidr-mask-size): no second node gets pod addresses; accepted: a "
                "larger pod subnet, such as 10.244.0.0/16"
            )
        return self

    def listeners(self) -> tuple[Listener, ...]:
        """Kubernetes' ports and protocols (kubernetes.io/docs/reference/networking/ports-and-protocols): the kubelet's
        10250 on every node, kube-proxy's 10256; on a control plane the API server, etcd's 2379-2380 and the
        scheduler's 10259 and controller manager's 10257."""
        ports = [Listener(10250, "kubernetes_role", "the kubelet API")]
        if self.kubelet.read_only_port:  # only through kubernetes_allow_insecure
            ports.append(Listener(self.kubelet.read_only_port, "kubernetes_kubelet", "the kubelet's read-only port"))
        if self.kube_proxy:
            ports.append(Listener(10256, "kubernetes_kube_proxy", "kube-proxy's health check"))
        if self.role == "control-plane":
            ports += [
                Listener(self.api_server_port, "kubernetes_api_server_port", "the Kubernetes API server"),
                Listener(2379, "kubernetes_role", "the cluster's etcd (client)"),
                Listener(2380, "kubernetes_role", "the cluster's etcd (peer)"),
                Listener(10259, "kubernetes_role", "kube-scheduler"),
                Listener(10257, "kubernetes_role", "kube-controller-manager"),
            ]
        return tuple(ports)

    def addresses(self) -> tuple[tuple[str, str], ...]:
        return (("kubernetes_advertise_address", self.advertise_address),) if self.advertise_address else ()

    def private_networks(self) -> tuple[tuple[str, str], ...]:
        return (("kubernetes_pod_subnet", self.pod_subnet), ("kubernetes_service_subnet", self.service_subnet))

    @property
    def node_cidr_mask(self) -> int:
        """The prefix length of each node's slice of the pod subnet (kube-controller-manager's, which kubeadm sets)."""
        version = ipaddress.ip_network(self.pod_subnet).version
        given = self.cluster.controller_manager.extra_args if self.cluster.controller_manager else None
        names = {"node-cidr-mask-size", f"node-cidr-mask-size-ipv{version}"}
        masks = [value for name, value in extra_args([arg.document() for arg in given or ()]) if name in names]
        return int(masks[-1]) if masks and masks[-1].isdigit() else NODE_CIDR_MASK[version]

    @property
    def node_cidrs(self) -> int:
        """How many nodes the pod subnet has room for at node_cidr_mask."""
        return int(2 ** max(0, self.node_cidr_mask - ipaddress.ip_network(self.pod_subnet).prefixlen))

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
