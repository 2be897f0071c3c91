"""roles/cluster_addons: what is rendered, and that every planted mistake is refused with a message naming it.

The custom resources are checked against the schemas `scripts/fetch-crd-schemas.sh` builds in the cache; a
test that needs them fails (never skips) when they are absent, saying to run the script.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from ironserve.config import ConfigError, build_config, validate_host
from ironserve.docs import BEGIN, END, key_table
from ironserve.manifests import dump_all
from roles import REGISTRY, StackConfig
from roles.cluster_addons import models_crd, render, render_corefile
from roles.cluster_addons.models import values_problems
from roles.cluster_addons.settings import ClusterAddonsSettings

SAMPLES = Path(__file__).parent / "samples"
TRUST_ANCHOR = SAMPLES / "cluster-addons-trust-anchor.crt"
README = Path(__file__).parents[2] / "roles" / "cluster_addons" / "README.md"
TOKEN = "cf-Tok3n-0123456789abcdefABCDEF-planted"


SITE: dict[str, Any] = {
    "ironserve_roles": ["kubernetes", "cluster_addons"],
    "kubernetes_advertise_address": "192.0.2.10",
    "kubernetes_repo_key": __file__,  # any readable file: the key's content is not what these tests are about
    "cluster_addons_acme_email": "ops@example.com",
    "cluster_addons_dns_zones": ["example.com"],
    "cluster_addons_tls_dns_names": ["llm.example.com"],
    "cluster_addons_linkerd_trust_anchor": str(TRUST_ANCHOR),
    "cluster_addons_helm_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",  # a stand-in
}


def config(**changes: Any) -> StackConfig:
    return build_config("r740-01", {**SITE, **changes}, REGISTRY)


@pytest.fixture(scope="module")
def schemas() -> Path:
    root = models_crd.cache_dir()
    try:
        models_crd.load_schemas(root)
    except models_crd.SchemasMissing as exc:
        pytest.fail(f"{exc} (the custom resources cannot be validated without them)")
    return root


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)


def custom_problems(obj: dict[str, Any], root: Path) -> list[str]:
    check = models_crd.custom_validators(render.CUSTOM_KINDS, root)[(obj["apiVersion"], obj["kind"])]
    return check(obj)


# --- what is rendered ----------------------------------------------------------------------------------------


@pytest.mark.invariant("k8s-minimal-stack")
def test_everything_rendered_is_valid_and_the_inventory_check_passes(schemas: Path) -> None:
    site = config()
    assert render.problems(site, 8000, TRUST_ANCHOR.read_text(), TOKEN, schemas) == []
    assert validate_host("r740-01", SITE, REGISTRY).cluster_addons.acme_email == "ops@example.com"


@pytest.mark.invariant("cni-cilium-ipam-cluster-pool", "cni-cilium-routing-mode")
def test_cilium_values_cluster_pool_tunnel_and_kube_proxy_replacement() -> None:
    values = render.cilium_values(config())
    assert values["ipam"] == {
        "mode": "cluster-pool",
        "operator": {"clusterPoolIPv4PodCIDRList": ["10.244.0.0/16"], "clusterPoolIPv4MaskSize": 24},
    }
    assert (values["routingMode"], values["tunnelProtocol"]) == ("tunnel", "vxlan")
    assert values["kubeProxyReplacement"] is True
    assert (values["k8sServiceHost"], values["k8sServicePort"]) == ("192.0.2.10", 6443)
    assert "tunnel" not in values and "autoDirectNodeRoutes" not in values


@pytest.mark.invariant("cni-cilium-routing-mode")
def test_cilium_native_routing_and_the_endpoint_setting() -> None:
    values = render.cilium_values(
        config(cluster_addons_cilium_routing_mode="native", kubernetes_control_plane_endpoint="k8s-api.example")
    )
    assert values["routingMode"] == "native" and values["autoDirectNodeRoutes"] is True
    assert values["ipv4NativeRoutingCIDR"] == "10.244.0.0/16" and "tunnelProtocol" not in values
    assert (values["k8sServiceHost"], values["k8sServicePort"]) == ("k8s-api.example", 6443)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"cluster_addons_cilium_pod_cidr_mask_size": 16}, ("/16 is not longer than", "accepted: a mask from /17")),
        (
            {
                "cluster_addons_cilium_routing_mode": "native",
                "cluster_addons_cilium_native_routing_cidr": "10.0.0.0/16",
            },
            ("does not contain kubernetes_pod_subnet 10.244.0.0/16",),
        ),
    ],
)
def test_a_cilium_pool_that_cannot_serve_the_cluster_is_refused(
    changes: dict[str, Any], words: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as raised:
        validate_host("r740-01", {**SITE, **changes}, REGISTRY)
    lines = [
        line for line in str(raised.value).splitlines() if "cluster_addons: the rendered add-ons are refused" in line
    ]
    assert any(all(word in line for word in words) for line in lines), lines
    assert render.network_problems(config()) == []


def test_cilium_without_an_api_server_address_is_refused() -> None:
    site = config(kubernetes_advertise_address=None)
    with pytest.raises(ValueError, match="kubernetes_control_plane_endpoint"):
        render.cilium_values(site)
    with pytest.raises(ConfigError, match="cilium replaces kube-proxy"):
        validate_host("r740-01", {**SITE, "kubernetes_advertise_address": None}, REGISTRY)


def test_helm_releases_are_pinned_and_come_from_the_settings_repositories() -> None:
    releases = {
        r.name: r for r in render.helm_releases(config(cluster_addons_cilium_chart_repo="https://m/cilium"), "PEM")
    }
    assert (releases["cilium"].repo, releases["cilium"].version) == ("https://m/cilium", "1.18.3")
    assert releases["cert-manager"].version == "v1.19.4"
    assert releases["cert-manager"].values == {"crds": {"enabled": True}}
    assert releases["eg"].chart == "gateway-helm" and releases["eg"].version == "v1.6.7"
    assert releases["linkerd-crds"].values == {"installGatewayAPI": False}
    assert releases["linkerd-control-plane"].values["identityTrustAnchorsPEM"] == "PEM"


@pytest.mark.invariant("dns-coredns", "dns-corefile-forward")
def test_corefile_is_kubeadms_with_the_forward_targets_changed() -> None:
    site = config(cluster_addons_coredns_forward=["9.9.9.9"], kubernetes_dns_domain="cluster.lab")
    text = render.coredns_configmap(site)["data"]["Corefile"]
    assert "    forward . 9.9.9.9 {\n       max_concurrent 1000\n    }\n" in text
    assert "    kubernetes cluster.lab in-addr.arpa ip6.arpa {\n       pods insecure\n" in text
    assert text == render_corefile.KUBEADM_COREFILE.format(domain="cluster.lab", forward="9.9.9.9")
    assert render_corefile.problems(text, "cluster.lab", ["9.9.9.9"]) == []


@pytest.mark.invariant("dns-corefile-server-block", "dns-corefile-cache", "dns-corefile-reload", "dns-corefile-forward")
def test_corefile_checker_finds_what_the_catalog_needs() -> None:
    seed = ".:53 {\n    forward . 1.1.1.1 8.8.8.8\n    cache 30\n    reload\n}\n"  # dns-corefile-server-block
    assert render_corefile.problems(seed, "cluster.local", ["1.1.1.1", "8.8.8.8"]) == [
        "Corefile: no `kubernetes cluster.local ...` plugin: Service names would not resolve"
    ]
    good = render_corefile.corefile("cluster.local", ["1.1.1.1", "8.8.8.8"])
    assert render_corefile.problems(good.replace("    reload\n", ""), "cluster.local", ["1.1.1.1", "8.8.8.8"]) == [
        "Corefile: no `reload` (dns-corefile-reload)"
    ]
    assert render_corefile.problems(good.replace("cache 30", "cache 300"), "cluster.local", ["1.1.1.1", "8.8.8.8"]) == [
        "Corefile: no `cache 30` (dns-corefile-cache)"
    ]
    assert render_corefile.problems(good, "cluster.local", ["8.8.8.8"]) == [
        "Corefile: no `forward . 8.8.8.8` (dns-corefile-forward)"
    ]
    assert render_corefile.problems(good + "}\n", "cluster.local", []) == [
        "Corefile: line 21: a closing brace without an opening one"
    ]
    blocks = render_corefile.parse(good)
    kubernetes_plugin = next(d for d in blocks[0].block if d.name == "kubernetes")
    assert [d.name for d in kubernetes_plugin.block] == ["pods", "fallthrough", "ttl"]


@pytest.mark.invariant(
    "ingress-envoy", "ingress-envoy-http2", "ingress-envoy-stream-idle-timeout", "ingress-tls-secret"
)
def test_gateway_objects_http2_stream_idle_timeout_and_no_request_timeout() -> None:
    objects = render.gateway_manifests(config(), 8000)
    assert by_kind(objects, "GatewayClass")["spec"] == {
        "controllerName": "gateway.envoyproxy.io/gatewayclass-controller"
    }
    listener = by_kind(objects, "Gateway")["spec"]["listeners"][0]
    assert (listener["protocol"], listener["port"]) == ("HTTPS", 443)
    assert listener["tls"]["certificateRefs"] == [{"group": "", "kind": "Secret", "name": "tls-secret"}]
    route = by_kind(objects, "HTTPRoute")
    assert route["metadata"]["namespace"] == "ai" and route["spec"]["hostnames"] == ["llm.example.com"]
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"][0]["name"] == "ai-service" and rule["backendRefs"][0]["port"] == 8000
    assert rule["timeouts"] == {"request": "0s"}
    policy = by_kind(objects, "ClientTrafficPolicy")["spec"]
    assert policy["tls"]["alpnProtocols"] == ["h2", "http/1.1"]
    assert policy["timeout"] == {"http": {"streamIdleTimeout": "300s"}}
    assert not any(o["kind"] == "GRPCRoute" for o in objects)


@pytest.mark.invariant("ingress-grpc-web")
def test_a_grpc_backend_adds_a_grpc_route_on_the_https_listener(schemas: Path) -> None:
    site = config(cluster_addons_grpc_web_backend="ai-grpc:9000")
    grpc = by_kind(render.gateway_manifests(site, 8000), "GRPCRoute")
    assert grpc["spec"]["parentRefs"][0]["sectionName"] == "https"
    assert grpc["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "",
        "kind": "Service",
        "name": "ai-grpc",
        "port": 9000,
    }
    assert custom_problems(grpc, schemas) == []


@pytest.mark.invariant(
    "cert-manager-dns01-cloudflare", "cert-cloudflare-token-secret", "cert-ingress-tls-secret", "cert-no-self-signed"
)
def test_cluster_issuer_and_certificate() -> None:
    issuer, certificate = render.certificate_manifests(config())
    acme = issuer["spec"]["acme"]
    assert acme["server"] == "https://acme-v02.api.letsencrypt.org/directory" and acme["email"] == "ops@example.com"
    assert acme["privateKeySecretRef"] == {"name": "letsencrypt-account-key"}
    assert acme["solvers"] == [
        {
            "selector": {"dnsZones": ["example.com"]},
            "dns01": {"cloudflare": {"apiTokenSecretRef": {"name": "cloudflare-api-token", "key": "api-token"}}},
        }
    ]
    assert certificate["metadata"]["namespace"] == "ai"
    assert certificate["spec"]["secretName"] == "tls-secret"
    assert certificate["spec"]["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "ClusterIssuer",
        "name": "letsencrypt",
    }


@pytest.mark.invariant("k8s-gpu-reset-initcontainer")
def test_device_plugin_daemonset_runs_on_the_nvidia_runtime_without_a_gpu_reset() -> None:
    runtime_class, daemonset = render.device_plugin_manifests(config())
    assert (runtime_class["kind"], runtime_class["handler"]) == ("RuntimeClass", "nvidia")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["containers"][0]["image"] == "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"
    assert "initContainers" not in pod  # k8s-gpu-reset-initcontainer: the product expects 0
    assert "gpu-reset" not in dump_all([daemonset])


# --- the token ---------------------------------------------------------------------------------------------


@pytest.mark.invariant("cert-cloudflare-token-secret")
def test_the_token_comes_from_the_environment_only_into_its_secret() -> None:
    site = config()
    token = render.cloudflare_token(site.cluster_addons, {"IRONSERVE_CLOUDFLARE_API_TOKEN": TOKEN})
    secret = render.cloudflare_token_secret(token)
    assert secret["metadata"]["namespace"] == "cert-manager" and secret["type"] == "Opaque"
    assert secret["data"] == {"api-token": base64.b64encode(TOKEN.encode()).decode()}
    everything_else = dump_all(render.manifests_of(site, 8000)) + json.dumps(
        [r.values for r in render.helm_releases(site, "PEM")]
    )
    assert TOKEN not in everything_else and TOKEN not in repr(site)


def test_an_unset_token_is_none_and_a_malformed_one_is_named_without_its_value() -> None:
    settings = config(cluster_addons_cloudflare_token_env="SITE_CF_TOKEN").cluster_addons
    assert render.cloudflare_token(settings, {}) is None
    assert render.cloudflare_token(settings, {"SITE_CF_TOKEN": " \t"}) is None
    with pytest.raises(ValueError, match="holds whitespace") as caught:
        render.cloudflare_token(settings, {"SITE_CF_TOKEN": f"{TOKEN}\n"})
    assert TOKEN not in str(caught.value)


def test_planted_token_in_the_inventory_is_refused_and_not_shown() -> None:
    with pytest.raises(ConfigError) as caught:
        config(cluster_addons_cloudflare_api_token=TOKEN)
    message = str(caught.value)
    assert "cluster_addons_cloudflare_api_token: is a credential and never an inventory value" in message
    assert "IRONSERVE_CLOUDFLARE_API_TOKEN" in message and "(got ***)" in message
    assert TOKEN not in message


def test_a_token_put_in_the_variable_name_setting_is_refused_and_not_shown() -> None:
    with pytest.raises(ConfigError) as caught:
        config(cluster_addons_cloudflare_token_env=TOKEN)
    assert "cluster_addons_cloudflare_token_env" in str(caught.value)
    assert TOKEN not in str(caught.value)


# --- the planted mistakes ---------------------------------------------------------------------------------------


def test_planted_misspelt_certificate_field(schemas: Path) -> None:
    certificate = render.certificate_manifests(config())[1]
    certificate["spec"]["secretNme"] = certificate["spec"].pop("secretName")
    assert custom_problems(certificate, schemas) == [
        "spec: unknown field 'secretNme', which the API server drops as unknown; did you mean secretName?",
        "spec: 'secretName' is a required property",
    ]


def test_planted_listener_port_as_text(schemas: Path) -> None:
    gateway = by_kind(render.gateway_manifests(config(), 8000), "Gateway")
    gateway["spec"]["listeners"][0]["port"] = "443"
    assert custom_problems(gateway, schemas) == ["spec.listeners[0].port: '443' is not of type 'number'"]


def test_planted_misspelt_cloudflare_solver(schemas: Path) -> None:
    issuer = render.certificate_manifests(config())[0]
    dns01 = issuer["spec"]["acme"]["solvers"][0]["dns01"]
    dns01["cloudflar"] = dns01.pop("cloudflare")
    assert custom_problems(issuer, schemas) == [
        "spec.acme.solvers[0].dns01: unknown field 'cloudflar', which the API server drops as unknown; "
        "did you mean cloudflare?"
    ]


def test_planted_misspelt_daemonset_container_field() -> None:
    from ironserve.manifests import problems

    daemonset = render.device_plugin_manifests(config())[1]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    assert problems([daemonset], "1.31.4") == [
        "DaemonSet kube-system/nvidia-device-plugin-daemonset: spec.template.spec.containers[0]: Additional "
        "properties are not allowed ('volumeMount' was unexpected)"
    ]


def test_planted_unknown_cilium_value() -> None:
    values = render.cilium_values(config())
    values["kubeProxyReplacment"] = values.pop("kubeProxyReplacement")
    assert values_problems("cilium", values) == [
        "cilium values: kubeProxyReplacement: Field required",
        "cilium values: kubeProxyReplacment: unknown key, which the chart would ignore",
    ]
    nested = render.cilium_values(config())
    nested["ipam"]["operator"]["clusterPoolIPv4PodCIDR"] = "10.0.0.0/8"
    assert values_problems("cilium", nested) == [
        "cilium values: ipam.operator.clusterPoolIPv4PodCIDR: unknown key, which the chart would ignore"
    ]


def test_planted_forward_target_that_is_not_an_ip() -> None:
    with pytest.raises(ConfigError) as caught:
        config(cluster_addons_coredns_forward=["1.1.1.1", "dns.google"])
    assert "cluster_addons_coredns_forward: 'dns.google' is not an IP address" in str(caught.value)


# --- the schemas: present, absent, stale, and how they are built -----------------------------------------------


def test_absent_schemas_fail_saying_to_run_the_script(tmp_path: Path) -> None:
    site = config()
    found = render.problems(site, 8000, TRUST_ANCHOR.read_text(), schemas_root=tmp_path)
    assert found and all("run scripts/fetch-crd-schemas.sh" in line for line in found)
    assert found[0].startswith(
        "ClusterIssuer letsencrypt: not validated: run scripts/fetch-crd-schemas.sh: no custom resource schemas in "
    )
    assert len(found) == 6  # ClusterIssuer, Certificate, GatewayClass, Gateway, HTTPRoute, ClientTrafficPolicy


def test_absent_schemas_stop_the_inventory_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("IRONSERVE_CACHE", str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"not validated: run scripts/fetch-crd-schemas\.sh: no custom resource schemas in "
    ):
        validate_host("r740-01", SITE, REGISTRY)


def test_schemas_of_another_lock_are_refused(tmp_path: Path) -> None:
    (tmp_path / models_crd.SCHEMAS_FILE).write_text(json.dumps({"lock": "0" * 64, "$defs": {}, "kinds": {}}))
    with pytest.raises(models_crd.SchemasMissing, match=r"built from another crd-schemas\.lock"):
        models_crd.load_schemas(tmp_path)


def test_missing_keys_are_named_together() -> None:
    with pytest.raises(ConfigError) as caught:
        validate_host("r740-01", {"ironserve_roles": ["kubernetes", "cluster_addons"]}, REGISTRY)
    message = str(caught.value)
    for key in ("acme_email", "dns_zones", "tls_dns_names", "linkerd_trust_anchor", "helm_sha256"):
        assert f"cluster_addons_{key}" in message


def test_a_trust_anchor_with_its_key_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "anchor.pem"
    bundle.write_text(TRUST_ANCHOR.read_text() + "-----BEGIN EC PRIVATE KEY-----\nMHc=\n-----END EC PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match="holds a private key; give the trust anchor's certificate only"):
        config(cluster_addons_linkerd_trust_anchor=str(bundle))


def test_the_lock_pins_every_package_with_a_sha256() -> None:
    pins = models_crd.read_lock()
    assert {p.package for p in pins} == {
        "@kubernetes-models/apimachinery",
        "@kubernetes-models/cert-manager",
        "@kubernetes-models/gateway-api",
        "@kubernetes-models/envoy-gateway",
    }
    assert all(re.fullmatch(r"[0-9a-f]{64}", p.sha256) and p.upstream for p in pins)


def _package(root: Path, name: str, files: dict[str, str]) -> Path:
    folder = root / name.replace("@", "").replace("/", "-")
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def test_declarations_become_closed_schemas(tmp_path: Path) -> None:
    base = _package(
        tmp_path,
        "@kubernetes-models/base-types",
        {
            "meta/ObjectMeta.d.ts": 'export interface IObjectMeta {\n  "name"?: string;\n  "labels"?: {\n'
            "    [key: string]: string;\n  };\n}\nexport type { IObjectMeta as IMeta };\n",
        },
    )
    widgets = _package(
        tmp_path,
        "@kubernetes-models/widgets",
        {
            "example.io/v1/Widget.d.ts": 'import { IMeta } from "@kubernetes-models/base-types/meta/ObjectMeta";\n'
            'import { IPort } from "./Port.js";\nimport { Model } from "@kubernetes-models/base";\n'
            "/** A widget. */\nexport interface IWidget extends IBase {\n"
            '  "apiVersion": "example.io/v1";\n  "kind": "Widget";\n  "metadata"?: IMeta;\n'
            '  "spec"?: {\n    "mode": "A" | "B";\n    "ports"?: Array<IPort>;\n'
            '    "size"?: number | string;\n  };\n}\n'
            'interface IBase {\n  "status"?: any;\n}\n'
            "export declare class Widget extends Model<IWidget> implements IWidget {\n  constructor();\n}\n",
            "example.io/v1/Port.d.ts": "export type IPortNumber = number;\nexport interface IPort {\n"
            '  "port": IPortNumber;\n}\n',
        },
    )
    converter = models_crd.Converter({"@kubernetes-models/base-types": base, "@kubernetes-models/widgets": widgets})
    kinds = converter.kinds()
    schema = {"$defs": converter.defs, **kinds["example.io/v1/Widget"]}
    import jsonschema

    checker = jsonschema.Draft202012Validator(schema)
    good = {"apiVersion": "example.io/v1", "kind": "Widget", "metadata": {"name": "w", "labels": {"a": "b"}},
            "spec": {"mode": "A", "ports": [{"port": 80}], "size": "1Gi"}, "status": {"anything": 1}}  # fmt: skip
    assert list(checker.iter_errors(good)) == []
    bad = {**good, "spec": {"mode": "C", "ports": [{"port": "80", "extra": 1}], "sise": 1}}
    messages = sorted(e.message for e in checker.iter_errors(bad))
    assert messages == [
        "'80' is not of type 'number'",
        "'C' is not one of ['A', 'B']",
        "Additional properties are not allowed ('extra' was unexpected)",
        "Additional properties are not allowed ('sise' was unexpected)",
    ]
    assert list(checker.iter_errors({**good, "metadata": {"nmae": "w"}}))


# --- the README ----------------------------------------------------------------------------------------------


def test_readme_key_table_is_the_settings_models() -> None:
    text = README.read_text()
    assert f"{BEGIN}\n{key_table(ClusterAddonsSettings)}{END}" in text, "run `make docs` once the role is registered"


def test_every_key_has_the_prefix_and_a_description() -> None:
    for name, field in ClusterAddonsSettings.model_fields.items():
        assert field.alias == f"cluster_addons_{name}" and field.description
