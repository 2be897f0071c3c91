"""The Kubernetes cluster's add-ons, rendered and strictly validated: cilium, CoreDNS's Corefile, Envoy Gateway
(Gateway API objects and its policies), linkerd, cert-manager (Let's Encrypt by Cloudflare DNS01) and NVIDIA's
device plugin.

`render` builds each add-on from one host's StackConfig (Helm releases with pinned versions and values, or
Kubernetes objects) and `render.problems` validates all of it; `cluster_addons_deployable` runs that check when
the inventory is loaded, so a misspelt field stops the deploy before any host is contacted. Each control plane
applies the objects of built-in kinds (CoreDNS's ConfigMap, RuntimeClass nvidia, the device plugin's DaemonSet)
server-side when the cluster differs; the Helm releases, the custom resources that need their CRDs and the
Cloudflare token's Secret are rendered and validated but not applied yet (no chart is reachable to test a Helm
release with; the token must not pass through a command line). Proxy injection into namespace ai is the
inference role's (annotation `linkerd.io/inject: enabled` on it).
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.context import host

from ironserve import manifests
from ironserve.kubectl import ADMIN_KUBECONFIG, objects_applied
from ironserve.owned import owned_directory, owned_file
from ironserve.run import HostRun
from roles.cluster_addons.render import (
    AddonsConfig,
    built_in_manifests,
    missing_keys,
    problems,
    service_port,
    trust_anchors_pem,
)

OBJECTS_DIR = "/etc/ironserve/kubernetes"
BUILT_IN_OBJECTS = f"{OBJECTS_DIR}/cluster-addons.yaml"


def cluster_addons_deployable(config: AddonsConfig) -> None:
    """ValueError naming the keys the add-ons need, or the first problem of what they render (and how many
    more): unknown fields, wrong types, a Corefile without the cluster's zone, schemas not fetched."""
    missing = missing_keys(config)
    if missing:
        raise ValueError("the cluster_addons role needs " + "; ".join(missing))
    found = list(dict.fromkeys(problems(config, service_port(config), trust_anchors_pem(config.cluster_addons))))
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValueError(f"cluster_addons: the rendered add-ons are refused: {found[0]}{more}")


@deploy("Cluster add-ons")
def cluster_addons(config: AddonsConfig, run: HostRun) -> None:
    del run  # no reboot or hand-over
    cluster_addons_deployable(config)
    if config.kubernetes.role != "control-plane":
        host.noop("cluster add-ons are applied from the control planes")
        return
    objects = manifests.dump_all(built_in_manifests(config))
    frozen = config.clear_immutable
    owned_directory(name="Kubernetes objects directory", path=OBJECTS_DIR, clear_immutable=frozen)
    owned_file(
        name="Cluster add-ons' objects of built-in kinds (strictly validated)",
        path=BUILT_IN_OBJECTS,
        content=objects,
        clear_immutable=frozen,
    )
    objects_applied(
        name="Cluster add-ons' objects applied (server-side, field manager ironserve)",
        path=BUILT_IN_OBJECTS,
        objects=objects,
        kubeconfig=ADMIN_KUBECONFIG,
    )
