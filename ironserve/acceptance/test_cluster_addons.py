"""Acceptance: roles/cluster_addons (catalog areas dns, kubernetes, certificates, ingress), read from the cluster
itself on a control plane, with kubeadm's admin kubeconfig and the host's kubectl: the objects the deploy applies
are in force as rendered, CoreDNS is the cluster's DNS and runs the rendered Corefile, the device plugin's
DaemonSet runs on RuntimeClass nvidia, no DaemonSet resets GPUs (each node's own GPUs:
ironserve/acceptance/test_kubernetes.py), and the Cloudflare token's Secret holds a token (its digest is read, never
its value).

Each Helm release is deployed at its pinned chart version with the rendered values (helm list and helm get values,
through the deploy's own fact). The custom resources (cert-manager's, Gateway API's, Envoy Gateway's) are read as
the cluster has them: the ClusterIssuer on Let's Encrypt by Cloudflare DNS01 with the token's Secret, the
Certificate into tls-secret, the Gateway terminating TLS with it, the client policy's HTTP/2 and stream idle
timeout. Workers skip: the cluster is read once, from a control plane. What needs the add-ons running (cilium's
status, linkerd check, an issued certificate, DNS latency) is waived (waivers.yaml) with what a site runs instead.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ironserve.acceptance.checks import not_root_only
from ironserve.helm import HelmRelease
from ironserve.kubectl import ADMIN_KUBECONFIG, SecretKeyDigest
from roles import StackConfig
from roles.cluster_addons import BUILT_IN_OBJECTS, CUSTOM_OBJECTS, OBJECTS_DIR, VALUES_DIR, render, render_corefile


@pytest.fixture(autouse=True)
def _reads_the_cluster_from_a_control_plane(config: StackConfig) -> None:
    if "cluster_addons" not in config.roles:
        pytest.skip("this host does not run the cluster_addons role (ironserve_roles)")
    if config.kubernetes.role != "control-plane":
        pytest.skip("the cluster's add-ons are read from a control plane; this host is a worker")


def in_force_corefile(kubectl: Any) -> str:
    text: str = kubectl("-n", "kube-system", "get", "configmap", "coredns", "-o", "json")["data"]["Corefile"]
    return text


@pytest.mark.invariant("dns-coredns", "k8s-nvidia-device-plugin")
def test_the_add_ons_objects_are_in_force_as_rendered(cluster_diff: Any, config: StackConfig, observe: Any) -> None:
    # kubectl's server-side diff of what the deploy renders now: any field another manager changed shows.
    diff = cluster_diff(render.built_in_manifests(config))
    observe(diff)
    assert diff is not None, f"no {ADMIN_KUBECONFIG} on this control plane"
    assert (diff.status, diff.stderr) == (0, "")


@pytest.mark.invariant("cni-cilium", "dns-coredns", "ingress-envoy", "cert-manager-dns01-cloudflare")
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, config: StackConfig, observe: Any) -> None:
    # The deploy applies these with the cluster's admin credentials: whoever may write one decides what the
    # cluster runs, privileged pods included.
    values = [
        f"{VALUES_DIR}/{release.name}.values.yaml"
        for release in render.helm_releases(config, render.trust_anchors_pem(config.cluster_addons))
    ]
    paths = [OBJECTS_DIR, BUILT_IN_OBJECTS, CUSTOM_OBJECTS, VALUES_DIR, *values]
    wrong = not_root_only(host, paths)
    observe(wrong or f"{len(paths)} paths, all root:root, writable by root alone")
    assert wrong == {}


# Each release, with the catalog ids its values carry (linkerd's ids need the mesh running: waivers.yaml).
RELEASES = [
    pytest.param("cilium", marks=pytest.mark.invariant("cni-cilium-ipam-cluster-pool", "cni-cilium-routing-mode")),
    pytest.param("cert-manager", marks=pytest.mark.invariant("cert-manager-dns01-cloudflare")),
    pytest.param("eg", marks=pytest.mark.invariant("ingress-envoy")),
    "linkerd-crds",
    "linkerd-control-plane",
]


@pytest.mark.parametrize("name", RELEASES)
def test_the_helm_release_is_deployed_at_its_pin_with_the_rendered_values(
    deploy_fact: Any, config: StackConfig, name: str, observe: Any
) -> None:
    releases = render.helm_releases(config, render.trust_anchors_pem(config.cluster_addons))
    release = next(r for r in releases if r.name == name)
    found = deploy_fact(HelmRelease, release=name, namespace=release.namespace, kubeconfig=ADMIN_KUBECONFIG)
    observe(found)
    assert found is not None, f"no {ADMIN_KUBECONFIG} on this control plane"
    assert (found.chart, found.status, found.error) == (f"{release.chart}-{release.version}", "deployed", "")
    assert found.values == json.loads(json.dumps(release.values))


@pytest.mark.invariant("dns-coredns")
def test_coredns_is_the_clusters_dns_and_kube_dns_is_not(kubectl: Any, observe: Any) -> None:
    deployments = kubectl("-n", "kube-system", "get", "deployments", "-o", "json")["items"]
    names = sorted(d["metadata"]["name"] for d in deployments)
    observe(names)
    assert "coredns" in names
    assert "kube-dns" not in names


@pytest.mark.invariant("dns-corefile-server-block")
def test_the_corefile_in_force_is_the_rendered_one(kubectl: Any, config: StackConfig, observe: Any) -> None:
    in_force = in_force_corefile(kubectl)
    observe(in_force)
    assert in_force == render.coredns_configmap(config)["data"]["Corefile"]


@pytest.mark.invariant("dns-corefile-forward")
def test_coredns_forwards_to_the_sites_targets(kubectl: Any, config: StackConfig, observe: Any) -> None:
    server = {d.name: d for b in render_corefile.parse(in_force_corefile(kubectl)) if b.name == ".:53" for d in b.block}
    forward = server["forward"].args if "forward" in server else None
    observe(forward)
    assert forward == (".", *config.cluster_addons.coredns_forward)


def corefile_problems(kubectl: Any, config: StackConfig) -> list[str]:
    forward = config.cluster_addons.coredns_forward
    return render_corefile.problems(in_force_corefile(kubectl), config.kubernetes.dns_domain, forward)


@pytest.mark.invariant("dns-corefile-cache")
def test_the_corefile_in_force_caches_for_30_seconds(kubectl: Any, config: StackConfig, observe: Any) -> None:
    found = corefile_problems(kubectl, config)
    observe(found)
    assert not [problem for problem in found if "`cache 30`" in problem]


@pytest.mark.invariant("dns-corefile-reload")
def test_the_corefile_in_force_reloads_itself(kubectl: Any, config: StackConfig, observe: Any) -> None:
    found = corefile_problems(kubectl, config)
    observe(found)
    assert not [problem for problem in found if "`reload`" in problem]


@pytest.mark.invariant("k8s-nvidia-device-plugin")
def test_the_device_plugin_runs_on_the_nvidia_runtime_with_the_pinned_image(
    kubectl: Any, config: StackConfig, observe: Any
) -> None:
    [rendered] = [o for o in render.built_in_manifests(config) if o["kind"] == "DaemonSet"]
    name = rendered["metadata"]["name"]
    spec = kubectl("-n", "kube-system", "get", "daemonset", name, "-o", "json")["spec"]["template"]["spec"]
    runtime = kubectl("get", "runtimeclass", render.RUNTIME_CLASS, "-o", "json")
    observe({"runtimeClassName": spec.get("runtimeClassName"), "handler": runtime["handler"]})
    assert spec.get("runtimeClassName") == render.RUNTIME_CLASS == runtime["handler"]
    addons = config.cluster_addons
    assert [c["image"] for c in spec["containers"]] == [f"{addons.device_plugin_image}:{addons.device_plugin_version}"]


@pytest.mark.invariant("k8s-gpu-reset-initcontainer")
def test_no_daemonset_resets_a_gpu(kubectl: Any, observe: Any) -> None:
    # The seed's initContainer (`nvidia-smi -i 0 -r`) would kill in-flight work on every restart of its pod.
    resets = []
    for daemonset in kubectl("get", "daemonsets", "--all-namespaces", "-o", "json")["items"]:
        for container in daemonset["spec"]["template"]["spec"].get("initContainers", []):
            command = " ".join(container.get("command", []) + container.get("args", []))
            if "nvidia-smi" in command and (" -r" in command or "--gpu-reset" in command):
                resets.append(f"{daemonset['metadata']['namespace']}/{daemonset['metadata']['name']}: {command}")
    observe(resets)
    assert resets == []


# --- the custom resources, served once the charts installed their CRDs ------------------------------------------


def in_cluster(kubectl: Any, config: StackConfig, kind: str, name: str) -> dict[str, Any]:
    """The custom resource `kind`/`name` the role renders, as the cluster has it (kubectl's kind.version.group)."""
    [rendered] = [
        o
        for o in render.custom_manifests(config, render.service_port(config))
        if (o["kind"], o["metadata"]["name"]) == (kind, name)
    ]
    group, version = rendered["apiVersion"].split("/")
    namespace = rendered["metadata"].get("namespace")
    scope = ("-n", namespace) if namespace else ()
    found: dict[str, Any] = kubectl(*scope, "get", f"{kind.lower()}.{version}.{group}", name, "-o", "json")
    return found


def test_the_custom_resources_are_in_force_as_rendered(cluster_diff: Any, config: StackConfig, observe: Any) -> None:
    diff = cluster_diff(render.custom_manifests(config, render.service_port(config)))
    observe(diff)
    assert diff is not None and (diff.status, diff.stderr) == (0, "")


@pytest.mark.invariant("cert-manager-dns01-cloudflare")
def test_the_cluster_issuer_is_lets_encrypt_by_dns01_on_cloudflare(
    kubectl: Any, config: StackConfig, observe: Any
) -> None:
    acme = in_cluster(kubectl, config, "ClusterIssuer", render.CLUSTER_ISSUER)["spec"]["acme"]
    observe({"server": acme["server"], "solvers": [sorted(s.get("dns01", {})) for s in acme["solvers"]]})
    assert acme["server"] == config.cluster_addons.acme_server
    assert [list(s["dns01"]) for s in acme["solvers"]] == [["cloudflare"]]


@pytest.mark.invariant("cert-cloudflare-token-secret")
def test_the_cluster_issuer_reads_the_cloudflare_token_secret(kubectl: Any, config: StackConfig, observe: Any) -> None:
    acme = in_cluster(kubectl, config, "ClusterIssuer", render.CLUSTER_ISSUER)["spec"]["acme"]
    refs = [s["dns01"]["cloudflare"]["apiTokenSecretRef"] for s in acme["solvers"]]
    observe(refs)
    assert refs == [{"name": render.CLOUDFLARE_SECRET, "key": render.CLOUDFLARE_SECRET_KEY}]


@pytest.mark.invariant("cert-cloudflare-token-secret")
def test_the_cloudflare_token_secret_holds_an_api_token(deploy_fact: Any, observe: Any) -> None:
    """The Secret the ClusterIssuer reads holds a token, read as the deploy reads it: the digest of its value,
    never the value."""
    found = deploy_fact(
        SecretKeyDigest,
        namespace=render.CERT_MANAGER_NAMESPACE,
        secret=render.CLOUDFLARE_SECRET,
        key=render.CLOUDFLARE_SECRET_KEY,
        kubeconfig=ADMIN_KUBECONFIG,
    )
    observe(found)
    assert found is not None, f"no {ADMIN_KUBECONFIG} on this control plane"
    assert found.namespace_exists, f"namespace {render.CERT_MANAGER_NAMESPACE} does not exist (cert-manager's chart)"
    assert found.digest is not None, f"{render.CLOUDFLARE_SECRET} holds no {render.CLOUDFLARE_SECRET_KEY}"


@pytest.mark.invariant("cert-ingress-tls-secret")
def test_the_certificate_is_issued_into_tls_secret_by_the_cluster_issuer(
    kubectl: Any, config: StackConfig, observe: Any
) -> None:
    spec = in_cluster(kubectl, config, "Certificate", render.TLS_SECRET)["spec"]
    observe({"secretName": spec["secretName"], "issuerRef": spec["issuerRef"]})
    assert spec["secretName"] == render.TLS_SECRET
    assert (spec["issuerRef"]["kind"], spec["issuerRef"]["name"]) == ("ClusterIssuer", render.CLUSTER_ISSUER)


@pytest.mark.invariant("ingress-tls-secret")
def test_the_gateways_https_listener_terminates_with_tls_secret(
    kubectl: Any, config: StackConfig, observe: Any
) -> None:
    listeners = in_cluster(kubectl, config, "Gateway", render.GATEWAY)["spec"]["listeners"]
    refs = {listener["name"]: [r["name"] for r in listener["tls"]["certificateRefs"]] for listener in listeners}
    observe(refs)
    assert refs == {render.HTTPS_LISTENER: [render.TLS_SECRET]}


@pytest.mark.invariant("ingress-envoy-http2", "ingress-envoy-stream-idle-timeout")
def test_the_client_policy_offers_http2_and_keeps_idle_streams_300_s(
    kubectl: Any, config: StackConfig, observe: Any
) -> None:
    spec = in_cluster(kubectl, config, "ClientTrafficPolicy", f"{render.GATEWAY}-clients")["spec"]
    observe({"alpn": spec["tls"]["alpnProtocols"], "timeout": spec["timeout"]})
    assert spec["tls"]["alpnProtocols"][0] == "h2"
    assert spec["timeout"]["http"]["streamIdleTimeout"] == f"{config.cluster_addons.stream_idle_timeout_s}s"
