"""The Kubernetes cluster's add-ons, rendered and strictly validated: cilium, CoreDNS's Corefile, Envoy Gateway
(Gateway API objects and its policies), linkerd, cert-manager (Let's Encrypt by Cloudflare DNS01) and NVIDIA's
device plugin.

`render` builds each add-on from one host's StackConfig (Helm releases with pinned versions and values, or
Kubernetes objects) and `render.problems` validates all of it; `cluster_addons_deployable` runs that check when
the inventory is loaded, so a misspelt field stops the deploy before any host is contacted. Applying them (helm,
kubectl) is not this round's: the `@deploy` below only reports that the add-ons are rendered and valid.
Proxy injection into namespace ai is the inference role's (annotation `linkerd.io/inject: enabled` on it).
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.context import host

from ironserve.run import HostRun
from roles.cluster_addons.render import AddonsConfig, missing_keys, problems, service_port, trust_anchors_pem


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
    del run  # no reboot or hand-over: nothing is applied yet
    cluster_addons_deployable(config)
    host.noop("cluster add-ons rendered and validated; applying them is not implemented (roles/cluster_addons)")
