"""The real Kubernetes 1.20.2 API server with no node, as API-only lab tests use it (the `kubernetes_api` fixture).

Plain objects written here show that the harness works: server-side apply is idempotent and its dry run
stores nothing, the real controller manager and scheduler act on what is applied (a Deployment's ReplicaSet
and Pods, Unschedulable with no node), RBAC is enforced on calls made with a ServiceAccount's own token and
agrees with a SubjectAccessReview, and `lab down` leaves no process of the control plane. Then what 1.20.2
does that a test applying ironserve's objects must know (see docs/lab-kubernetes-node.md).
The last test takes the module's host and control plane down.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from ironserve_lab import kubernetes_node, manager, state
from ironserve_lab.kubernetes_control_plane import MERGE_PATCH, ControlPlane, service_account_user, wait_for
from ironserve_lab.state import LabHost

pytestmark = pytest.mark.lab
NAMESPACE = "kapi-harness"
SCALER = "scaler"  # the ServiceAccount allowed get/patch on deployments/scale only
UNPULLABLE = "lab.ironserve.invalid/none:1"  # no node ever pulls it
RBAC = "rbac.authorization.k8s.io/v1"
# A write of nothing but managedFields' time (whole seconds) shows only between applies further apart.
APART_S = 1.2


def metadata(name: str, namespaced: bool = True) -> dict[str, Any]:
    # A label, so that the applied configuration is more than the name (see the Namespace test below).
    return {"name": name, "labels": {"test": "kapi"}, **({"namespace": NAMESPACE} if namespaced else {})}


def config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(name), "data": data}


def deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": name, "image": UNPULLABLE}]},
            },
        },
    }


def deployment_path(name: str, subresource: str = "") -> str:
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}" + (f"/{subresource}" if subresource else "")


def selected(path: str, labels: str) -> str:
    return f"{path}?{urllib.parse.urlencode({'labelSelector': labels})}"


def managers(obj: dict[str, Any], field: str) -> list[str]:
    """The field managers whose fieldsV1 name the top-level `field` (spec, data, ...)."""
    return [m["manager"] for m in obj["metadata"].get("managedFields", []) if f"f:{field}" in m["fieldsV1"]]


def server_answer(error: urllib.error.HTTPError) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(error.read())
    return answer


@pytest.fixture(scope="module")
def namespace(kubernetes_api: ControlPlane) -> str:
    kubernetes_api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata(NAMESPACE, False)})
    return NAMESPACE


@pytest.fixture(scope="module")
def web(kubernetes_api: ControlPlane, namespace: str) -> dict[str, Any]:
    """A Deployment of two replicas, as applied."""
    return kubernetes_api.apply(deployment("web", 2))


@pytest.fixture(scope="module")
def scaler_token(kubernetes_api: ControlPlane, namespace: str) -> str:
    """The token of a ServiceAccount whose Role allows only get and patch on deployments/scale, once RBAC
    (the authorizer's informer) knows its binding; the Deployment `scaled` (one replica) to scale."""
    rule = {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]}
    binding = {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": metadata(SCALER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SCALER},
        "subjects": [{"kind": "ServiceAccount", "name": SCALER, "namespace": NAMESPACE}],
    }
    kubernetes_api.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(SCALER)})
    kubernetes_api.apply({"apiVersion": RBAC, "kind": "Role", "metadata": metadata(SCALER), "rules": [rule]})
    kubernetes_api.apply(binding)
    kubernetes_api.apply(deployment("scaled", 1))
    user = service_account_user(NAMESPACE, SCALER)

    def in_force() -> bool:
        return kubernetes_api.can_i(
            user, "patch", "deployments", group="apps", subresource="scale", namespace=NAMESPACE
        )

    wait_for(in_force, 30, "the scaler's RoleBinding in force")
    return kubernetes_api.service_account_token(NAMESPACE, SCALER)


# --- the harness ------------------------------------------------------------------------------------------


def test_a_second_apply_of_the_same_object_changes_nothing(kubernetes_api: ControlPlane, namespace: str) -> None:
    first = kubernetes_api.apply(config_map("idempotent", {"key": "value"}))
    time.sleep(APART_S)
    second = kubernetes_api.apply(config_map("idempotent", {"key": "value"}))
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert managers(second, "data") == ["ironserve"]


def test_a_dry_run_apply_leaves_the_object_as_it_was(kubernetes_api: ControlPlane, namespace: str) -> None:
    stored = kubernetes_api.apply(config_map("dry-run", {"key": "before"}))
    answer = kubernetes_api.apply(config_map("dry-run", {"key": "after"}), dry_run=True)
    assert answer["data"] == {"key": "after"}  # what the server would store
    now = kubernetes_api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/dry-run")
    assert now["data"] == {"key": "before"}
    assert now["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]


def test_a_dry_run_apply_creates_nothing(kubernetes_api: ControlPlane, namespace: str) -> None:
    answer = kubernetes_api.apply(config_map("never-stored", {}), dry_run=True)
    assert answer["metadata"]["name"] == "never-stored"
    with pytest.raises(urllib.error.HTTPError) as error:
        kubernetes_api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/never-stored")
    assert error.value.code == 404


def test_the_controller_manager_gives_a_deployment_its_replicaset(
    kubernetes_api: ControlPlane, web: dict[str, Any]
) -> None:
    uid = web["metadata"]["uid"]

    def owned(answer: dict[str, Any]) -> bool:
        return any(o["uid"] == uid for rs in answer["items"] for o in rs["metadata"].get("ownerReferences", []))

    replica_sets = kubernetes_api.wait_for_object(f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets", owned)
    [replica_set] = [rs for rs in replica_sets["items"] if rs["metadata"]["ownerReferences"][0]["uid"] == uid]
    assert replica_set["metadata"]["ownerReferences"][0]["controller"] is True
    assert replica_set["spec"]["replicas"] == 2


def test_its_pods_are_created_and_unschedulable_without_a_node(
    kubernetes_api: ControlPlane, web: dict[str, Any]
) -> None:
    """The ReplicaSet controller creates the pods, the scheduler finds no node: Pending, PodScheduled False."""

    def judged(pod: dict[str, Any]) -> bool:
        return any(c["type"] == "PodScheduled" for c in pod["status"].get("conditions", []))

    path = selected(f"/api/v1/namespaces/{NAMESPACE}/pods", "app=web")
    pods = kubernetes_api.wait_for_object(path, lambda a: len(a["items"]) == 2 and all(map(judged, a["items"])))
    for pod in pods["items"]:
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        assert pod["status"]["phase"] == "Pending"
        [scheduled] = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
        assert scheduled["message"] == "no nodes available to schedule pods"  # 1.20's words


def test_a_service_account_scales_a_deployment_through_the_scale_subresource(
    kubernetes_api: ControlPlane, scaler_token: str
) -> None:
    patch = {"spec": {"replicas": 3}}
    scale = kubernetes_api.request_as(scaler_token, "PATCH", deployment_path("scaled", "scale"), patch, MERGE_PATCH)
    assert (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 3)
    assert kubernetes_api.request("GET", deployment_path("scaled"))["spec"]["replicas"] == 3


def test_the_same_token_is_forbidden_a_plain_patch_of_the_deployment(
    kubernetes_api: ControlPlane, scaler_token: str
) -> None:
    before = kubernetes_api.request("GET", deployment_path("scaled"))["spec"]["replicas"]
    with pytest.raises(urllib.error.HTTPError) as error:
        patch = {"spec": {"replicas": before + 2}}
        kubernetes_api.request_as(scaler_token, "PATCH", deployment_path("scaled"), patch, MERGE_PATCH)
    assert error.value.code == 403
    answer = server_answer(error.value)
    assert answer["reason"] == "Forbidden"
    assert f'User "{service_account_user(NAMESPACE, SCALER)}" cannot patch resource "deployments"' in answer["message"]
    assert kubernetes_api.request("GET", deployment_path("scaled"))["spec"]["replicas"] == before


def test_can_i_agrees_with_the_role(kubernetes_api: ControlPlane, scaler_token: str) -> None:
    user = service_account_user(NAMESPACE, SCALER)

    def can(verb: str, subresource: str = "", namespace: str = NAMESPACE) -> bool:
        return kubernetes_api.can_i(
            user, verb, "deployments", group="apps", subresource=subresource, namespace=namespace
        )

    assert can("patch", "scale") and can("get", "scale")
    assert not can("update", "scale")
    assert not can("patch") and not can("get")
    assert not can("patch", "scale", namespace="default")


# --- what 1.20.2 does that a test of ironserve's objects must know ----------------------------------------


def test_a_scale_through_the_subresource_is_taken_back_by_the_next_apply(
    kubernetes_api: ControlPlane, namespace: str
) -> None:
    """1.20 records no field manager for a write through /scale: the applier keeps spec.replicas, and its next
    apply (not forced) resets the scale without a conflict. Newer API servers track /scale writes."""
    kubernetes_api.apply(deployment("rescaled", 1))
    kubernetes_api.request("PATCH", deployment_path("rescaled", "scale"), {"spec": {"replicas": 4}}, MERGE_PATCH)
    scaled = kubernetes_api.request("GET", deployment_path("rescaled"))
    assert scaled["spec"]["replicas"] == 4 and managers(scaled, "spec") == ["ironserve"]
    assert kubernetes_api.apply(deployment("rescaled", 1), force=False)["spec"]["replicas"] == 1


def test_server_side_apply_refuses_a_service_port_without_protocol(
    kubernetes_api: ControlPlane, namespace: str
) -> None:
    """1.20's apply does not default the key field `protocol` of spec.ports (a list keyed by port and
    protocol), and answers 500, not 400; ironserve's Services must name it."""

    def service(port: dict[str, Any]) -> dict[str, Any]:
        spec = {"selector": {"app": "web"}, "ports": [port]}
        return {"apiVersion": "v1", "kind": "Service", "metadata": metadata("no-protocol"), "spec": spec}

    with pytest.raises(urllib.error.HTTPError) as error:
        kubernetes_api.apply(service({"port": 80}))
    assert error.value.code == 500
    assert 'element that omits key field "protocol"' in server_answer(error.value)["message"]
    assert kubernetes_api.apply(service({"port": 80, "protocol": "TCP"}))["spec"]["ports"][0]["protocol"] == "TCP"


def test_a_secret_applied_with_string_data_is_written_again_by_every_apply(
    kubernetes_api: ControlPlane, namespace: str
) -> None:
    """stringData is stored as data, so the applied fields never match what is stored: every apply a second
    or more after the last writes the Secret again (a new resourceVersion). With `data` it is idempotent."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": metadata("string-data"), "stringData": {"k": "v"}}
    first = kubernetes_api.apply(secret)
    time.sleep(APART_S)
    assert kubernetes_api.apply(secret)["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]


def test_a_namespace_applied_with_only_its_name_is_written_once_more_by_its_second_apply(
    kubernetes_api: ControlPlane,
) -> None:
    """An applied configuration of nothing but the name records no managedFields at all; the second apply
    then writes them (the server's own fields, finalizers and phase, under the manager "before-first-apply"),
    the third nothing. A bare ServiceAccount does the same once the token controller has written to it; a
    label is enough to avoid it."""
    bare = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kapi-bare"}}
    first, second, third = (kubernetes_api.apply(bare) for _ in range(3))
    assert "managedFields" not in first["metadata"]
    assert managers(second, "spec") == ["before-first-apply"]
    versions = [answer["metadata"]["resourceVersion"] for answer in (first, second, third)]
    assert versions[0] != versions[1] == versions[2]


# --- last: lab down ---------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def host_of(plane: ControlPlane) -> LabHost:
    return next(h for h in state.load().hosts if h.extra.get("kubernetes_pid") == str(plane.pid))


def test_a_kubelet_is_refused_on_a_container_host(kubernetes_api: ControlPlane) -> None:
    """The control plane attaches to a container host; a kubelet, which needs a kernel of its own, does not."""
    with pytest.raises(ValueError, match="the kubelet needs a real kernel"):
        kubernetes_node.start_kubelet(host_of(kubernetes_api), kubernetes_api, "kind: KubeletConfiguration\n")


def test_lab_down_leaves_no_process_of_the_control_plane(kubernetes_api: ControlPlane) -> None:
    """Last: `lab down` of the container host detaches the control plane (the supervisor and its etcd,
    kube-apiserver, kube-controller-manager, kube-scheduler, by pid) and stops the host."""
    host = host_of(kubernetes_api)
    parts = children(kubernetes_api.pid)
    names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in parts)
    assert names == ["etcd", "kube-apiserver", "kube-controller", "kube-scheduler"]  # comm: 15 characters
    manager.down({host.name})
    gone = [kubernetes_api.pid, *parts, host.pids[0]]
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in gone), 10, "the control plane's end")
    assert processes_naming(str(kubernetes_api.directory)) == []
    assert host.name not in {h.name for h in state.load().hosts}
