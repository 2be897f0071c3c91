"""Cluster settings that open a host, network plans that cannot work and plain HTTP or staging where trust matters
(issue 33, items 2-4): each is refused when the inventory is loaded, before any host is contacted, with a message
that names the key, says what the value opens or why it cannot work, and what is accepted, the allowance key
included; each allowance key lets exactly its own value through and nothing beside it.

Every case is one inventory value and the essential words of its message (besides the key); BASE is merged into
each so the zone a TLS name is checked against is set.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from ironserve.config import ConfigError
from roles import stack_config
from roles.kubernetes.render import cluster_configuration, kubelet_configuration_yaml

# (key, value, essential words of the message besides the key)
Case = tuple[str, Any, tuple[str, ...]]

BASE = {"cluster_addons_dns_zones": ["example.com"]}
INSECURE = "kubernetes_allow_insecure"
LOCAL = "kubernetes_allow_local_address"


def _api_args(*args: Any) -> dict[str, Any]:
    return {"apiServer": {"extraArgs": list(args)}}


def _always_allow(value: str = "Node,RBAC,AlwaysAllow") -> dict[str, Any]:
    return _api_args({"name": "authorization-mode", "value": value})


SECURITY: list[Case] = [
    (
        "kubernetes_kubelet",
        {"authentication": {"anonymous": {"enabled": True}}},
        ("requests with no credentials", INSECURE, "kubelet-anonymous-auth"),
    ),
    ("kubernetes_kubelet", {"authentication": {"anonymous": {"enabled": "true"}}}, ("kubelet-anonymous-auth",)),
    ("kubernetes_kubelet", {"Authentication": {"Anonymous": {"Enabled": True}}}, ("kubelet-anonymous-auth",)),
    (
        "kubernetes_kubelet",
        {"authorization": {"mode": "AlwaysAllow"}},
        ("RBAC no longer decides", INSECURE, "kubelet-always-allow"),
    ),
    ("kubernetes_kubelet", {"authorization": {"mode": "alwaysallow"}}, ("kubelet-always-allow",)),
    ("kubernetes_kubelet", {"readOnlyPort": 10255}, ("no authentication", INSECURE, "kubelet-read-only-port")),
    ("kubernetes_kubelet", {"readOnlyPort": "10255"}, ("kubelet-read-only-port",)),
    ("kubernetes_kubelet", {"readonlyport": 10255}, ("kubelet-read-only-port",)),
    (
        "kubernetes_kubelet",
        {"readOnlyPort": 10255, "authorization": {"mode": "AlwaysAllow"}},
        ("kubelet-read-only-port", "kubelet-always-allow"),
    ),
    ("kubernetes_cluster", _always_allow(), ("RBAC is bypassed", INSECURE, "apiserver-always-allow")),
    ("kubernetes_cluster", _always_allow("AlwaysAllow"), ("apiserver-always-allow",)),
    ("kubernetes_cluster", _always_allow("Node, alwaysallow"), ("apiserver-always-allow",)),
    (
        "kubernetes_cluster",
        _api_args({"name": "--authorization-mode", "value": "AlwaysAllow"}),
        ("apiserver-always-allow",),
    ),
    (
        "kubernetes_cluster",
        {"apiServer": {"extraArgs": {"authorization-mode": "AlwaysAllow"}}},
        ("apiserver-always-allow",),
    ),
    ("kubernetes_cluster", _api_args("--authorization-mode=AlwaysAllow"), ("apiserver-always-allow",)),
    ("kubernetes_cluster", _api_args("--authorization-mode AlwaysAllow"), ("apiserver-always-allow",)),
    ("kubernetes_cluster", _api_args("--Authorization-Mode=AlwaysAllow"), ("apiserver-always-allow",)),
    (
        "kubernetes_cluster",
        {"APIServer": {"ExtraArgs": [{"Name": "authorization-mode", "Value": "AlwaysAllow"}]}},
        ("apiserver-always-allow",),
    ),
    (
        "kubernetes_cluster",
        {"etcd": {"local": {"extraArgs": [{"name": "listen-client-urls", "value": "http://0.0.0.0:2379"}]}}},
        ("neither TLS nor a client certificate", INSECURE, "etcd-plain-http"),
    ),
    (
        "kubernetes_cluster",
        {"etcd": {"local": {"extraArgs": {"advertise-client-urls": "HTTP://10.0.0.5:2379"}}}},
        ("etcd-plain-http",),
    ),
    ("kubernetes_allow_insecure", ["kubelet-anonymous"], ("kubelet-anonymous-auth",)),
    ("kubernetes_allow_insecure", ["insecure-port"], ("apiserver-always-allow",)),
]

NETWORK: list[Case] = [
    ("kubernetes_advertise_address", "127.0.0.1", ("is loopback", "pod itself", LOCAL)),
    ("kubernetes_advertise_address", "::1", ("is loopback", LOCAL)),
    ("kubernetes_advertise_address", "169.254.10.1", ("is link-local", LOCAL)),
    ("kubernetes_advertise_address", "fe80::1", ("is link-local", LOCAL)),
    ("kubernetes_advertise_address", "fe80::1%eth0", ("IPv6 zone", "net.ParseIP", "accepted:")),
    ("kubernetes_advertise_address", "0.0.0.0", ("no one host's address", "kubeadm's choice")),
    ("kubernetes_advertise_address", "224.0.0.1", ("no one host's address",)),
    ("kubernetes_control_plane_endpoint", "127.0.0.1:6443", ("is loopback", LOCAL)),
    ("kubernetes_control_plane_endpoint", "169.254.0.10", ("is link-local", LOCAL)),
    ("kubernetes_advertise_address", "10.244.3.4", ("kubernetes_pod_subnet 10.244.0.0/16 contains", "apart")),
    ("kubernetes_advertise_address", "10.96.0.10", ("kubernetes_service_subnet 10.96.0.0/12 contains",)),
    ("kubernetes_control_plane_endpoint", "10.244.0.1:6443", ("kubernetes_pod_subnet", "contains")),
    ("kubernetes_control_plane_endpoint", "10.100.0.1", ("kubernetes_service_subnet", "contains")),
    ("kubernetes_pod_subnet", "10.96.0.0/16", ("overlaps kubernetes_service_subnet",)),
    ("kubernetes_service_subnet", "10.0.0.0/8", ("overlaps",)),
    ("kubernetes_pod_subnet", "10.244.0.0/24", ("room for one node", "/24", "--node-cidr-mask-size")),
    (
        "kubernetes_cluster",
        {"controllerManager": {"extraArgs": [{"name": "node-cidr-mask-size", "value": "16"}]}},
        ("room for one node", "/16"),
    ),
    (
        "kubernetes_cluster",
        {"controllerManager": {"extraArgs": [{"name": "node-cidr-mask-size-ipv4", "value": "12"}]}},
        ("room for one node", "/12"),
    ),
    ("cluster_addons_coredns_forward", ["127.0.0.53"], ("CoreDNS pod itself", "accepted:")),
    ("cluster_addons_coredns_forward", ["1.1.1.1", "127.0.0.1"], ("CoreDNS pod itself",)),
    ("cluster_addons_coredns_forward", ["::1"], ("CoreDNS pod itself",)),
    ("cluster_addons_coredns_forward", ["0.0.0.0"], ("CoreDNS pod itself",)),
]

MIRROR = "http://mirror.lab:5000"
CHARTS = "http://mirror.lab/charts"
TRUST: list[Case] = [
    (
        "container_runtime_registry_mirrors",
        {"registry.k8s.io": MIRROR},
        ("plain http", "by tag", "container_runtime_allow_plain_http"),
    ),
    ("container_runtime_registry_mirrors", {"docker.io": "http://mirror.lab:5000/v2-cache"}, ("plain http",)),
    ("container_runtime_allow_plain_http", ["https://mirror.lab"], ("http://",)),
    ("cluster_addons_cilium_chart_repo", CHARTS, ("plain http", "cluster-admin", "cluster_addons_allow_plain_http")),
    ("cluster_addons_cert_manager_chart_repo", CHARTS, ("cluster_addons_allow_plain_http",)),
    ("cluster_addons_linkerd_chart_repo", CHARTS, ("cluster_addons_allow_plain_http",)),
    ("cluster_addons_envoy_gateway_chart_repo", CHARTS, ("cluster_addons_allow_plain_http",)),
    ("cluster_addons_helm_base_url", "http://mirror.lab/helm", ("plain http", "cluster_addons_allow_plain_http")),
    (
        "kubernetes_repo_url",
        "http://mirror.lab/k8s/core:/stable:",
        ("plain http", "older signed index", "kubernetes_allow_plain_http"),
    ),
    (
        "kubernetes_repo_url",
        "https://ops:hunter2@mirror.lab/k8s",
        ("credentials are never inventory values", "/etc/apt/auth.conf.d/"),
    ),
    ("kubernetes_repo_url", "https://token@mirror.lab/k8s", ("credentials are never inventory values",)),
    (
        "cluster_addons_acme_server",
        "https://acme-staging-v02.api.letsencrypt.org/directory",
        ("staging directory", "no browser or client trusts", "cluster_addons_acme_staging"),
    ),
    (
        "cluster_addons_acme_server",
        "https://ACME-STAGING-V02.api.letsencrypt.org:443/directory",
        ("staging directory",),
    ),
    (
        "cluster_addons_tls_dns_names",
        ["llm.example.org"],
        ("outside the zones", "never be issued", "cluster_addons_dns_zones"),
    ),
    ("cluster_addons_tls_dns_names", ["llm.example.com", "notexample.com"], ("notexample.com",)),
    ("cluster_addons_tls_dns_names", ["*.example.net"], ("*.example.net",)),
]

CASES = SECURITY + NETWORK + TRUST


def _id(case: Case) -> str:
    key, value, _ = case
    return f"{key}={value!r}"[:80]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_cluster_mistake_is_refused_naming_the_key_and_what_is_accepted(case: Case) -> None:
    key, value, words = case
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {**BASE, key: value})
    message = str(raised.value)
    assert message.startswith("host r740-01: "), message
    assert key in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# --- each allowance lets exactly its own value through ---------------------------------------------------------------

# (allowance data, the value it lets through, a value beside it still refused, words of that refusal)
Allowance = tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]
KUBELET_OPENINGS: dict[str, dict[str, Any]] = {
    "kubelet-anonymous-auth": {"authentication": {"anonymous": {"enabled": True}}},
    "kubelet-always-allow": {"authorization": {"mode": "AlwaysAllow"}},
    "kubelet-read-only-port": {"readOnlyPort": 10255},
}
ALLOWANCES: list[Allowance] = [
    *(
        (
            {INSECURE: [name]},
            {"kubernetes_kubelet": opening},
            {"kubernetes_kubelet": {**opening, **other}},
            other_name,
        )
        for name, opening in KUBELET_OPENINGS.items()
        for other_name, other in KUBELET_OPENINGS.items()
        if other_name != name
    ),
    (
        {INSECURE: ["apiserver-always-allow"]},
        {"kubernetes_cluster": _always_allow()},
        {"kubernetes_kubelet": {"readOnlyPort": 10255}},
        "kubelet-read-only-port",
    ),
    (
        {INSECURE: ["etcd-plain-http"]},
        {
            "kubernetes_cluster": {
                "etcd": {"local": {"extraArgs": [{"name": "listen-client-urls", "value": "http://127.0.0.1:2379"}]}}
            }
        },
        {"kubernetes_cluster": _always_allow()},
        "apiserver-always-allow",
    ),
    (
        {LOCAL: True},
        {"kubernetes_advertise_address": "127.0.0.1"},
        {"kubernetes_advertise_address": "fe80::1%eth0"},
        "IPv6 zone",
    ),
    (
        {LOCAL: True},
        {"kubernetes_control_plane_endpoint": "169.254.0.10:6443"},
        {"kubernetes_advertise_address": "0.0.0.0"},
        "no one host's address",
    ),
    (
        {"kubernetes_allow_plain_http": ["http://mirror.lab/k8s"]},
        {"kubernetes_repo_url": "http://mirror.lab/k8s"},
        {"kubernetes_repo_url": "http://mirror.lab/k8s2"},
        "kubernetes_allow_plain_http",
    ),
    (
        {"container_runtime_allow_plain_http": [MIRROR]},
        {"container_runtime_registry_mirrors": {"registry.k8s.io": MIRROR}},
        {"container_runtime_registry_mirrors": {"registry.k8s.io": MIRROR, "docker.io": "http://mirror.lab:5001"}},
        "http://mirror.lab:5001 is plain http",
    ),
    (
        {"cluster_addons_allow_plain_http": [CHARTS]},
        {"cluster_addons_cilium_chart_repo": CHARTS, "cluster_addons_linkerd_chart_repo": CHARTS},
        {"cluster_addons_cilium_chart_repo": CHARTS, "cluster_addons_helm_base_url": "http://mirror.lab/helm"},
        "cluster_addons_helm_base_url",
    ),
    (
        {"cluster_addons_acme_staging": True},
        {"cluster_addons_acme_server": "https://acme-staging-v02.api.letsencrypt.org/directory"},
        {"cluster_addons_cilium_chart_repo": CHARTS},
        "cluster_addons_allow_plain_http",
    ),
]


@pytest.mark.parametrize(("allowance", "allowed", "beside", "words"), ALLOWANCES, ids=lambda v: str(v)[:60])
def test_an_allowance_lets_exactly_its_value_through(
    allowance: dict[str, Any], allowed: dict[str, Any], beside: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError):
        stack_config("r740-01", {**BASE, **allowed})
    stack_config("r740-01", {**BASE, **allowance, **allowed})
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {**BASE, **allowance, **beside})
    assert words in str(raised.value), str(raised.value)


def test_an_allowed_opening_is_rendered_as_given() -> None:
    config = stack_config(
        "r740-01", {INSECURE: ["kubelet-read-only-port"], "kubernetes_kubelet": {"readOnlyPort": 10255}}
    )
    kubelet = yaml.safe_load(
        kubelet_configuration_yaml(config.kubernetes, "systemd", "/run/containerd/containerd.sock")
    )
    assert kubelet["readOnlyPort"] == 10255


def test_the_rendered_defaults_open_nothing_and_leave_room_for_nodes() -> None:
    settings = stack_config("r740-01", {}).kubernetes
    kubelet = yaml.safe_load(kubelet_configuration_yaml(settings, "systemd", "/run/containerd/containerd.sock"))
    # kubeadm's secure values, written explicitly: anonymous off, Webhook authorization, readOnlyPort 0.
    assert kubelet["authentication"]["anonymous"] == {"enabled": False}
    assert kubelet["authorization"] == {"mode": "Webhook"} and kubelet["readOnlyPort"] == 0
    cluster = cluster_configuration(settings)
    assert cluster.api_server is None and cluster.etcd is None
    assert settings.node_cidrs == 256  # a /16 at kube-controller-manager's /24


def test_a_lower_node_mask_gives_the_small_pod_subnet_its_room() -> None:
    mask = {"controllerManager": {"extraArgs": [{"name": "node-cidr-mask-size", "value": "26"}]}}
    config = stack_config("r740-01", {"kubernetes_pod_subnet": "10.244.0.0/24", "kubernetes_cluster": mask})
    assert config.kubernetes.node_cidr_mask == 26 and config.kubernetes.node_cidrs == 4


def test_tls_names_inside_the_zones_and_forwarders_off_the_pod_are_accepted() -> None:
    config = stack_config(
        "r740-01",
        {
            "cluster_addons_dns_zones": ["example.com", "lab.example.net"],
            "cluster_addons_tls_dns_names": ["example.com", "llm.example.com", "*.lab.example.net"],
            "cluster_addons_coredns_forward": ["10.0.0.53", "169.254.169.253"],
        },
    )
    assert config.cluster_addons.tls_dns_names == ("example.com", "llm.example.com", "*.lab.example.net")
