"""The blue/green swap in `kubernetes` mode, each step a named gate, as in swap.py.

apply (the idle colour's ConfigMap and Deployment for the version, with the active colour's replicas) ->
ready (the Deployment rolled out: every replica updated and Ready, and Ready means the model answered, see
kube_objects' probes) -> switch (the Service's selector to the new colour, observed in its Endpoints) ->
drain (`swap.drain_idle_s` for requests in flight on the old pods) -> stop (the old colour scaled to zero:
its pods get SIGTERM and the launcher's own drain). A failure before the switch scales the new colour back to
zero and leaves the selector alone: traffic never moved. The cluster's state (the selector, the colours'
version annotations) is the source of truth, kept in the cluster's etcd.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ironserve_service.kube import KubeError
from ironserve_service.kube_objects import (
    SERVICE,
    VERSION_ANNOTATION,
    colour_objects,
    deployment,
    deployment_name,
    service_selector,
)
from ironserve_service.settings import COLOURS, Colour, ServiceSettings
from ironserve_service.swap import GateFailed, SwapResult, other

FIELD_MANAGER = "ironserve-swap"
APPLY = "application/apply-patch+yaml"
# REST collections of the kinds the swap applies (core v1 and apps/v1).
COLLECTIONS = {"ConfigMap": ("/api/v1", "configmaps"), "Service": ("/api/v1", "services"),
               "Deployment": ("/apis/apps/v1", "deployments")}  # fmt: skip


class Api(Protocol):
    """What the swap needs of a Kubernetes client (kube.KubeClient)."""

    def get(self, path: str) -> dict[str, Any]: ...

    def patch(self, path: str, body: dict[str, Any], content_type: str = ...) -> dict[str, Any]: ...


def object_path(obj: dict[str, Any]) -> str:
    prefix, plural = COLLECTIONS[obj["kind"]]
    meta = obj["metadata"]
    return f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"


def apply(api: Api, obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply under the swap's field manager (it owns what it applies; the deploy owns the rest)."""
    return api.patch(f"{object_path(obj)}?fieldManager={FIELD_MANAGER}&force=true", obj, APPLY)


def active_colour(api: Api, settings: ServiceSettings) -> Colour | None:
    """The colour the Service selects; None before the first swap."""
    service = api.get(f"/api/v1/namespaces/{settings.kubernetes.namespace}/services/{SERVICE}")
    colour = (service.get("spec", {}).get("selector") or {}).get("colour")
    return colour if colour in COLOURS else None


def read_deployment(api: Api, settings: ServiceSettings, colour: Colour) -> dict[str, Any]:
    return api.get(f"/apis/apps/v1/namespaces/{settings.kubernetes.namespace}/deployments/{deployment_name(colour)}")


def rollout_problem(obj: dict[str, Any]) -> str | None:
    """None when every wanted replica runs the Deployment's current template and is Ready; else what is missing."""
    wanted = obj.get("spec", {}).get("replicas", 1)
    status = obj.get("status", {})
    if status.get("observedGeneration", 0) < obj["metadata"].get("generation", 0):
        return "the controller has not seen this version yet"
    pods, updated, ready = (status.get(key, 0) for key in ("replicas", "updatedReplicas", "readyReplicas"))
    if updated < wanted or ready < wanted or pods > wanted:
        return f"{ready}/{wanted} ready, {updated} updated, {pods} pods"
    return None


def endpoint_colours(api: Api, settings: ServiceSettings) -> set[str]:
    """The colours of the pods the Service's Endpoints list (the endpoints controller's view of the switch)."""
    try:
        endpoints = api.get(f"/api/v1/namespaces/{settings.kubernetes.namespace}/endpoints/{SERVICE}")
    except KubeError as error:
        if error.status != 404:
            raise
        return set()  # the endpoints controller writes the object only after the Service first has a selector
    pods = [
        address.get("targetRef", {}).get("name", "")
        for subset in endpoints.get("subsets") or []
        for address in subset.get("addresses") or []
    ]
    return {colour for colour in COLOURS for pod in pods if pod.startswith(deployment_name(colour) + "-")}


def _wait(check: Callable[[], str | None], timeout_s: float, interval_s: float) -> str | None:
    """Poll `check` until it returns None (done) or the timeout passes; the last problem otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        problem = check()
        if problem is None or time.monotonic() >= deadline:
            return problem
        time.sleep(interval_s)


def kube_swap(
    settings: ServiceSettings, api: Api, version: str, replicas: int | None = None, log: Callable[[str], None] = print
) -> SwapResult:
    """Move the Service to `version` on the idle colour; `replicas`: the new colour's (default: the active's)."""
    swap = settings.swap
    timings: dict[str, float] = {}
    started = time.monotonic()
    old = active_colour(api, settings)
    current = read_deployment(api, settings, old) if old is not None else None
    old_version = current["metadata"].get("annotations", {}).get(VERSION_ANNOTATION) if current else None
    if old is not None and old_version == version:
        return SwapResult(True, "noop", f"{version} already active on {old}", old, old)
    new: Colour = other(old) if old else COLOURS[0]
    wanted = max(1, replicas if replicas is not None else (current["spec"].get("replicas", 1) if current else 1))
    try:
        for obj in colour_objects(settings, new, version, wanted):
            apply(api, obj)
        log(f"OK apply {deployment_name(new)} {version} x{wanted}")
        timings["apply"] = time.monotonic() - started

        problem = _wait(
            lambda: rollout_problem(read_deployment(api, settings, new)), swap.ready_timeout_s, swap.poll_interval_s
        )
        if problem is not None:
            raise GateFailed("ready", f"{deployment_name(new)} not ready within {swap.ready_timeout_s:g} s: {problem}")
        log(f"OK ready {deployment_name(new)}")
        timings["ready"] = time.monotonic() - started
    except GateFailed as failed:
        apply(api, deployment(settings, new, version, 0))
        log(f"FAIL {failed}; {deployment_name(new)} scaled back to zero, the Service still selects {old}")
        return SwapResult(False, failed.gate, failed.reason, new, old, timings)

    apply(api, service_selector(settings, new))
    switched_at = time.monotonic()
    problem = _wait(
        lambda: None if endpoint_colours(api, settings) == {new} else f"endpoints: {endpoint_colours(api, settings)}",
        swap.switch_timeout_s,
        swap.poll_interval_s,
    )
    timings["switch"] = time.monotonic() - switched_at
    if problem is not None:
        # The selector is the switch; the endpoints controller lagging is reported, never undone by guessing.
        log(f"WARN switch: the Service selects {new} but after {swap.switch_timeout_s:g} s {problem}")
    log(f"OK switch ai-service -> {new}")
    if old is not None:
        time.sleep(swap.drain_idle_s)
        timings["drain"] = time.monotonic() - started
        apply(api, deployment(settings, old, old_version or version, 0))
        log(f"OK stop {deployment_name(old)} scaled to zero")
    timings["total"] = time.monotonic() - started
    return SwapResult(True, "done", f"{version} on {new}", new, old, timings)
