"""`inference_mode: kubernetes` against the lab's real Kubernetes 1.20.2 API server, controllers and RBAC (no
node: the `kubernetes_api` fixture). The objects are the ones the unit tests validate strictly at 1.31
(tests/unit/test_inference_kubernetes.py); here the real server stores them, its controllers act on them, and
the swap and the scaler change them with their own ServiceAccounts' tokens through ironserve_service's client.

Simulated: nothing on the API side. There is no node, so no engine pod starts: the swap's readiness gate is
shown refusing a colour whose pods cannot be scheduled, which is the gate a real cluster runs too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ironserve_service.kube import KubeClient, KubeError
from ironserve_service.kube_objects import (
    SCALER,
    SCALER_ACCOUNT,
    SERVICE,
    SWAP_ACCOUNT,
    colour_objects,
    deployment_name,
)
from ironserve_service.kube_swap import endpoint_colours, kube_swap
from ironserve_service.scaler import Scaler
from ironserve_service.settings import ServiceSettings

from ironserve import manifests
from ironserve.kubectl import KubectlDiff, ObjectsDiff, ServedKinds, kinds_of, objects_applied
from ironserve_lab import kubernetes_control_plane
from ironserve_lab.deploying import verify
from ironserve_lab.kubernetes_control_plane import MERGE_PATCH, ControlPlane, service_account_user, wait_for
from roles import stack_config
from roles.inference.render_kubernetes import deploy_objects, host_settings
from roles.kubernetes import kubernetes_traffic
from tests.lab.conftest import ClusterHost, inventory_with
from tests.lab.ssh import ssh_run
from tests.unit.operation_harness import FakeHost, fact_key, run_operation
from tests.unit.test_inference_kubernetes import KUBERNETES_MODE

pytestmark = pytest.mark.lab
CONFIG = stack_config("lab-k8s", KUBERNETES_MODE)
NAMESPACE = "ai"
VERSION = CONFIG.inference.version()


@pytest.fixture(scope="module")
def applied(kubernetes_api: ControlPlane) -> Iterator[ControlPlane]:
    """The deploy's objects applied once, as `kubectl apply --server-side` would."""
    for obj in deploy_objects(CONFIG):
        kubernetes_api.apply(obj)
    blue = deployment_name("blue")
    for account, subresource in ((SWAP_ACCOUNT, ""), (SCALER_ACCOUNT, "scale")):  # RBAC in force before use
        user = service_account_user(NAMESPACE, account)

        def in_force(user: str = user, subresource: str = subresource) -> bool | None:
            allowed = kubernetes_api.can_i(
                user, "get", "deployments", group="apps", subresource=subresource, namespace=NAMESPACE, name=blue
            )
            return allowed or None

        wait_for(in_force, 30, f"{account}'s Role in force")
        # 1.20's token controller adds the account's token Secret to it: one write of its own, awaited here.
        kubernetes_api.wait_for_object(
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}", lambda sa: bool(sa.get("secrets")), 30
        )
    yield kubernetes_api


def client_as(plane: ControlPlane, account: str, directory: Path) -> KubeClient:
    """ironserve_service's own client, with a token of `account` (TokenRequest) and the cluster's CA."""
    token = directory / f"{account}.token"
    token.write_text(plane.service_account_token(NAMESPACE, account))
    return KubeClient(plane.api_url, token, plane.directory / "pki" / "ca.crt", timeout_s=10)


def admin_get(plane: ControlPlane, path: str) -> dict[str, Any]:
    return plane.request("GET", path)


def deployment_path(colour: str) -> str:
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment_name(colour)}"  # type: ignore[arg-type]


def settings(**swap: Any) -> ServiceSettings:
    base = host_settings(CONFIG)
    return base.model_copy(update={"swap": base.swap.model_copy(update=swap)})


def test_the_server_accepts_every_object_with_both_colours_as_a_dry_run(applied: ControlPlane) -> None:
    for colour in ("blue", "green"):
        for obj in colour_objects(host_settings(CONFIG), colour, VERSION, 1):  # type: ignore[arg-type]
            answer = applied.apply(obj, dry_run=True)
            assert answer["metadata"]["name"] == obj["metadata"]["name"]
    with pytest.raises(urllib.error.HTTPError, match=r"404|not found"):
        admin_get(applied, deployment_path("blue"))  # the dry run stored nothing


def test_a_second_apply_of_the_deploys_objects_changes_nothing(applied: ControlPlane) -> None:
    before = {applied.resource_path(o): admin_get(applied, applied.resource_path(o)) for o in deploy_objects(CONFIG)}
    time.sleep(1.2)  # managedFields' times are whole seconds: a write would show
    for obj in deploy_objects(CONFIG):
        applied.apply(obj)
    for path, old in before.items():
        assert admin_get(applied, path)["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"], path


def test_before_any_selector_the_switch_gate_reads_no_colour_from_the_absent_endpoints(
    applied: ControlPlane, tmp_path: Path
) -> None:
    """1.20's endpoints controller writes no Endpoints for a Service without a selector: the read is a 404, which
    the switch gate must take as "no colour yet" and keep waiting, not raise after the selector moved."""
    with pytest.raises(urllib.error.HTTPError, match="404"):
        admin_get(applied, f"/api/v1/namespaces/{NAMESPACE}/endpoints/{SERVICE}")
    assert endpoint_colours(client_as(applied, SWAP_ACCOUNT, tmp_path), settings()) == set()


@pytest.mark.invariant("scale-patch-deployment")
@pytest.mark.parametrize(
    ("verb", "resource", "subresource", "allowed"),
    [
        ("get", "deployments", "scale", True),
        ("patch", "deployments", "scale", True),
        ("patch", "deployments", "", False),
        ("update", "deployments", "scale", False),
        ("create", "deployments", "", False),
        ("patch", "services", "", False),
    ],
)
def test_the_scalers_service_account_may_only_read_and_patch_the_scale(
    applied: ControlPlane, verb: str, resource: str, subresource: str, allowed: bool
) -> None:
    user = service_account_user(NAMESPACE, SCALER_ACCOUNT)
    group = "apps" if resource == "deployments" else ""
    name = deployment_name("blue")
    assert (
        applied.can_i(user, verb, resource, group=group, subresource=subresource, namespace=NAMESPACE, name=name)
        is allowed
    )


def test_a_swap_to_a_colour_that_cannot_become_ready_is_refused_and_scaled_back(
    applied: ControlPlane, tmp_path: Path
) -> None:
    """The swap runs with its own token: its Role allows what it does. The colour's pods are created by the real
    controllers and stay unschedulable (no node), so the readiness gate refuses; traffic never moves."""
    api = client_as(applied, SWAP_ACCOUNT, tmp_path)
    lines: list[str] = []
    result = kube_swap(settings(ready_timeout_s=10, poll_interval_s=0.5), api, VERSION, log=lines.append)
    assert not result.ok and result.gate == "ready", lines
    assert "0/1 ready" in result.detail
    replica_sets = admin_get(applied, f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets?labelSelector=colour%3Dblue")
    assert [rs["metadata"]["ownerReferences"][0]["name"] for rs in replica_sets["items"]] == [deployment_name("blue")]
    blue = admin_get(applied, deployment_path("blue"))
    assert blue["spec"]["replicas"] == 0
    assert blue["metadata"]["annotations"]["ironserve.io/model-version"] == VERSION
    service = admin_get(applied, f"/api/v1/namespaces/{NAMESPACE}/services/{SERVICE}")
    assert "selector" not in service["spec"]


def test_the_scalers_deployment_gets_its_pod_from_the_real_controllers(applied: ControlPlane) -> None:
    """The deploy's objects include the scaler's Deployment: the controller manager makes its ReplicaSet and Pod,
    and the scheduler reports it Unschedulable (there is no node)."""

    def scheduled_condition() -> dict[str, Any] | None:
        pods = admin_get(applied, f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app%3Dai-scaler")["items"]
        conditions = [c for pod in pods for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return conditions[0] if conditions else None

    condition = wait_for(scheduled_condition, 60, "the scaler's pod")
    assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
    owner = admin_get(applied, f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets?labelSelector=app%3Dai-scaler")
    assert [rs["metadata"]["ownerReferences"][0]["name"] for rs in owner["items"]] == [SCALER]


@pytest.mark.invariant("scale-replica-bounds")
def test_the_scaler_moves_the_serving_deployment_through_the_scale_subresource(
    applied: ControlPlane, tmp_path: Path
) -> None:
    """Blue serving one replica (as a swap leaves it) at 95 % GPU utilisation: the real scaler, deciding once a
    (simulated) second with the scaler's own token, adds replicas; the Deployment's spec says so. Green was
    never created (404): it counts as idle."""
    blue = colour_objects(host_settings(CONFIG), "blue", VERSION, 1)[1]  # type: ignore[arg-type]
    applied.apply(blue, field_manager="ironserve-swap")
    api = client_as(applied, SCALER_ACCOUNT, tmp_path)
    scaler_settings = host_settings(CONFIG).scaler
    scaler = Scaler(
        scaler_settings,
        read_utilisation=lambda: 95.0,
        get_replicas=lambda name: api.get_scale(NAMESPACE, name),
        set_replicas=lambda name, replicas: api.set_scale(NAMESPACE, name, replicas),
    )
    decisions = [scaler.step(float(second)) for second in range(60)]
    moved = [d for d in decisions if d is not None and d.desired != d.current]
    assert moved and all(d.desired > d.current for d in moved), decisions
    assert admin_get(applied, deployment_path("blue"))["spec"]["replicas"] == moved[-1].desired


def test_the_scalers_token_is_refused_a_plain_patch_of_the_deployment(applied: ControlPlane, tmp_path: Path) -> None:
    api = client_as(applied, SCALER_ACCOUNT, tmp_path)
    with pytest.raises(KubeError) as refused:
        api.patch(deployment_path("blue"), {"spec": {"replicas": 7}})
    assert refused.value.status == 403


def test_the_kube_swap_command_refuses_the_same_gate_with_the_swaps_token(
    applied: ControlPlane, tmp_path: Path
) -> None:
    """`ironserve-service kube-swap`, as an admin runs it on a control-plane host: the config's kubernetes section
    names the API server, the token and the CA; the gate's failure is its exit status and one line."""
    client = client_as(applied, SWAP_ACCOUNT, tmp_path)
    data = settings(ready_timeout_s=3, poll_interval_s=0.5).model_dump(mode="json")
    data["kubernetes"] |= {"api_server": applied.api_url, "token_file": str(client.token_file)}
    data["kubernetes"]["ca_file"] = str(client.ca_file)
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "ironserve_service", "kube-swap", VERSION, "--config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith("FAILED gate ready: ai-service-blue not ready within 3 s")
    assert admin_get(applied, deployment_path("blue"))["spec"]["replicas"] == 0


@pytest.fixture(scope="module")
def gate_inventory(
    kubernetes_api_host: ClusterHost, applied: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The control plane's host as a site's (the real kubectl, the admin kubeconfig) in an inventory of its own."""
    kubernetes_control_plane.install_admin_client(kubernetes_api_host.host, applied)
    # The lab inventory gives the host its bridge address to listen on; the objects applied above were rendered
    # with the default (service.yaml in the scaler's ConfigMap carries it; no pod listens on it).
    keys = {**KUBERNETES_MODE, "inference_listen_address": str(host_settings(CONFIG).swap.listen_host)}
    return str(inventory_with(tmp_path_factory.mktemp("gate"), kubernetes_api_host.host, keys))


def cluster_gate(cluster: ClusterHost, inventory: str) -> subprocess.CompletedProcess[str]:
    """`ironserve verify` of the inference role's tests that read the cluster (test_kubernetes_mode_cluster_*): the
    host's own files and units are the deploy's, which this module does not run. Kubernetes mode needs the
    kubernetes role beside inference (the inventory check), whose own tests the selection leaves out."""
    selected = ("-k", "kubernetes_mode_cluster")
    return verify([cluster.host], "-q", "-rfEs", *selected, roles=("kubernetes", "inference"), inventory=inventory)


def test_the_gate_passes_the_services_cluster_checks_on_the_control_plane(
    kubernetes_api_host: ClusterHost, gate_inventory: str
) -> None:
    """After the refused swap above, blue's Deployment is in the cluster (0 replicas): the gate reads its pods'
    memory and DNS policy too, so no cluster check skips."""
    result = cluster_gate(kubernetes_api_host, gate_inventory)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = f"invariants on {kubernetes_api_host.host.name}: 5 pass, 0 fail, 0 skip"
    assert summary in result.stdout, result.stdout


def test_a_scaler_role_widened_by_hand_fails_the_gate(kubernetes_api_host: ClusterHost, gate_inventory: str) -> None:
    plane = kubernetes_api_host.plane
    [role] = [o for o in deploy_objects(CONFIG) if (o["kind"], o["metadata"]["name"]) == ("Role", SCALER_ACCOUNT)]
    wide = [{"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"], "verbs": ["*"]}]
    plane.request("PATCH", plane.resource_path(role), {"rules": wide}, content_type=MERGE_PATCH)
    try:
        failed = cluster_gate(kubernetes_api_host, gate_inventory)
    finally:
        plane.apply(role)
    assert failed.returncode != 0
    failures = {line.split("::")[1].split("[")[0] for line in failed.stdout.splitlines() if line.startswith("FAILED")}
    assert failures == {
        "test_kubernetes_mode_cluster_has_the_services_objects_as_rendered",
        "test_kubernetes_mode_cluster_lets_the_scaler_change_only_the_scale",  # its "no" case: a plain patch
    }, failed.stdout
    summary = f"invariants on {kubernetes_api_host.host.name}: 3 pass, 2 fail, 0 skip"
    assert summary in failed.stdout, failed.stdout


def _run_on_this_machine(command: str, plane: ControlPlane) -> subprocess.CompletedProcess[str]:
    """A fact's or an operation's shell command as the host would run it, with the lab's real kubectl 1.20.2."""
    path = f"{kubernetes_control_plane.build_dir() / 'bin'}:{os.environ['PATH']}"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={**os.environ, "PATH": path})


def _diff(plane: ControlPlane) -> ObjectsDiff | None:
    objects = manifests.dump_all(deploy_objects(CONFIG))
    fact = KubectlDiff()
    result = _run_on_this_machine(fact.command(objects, str(plane.directory / "admin.conf")), plane)
    return fact.process(result.stdout.splitlines())


def test_the_deploys_diff_fact_finds_nothing_to_apply_when_the_objects_are_in_force(applied: ControlPlane) -> None:
    """The deploy's KubectlDiff fact (ironserve.kubectl), run with the real kubectl against the real API server: the
    objects the fixture applied (as field manager ironserve) are in force, so objects_applied is a no-op."""
    diff = _diff(applied)
    assert diff is not None and (diff.status, diff.stderr) == (0, "")


def test_a_widened_role_is_found_by_the_diff_and_the_deploys_apply_restores_it(applied: ControlPlane) -> None:
    """Drift of the kind that matters: someone lets the scaler update whole Deployments. The diff fact finds it
    (kubectl's status 1), objects_applied yields the apply, which, run with the real kubectl, puts the Role back."""
    role = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/{SCALER_ACCOUNT}"
    wide = [{"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"], "verbs": ["*"]}]
    applied.request("PATCH", role, {"rules": wide}, content_type=MERGE_PATCH)
    kubeconfig = str(applied.directory / "admin.conf")
    objects = manifests.dump_all(deploy_objects(CONFIG))
    diff = _diff(applied)
    assert diff is not None and diff.status == 1, diff
    objects_file = Path(tempfile.mkdtemp()) / "ai-service.yaml"
    objects_file.write_text(objects)
    versions = list(kinds_of(objects))
    served_fact = ServedKinds()
    served_run = _run_on_this_machine(served_fact.command(versions, kubeconfig), applied)
    served = served_fact.process(served_run.stdout.splitlines())  # the real discovery: every kind is served
    host = FakeHost({
        fact_key(ServedKinds, (), {"api_versions": versions, "kubeconfig": kubeconfig}): served,
        fact_key(KubectlDiff, (), {"objects": objects, "kubeconfig": kubeconfig}): diff,
    })  # fmt: skip
    [command] = run_operation(objects_applied, host, path=str(objects_file), objects=objects, kubeconfig=kubeconfig)
    result = _run_on_this_machine(str(command), applied)
    assert result.returncode == 0, result.stderr
    assert admin_get(applied, role)["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": [deployment_name("blue"),
         deployment_name("green")], "verbs": ["get", "patch"]}
    ]  # fmt: skip
    after = _diff(applied)
    assert after is not None and after.status == 0, after


def test_a_hand_changed_service_port_makes_the_apply_fail_loudly(applied: ControlPlane) -> None:
    """A port number edited by hand is another manager's entry of the ports list (keyed by port and protocol):
    the diff fails with the server's message (status 2) and so would the apply, both naming the duplicate; the
    deploy stops this host with that message rather than guess which port to drop."""
    service = f"/api/v1/namespaces/{NAMESPACE}/services/{SERVICE}"
    port = {"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}
    applied.request("PATCH", service, {"spec": {"ports": [port]}}, content_type=MERGE_PATCH)
    diff = _diff(applied)
    assert diff is not None and diff.status == 2 and 'Duplicate value: "http"' in diff.stderr, diff


# `ironserve rollout` on a Kubernetes node: roles/kubernetes's commands, run over SSH on the control plane's host as
# the rollout runs them (the real kubectl with kubeadm's admin kubeconfig), against the real API server. The lab
# has no kubelet here, so the Node is an object created by the admin, and its pods are a ReplicaSet's bound to it
# by name (the scheduler places none on a node that never reported Ready). Their grace period is 0: with no kubelet
# to confirm a pod's end, only a pod deleted at once leaves the API server, as a real node's pods do once stopped.
DRAINED_NODE = "gpu-node-1"
EVICTABLE = "evictable"


def node_fleet(plane_host: str) -> dict[str, Any]:
    """The inventory's configs: the control plane's host and the node, both with the kubernetes role."""
    base = {"ironserve_roles": ["kubernetes"], "kubernetes_repo_key": __file__}
    return {
        plane_host: stack_config(plane_host, {**base, "kubernetes_role": "control-plane"}),
        DRAINED_NODE: stack_config(DRAINED_NODE, {**base, "kubernetes_role": "worker"}),
    }


def bound_pods(plane: ControlPlane) -> list[dict[str, Any]]:
    path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app%3D{EVICTABLE}"
    return [p for p in plane.request("GET", path)["items"] if "deletionTimestamp" not in p["metadata"]]


@pytest.fixture(scope="module")
def node_with_pods(applied: ControlPlane, gate_inventory: str) -> Iterator[ControlPlane]:
    """The Node and a ReplicaSet of two pods on it; the admin client is on the control plane's host (gate_inventory)."""
    applied.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": DRAINED_NODE}})
    labels = {"app": EVICTABLE}
    pod = {"nodeName": DRAINED_NODE, "terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": "x:1"}]}
    replica_set = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": EVICTABLE, "namespace": NAMESPACE},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    applied.apply(replica_set)
    wait_for(lambda: len(bound_pods(applied)) == 2 or None, 30, "the ReplicaSet's two pods on the node")
    yield applied
    applied.request("DELETE", f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/{EVICTABLE}")
    applied.request("DELETE", f"/api/v1/nodes/{DRAINED_NODE}")


def unschedulable(plane: ControlPlane) -> bool:
    return bool(plane.request("GET", f"/api/v1/nodes/{DRAINED_NODE}")["spec"].get("unschedulable"))


def test_the_rollout_cordons_and_drains_a_node_through_the_api_server_then_uncordons_it(
    kubernetes_api_host: ClusterHost, node_with_pods: ControlPlane
) -> None:
    plane, host = node_with_pods, kubernetes_api_host.host
    control = kubernetes_traffic(DRAINED_NODE, node_fleet(host.name), 60)
    assert control.via == host.name  # the node's own host has no admin credentials
    before = {p["metadata"]["uid"] for p in bound_pods(plane)}
    status, out, err = ssh_run(host, control.drain, timeout=120)
    print(f"drain: {status} {out.strip()!r} {err.strip()!r}")
    assert (status, out.strip()) == (0, f"node {DRAINED_NODE} drained"), err
    assert unschedulable(plane)
    # Both pods were evicted; the ReplicaSet made new ones, bound by name past the cordon (a real node's would be
    # scheduled elsewhere).
    assert not before & {p["metadata"]["uid"] for p in bound_pods(plane)}
    assert ssh_run(host, control.describe)[1].strip() == f"node {DRAINED_NODE}: kubelet none reported, cordoned"
    assert ssh_run(host, control.hold)[0] == 0 and unschedulable(plane)
    status, out, err = ssh_run(host, control.restore)
    assert (status, out.strip()) == (0, f"node/{DRAINED_NODE} uncordoned"), err
    assert not unschedulable(plane)


def test_a_drain_a_disruption_budget_refuses_fails_in_its_bound_naming_the_budget(
    kubernetes_api_host: ClusterHost, node_with_pods: ControlPlane
) -> None:
    """A budget of one available pod over two Running pods that are not ready allows no eviction: kubectl drain
    retries until its timeout, and the reason the rollout records names the refusal. The rollout then runs restore
    (uncordon). The API server ignores budgets for Pending pods, so the pods are reported Running through their
    status subresource, as a kubelet reports them (simulated: there is no kubelet)."""
    plane, host = node_with_pods, kubernetes_api_host.host
    for pod in bound_pods(plane):
        path = f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}/status"
        plane.request("PATCH", path, {"status": {"phase": "Running"}}, MERGE_PATCH)
    budget = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": EVICTABLE, "namespace": NAMESPACE},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": EVICTABLE}}},
    }
    plane.apply(budget)
    try:
        plane.wait_for_object(
            f"/apis/policy/v1beta1/namespaces/{NAMESPACE}/poddisruptionbudgets/{EVICTABLE}",
            lambda pdb: pdb.get("status", {}).get("observedGeneration") == pdb["metadata"]["generation"],
            30,
        )
        control = kubernetes_traffic(DRAINED_NODE, node_fleet(host.name), 5)
        started = time.monotonic()
        status, out, err = ssh_run(host, control.drain, timeout=120)
        took = time.monotonic() - started
        print(f"drain against the budget: {status} after {took:.1f} s: {err.strip().splitlines()[-1:]}")
        assert status == 1 and took < 60, (out, err)
        reason = err.strip().splitlines()[-1]
        assert reason.startswith(f"kubectl drain {DRAINED_NODE}: "), reason
        assert "Cannot evict pod as it would violate the pod's disruption budget" in reason, reason
        assert unschedulable(plane)  # cordoned until the rollout's restore
        assert ssh_run(host, control.restore)[0] == 0 and not unschedulable(plane)
    finally:
        plane.request("DELETE", f"/apis/policy/v1beta1/namespaces/{NAMESPACE}/poddisruptionbudgets/{EVICTABLE}")


def test_a_node_the_cluster_does_not_know_is_named_before_anything_is_cordoned(
    kubernetes_api_host: ClusterHost,
) -> None:
    host = kubernetes_api_host.host
    fleet = node_fleet(host.name)
    fleet["gpu-node-9"] = fleet.pop(DRAINED_NODE)
    status, _, err = ssh_run(host, kubernetes_traffic("gpu-node-9", fleet, 5).drain)
    assert status == 1
    assert err.strip().endswith(
        'nodes "gpu-node-9" not found (the Node\'s name is kubernetes_node_name, or the inventory name gpu-node-9 '
        "when unset)"
    ), err
