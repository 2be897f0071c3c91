"""The Kubernetes cluster's add-ons, rendered and strictly validated: cilium, CoreDNS's Corefile, Envoy Gateway
(Gateway API objects and its policies), linkerd, cert-manager (Let's Encrypt by Cloudflare DNS01) and NVIDIA's
device plugin.

`render` builds each add-on from one host's StackConfig (Helm releases with pinned versions and values, or
Kubernetes objects) and `render.problems` validates all of it; `cluster_addons_deployable` runs that check when
the inventory is loaded, so a misspelt field stops the deploy before any host is contacted. Each control plane
installs the pinned Helm from its checked release tarball and `helm upgrade --install`s each release only when the
cluster's differs (`ironserve.helm`); then applies, server-side and only when the cluster differs, the objects of
built-in kinds (CoreDNS's ConfigMap, RuntimeClass nvidia, the device plugin's DaemonSet) and the custom resources
(cert-manager's, Gateway API's, Envoy Gateway's), these once the cluster serves their kinds (their CRDs come with
the charts), and the Cloudflare token's Secret, its value read from the deploy machine's environment and compared
by digest (`ironserve.kubectl.secret_applied`), once cert-manager's namespace exists. Proxy injection into
namespace ai is the inference role's (annotation `linkerd.io/inject: enabled` on it).
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.context import host

from ironserve import manifests
from ironserve.helm import helm_installed, helm_released, tarball_name
from ironserve.kubectl import ADMIN_KUBECONFIG, objects_applied, secret_applied
from ironserve.owned import DOWNLOADS, downloaded, downloads_ready, owned_directory, owned_file
from ironserve.run import HostRun
from roles.cluster_addons.render import (
    CLOUDFLARE_SECRET_KEY,
    AddonsConfig,
    built_in_manifests,
    cloudflare_token,
    cloudflare_token_secret,
    custom_manifests,
    helm_releases,
    missing_keys,
    network_problems,
    problems,
    service_port,
    trust_anchors_pem,
)

OBJECTS_DIR = "/etc/ironserve/kubernetes"
VALUES_DIR = f"{OBJECTS_DIR}/helm"  # each release's values, <release>.values.yaml
BUILT_IN_OBJECTS = f"{OBJECTS_DIR}/cluster-addons.yaml"
CUSTOM_OBJECTS = f"{OBJECTS_DIR}/cluster-addons-custom.yaml"
# Holds the token only while its apply runs (root:root 0600; the apply's command removes it).
TOKEN_SECRET_STAGED = f"{OBJECTS_DIR}/.cloudflare-api-token.yaml"


def cluster_addons_deployable(config: AddonsConfig) -> None:
    """ValueError naming the keys the add-ons need, or the first problem of what they render (and how many
    more): unknown fields, wrong types, a Corefile without the cluster's zone, schemas not fetched."""
    missing = missing_keys(config)
    if missing:
        raise ValueError("the cluster_addons role needs " + "; ".join(missing))
    found = network_problems(config)
    found += list(dict.fromkeys(problems(config, service_port(config), trust_anchors_pem(config.cluster_addons))))
    if found:
        raise ValueError("\n".join(f"cluster_addons: the rendered add-ons are refused: {line}" for line in found))


@deploy("Cluster add-ons")
def cluster_addons(config: AddonsConfig, run: HostRun) -> None:
    del run  # no reboot or hand-over
    cluster_addons_deployable(config)
    if config.kubernetes.role != "control-plane":
        host.noop("cluster add-ons are applied from the control planes")
        return
    frozen = config.clear_immutable
    owned_directory(name="Kubernetes objects directory", path=OBJECTS_DIR, clear_immutable=frozen)
    _helm_releases(config)
    files = (
        ("objects of built-in kinds", BUILT_IN_OBJECTS, built_in_manifests(config)),
        ("custom resources", CUSTOM_OBJECTS, custom_manifests(config, service_port(config))),
    )
    for what, path, objects in files:
        content = manifests.dump_all(objects)
        written = f"Cluster add-ons' {what} (strictly validated)"
        owned_file(name=written, path=path, content=content, clear_immutable=frozen)
        objects_applied(
            name=f"Cluster add-ons' {what} applied (server-side, field manager ironserve)",
            path=path,
            objects=content,
            kubeconfig=ADMIN_KUBECONFIG,
        )
    token = cloudflare_token(config.cluster_addons)
    if token is None:
        variable = config.cluster_addons.cloudflare_token_env
        host.noop(f"the Cloudflare token's Secret: not applied, ${variable} is not set on this machine")
        return
    secret_applied(
        name="Cluster add-ons' Cloudflare token Secret applied (compared by digest, value not shown)",
        path=TOKEN_SECRET_STAGED,
        secret=cloudflare_token_secret(token),
        key=CLOUDFLARE_SECRET_KEY,
        kubeconfig=ADMIN_KUBECONFIG,
    )


def _helm_releases(config: AddonsConfig) -> None:
    """The pinned Helm client from its checked release tarball, then each release in install order, its values in
    a file of its own; the charts create their namespaces and CRDs, which the Secret and custom resources need."""
    addons, frozen = config.cluster_addons, config.clear_immutable
    assert addons.helm_sha256 is not None  # missing_keys
    tarball = tarball_name(addons.helm_version)
    downloads_ready(frozen)
    downloaded(
        name=f"Helm {addons.helm_version} release tarball (SHA-256 checked)",
        src=f"{addons.helm_base_url}/{tarball}",
        dest=f"{DOWNLOADS}/{tarball}",
        sha256=addons.helm_sha256,
    )
    helm_installed(name=f"Helm {addons.helm_version}", tarball=f"{DOWNLOADS}/{tarball}", version=addons.helm_version)
    owned_directory(name="Helm values directory", path=VALUES_DIR, clear_immutable=frozen)
    for release in helm_releases(config, trust_anchors_pem(addons)):
        values_path = f"{VALUES_DIR}/{release.name}.values.yaml"
        owned_file(
            name=f"Helm release {release.name}'s values (strictly validated)",
            path=values_path,
            content=manifests.dump_all([release.values]),
            clear_immutable=frozen,
        )
        helm_released(
            name=f"Helm release {release.namespace}/{release.name} ({release.chart} {release.version})",
            release=release.name,
            namespace=release.namespace,
            chart=release.chart,
            repo=release.repo,
            version=release.version,
            values=release.values,
            values_path=values_path,
            kubeconfig=ADMIN_KUBECONFIG,
        )
