"""`inference_mode: kubernetes`: the service's settings on a cluster host and its Kubernetes objects.

The objects come from ironserve_service.kube_objects, rendered from the same ServiceSettings the systemd
mode writes to service.yaml (one source of truth for ports, paths, limits and readiness). This module adds
what only the stack knows (the profile's serving GPUs, roles/security's seccomp profile and capabilities)
and validates every object strictly at the cluster's pinned Kubernetes version, at inventory load.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ironserve_service.kube_objects import colour_objects, static_objects
from ironserve_service.settings import COLOURS, ServiceSettings

from ironserve import manifests
from ironserve.validators import is_within

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig

# The kubelet resolves a Localhost profile relative to <root-dir>/seccomp, /var/lib/kubelet/seccomp by
# default (kubernetes.io/docs/tutorials/security/render).
KUBELET_SECCOMP_ROOT = "/var/lib/kubelet/seccomp"


def kubernetes_layout(config: StackConfig) -> dict[str, Any]:
    """The kubernetes section's keys that the stack derives: GPUs per pod, the account's numbers, the Localhost
    profile, capabilities."""
    profile = config.security.kubelet_seccomp_profile
    if not is_within(profile, KUBELET_SECCOMP_ROOT) or profile == KUBELET_SECCOMP_ROOT:
        raise ValueError(
            f"security_kubelet_seccomp_dir puts the profile at {profile}, outside {KUBELET_SECCOMP_ROOT}: a pod's "
            "Localhost profile is a path relative to the kubelet's seccomp directory"
        )
    hardware = config.profile.hardware
    return {
        "gpus": hardware.serving_gpus if hardware else 0,
        "run_as_user": config.security.uid,
        "run_as_group": config.security.gid,
        "seccomp_profile": posixpath.relpath(profile, KUBELET_SECCOMP_ROOT),
        # systemd's CAP_SYS_NICE is the container runtime's SYS_NICE.
        "capabilities": [name.removeprefix("CAP_") for name in config.security.capabilities],
    }


def host_settings(config: StackConfig) -> ServiceSettings:
    """This host's service settings (service.yaml), with the kubernetes layout in kubernetes mode."""
    security = config.security
    layout = kubernetes_layout(config) if config.inference.mode == "kubernetes" else None
    return config.inference.service_settings(
        security.model_dir, security.group, security.slice, layout, gpu_layout(config)
    )


def gpu_layout(config: StackConfig) -> dict[str, Any] | None:
    """The GPU health watch's expectations from the hardware profile: every installed GPU on the bus, the serving ones
    (lowest slots first, NVML's order) at their full width; None for a profile that states no hardware."""
    hardware = config.profile.hardware
    if hardware is None:
        return None
    return {
        "expected_gpus": hardware.gpus_installed,
        "expected_pcie_width": hardware.serving_width,
        "full_width_devices": list(range(hardware.serving_gpus)) or None,
    }


def deploy_objects(config: StackConfig) -> list[manifests.Manifest]:
    """What the deploy applies: the namespace, the Service without a selector, the swap's and scaler's RBAC."""
    return static_objects(host_settings(config))


def service_objects(config: StackConfig) -> list[manifests.Manifest]:
    """Every object of the service: the static ones the deploy applies, then each colour as the swap applies it
    for the configured version (the first colour with one replica, the other scaled to zero)."""
    return _every_object(host_settings(config), config.inference.version())


def _every_object(settings: ServiceSettings, version: str) -> list[manifests.Manifest]:
    objects = static_objects(settings)
    for colour in COLOURS:
        objects += colour_objects(settings, colour, version, replicas=1 if colour == COLOURS[0] else 0)
    return objects


def pod_policy_problems(obj: manifests.Manifest) -> list[str]:
    """What a schema cannot say about a workload's pods: Guaranteed QoS (requests == limits), a Localhost seccomp
    profile that names its file, a non-root user, every capability dropped but the ones added."""
    if obj.get("kind") not in {"Deployment", "DaemonSet"}:
        return []
    name = manifests.identity(obj)
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    context = pod.get("securityContext", {})
    found = []
    seccomp = context.get("seccompProfile", {})
    if seccomp.get("type") != "Localhost" or not seccomp.get("localhostProfile"):
        found.append(f"{name}: seccompProfile must be Localhost with a localhostProfile (ironserve's profile)")
    if context.get("runAsNonRoot") is not True or not context.get("runAsUser"):
        found.append(f"{name}: the pod must run as non-root, as the service account's uid")
    for container in pod.get("containers", []):
        resources = container.get("resources", {})
        if resources.get("requests") != resources.get("limits") or not resources.get("limits"):
            found.append(f"{name}: container {container.get('name')}: requests must equal limits (Guaranteed QoS)")
        if container.get("securityContext", {}).get("capabilities", {}).get("drop") != ["ALL"]:
            found.append(f"{name}: container {container.get('name')}: capabilities must drop ALL")
    return found


def kubernetes_problems(config: StackConfig) -> list[str]:
    """The objects' problems at the cluster's pinned Kubernetes version (empty: all valid)."""
    settings = host_settings(config)
    objects = _every_object(settings, config.inference.version())
    found = manifests.problems(objects, config.kubernetes.version)
    prometheus = urlsplit(settings.scaler.prometheus_url).hostname or ""
    if prometheus == "localhost" or prometheus.startswith("127.") or prometheus == "::1":
        found.append(
            f"inference_service.scaler.prometheus_url names {prometheus}: the scaler runs in a pod, whose loopback is "
            "its own; give the Prometheus that scrapes the nodes' gpu_utilization_percent, e.g. "
            "http://prometheus.monitoring.svc:9090"
        )
    return found + [problem for obj in objects for problem in pod_policy_problems(obj)]
