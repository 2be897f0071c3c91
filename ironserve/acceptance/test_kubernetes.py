"""Acceptance: roles/kubernetes (catalog areas kubernetes and container_runtime): the pinned, held packages,
kubeadm's typed config, one cgroup driver for the kubelet and containerd, and the node Ready where an API server
answers."""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from ironserve.acceptance.checks import admin_dropins, not_root_only
from ironserve.apt import preferences
from ironserve.kubectl import ADMIN_KUBECONFIG
from roles import StackConfig
from roles.kubernetes import (
    KEYRING,
    KEYRINGS,
    OWNER,
    PIN_PRIORITY,
    PREFERENCES,
    SOURCES_LIST,
    UNATTENDED_BLACKLIST,
    sources_line,
)
from roles.kubernetes.checks import cgroup_driver_problem
from roles.kubernetes.facts import KUBELET_CONF
from roles.kubernetes.models import ClusterConfiguration, InitConfiguration, KubeletConfiguration
from roles.kubernetes.operations import JOIN_DIR
from roles.kubernetes.render import KUBEADM_CONFIG, KUBELET_CONFIG

MODELS: dict[str, type[BaseModel]] = {
    "InitConfiguration": InitConfiguration,
    "ClusterConfiguration": ClusterConfiguration,
    "KubeletConfiguration": KubeletConfiguration,
}


@pytest.fixture(autouse=True)
def _runs_the_role(config: StackConfig) -> None:
    if "kubernetes" not in config.roles:
        pytest.skip("this host does not run the kubernetes role (ironserve_roles)")


@pytest.mark.invariant("k8s-not-k3s")
def test_kubernetes_packages_pinned_and_held(host: Any, config: StackConfig, observe: Any) -> None:
    pins = config.kubernetes.packages()
    versions = {name: host.package(name).version if host.package(name).is_installed else None for name in pins}
    held = host.run("apt-mark showhold").stdout.split()
    observe({"versions": versions, "held": sorted(set(pins) & set(held))})
    assert versions == pins
    assert set(pins) <= set(held)


@pytest.mark.invariant("k8s-not-k3s", "k8s-minimal-stack")
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, observe: Any) -> None:
    # apt installs as root what the source, key and pins name; kubeadm and the kubelet run as root with these configs;
    # whoever may write one of the folders may replace the files in it.
    paths = [KEYRINGS, KEYRING, SOURCES_LIST, PREFERENCES, UNATTENDED_BLACKLIST]
    paths += [posixpath.dirname(KUBEADM_CONFIG), KUBEADM_CONFIG, posixpath.dirname(KUBELET_CONFIG), KUBELET_CONFIG]
    wrong = not_root_only(host, paths)
    observe(wrong or "all root:root, writable by root alone")
    assert wrong == {}


@pytest.mark.invariant("k8s-not-k3s")
def test_apt_would_install_the_pins(host: Any, config: StackConfig, observe: Any) -> None:
    # What apt really uses: the candidate after every preferences file and source, not only ironserve's pin file.
    pins = config.kubernetes.packages()
    policy = host.run("apt-cache policy " + " ".join(pins)).stdout
    candidates = dict.fromkeys(pins)
    name = None
    for line in policy.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            name = line[:-1]
        elif name in candidates and line.strip().startswith("Candidate:"):
            candidates[name] = line.split(":", 1)[1].strip()
    observe(candidates)
    assert candidates == pins
    assert host.file(PREFERENCES).content_string == preferences(pins, PIN_PRIORITY, OWNER)
    assert host.file(SOURCES_LIST).content_string == sources_line(config.kubernetes)


@pytest.mark.invariant("k8s-not-k3s")
def test_kubeadm_is_the_pinned_release(host: Any, config: StackConfig, observe: Any) -> None:
    version = host.run("kubeadm version -o short")
    observe(version.stdout.strip() or version.stderr.strip())
    assert version.succeeded and version.stdout.strip() == f"v{config.kubernetes.version}"


@pytest.mark.invariant("k8s-not-k3s")
def test_kubeadm_config_passes_the_typed_models(host: Any, config: StackConfig, observe: Any) -> None:
    text = host.file(KUBEADM_CONFIG).content_string
    kinds = []
    for document in yaml.safe_load_all(text):
        kinds.append(document.get("kind"))
        try:
            MODELS[document["kind"]].model_validate(document)
        except ValidationError as exc:
            observe(str(exc).splitlines()[:3])
            raise
    observe(kinds)
    assert kinds == ["InitConfiguration", "ClusterConfiguration", "KubeletConfiguration"]
    assert host.file(KUBEADM_CONFIG).mode == 0o600


@pytest.mark.invariant("cri-systemd-cgroup")
def test_kubelet_and_containerd_use_one_cgroup_driver(host: Any, observe: Any) -> None:
    # What both really read: containerd's config as containerd loads it, the kubelet's file its unit names.
    dump = host.run("containerd config dump")
    kubelet = host.file(KUBELET_CONFIG)
    problem = cgroup_driver_problem(dump.stdout, kubelet.content_string if kubelet.exists else "")
    observe(problem or "one driver")
    assert dump.succeeded and kubelet.exists
    assert problem is None


@pytest.mark.invariant("cri-systemd-cgroup")
def test_the_kubelet_reads_the_file_ironserve_renders(host: Any, observe: Any) -> None:
    # In force after every drop-in: the kubelet's ExecStart names the checked file, directly or through the
    # KUBELET_CONFIG_ARGS variable the kubeadm drop-in (10-kubeadm.conf) sets.
    start = host.run("systemctl show kubelet.service -p ExecStart --value").stdout
    environment = host.run("systemctl show kubelet.service -p Environment --value").stdout.split()
    observe({"ExecStart": start.strip()[:160], "Environment": environment})
    flag = f"--config={KUBELET_CONFIG}"
    assert flag in start or ("$KUBELET_CONFIG_ARGS" in start and f"KUBELET_CONFIG_ARGS={flag}" in environment)


@pytest.mark.invariant("k8s-not-k3s")
def test_kubelet_enabled_and_running(host: Any, observe: Any) -> None:
    kubelet = host.service("kubelet")
    dropins = admin_dropins(host, "kubelet.service")  # kubeadm's own 10-kubeadm.conf is under /usr/lib
    observe({"enabled": kubelet.is_enabled, "running": kubelet.is_running, "admin drop-ins": dropins})
    assert kubelet.is_enabled and kubelet.is_running
    assert dropins == []


@pytest.mark.invariant("k8s-not-k3s")
def test_the_node_is_in_a_cluster_and_no_join_token_is_left(host: Any, config: StackConfig, observe: Any) -> None:
    joined = host.file(KUBELET_CONF).exists
    leftover = host.file(JOIN_DIR).exists
    observe({"kubelet.conf": joined, "join folder left": leftover})
    assert joined and not leftover
    if config.kubernetes.role == "control-plane":  # init and a control plane's join both write it
        assert host.file(ADMIN_KUBECONFIG).exists


def this_node(host: Any, config: StackConfig) -> dict[str, Any] | None:
    """This host's Node object, read with its own credentials (the admin's on a control plane, else the kubelet's:
    NodeRestriction lets a node read itself); None when it is not registered; skips where no API server answers."""
    kubeconfig = ADMIN_KUBECONFIG if host.file(ADMIN_KUBECONFIG).exists else KUBELET_CONF
    ready = host.run(f"kubectl --kubeconfig {kubeconfig} --request-timeout=10s get --raw=/readyz")
    if not ready.succeeded:
        pytest.skip(f"no API server answers through {kubeconfig}: {(ready.stderr or ready.stdout).strip()[:200]}")
    name = config.kubernetes.node_name or host.run("hostname").stdout.strip()
    node = host.run(f"kubectl --kubeconfig {kubeconfig} get node {shlex.quote(name)} -o json")
    return json.loads(node.stdout) if node.succeeded else None


@pytest.mark.invariant("k8s-not-k3s")
def test_the_node_is_ready_where_an_api_server_answers(host: Any, config: StackConfig, observe: Any) -> None:
    node = this_node(host, config)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]} if node else {}
    observe(conditions)
    assert conditions.get("Ready") == "True"


@pytest.mark.invariant("k8s-nvidia-device-plugin")
def test_the_node_offers_its_gpus_to_pods_where_an_api_server_answers(
    host: Any, config: StackConfig, observe: Any
) -> None:
    # The device plugin registers nvidia.com/gpu with the kubelet; every GPU the profile installs is allocatable.
    hardware = config.profile.hardware
    if hardware is None or hardware.gpus_installed == 0:
        pytest.skip(f"profile {config.profile.name} states no GPUs for this host")
    node = this_node(host, config)
    allocatable = node["status"].get("allocatable", {}).get("nvidia.com/gpu") if node else None
    observe(allocatable)
    assert allocatable == str(hardware.gpus_installed)
