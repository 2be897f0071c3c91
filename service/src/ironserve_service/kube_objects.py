"""The service's Kubernetes objects in `kubernetes` mode, rendered from the same ServiceSettings the systemd
mode uses: one Deployment and one ConfigMap per colour, the Service `ai-service`, and the RBAC of the two
controllers that change them (the blue/green swap and the PID scaler).

Pure functions, no API calls. Ownership is split the way server-side apply is meant to be used: the deploy
applies the static objects (Service without a selector, RBAC); the swap applies a colour's Deployment and
ConfigMap for a version and owns the Service's selector; the scaler owns only `replicas`, through the scale
subresource. A re-run of the deploy therefore never reverts a swap or a scaling decision.
"""

from __future__ import annotations

from typing import Any

import yaml

from ironserve_service.settings import COLOURS, Colour, ServiceSettings

APP = "ai-service"
SERVICE = "ai-service"  # k8s-ai-service-objects: the stable entry point of both colours
CONTAINER = "ai-container"  # k8s-ai-service-objects
CONFIG_DIR = "/etc/ironserve"
CONFIG_FILE = "service.yaml"
SWAP_ACCOUNT = "ai-swap"
SCALER_ACCOUNT = "ai-scaler"
SCALER = "ai-scaler"  # the scaler's own Deployment and ConfigMap
# The scaler's pod: `python -m ironserve_service scale` peaks at 38 MiB RSS here (/usr/bin/time -v); a decision a
# second is a few milliseconds of CPU.
SCALER_RESOURCES = {"cpu": "100m", "memory": "128Mi"}
VERSION_ANNOTATION = "ironserve.io/model-version"
GPU_RESOURCE = "nvidia.com/gpu"  # k8s-nvidia-device-plugin
# linkerd injects its proxy into pods of an annotated namespace (mesh-linkerd-proxy-only).
MESH_ANNOTATION = {"linkerd.io/inject": "enabled"}

Manifest = dict[str, Any]


def deployment_name(colour: Colour) -> str:
    return f"{APP}-{colour}"


def config_map_name(colour: Colour) -> str:
    return f"{APP}-{colour}-config"


def labels(colour: Colour | None = None) -> dict[str, str]:
    """The pods' labels; the Service selects app plus the active colour."""
    return {"app": APP, **({"colour": colour} if colour else {})}


def _metadata(settings: ServiceSettings, name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": settings.kubernetes.namespace, **extra}


def pod_settings(settings: ServiceSettings, colour: Colour, version: str) -> ServiceSettings:
    """The launcher's config inside a colour's pod: the version's model directory (mounted read-only at the
    same path as on the node), the colour's port on the pod's address, readiness markers in the pod's /tmp."""
    engine = settings.engine.model_copy(
        update={
            "model_dir": settings.swap.models_root / version,
            "port": settings.swap.port(colour),
            # The pod's own network namespace: the Service reaches the engine on the pod's address.
            "host": "0.0.0.0",
        }
    )
    return settings.model_copy(update={"engine": engine})


def namespace(settings: ServiceSettings) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": settings.kubernetes.namespace, "labels": labels(), "annotations": MESH_ANNOTATION},
    }


def config_map(settings: ServiceSettings, colour: Colour, version: str) -> Manifest:
    text = yaml.safe_dump(pod_settings(settings, colour, version).model_dump(mode="json"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(settings, config_map_name(colour), labels=labels(colour)),
        "data": {CONFIG_FILE: text},
    }


def _probe(settings: ServiceSettings, python: str, kind: str, period_s: int, failures: int) -> dict[str, Any]:
    """An exec probe running the same readiness definition as the systemd mode (`ironserve-service probe`)."""
    command = [python, "-m", "ironserve_service", "probe", kind, "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    return {
        "exec": {"command": command},
        "periodSeconds": period_s,
        "timeoutSeconds": max(1, int(settings.readiness.probe_timeout_s)),
        "failureThreshold": failures,
    }


def _pod_security(settings: ServiceSettings) -> dict[str, Any]:
    k8s = settings.kubernetes
    if k8s.image is None or k8s.run_as_user is None or k8s.run_as_group is None:
        raise ValueError("kubernetes.image, run_as_user and run_as_group must be set to render the pods")
    return {
        "runAsNonRoot": True,
        "runAsUser": k8s.run_as_user,
        "runAsGroup": k8s.run_as_group,
        "seccompProfile": {"type": "Localhost", "localhostProfile": k8s.seccomp_profile},
    }


def _container_security(added: list[str]) -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], **({"add": added} if added else {})}}


def deployment(settings: ServiceSettings, colour: Colour, version: str, replicas: int) -> Manifest:
    """One colour's Deployment serving `version` (what the swap applies)."""
    k8s = settings.kubernetes
    security = _pod_security(settings)
    python = str(settings.engine.engine_python or "python3")
    model_dir = str(settings.swap.models_root / version)
    resources: dict[str, str] = {"cpu": k8s.cpu, "memory": k8s.memory}
    if k8s.gpus:
        resources[GPU_RESOURCE] = str(k8s.gpus)
    startup_failures = max(1, int(settings.readiness.startup_timeout_s) // k8s.startup_period_s)
    container = {
        "name": CONTAINER,
        "image": k8s.image,
        "command": [python, "-m", "ironserve_service", "launch", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": settings.swap.port(colour), "protocol": "TCP"}],
        # Guaranteed QoS: requests == limits for every resource (the catalog's correction of k8s-pod-memory-limit).
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        # "Ready" means the model answered a completion: the launcher writes the marker only then.
        "startupProbe": _probe(settings, python, "ready", k8s.startup_period_s, startup_failures),
        "readinessProbe": _probe(settings, python, "ready", k8s.readiness_period_s, 1),
        "livenessProbe": _probe(settings, python, "live", k8s.readiness_period_s, 3),
        "securityContext": _container_security(list(k8s.capabilities)),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "model", "mountPath": model_dir, "readOnly": True},
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": "default",
        "automountServiceAccountToken": False,
        "securityContext": security,
        "terminationGracePeriodSeconds": int(settings.readiness.drain_timeout_s) + 30,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_map_name(colour)}},
            # The sealed version on the node's model store (io-nvme-model-store), never writable by the pod.
            {"name": "model", "hostPath": {"path": model_dir, "type": "Directory"}},
        ],
    }
    if k8s.runtime_class:
        pod_spec["runtimeClassName"] = k8s.runtime_class
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(
            settings, deployment_name(colour), labels=labels(colour), annotations={VERSION_ANNOTATION: version}
        ),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels(colour)},
            # A new version replaces the colour's pods only when the old ones are gone: two versions in one
            # colour would make the colour's readiness mean nothing.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels(colour), "annotations": {VERSION_ANNOTATION: version}},
                "spec": pod_spec,
            },
        },
    }


def service(settings: ServiceSettings) -> Manifest:
    """The stable entry point, without a selector: the swap sets it to the active colour once that is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(settings, SERVICE, labels=labels()),
        "spec": {
            "type": "ClusterIP",
            "ports": [{"name": "http", "port": settings.swap.listen_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_selector(settings: ServiceSettings, colour: Colour) -> Manifest:
    """What the swap applies to move traffic: only the Service's selector, under its own field manager."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(settings, SERVICE),
        "spec": {"selector": labels(colour)},
    }


def _role(settings: ServiceSettings, name: str, rules: list[dict[str, Any]]) -> list[Manifest]:
    meta = _metadata(settings, name, labels=labels())
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta), "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta), "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": settings.kubernetes.namespace}],
        },
    ]


def scaler_rbac(settings: ServiceSettings) -> list[Manifest]:
    """scale-patch-deployment: the scaler reads and patches the colours' `scale` subresource, nothing else."""
    names = [deployment_name(colour) for colour in COLOURS]
    rule = {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": names,
        "verbs": ["get", "patch"],
    }
    return _role(settings, SCALER_ACCOUNT, [rule])


def swap_rbac(settings: ServiceSettings) -> list[Manifest]:
    """The swap applies the colours' Deployments and ConfigMaps, reads their status, and sets the selector."""
    deployments = [deployment_name(colour) for colour in COLOURS]
    maps = [config_map_name(colour) for colour in COLOURS]
    verbs = ["get", "patch"]
    rules = [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments", "deployments/scale"],
            "resourceNames": deployments,
            "verbs": verbs,
        },
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": maps, "verbs": verbs},
        {"apiGroups": [""], "resources": ["services"], "resourceNames": [SERVICE], "verbs": verbs},
        # Draining reads the old colour's endpoints; create is for the first apply of an absent object.
        {"apiGroups": [""], "resources": ["endpoints"], "resourceNames": [SERVICE], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
    ]
    return _role(settings, SWAP_ACCOUNT, rules)


def scaler_objects(settings: ServiceSettings) -> list[Manifest]:
    """The PID scaler in the cluster: its config (the service's settings) and one replica as ai-scaler."""
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(settings, SCALER, labels={"app": SCALER}),
        "data": {CONFIG_FILE: yaml.safe_dump(settings.model_dump(mode="json"))},
    }
    python = str(settings.engine.engine_python or "python3")
    container = {
        "name": SCALER,
        "image": settings.kubernetes.image,
        "command": [python, "-m", "ironserve_service", "scale", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "resources": {"requests": dict(SCALER_RESOURCES), "limits": dict(SCALER_RESOURCES)},
        "securityContext": _container_security([]),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(settings, SCALER, labels={"app": SCALER}),
        "spec": {
            # One decision-maker: two scalers would fight over the same count.
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app": SCALER}},
            "template": {
                "metadata": {"labels": {"app": SCALER}},
                "spec": {
                    "serviceAccountName": SCALER_ACCOUNT,
                    "securityContext": _pod_security(settings),
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": SCALER}}],
                },
            },
        },
    }
    return [config_map, deployment]


def static_objects(settings: ServiceSettings) -> list[Manifest]:
    """What the deploy applies: the namespace, the Service skeleton, both controllers' RBAC and the scaler."""
    return [
        namespace(settings),
        service(settings),
        *swap_rbac(settings),
        *scaler_rbac(settings),
        *scaler_objects(settings),
    ]


def colour_objects(settings: ServiceSettings, colour: Colour, version: str, replicas: int) -> list[Manifest]:
    """What the swap applies for one colour: its config, then its Deployment."""
    return [config_map(settings, colour, version), deployment(settings, colour, version, replicas)]
