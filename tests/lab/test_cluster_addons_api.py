"""roles/cluster_addons' objects against the lab's real Kubernetes 1.20.2 API server (no node, the
`kubernetes_api` fixture): the built-in kinds it renders (CoreDNS's ConfigMap, the RuntimeClass, the device
plugin's DaemonSet, the token's Secret) are stored and re-applied without a write; the custom resources
(cert-manager, Gateway API, Envoy Gateway) have no kind on a server without their CRDs, which is why they are
validated against their projects' schemas (tests/unit/test_cluster_addons.py) and applied after their charts.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from ironserve.config import build_config
from ironserve.lab.kubernetes_control_plane import ControlPlane
from roles import REGISTRY, StackConfig
from roles.cluster_addons import render
from tests.unit.test_cluster_addons import SITE, TOKEN

pytestmark = pytest.mark.lab
CONFIG: StackConfig = build_config("r740-01", SITE, REGISTRY)
PORT = render.service_port(CONFIG)
BUILT_IN = {"v1", "apps/v1", "node.k8s.io/v1"}


def built_in() -> list[dict[str, Any]]:
    objects = [*render.manifests_of(CONFIG, PORT), render.cloudflare_token_secret(TOKEN)]
    return [o for o in objects if o["apiVersion"] in BUILT_IN]


@pytest.fixture(scope="module")
def applied(kubernetes_api: ControlPlane) -> Iterator[ControlPlane]:
    # The charts create their namespaces (helm --create-namespace); here the test does.
    for name in sorted({o["metadata"]["namespace"] for o in built_in() if o["metadata"].get("namespace")}):
        kubernetes_api.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"a": "b"}}}
        )
    for obj in built_in():
        kubernetes_api.apply(obj)
    yield kubernetes_api


def test_every_built_in_kind_is_rendered_for_an_api_this_server_has(applied: ControlPlane) -> None:
    kinds = sorted(f"{o['apiVersion']} {o['kind']}" for o in built_in())
    assert kinds == ["apps/v1 DaemonSet", "node.k8s.io/v1 RuntimeClass", "v1 ConfigMap", "v1 Secret"]
    for obj in built_in():
        stored = applied.request("GET", applied.resource_path(obj))
        assert stored["metadata"]["name"] == obj["metadata"]["name"]


@pytest.mark.invariant("dns-corefile-forward")
def test_the_stored_corefile_is_the_rendered_one(applied: ControlPlane) -> None:
    stored = applied.request("GET", "/api/v1/namespaces/kube-system/configmaps/coredns")
    assert stored["data"]["Corefile"] == render.coredns_configmap(CONFIG)["data"]["Corefile"]


def test_a_second_apply_writes_nothing_the_token_secret_included(applied: ControlPlane) -> None:
    """The Secret is rendered as `data`: with `stringData` 1.20.2 writes it again on every apply."""
    before = {applied.resource_path(o): applied.request("GET", applied.resource_path(o)) for o in built_in()}
    time.sleep(1.2)  # managedFields' times are whole seconds: a write would show
    for obj in built_in():
        applied.apply(obj)
    for path, old in before.items():
        assert applied.request("GET", path)["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"], path


def test_the_custom_resources_have_no_kind_without_their_crds(applied: ControlPlane) -> None:
    custom = [o for o in render.manifests_of(CONFIG, PORT) if o["apiVersion"] not in BUILT_IN]
    assert {o["kind"] for o in custom} >= {"ClusterIssuer", "Certificate", "Gateway", "HTTPRoute"}
    for obj in custom:  # discovery has no such group (404) or no such kind in it
        with pytest.raises((LookupError, urllib.error.HTTPError), match=r"404|no kind|serves"):
            applied.resource_path(obj)
