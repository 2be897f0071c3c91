"""The roles of ironserve's deploy, in order, and the stack model that holds one host's settings of each.

One role is one package: `roles/<name>/__init__.py` has its single `@deploy`, `settings.py` its settings
model (the inventory keys prefixed `<name>_`, with defaults and descriptions), its facts, operations and
renderings beside them; its templates and files are in the project's `templates/<name>/` and `files/<name>/`
(ironserve.layout). This module is the only place that lists them; the core (`ironserve/`) receives
the registry and names no role.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ironserve.config import Registry, Role, StackBase, build_config, check_roles_deployable
from roles.bios import bios
from roles.bios.settings import BiosSettings
from roles.cluster_addons import cluster_addons, cluster_addons_deployable
from roles.cluster_addons.settings import ClusterAddonsSettings
from roles.container_runtime import container_runtime
from roles.container_runtime.settings import ContainerRuntimeSettings
from roles.host_tuning import host_tuning
from roles.host_tuning.settings import HostTuningSettings
from roles.inference import inference, inference_deployable, inference_traffic
from roles.inference.settings import InferenceSettings
from roles.kubernetes import cluster_layout_problems, kubernetes, kubernetes_deployable, kubernetes_traffic
from roles.kubernetes.settings import KubernetesSettings
from roles.monitoring import monitoring, monitoring_deployable
from roles.monitoring.settings import MonitoringSettings
from roles.nvidia import nvidia, nvidia_deployable
from roles.nvidia import queue_reads as nvidia_queue_reads
from roles.nvidia.settings import NvidiaSettings
from roles.preflight import preflight
from roles.preflight.settings import PreflightSettings
from roles.security import security
from roles.security.settings import SecuritySettings


class StackConfig(StackBase):
    """Everything ironserve deploys to one host; roles and acceptance tests receive it explicitly."""

    bios: BiosSettings
    preflight: PreflightSettings
    nvidia: NvidiaSettings
    host_tuning: HostTuningSettings
    security: SecuritySettings
    container_runtime: ContainerRuntimeSettings
    kubernetes: KubernetesSettings
    cluster_addons: ClusterAddonsSettings
    monitoring: MonitoringSettings
    inference: InferenceSettings


# In order: the BIOS through the iDRAC and the preflight gate stop a physically wrong host before
# anything is installed; then the pinned NVIDIA set, the OS tuning, the security boundary, the runtime,
# Kubernetes and its add-ons where a site opts in, the monitoring a site opts in to (its rules and discovery files
# are in place when the inference role's Prometheus starts), and the inference service on top.
REGISTRY = Registry(
    stack=StackConfig,
    roles=(
        Role("bios", BiosSettings, bios),
        Role("preflight", PreflightSettings, preflight),
        Role("nvidia", NvidiaSettings, nvidia, nvidia_deployable, queue_reads=nvidia_queue_reads),
        Role("host_tuning", HostTuningSettings, host_tuning),
        Role("security", SecuritySettings, security),
        Role("container_runtime", ContainerRuntimeSettings, container_runtime),
        Role(
            "kubernetes",
            KubernetesSettings,
            kubernetes,
            kubernetes_deployable,
            check_fleet=cluster_layout_problems,
            opt_in=True,
            traffic=kubernetes_traffic,
        ),
        Role("cluster_addons", ClusterAddonsSettings, cluster_addons, cluster_addons_deployable, opt_in=True),
        Role("monitoring", MonitoringSettings, monitoring, monitoring_deployable, opt_in=True),
        Role("inference", InferenceSettings, inference, inference_deployable, traffic=inference_traffic),
    ),
)


def stack_config(host: str, data: Mapping[str, Any]) -> StackConfig:
    """One host's validated configuration from its inventory data; ConfigError lists every problem."""
    return build_config(host, data, REGISTRY)


def check_deployable(config: StackConfig) -> None:
    """ConfigError when a selected role lacks a key it cannot run without."""
    check_roles_deployable(config, REGISTRY)
