"""roles/kubernetes: the typed kubeadm/kubelet documents, the cgroup-driver check, the cluster layout refused at
inventory load, and the join's handling of its bootstrap token."""

from __future__ import annotations

import inspect
import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from ironserve.config import ConfigError
from ironserve.inventory import InventoryHost, validate_inventory
from roles import REGISTRY, check_deployable, stack_config
from roles.container_runtime.render import render_config
from roles.kubernetes import kubernetes_traffic, models, repository_url, sources_line
from roles.kubernetes.checks import cgroup_driver_problem
from roles.kubernetes.operations import JOIN_DIR, JOIN_FILE, _join
from roles.kubernetes.render import (
    join_configuration,
    kubeadm_config_yaml,
    kubelet_configuration_yaml,
)
from roles.kubernetes.settings import KubernetesSettings

FACTS = Path(__file__).parents[1] / "facts"
# /var/lib/kubelet/config.yaml as a real kubeadm (1.29/1.30) wrote it for kubeadm's default networking; where it is
# from (provenance incomplete: a blog post's `cat`, repository unknown) is in the .source note beside it.
KUBEADM_KUBELET_CAPTURE = Path(__file__).parents[1] / "data" / "realworld" / "kubernetes"
KUBEADM_KUBELET_CAPTURE /= "kubelet-config-kubeadm-1.29-node-madness-blog.txt"
UPSTREAM = yaml.safe_load((Path(__file__).parent / "samples" / "kubernetes-upstream-fields.yaml").read_text())
SOCKET = "/run/containerd/containerd.sock"
TOKEN = "abcdef.0123456789abcdef"
CA_HASH = "sha256:" + "ab" * 32


def settings(**data: Any) -> KubernetesSettings:
    return KubernetesSettings.model_validate(data)


def documents(text: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


# --- the documents ---------------------------------------------------------------------------------------------


def test_kubeadm_config_has_the_three_documents_kubeadm_init_reads() -> None:
    docs = documents(kubeadm_config_yaml(settings(kubernetes_advertise_address="192.0.2.10"), "systemd", SOCKET))
    assert set(docs) == {"InitConfiguration", "ClusterConfiguration", "KubeletConfiguration"}
    assert docs["InitConfiguration"]["apiVersion"] == "kubeadm.k8s.io/v1beta4"
    assert docs["InitConfiguration"]["nodeRegistration"] == {"criSocket": f"unix://{SOCKET}"}
    assert docs["InitConfiguration"]["localAPIEndpoint"] == {"advertiseAddress": "192.0.2.10", "bindPort": 6443}
    assert docs["InitConfiguration"]["skipPhases"] == ["addon/kube-proxy"]
    assert docs["ClusterConfiguration"]["kubernetesVersion"] == "v1.31.4"
    assert docs["ClusterConfiguration"]["networking"] == {
        "podSubnet": "10.244.0.0/16",
        "serviceSubnet": "10.96.0.0/12",
        "dnsDomain": "cluster.local",
    }
    assert docs["KubeletConfiguration"]["cgroupDriver"] == "systemd"
    assert docs["KubeletConfiguration"]["containerRuntimeEndpoint"] == f"unix://{SOCKET}"


def test_kube_proxy_kept_when_asked_and_the_site_fields_are_merged() -> None:
    site = settings(
        kubernetes_kube_proxy=True,
        kubernetes_control_plane_endpoint="k8s-api.example",
        kubernetes_kubelet={"maxPods": 64, "systemReserved": {"cpu": "2"}},
        kubernetes_cluster={"apiServer": {"certSANs": ["k8s-api.example"]}},
    )
    docs = documents(kubeadm_config_yaml(site, "systemd", SOCKET))
    assert "skipPhases" not in docs["InitConfiguration"]
    assert docs["ClusterConfiguration"]["controlPlaneEndpoint"] == "k8s-api.example:6443"
    assert docs["ClusterConfiguration"]["apiServer"] == {"certSANs": ["k8s-api.example"]}
    assert docs["KubeletConfiguration"]["maxPods"] == 64
    assert docs["KubeletConfiguration"]["systemReserved"] == {"cpu": "2"}


def test_every_rendered_document_passes_its_model_again() -> None:
    text = kubeadm_config_yaml(settings(kubernetes_kubelet={"maxPods": 64}), "systemd", SOCKET)
    by_kind = {"InitConfiguration": models.InitConfiguration, "ClusterConfiguration": models.ClusterConfiguration}
    by_kind["KubeletConfiguration"] = models.KubeletConfiguration  # type: ignore[assignment]
    for kind, document in documents(text).items():
        assert by_kind[kind].model_validate(document).document() == document


# --- /var/lib/kubelet/config.yaml: kubeadm's file, the site's fields on top -----------------------------------------

# The fields kubeadm's (*kubeletConfig).Default sets (kubernetes/kubernetes cmd/kubeadm/app/componentconfigs/kubelet.go,
# commit 046d201c45cebd19eb1fc4612426761c64802825), by their path in the file. resolvConf is set only where
# systemd-resolved runs on the node (as on the captured Ubuntu host): a host fact, set by a site in kubernetes_kubelet.
KUBEADM_SETS = (
    "authentication.anonymous.enabled",
    "authentication.webhook.enabled",
    "authentication.x509.clientCAFile",
    "authorization.mode",
    "cgroupDriver",
    "clusterDNS",
    "clusterDomain",
    "healthzBindAddress",
    "healthzPort",
    "rotateCertificates",
    "staticPodPath",
)
HOST_DEPENDENT = ("resolvConf",)
# Go's zero values that kubeadm's marshaller prints for unset non-pointer fields; the kubelet defaults them itself.
GO_ZERO_VALUES = ("0s", 0, "0", "", {})
CLIENT_CA = "/etc/kubernetes/pki/ca.crt"


def leaves(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Each leaf of a YAML mapping by its dotted path (an empty mapping is a leaf)."""
    found: dict[str, Any] = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found.update(leaves(value, f"{path}."))
        else:
            found[path] = value
    return found


def rendered_kubelet_file(**data: Any) -> dict[str, Any]:
    return yaml.safe_load(kubelet_configuration_yaml(settings(**data), "systemd", SOCKET))


def test_the_capture_holds_no_field_kubeadm_sets_that_the_list_misses() -> None:
    capture = leaves(yaml.safe_load(KUBEADM_KUBELET_CAPTURE.read_text()))
    meaningful = {path for path, value in capture.items() if isinstance(value, bool) or value not in GO_ZERO_VALUES}
    assert meaningful - {"apiVersion", "kind"} == set(KUBEADM_SETS) | set(HOST_DEPENDENT)


def test_the_kubelet_file_carries_every_field_kubeadm_writes_for_the_same_settings() -> None:
    """The capture's cluster is on kubeadm's defaults (10.96.0.0/12, cluster.local, /etc/kubernetes/pki): so is
    settings() here. Every field kubeadm set there has the same value in ironserve's file."""
    capture = leaves(yaml.safe_load(KUBEADM_KUBELET_CAPTURE.read_text()))
    rendered = leaves(rendered_kubelet_file())
    assert {path: rendered.get(path) for path in KUBEADM_SETS} == {path: capture[path] for path in KUBEADM_SETS}
    assert rendered["apiVersion"] == capture["apiVersion"] and rendered["kind"] == capture["kind"]
    assert "resolvConf" not in rendered  # the kubelet's /etc/resolv.conf, unless the site names systemd-resolved's
    site = leaves(rendered_kubelet_file(kubernetes_kubelet={"resolvConf": "/run/systemd/resolve/resolv.conf"}))
    assert site["resolvConf"] == capture["resolvConf"]


def test_the_kubeadm_config_and_the_kubelet_file_hold_the_same_kubelet_configuration() -> None:
    site = settings(kubernetes_kubelet={"maxPods": 64}, kubernetes_service_subnet="10.112.0.0/12")
    in_kubeadm_config = documents(kubeadm_config_yaml(site, "systemd", SOCKET))["KubeletConfiguration"]
    assert in_kubeadm_config == yaml.safe_load(kubelet_configuration_yaml(site, "systemd", SOCKET))


@pytest.mark.parametrize(
    ("data", "dns", "domain", "client_ca"),
    [
        ({}, "10.96.0.10", "cluster.local", CLIENT_CA),
        (
            {"kubernetes_service_subnet": "172.20.0.0/16", "kubernetes_dns_domain": "gpu.example"},
            "172.20.0.10",
            "gpu.example",
            CLIENT_CA,
        ),
        ({"kubernetes_service_subnet": "fd00:10:96::/112"}, "fd00:10:96::a", "cluster.local", CLIENT_CA),
        ({"kubernetes_cluster": {"certificatesDir": "/srv/pki"}}, "10.96.0.10", "cluster.local", "/srv/pki/ca.crt"),
    ],
)
def test_kubeadms_values_follow_the_clusters_settings(
    data: dict[str, Any], dns: str, domain: str, client_ca: str
) -> None:
    """clusterDNS is the service subnet's 10th address (kubeadm's constants.GetDNSIP), clusterDomain the DNS domain,
    clientCAFile the CA in ClusterConfiguration certificatesDir."""
    file = rendered_kubelet_file(**data)
    assert file["clusterDNS"] == [dns]
    assert file["clusterDomain"] == domain
    assert file["authentication"]["x509"]["clientCAFile"] == client_ca


@pytest.mark.parametrize("role", ["control-plane", "worker"])
def test_a_node_keeps_kubeadms_static_pod_path(role: str) -> None:
    """A control plane's API server, etcd, scheduler and controller manager are static pods in
    /etc/kubernetes/manifests: the file the role writes after `kubeadm init` must keep the kubelet watching it."""
    data: dict[str, Any] = {"kubernetes_role": role, "kubernetes_kubelet": {"maxPods": 64}}
    assert rendered_kubelet_file(**data)["staticPodPath"] == "/etc/kubernetes/manifests"


def test_the_sites_kubelet_fields_win_and_nested_defaults_stay() -> None:
    file = rendered_kubelet_file(
        kubernetes_kubelet={
            "staticPodPath": "/srv/manifests",
            "clusterDNS": ["169.254.25.10"],
            "authentication": {"webhook": {"cacheTTL": "30s"}},
            "rotateCertificates": False,
            "maxPods": 64,
        }
    )
    assert file["staticPodPath"] == "/srv/manifests"
    assert file["clusterDNS"] == ["169.254.25.10"]
    assert file["rotateCertificates"] is False
    assert file["maxPods"] == 64
    assert file["authentication"] == {
        "x509": {"clientCAFile": "/etc/kubernetes/pki/ca.crt"},
        "webhook": {"enabled": True, "cacheTTL": "30s"},
        "anonymous": {"enabled": False},
    }


def test_the_kubelet_file_keeps_the_secure_values() -> None:
    file = rendered_kubelet_file()
    assert file["authentication"]["anonymous"] == {"enabled": False}
    assert file["authentication"]["webhook"]["enabled"] is True
    assert file["authorization"] == {"mode": "Webhook"}
    assert file["readOnlyPort"] == 0
    opened = rendered_kubelet_file(
        kubernetes_allow_insecure=["kubelet-read-only-port"], kubernetes_kubelet={"readOnlyPort": 10255}
    )
    assert opened["readOnlyPort"] == 10255 and opened["authorization"] == {"mode": "Webhook"}


def test_the_join_configuration_carries_the_token_and_the_ca_hash() -> None:
    worker = documents(join_configuration(settings(), SOCKET, "192.0.2.10:6443", TOKEN, CA_HASH))
    discovery = worker["JoinConfiguration"]["discovery"]["bootstrapToken"]
    assert discovery == {"apiServerEndpoint": "192.0.2.10:6443", "token": TOKEN, "caCertHashes": [CA_HASH]}
    assert "controlPlane" not in worker["JoinConfiguration"]
    plane = documents(join_configuration(settings(), SOCKET, "k8s:6443", TOKEN, CA_HASH, "0f" * 32))
    assert plane["JoinConfiguration"]["controlPlane"] == {
        "localAPIEndpoint": {"bindPort": 6443},
        "certificateKey": "0f" * 32,
    }


def test_a_malformed_token_never_reaches_a_file() -> None:
    with pytest.raises(ValueError, match="token"):
        join_configuration(settings(), SOCKET, "k8s:6443", "not-a-token", CA_HASH)


def test_the_repository_is_pkgs_k8s_io_per_minor_layout() -> None:
    site = settings(kubernetes_version="1.32.1", kubernetes_repo_url="https://mirror.example/k8s/core:/stable:")
    assert repository_url(site) == "https://mirror.example/k8s/core:/stable:/v1.32/deb/"
    keyring = "/etc/apt/keyrings/kubernetes-apt-keyring.gpg"
    assert sources_line(site) == f"deb [signed-by={keyring}] https://mirror.example/k8s/core:/stable:/v1.32/deb/ /\n"
    assert settings().packages() == {
        "kubeadm": "1.31.4-1.1",
        "kubelet": "1.31.4-1.1",
        "kubectl": "1.31.4-1.1",
        "cri-tools": "1.31.1-1.1",
        "kubernetes-cni": "1.5.1-1.1",
    }


# --- field names checked against upstream ---------------------------------------------------------------------


def _modelled() -> list[type[models.KubeModel]]:
    return [
        cls
        for _, cls in inspect.getmembers(models, inspect.isclass)
        if issubclass(cls, models.KubeModel) and cls is not models.KubeModel
    ]


@pytest.mark.parametrize("model", _modelled(), ids=lambda m: m.__name__)
def test_every_field_name_is_upstreams(model: type[BaseModel]) -> None:
    group = "kubelet.config.k8s.io/v1beta1" if model.__name__.startswith("Kubelet") else "kubeadm.k8s.io/v1beta4"
    section = UPSTREAM[group]
    upstream = set(section["types"][model.__name__]["fields"]) | set(
        section.get("added_after", {}).get(model.__name__, [])
    )
    names = {field.alias or name for name, field in model.model_fields.items()}
    assert names - upstream == set(), (
        f"{model.__name__} has fields upstream's {section['types'][model.__name__]['upstream']} lacks"
    )


# --- the cgroup driver, one source of truth ------------------------------------------------------------------------


def _containerd(**data: Any) -> str:
    return render_config(stack_config("r740-01", data).container_runtime)


def test_containerd_and_the_kubelet_ironserve_renders_agree() -> None:
    kubelet = kubelet_configuration_yaml(settings(), "systemd", SOCKET)
    assert cgroup_driver_problem(_containerd(), kubelet) is None


@pytest.mark.parametrize(
    ("kubelet", "words"),
    [
        (
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: cgroupfs\n",
            "is cgroupfs",
        ),
        ("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n", "is cgroupfs"),  # kubelet's default
        ("kind: KubeletConfiguration\ncgroupDriver: [systemd\n", "not YAML"),
    ],
)
def test_a_kubelet_on_another_driver_is_caught(kubelet: str, words: str) -> None:
    problem = cgroup_driver_problem(_containerd(), kubelet)
    assert problem is not None and words in problem


def test_a_containerd_runtime_on_cgroupfs_is_caught_by_name() -> None:
    drifted = _containerd().replace("SystemdCgroup = true", "SystemdCgroup = false", 1)
    problem = cgroup_driver_problem(drifted, kubelet_configuration_yaml(settings(), "systemd", SOCKET))
    assert problem is not None and "runc uses cgroupfs" in problem and "nvidia" not in problem


def test_debian_containerds_own_dump_agrees_with_the_kubelet_ironserve_renders() -> None:
    # `containerd config dump` of Debian's containerd 1.6.20 with ironserve's config.toml, captured on a lab host.
    case = FACTS / "roles.kubernetes.facts.ContainerdConfigInForce" / "debian-containerd-1.6.20.json"
    dump = "\n".join(json.loads(case.read_text())["output"]) + "\n"
    kubelet = kubelet_configuration_yaml(settings(), "systemd", SOCKET)
    assert cgroup_driver_problem(dump, kubelet) is None
    assert "is cgroupfs" in (cgroup_driver_problem(dump, kubelet.replace("systemd", "cgroupfs")) or "")


def test_the_config_of_a_daemon_started_with_another_file_is_the_one_checked() -> None:
    # Captured on a lab host whose containerd a drop-in started with --config other.toml (runc on cgroupfs).
    case = FACTS / "roles.kubernetes.facts.ContainerdConfigInForce" / "started-with-another-config.json"
    dump = "\n".join(json.loads(case.read_text())["output"]) + "\n"
    problem = cgroup_driver_problem(dump, kubelet_configuration_yaml(settings(), "systemd", SOCKET))
    assert problem is not None and "runc uses cgroupfs" in problem


def test_a_kubelet_cgroup_driver_that_is_not_containerds_is_refused_at_load() -> None:
    config = stack_config(
        "r740-01",
        {"ironserve_roles": ["container_runtime", "kubernetes"], "kubernetes_repo_key": __file__,
         "kubernetes_kubelet": {"cgroupDriver": "cgroupfs"}},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="cgroupDriver cgroupfs is not containerd's systemd"):
        check_deployable(config)


def test_the_repository_key_is_required_when_the_role_runs() -> None:
    config = stack_config("r740-01", {"ironserve_roles": ["kubernetes"]})
    with pytest.raises(ConfigError, match="kubernetes_repo_key must be set"):
        check_deployable(config)


def test_the_role_is_opt_in() -> None:
    assert "kubernetes" not in stack_config("r740-01", {}).roles
    assert "kubernetes" in REGISTRY.names


# --- the cluster's layout, refused at inventory load ----------------------------------------------------------------


def _layout(*hosts: tuple[str, dict[str, Any]]) -> list[str]:
    base = {"ironserve_roles": ["container_runtime", "kubernetes"], "kubernetes_repo_key": __file__}
    entries = [InventoryHost(name=name, groups=(), data={**base, **data}) for name, data in hosts]
    return validate_inventory(entries, REGISTRY)[1]


def test_a_control_plane_and_workers_form_a_cluster() -> None:
    assert (
        _layout(
            ("cp", {"kubernetes_advertise_address": "192.0.2.10"}),
            ("w1", {"kubernetes_role": "worker"}),
            ("w2", {"kubernetes_role": "worker"}),
        )
        == []
    )


@pytest.mark.parametrize(
    ("hosts", "words"),
    [
        ((("w1", {"kubernetes_role": "worker"}),), "no host of the inventory is a control plane"),
        (
            (("cp1", {"kubernetes_advertise_address": "192.0.2.10"}), ("cp2", {})),
            "2 control planes (cp1, cp2) need one kubernetes_control_plane_endpoint",
        ),
        ((("cp", {}), ("w1", {"kubernetes_role": "worker"})), "neither kubernetes_control_plane_endpoint nor"),
        (
            (
                ("cp", {"kubernetes_control_plane_endpoint": "k8s-a.example"}),
                ("w1", {"kubernetes_role": "worker", "kubernetes_control_plane_endpoint": "k8s-b.example"}),
            ),
            "host w1: kubernetes_control_plane_endpoint differs",
        ),
        (
            # /23 at the default /24 node mask: room for two nodes, the inventory has three.
            (
                ("cp", {"kubernetes_advertise_address": "192.0.2.10", "kubernetes_pod_subnet": "10.244.0.0/23"}),
                ("w1", {"kubernetes_role": "worker", "kubernetes_pod_subnet": "10.244.0.0/23"}),
                ("w2", {"kubernetes_role": "worker", "kubernetes_pod_subnet": "10.244.0.0/23"}),
            ),
            "has room for 2 nodes at the node CIDR mask /24, the inventory's cluster has 3",
        ),
        (
            (
                ("cp", {"kubernetes_advertise_address": "192.0.2.10"}),
                ("w1", {"kubernetes_role": "worker", "ssh_hostname": "10.96.0.20"}),
            ),
            "host cp: kubernetes_service_subnet: 10.96.0.0/12 contains 10.96.0.20, host w1's ssh_hostname",
        ),
    ],
)
def test_an_impossible_layout_is_refused(hosts: tuple[tuple[str, dict[str, Any]], ...], words: str) -> None:
    problems = _layout(*hosts)
    assert any(words in p for p in problems), problems


def test_hosts_without_the_role_are_not_part_of_the_cluster() -> None:
    data = {"ironserve_roles": ["container_runtime"], "kubernetes_role": "worker"}
    hosts = [InventoryHost(name="w1", groups=(), data=data)]
    assert validate_inventory(hosts, REGISTRY)[1] == []


# --- the join: a token from the first control plane, never on a command line or left on disk ----------------


class Output:
    def __init__(self, stdout: str = "", stderr: str = "") -> None:
        self.stdout_lines = stdout.splitlines()
        self.stderr_lines = stderr.splitlines()


class Shell:
    """A host that answers commands from a table and records them (the lab test runs the real thing)."""

    def __init__(self, name: str, answers: dict[str, tuple[bool, str]]) -> None:
        self.name, self.answers, self.commands, self.files = name, answers, [], {}

    def run_shell_command(self, command: Any, **_: Any) -> tuple[bool, Output]:
        text = command if isinstance(command, str) else command.get_raw_value()
        self.commands.append(text)
        for prefix, (ok, out) in self.answers.items():
            if text.startswith(prefix):
                return ok, Output(out if ok else "", "" if ok else out)
        return True, Output()

    def put_file(self, data: Any, path: str, **_: Any) -> bool:
        self.files[path] = data.read().decode()
        return True


class Inventory:
    def __init__(self, *hosts: Shell) -> None:
        self.hosts = {h.name: h for h in hosts}

    def get_host(self, name: str, default: Any = None) -> Any:
        return self.hosts.get(name, default)


class Run:
    def __init__(self, *hosts: Shell) -> None:
        self.inventory = Inventory(*hosts)
        self.activated_hosts = set(hosts)
        self.failed_hosts: set[Shell] = set()


def _plane() -> Shell:
    return Shell("cp", {"kubeadm token create": (True, TOKEN + "\n"), "openssl x509": (True, "ab" * 32 + "  -\n")})


@pytest.mark.parametrize("join_works", [True, False])
def test_the_token_travels_only_in_the_uploaded_file_which_is_removed(join_works: bool) -> None:
    plane = _plane()
    worker = Shell("w1", {"kubeadm join": (join_works, f"error: token {TOKEN} rejected")})
    run: Any = Run(plane, worker)
    if join_works:
        assert _join(run, worker, settings(), SOCKET, "cp", "192.0.2.10:6443", False) is True
    else:
        masked = r"'kubeadm join --config \S+' failed on w1: error: token \*\*\* rejected"
        with pytest.raises(Exception, match=masked) as raised:
            _join(run, worker, settings(), SOCKET, "cp", "192.0.2.10:6443", False)
        assert TOKEN not in str(raised.value) and "0123456789abcdef" not in str(raised.value)
    assert TOKEN in worker.files[JOIN_FILE]
    assert not any(TOKEN in c or "0123456789abcdef" in c for c in plane.commands + worker.commands)
    assert worker.commands[0].startswith(f"rm -rf {JOIN_DIR} && install -d -m 700")
    assert worker.commands[-1] == f"rm -rf {JOIN_DIR}"


def test_a_join_without_its_control_plane_in_the_run_says_so() -> None:
    worker = Shell("w1", {})
    run: Any = Run(worker)
    with pytest.raises(Exception, match="first control plane cp is not part of this run"):
        _join(run, worker, settings(), SOCKET, "cp", "192.0.2.10:6443", False)


# --- `ironserve rollout` on a node (the commands run against the real 1.20 API server in
# tests/lab/test_inference_kubernetes_api.py) -------------------------------------------------------------------


def fleet_of(**roles: str) -> dict[str, Any]:
    """{host: config} with the kubernetes role as `host=role` says, in that order."""
    return {
        name: stack_config(name, {"ironserve_roles": ["kubernetes"], "kubernetes_role": role})
        for name, role in roles.items()
    }


def test_a_node_is_drained_from_a_control_plane_and_a_control_plane_from_another() -> None:
    fleet = fleet_of(cp1="control-plane", cp2="control-plane", gpu1="worker")
    assert kubernetes_traffic("gpu1", fleet, None).via == "cp1"
    assert kubernetes_traffic("cp1", fleet, None).via == "cp2"
    assert kubernetes_traffic("cp2", fleet, None).via == "cp1"
    # The only control plane drains itself (its API server keeps running while it is cordoned).
    assert kubernetes_traffic("cp1", fleet_of(cp1="control-plane", gpu1="worker"), None).via == "cp1"


def test_the_drain_is_bounded_by_the_rollout_else_by_the_setting() -> None:
    fleet = fleet_of(cp1="control-plane", gpu1="worker")
    assert "--timeout=360s" in kubernetes_traffic("gpu1", fleet, None).drain  # Kubespray's drain_timeout
    assert "--timeout=30s" in kubernetes_traffic("gpu1", fleet, 30.0).drain
    fleet["gpu1"] = stack_config("gpu1", {"ironserve_roles": ["kubernetes"], "kubernetes_drain_timeout_s": 90})
    assert "--timeout=90s" in kubernetes_traffic("gpu1", fleet, None).drain
    with pytest.raises(ConfigError, match="kubernetes_drain_timeout_s"):
        stack_config("gpu1", {"ironserve_roles": ["kubernetes"], "kubernetes_drain_timeout_s": 0})


def test_the_node_is_the_settings_name_else_the_inventory_name_each_one_shell_word() -> None:
    fleet = fleet_of(cp1="control-plane", gpu1="worker")
    control = kubernetes_traffic("gpu1", fleet, None)
    words = shlex.split(control.drain.split("; out=$(", 1)[1])
    assert words[:6] == [
        "kubectl",
        "--kubeconfig",
        "/etc/kubernetes/admin.conf",
        "drain",
        "gpu1",
        "--ignore-daemonsets",
    ]
    fleet["gpu1"] = stack_config("gpu1", {"ironserve_roles": ["kubernetes"], "kubernetes_node_name": "gpu-01.rack-3"})
    control = kubernetes_traffic("gpu1", fleet, None)
    assert shlex.split(control.restore.split("exit 1; }; ", 1)[1]) == [
        "kubectl", "--kubeconfig", "/etc/kubernetes/admin.conf", "uncordon", "gpu-01.rack-3"
    ]  # fmt: skip
    for command in (control.drain, control.hold, control.restore, control.describe):
        assert command.startswith("err=$(kubectl --kubeconfig /etc/kubernetes/admin.conf get node gpu-01.rack-3 ")
        assert subprocess.run(["bash", "-n", "-c", command], check=False).returncode == 0
