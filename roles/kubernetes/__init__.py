"""Kubernetes with kubeadm on containerd (k8s-not-k3s): the pinned packages from pkgs.k8s.io or a site mirror,
kubeadm's and the kubelet's config rendered from typed models, the cluster started once and nodes joined.

Order: packages (the same apt pin, install and hold code as the NVIDIA and containerd sets), then the kubeadm
config, the check that the kubelet's cgroup driver is containerd's (read in force, before any kubelet starts),
`kubeadm init` on the first control plane, `kubeadm join` elsewhere with a token the first control plane makes for
it in this run, and last the kubelet's own config, restored when it drifts. Node prerequisites (swap off,
overlay/br_netfilter, forwarding sysctls) and containerd's CRI settings belong to container_runtime.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pyinfra.api.deploy import deploy
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from ironserve.apt import (
    apt_updated,
    held,
    pinned_install,
    pins_in_force,
    preferences,
    repository_fetched,
    unattended_blacklist,
)
from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.kubectl import ADMIN_KUBECONFIG
from ironserve.operations import service_state
from ironserve.owned import owned_directory, owned_file
from ironserve.run import HostRun
from ironserve.traffic import TrafficControl
from roles.kubernetes.operations import cgroup_drivers_agree, cluster_initialised, cluster_version_kept, node_joined
from roles.kubernetes.render import (
    KUBEADM_CONFIG,
    KUBELET_CONFIG,
    kubeadm_config_yaml,
    kubelet_configuration_yaml,
    runtime_endpoint,
)

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig
    from roles.kubernetes.settings import KubernetesSettings

OWNER = "roles/kubernetes"
# Where the Kubernetes install docs put the repository key ("Installing kubeadm", Debian-based distributions).
KEYRINGS = "/etc/apt/keyrings"
KEYRING = f"{KEYRINGS}/kubernetes-apt-keyring.gpg"
SOURCES_LIST = "/etc/apt/sources.list.d/ironserve-kubernetes.list"
PREFERENCES = "/etc/apt/preferences.d/ironserve-kubernetes.pref"
UNATTENDED_BLACKLIST = "/etc/apt/apt.conf.d/51ironserve-kubernetes-blacklist"
PIN_PRIORITY = 1001  # above 1000: apt also downgrades to the pin (apt_preferences(5))


def repository_url(settings: KubernetesSettings) -> str:
    """pkgs.k8s.io's layout: one flat repository per minor release."""
    return f"{settings.repo_url}/v{settings.minor}/deb/"


def sources_line(settings: KubernetesSettings) -> str:
    return f"deb [signed-by={KEYRING}] {repository_url(settings)} /\n"


def members(fleet: Mapping[str, StackConfig]) -> dict[str, StackConfig]:
    """The hosts that run the kubernetes role, in inventory order."""
    return {name: config for name, config in fleet.items() if "kubernetes" in config.roles}


def first_control_plane(fleet: Mapping[str, StackConfig]) -> str | None:
    """The control plane that starts the cluster: the first listed in the inventory."""
    return next((n for n, c in members(fleet).items() if c.kubernetes.role == "control-plane"), None)


def cluster_layout_problems(fleet: Mapping[str, StackConfig]) -> list[str]:
    """Why the inventory's hosts cannot form one cluster (checked at inventory load, before any host is
    contacted): a worker with no control plane to join, several control planes without one endpoint."""
    cluster = members(fleet)
    planes = [n for n, c in cluster.items() if c.kubernetes.role == "control-plane"]
    workers = [n for n, c in cluster.items() if c.kubernetes.role == "worker"]
    problems = []
    if workers and not planes:
        problems.append(
            f"host {', '.join(workers)}: kubernetes_role worker, but no host of the inventory is a control plane "
            "(kubernetes_role control-plane) to join"
        )
    if len(planes) > 1:
        unset = [n for n in planes if not cluster[n].kubernetes.control_plane_endpoint]
        if unset:
            problems.append(
                f"host {', '.join(unset)}: {len(planes)} control planes ({', '.join(planes)}) need one "
                "kubernetes_control_plane_endpoint (a load balancer or DNS name in front of every API server)"
            )
    if planes:
        endpoint = cluster[planes[0]].kubernetes.client_endpoint
        joining = [n for n in (*planes[1:], *workers)]
        if endpoint is None and joining:
            problems.append(
                f"host {planes[0]}: {', '.join(joining)} join this first control plane, which has neither "
                "kubernetes_control_plane_endpoint nor kubernetes_advertise_address: set one"
            )
        apart = sorted({n for n in joining if cluster[n].kubernetes.client_endpoint not in {None, endpoint}})
        if apart:
            problems.append(
                f"host {', '.join(apart)}: kubernetes_control_plane_endpoint differs from the first control plane "
                f"{planes[0]}'s ({endpoint}); a cluster has one"
            )
        first = cluster[planes[0]].kubernetes
        if len(cluster) > first.node_cidrs:
            problems.append(
                f"host {planes[0]}: kubernetes_pod_subnet {first.pod_subnet} has room for {first.node_cidrs} nodes at "
                f"the node CIDR mask /{first.node_cidr_mask}, the inventory's cluster has {len(cluster)}: the rest get "
                "no pod addresses; accepted: a larger pod subnet or a longer --node-cidr-mask-size"
            )
    return problems


def traffic_via(host: str, fleet: Mapping[str, StackConfig]) -> str:
    """Where `ironserve rollout` runs kubectl for `host`'s node: another control plane of the inventory when there
    is one (a control plane being changed may not answer), else the only one, which may be the host itself."""
    planes = [name for name, config in members(fleet).items() if config.kubernetes.role == "control-plane"]
    return next((name for name in planes if name != host), host)


def kubernetes_traffic(
    host: str, fleet: Mapping[str, StackConfig], drain_timeout_s: float | None
) -> TrafficControl | None:
    """`ironserve rollout`'s commands for a node, run with kubeadm's admin kubeconfig on a control plane: drain
    cordons the node and evicts its pods through the eviction API (PodDisruptionBudgets respected; DaemonSet pods
    stay) within the bound, else fails with kubectl's reason, and the rollout uncordons the node; hold keeps it
    cordoned; restore uncordons it. The inference pods are Deployment pods: evicted, they start on other nodes and
    the Service follows their readiness."""
    config = fleet[host]
    node = config.kubernetes.node_name or host
    timeout = drain_timeout_s if drain_timeout_s is not None else config.kubernetes.drain_timeout_s
    kubectl = shlex.join(["kubectl", "--kubeconfig", ADMIN_KUBECONFIG])
    quoted = shlex.quote(node)
    # kubectl's own message first (NotFound, or an API server that does not answer), then where the name came from.
    hint = f" (the Node's name is kubernetes_node_name, or the inventory name {host} when unset)"
    known = (
        f"err=$({kubectl} get node {quoted} -o name 2>&1 >/dev/null) || "
        f"""{{ printf '%s%s\\n' "$err" {shlex.quote(hint)} >&2; exit 1; }}"""
    )
    # kubectl's last line says that it gave up; the first refused eviction says why (a disruption budget).
    failed = f"kubectl drain {node}: "
    drain = (
        f"{known}; out=$({kubectl} drain {quoted} --ignore-daemonsets --delete-emptydir-data "
        f"--timeout={timeout:g}s 2>&1) && {{ echo {shlex.quote(f'node {node} drained')}; exit 0; }}; "
        """blocked=$(printf '%s\\n' "$out" | grep -m1 '^error when evicting'); """
        f"""printf '%s%s%s\\n' {shlex.quote(failed)} "$(printf '%s\\n' "$out" | tail -n1)" """
        """"${blocked:+ ($blocked)}" >&2; exit 1"""
    )
    describe = (
        f"{known}; state=$({kubectl} get node {quoted} "
        "-o jsonpath='{.status.nodeInfo.kubeletVersion}/{.spec.unschedulable}') || exit 1; "
        'case "$state" in */true) held=cordoned;; *) held=schedulable;; esac; '
        f"""version=${{state%/*}}; printf '%s%s, %s\\n' {shlex.quote(f"node {node}: kubelet ")} """
        '"${version:-none reported}" "$held"'
    )
    return TrafficControl(
        role="kubernetes",
        drain=drain,
        hold=f"{known}; {kubectl} cordon {quoted}",
        restore=f"{known}; {kubectl} uncordon {quoted}",
        describe=describe,
        via=traffic_via(host, fleet),
    )


def kubernetes_deployable(config: StackConfig) -> None:
    """The repository key has no default; the kubelet fields containerd decides must agree with it."""
    settings, runtime = config.kubernetes, config.container_runtime
    problems = []
    if settings.repo_key is None:
        problems.append(
            "kubernetes_repo_key must be set for the kubernetes role (the binary keyring of kubernetes_repo_url's "
            "repository: `curl -fsSL <repo>/v<minor>/deb/Release.key | gpg --dearmor`)"
        )
    driver = settings.kubelet.cgroup_driver
    if driver is not None and driver != runtime.cgroup_driver:
        problems.append(
            f"kubernetes_kubelet cgroupDriver {driver} is not containerd's {runtime.cgroup_driver} (its runtimes have "
            "SystemdCgroup = true): the kubelet would restart pods in a loop; leave cgroupDriver out, it is derived"
        )
    endpoint = settings.kubelet.container_runtime_endpoint
    if endpoint is not None and endpoint != runtime_endpoint(runtime.socket):
        problems.append(
            f"kubernetes_kubelet containerRuntimeEndpoint {endpoint} is not containerd's socket "
            f"{runtime_endpoint(runtime.socket)}; leave it out, it is derived"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _repository(settings: KubernetesSettings, frozen: bool) -> None:
    assert settings.repo_key is not None  # kubernetes_deployable
    owned_directory(name="apt keyrings folder", path=KEYRINGS, clear_immutable=frozen)
    key = owned_file(
        name="Kubernetes repository key",
        path=KEYRING,
        content=Path(settings.repo_key).read_bytes(),
        clear_immutable=frozen,
    )
    source = owned_file(
        name=f"Kubernetes {settings.minor} repository (signed-by)",
        path=SOURCES_LIST,
        content=sources_line(settings),
        clear_immutable=frozen,
    )
    # apt knows a restored source or key only after it fetched the index again.
    apt_updated(name="apt reads the Kubernetes repository again", _if=any_changed(key, source))
    repository_fetched(name="apt has fetched the Kubernetes repository", url=repository_url(settings))


@deploy("Kubernetes")
def kubernetes(config: StackConfig, run: HostRun) -> None:
    settings, runtime = config.kubernetes, config.container_runtime
    frozen = config.clear_immutable
    pins = settings.packages()
    kubelet_yaml = kubelet_configuration_yaml(settings, runtime.cgroup_driver, runtime.socket)

    cluster_version_kept(name="The pinned version is the control plane's", pinned=settings.version)
    _repository(settings, frozen)
    owned_file(
        name="Pin the Kubernetes packages",
        path=PREFERENCES,
        content=preferences(pins, PIN_PRIORITY, OWNER),
        clear_immutable=frozen,
    )
    owned_file(
        name="Keep unattended-upgrades off the Kubernetes packages",
        path=UNATTENDED_BLACKLIST,
        content=unattended_blacklist(list(pins), OWNER),
        clear_immutable=frozen,
    )
    pins_in_force(name="apt's candidates are the Kubernetes pins", pins=pins, own_file=PREFERENCES)
    pinned_install(name="Install the Kubernetes packages (pinned)", pins=pins, recommends=False)
    held(name="Hold the Kubernetes packages", names=list(pins))

    owned_directory(name="kubeadm's folder", path="/etc/kubernetes", clear_immutable=frozen)
    owned_file(
        name="kubeadm config (typed, v1beta4)",
        path=KUBEADM_CONFIG,
        content=kubeadm_config_yaml(settings, runtime.cgroup_driver, runtime.socket),
        mode="600",
        clear_immutable=frozen,
    )
    cgroup_drivers_agree(name="The kubelet's cgroup driver is containerd's", kubelet_config=kubelet_yaml)

    first = first_control_plane(run.fleet) or config.host
    if config.host == first:
        cluster_initialised(name="Start the cluster (kubeadm init, once)", config_path=KUBEADM_CONFIG)
    else:
        endpoint = run.fleet[first].kubernetes.client_endpoint
        assert endpoint is not None  # cluster_layout_problems
        node_joined(
            name="Join the cluster (kubeadm join, once)",
            settings=settings,
            socket=runtime.socket,
            control_plane=first,
            endpoint=endpoint,
            as_control_plane=settings.role == "control-plane",
        )

    owned_directory(name="The kubelet's folder", path="/var/lib/kubelet", mode="700", clear_immutable=frozen)
    # What kubeadm wrote there at init/join (its defaults: staticPodPath, clusterDNS, clientCAFile...) with the site's
    # fields on top, the same document as the kubeadm config's: rewriting it never drops what kubeadm set.
    kubelet_config = owned_file(
        name="kubelet config (kubeadm's, typed; cgroup driver from containerd)",
        path=KUBELET_CONFIG,
        content=kubelet_yaml,
        clear_immutable=frozen,
    )
    # kubeadm's own drop-in lives in /usr/lib; one in /etc or /run (`systemctl edit`) outranks the config above.
    dropins = foreign_dropins_moved_aside(
        name="No foreign drop-in on the kubelet",
        units=["kubelet.service"],
        own=[],
        why="overrides the kubelet's unit (set the kubelet through kubernetes_kubelet)",
    )
    systemd.daemon_reload(name="systemd drops the foreign kubelet drop-in", _if=dropins.did_change)
    systemd.service(
        name="Restart the kubelet for its restored config",
        service="kubelet.service",
        restarted=True,
        _if=any_changed(kubelet_config, dropins),
    )
    service_state(name="kubelet enabled and running", unit="kubelet.service", running=True, enabled=True)
