"""`inference_mode: kubernetes` without a cluster: the service's objects from the same settings as the systemd
mode, strict validation at the pinned Kubernetes version (kubernetes-validate), planted mistakes, and the
mode's inventory rules, all refused before any host is contacted. The lab's real API server acts on the same
objects in tests/lab/test_inference_kubernetes_api.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from ironserve_service.kube_objects import (
    CONTAINER,
    GPU_RESOURCE,
    SCALER_ACCOUNT,
    SERVICE,
    deployment_name,
    pod_settings,
)

from ironserve import manifests
from ironserve.config import ConfigError
from ironserve_lab.inference import model_versions
from roles import REGISTRY, check_deployable, stack_config
from roles.inference.render_kubernetes import host_settings, kubernetes_problems, pod_policy_problems, service_objects

IMAGE = "registry.example.org/ironserve/engine@sha256:" + "ab" * 32
PODS = {"image": IMAGE}
KUBERNETES_MODE: dict[str, Any] = {
    "ironserve_roles": ["security", "container_runtime", "kubernetes", "inference"],
    "kubernetes_repo_key": __file__,  # any readable file: the key's content is not what these tests are about
    "inference_mode": "kubernetes",
    "security_uid": 990,
    "security_gid": 991,
    "inference_model_source": str(model_versions()["lab-v1"]),
    "inference_service": {"kubernetes": PODS, "scaler": {"prometheus_url": "http://prometheus.monitoring.svc:9090"}},
}


def config(**data: Any) -> Any:
    return stack_config("h", {**KUBERNETES_MODE, **data})


def by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    return by_name(service_objects(config()))


def test_every_object_passes_strict_validation_at_the_pinned_minor() -> None:
    built = config()
    assert built.kubernetes.version.startswith("1.31.")
    assert kubernetes_problems(built) == []


@pytest.mark.invariant("k8s-ai-service-objects")
def test_the_objects_are_the_catalogs_names(objects: dict[str, dict[str, Any]]) -> None:
    assert {o["metadata"].get("namespace", o["metadata"]["name"]) for o in objects.values()} == {"ai"}
    assert f"Service/{SERVICE}" in objects and SERVICE == "ai-service"
    for colour in ("blue", "green"):
        assert [c["name"] for c in pod_spec(objects[f"Deployment/{deployment_name(colour)}"])["containers"]] == [
            CONTAINER
        ]


@pytest.mark.invariant("k8s-pod-memory-limit")
def test_memory_is_24gi_with_requests_equal_to_limits(objects: dict[str, dict[str, Any]]) -> None:
    resources = pod_spec(objects["Deployment/ai-service-blue"])["containers"][0]["resources"]
    assert resources["limits"]["memory"] == "24Gi"
    assert resources["requests"] == resources["limits"]


def test_gpus_per_pod_are_the_profiles_serving_gpus(objects: dict[str, dict[str, Any]]) -> None:
    hardware = config().profile.hardware
    assert hardware is not None and hardware.serving_gpus == 2
    limits = pod_spec(objects["Deployment/ai-service-blue"])["containers"][0]["resources"]["limits"]
    assert limits[GPU_RESOURCE] == "2"
    assert pod_spec(objects["Deployment/ai-service-blue"])["runtimeClassName"] == "nvidia"


def test_pods_run_as_the_service_account_under_ironserves_seccomp_profile(
    objects: dict[str, dict[str, Any]],
) -> None:
    spec = pod_spec(objects["Deployment/ai-service-green"])
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 990,
        "runAsGroup": 991,
        # roles/security installs it at /var/lib/kubelet/seccomp/profiles/ai-service.json.
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/ai-service.json"},
    }
    capabilities = spec["containers"][0]["securityContext"]["capabilities"]
    assert capabilities == {"drop": ["ALL"], "add": ["SYS_NICE"]}


def test_the_model_is_the_nodes_sealed_version_read_only(objects: dict[str, dict[str, Any]]) -> None:
    built = config()
    version_dir = f"{host_settings(built).swap.models_root}/{built.inference.version()}"
    spec = pod_spec(objects["Deployment/ai-service-blue"])
    assert {"name": "model", "hostPath": {"path": version_dir, "type": "Directory"}} in spec["volumes"]
    assert {"name": "model", "mountPath": version_dir, "readOnly": True} in spec["containers"][0]["volumeMounts"]


def test_the_pod_config_is_the_systemd_modes_settings_with_the_colours_port() -> None:
    """One source of truth: the ConfigMap's service.yaml is service.yaml's settings, moved only where a pod
    differs (the version's directory, the colour's port, the pod's address)."""
    built = config()
    settings = host_settings(built)
    objects = by_name(service_objects(built))
    pod_config = yaml.safe_load(objects["ConfigMap/ai-service-green-config"]["data"]["service.yaml"])
    expected = pod_settings(settings, "green", built.inference.version()).model_dump(mode="json")
    assert pod_config == expected
    assert pod_config["engine"]["port"] == settings.swap.green_port
    assert pod_config["readiness"] == settings.readiness.model_dump(mode="json")
    container = pod_spec(objects["Deployment/ai-service-green"])["containers"][0]
    assert container["ports"] == [{"name": "http", "containerPort": settings.swap.green_port, "protocol": "TCP"}]
    probe = ["-m", "ironserve_service", "probe", "ready", "--config", "/etc/ironserve/service.yaml"]
    assert container["readinessProbe"]["exec"]["command"] == [str(settings.engine.engine_python), *probe]


def test_the_first_colour_serves_and_the_other_is_scaled_to_zero(objects: dict[str, dict[str, Any]]) -> None:
    assert objects["Deployment/ai-service-blue"]["spec"]["replicas"] == 1
    assert objects["Deployment/ai-service-green"]["spec"]["replicas"] == 0


def test_the_service_has_no_selector_until_the_swap_sets_one(objects: dict[str, dict[str, Any]]) -> None:
    assert "selector" not in objects["Service/ai-service"]["spec"]


def test_the_scalers_role_allows_only_the_scale_subresource(objects: dict[str, dict[str, Any]]) -> None:
    assert objects[f"Role/{SCALER_ACCOUNT}"]["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["ai-service-blue", "ai-service-green"],
            "verbs": ["get", "patch"],
        }
    ]


def test_namespace_ai_gets_linkerds_proxy(objects: dict[str, dict[str, Any]]) -> None:
    assert objects["Namespace/ai"]["metadata"]["annotations"] == {"linkerd.io/inject": "enabled"}


# --- planted mistakes: each must fail ---------------------------------------------------------------------


def _planted(change: Any) -> list[str]:
    objects = copy.deepcopy(service_objects(config()))
    change(by_name(objects))
    found = manifests.problems(objects, "1.31.4")
    return found + [problem for obj in objects for problem in pod_policy_problems(obj)]


def _blue(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return pod_spec(objects["Deployment/ai-service-blue"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: _blue(o)["containers"][0].update(resourcez={}), "'resourcez' was unexpected"),
        (lambda o: o["Deployment/ai-service-blue"]["spec"].update(replicas="1"), "is not of type 'integer'"),
        (lambda o: _blue(o)["securityContext"]["seccompProfile"].pop("localhostProfile"), "localhostProfile"),
        (
            lambda o: _blue(o)["containers"][0]["resources"]["requests"].update({GPU_RESOURCE: "1"}),
            "requests must equal limits",
        ),
        (lambda o: _blue(o)["securityContext"].update(runAsNonRoot=False), "non-root"),
        (lambda o: o["Service/ai-service"]["spec"].update(tpye="ClusterIP"), "'tpye' was unexpected"),
        (lambda o: o["Role/ai-scaler"].update(apiVersion="rbac.authorization.k8s.io/v1alpha9"), "has no kind Role"),
    ],
    ids=[
        "misspelt-field",
        "wrong-type",
        "seccomp-without-profile",
        "gpu-requests-not-limits",
        "root",
        "service-typo",
        "unknown-api-version",
    ],
)
def test_a_planted_mistake_fails(change: Any, message: str) -> None:
    found = _planted(change)
    assert any(message in problem for problem in found), found


# --- the mode's inventory rules ---------------------------------------------------------------------------


def test_kubernetes_mode_needs_the_kubernetes_role_on_the_host() -> None:
    with pytest.raises(ConfigError, match="needs the kubernetes role on this host"):
        check_deployable(config(ironserve_roles=["security", "inference"]))


def test_kubernetes_mode_needs_the_image() -> None:
    with pytest.raises(ConfigError, match=r"inference_service\.kubernetes\.image"):
        check_deployable(config(inference_service={}))


def test_the_scaler_in_its_pod_cannot_read_a_loopback_prometheus() -> None:
    with pytest.raises(ConfigError, match="the scaler runs in a pod, whose loopback is its own"):
        check_deployable(config(inference_service={"kubernetes": PODS}))


@pytest.mark.invariant("scale-patch-deployment")
def test_the_scaler_runs_once_in_the_cluster_as_its_service_account(objects: dict[str, dict[str, Any]]) -> None:
    scaler = objects["Deployment/ai-scaler"]
    assert scaler["spec"]["replicas"] == 1
    spec = pod_spec(scaler)
    assert spec["serviceAccountName"] == SCALER_ACCOUNT
    assert spec["containers"][0]["command"][-3:] == ["scale", "--config", "/etc/ironserve/service.yaml"]
    config = yaml.safe_load(objects["ConfigMap/ai-scaler"]["data"]["service.yaml"])
    assert config["scaler"]["prometheus_url"] == "http://prometheus.monitoring.svc:9090"


@pytest.mark.parametrize("missing", ["security_uid", "security_gid"])
def test_kubernetes_mode_needs_the_account_numbers(missing: str) -> None:
    data = {key: value for key, value in KUBERNETES_MODE.items() if key != missing}
    with pytest.raises(ConfigError, match="needs security_uid and security_gid"):
        check_deployable(stack_config("h", data))


def test_the_pods_numbers_come_from_roles_security() -> None:
    with pytest.raises(ConfigError, match=r"kubernetes\.run_as_user"):
        config(inference_service={"kubernetes": {**PODS, "run_as_user": 0}})


def test_an_image_by_tag_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"kubernetes\.image"):
        check_deployable(
            config(inference_service={"kubernetes": {**PODS, "image": "registry.example.org/ironserve/engine:1.0"}})
        )


def test_a_misspelt_kubernetes_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="imag"):
        check_deployable(config(inference_service={"kubernetes": {**PODS, "imag": IMAGE}}))


def test_the_derived_gpu_count_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match=r"kubernetes\.gpus"):
        config(inference_service={"kubernetes": {**PODS, "gpus": 8}})


def test_a_memory_limit_that_is_not_a_quantity_is_refused() -> None:
    with pytest.raises(ConfigError, match="memory"):
        check_deployable(config(inference_service={"kubernetes": {**PODS, "memory": "24 GB"}}))


def test_the_host_engines_keys_are_not_needed_in_kubernetes_mode() -> None:
    check_deployable(config())  # no pip index, lock or listen address: the image and the cluster carry them


def test_a_kubelet_seccomp_dir_outside_the_kubelets_root_is_refused() -> None:
    with pytest.raises(ConfigError, match="relative to the kubelet's seccomp directory"):
        check_deployable(config(security_kubelet_seccomp_dir="/etc/seccomp"))


@pytest.mark.invariant("dns-policy-hostnet")
def test_the_pods_are_on_the_pod_network_with_the_default_dns_policy(objects: dict[str, dict[str, Any]]) -> None:
    """The catalog's correction: ClusterFirstWithHostNet only matters to hostNetwork pods; these are not."""
    spec = pod_spec(objects["Deployment/ai-service-blue"])
    assert "hostNetwork" not in spec and "dnsPolicy" not in spec  # ClusterFirst, Kubernetes' default


def test_the_rollout_gets_no_host_traffic_to_move_in_kubernetes_mode() -> None:
    """The pods' traffic is the cluster's: roles/kubernetes cordons and drains the node, evicting them."""
    role = next(r for r in REGISTRY.roles if r.name == "inference")
    assert role.traffic is not None and role.traffic("h", {"h": config()}, None) is None
