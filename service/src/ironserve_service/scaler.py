"""The PID replica scaler: GPU utilisation from the local Prometheus -> the active Deployment's replica count.

Instead of the HPA (metrics-server's GPU figures lag about 15 s, k8s-no-hpa), a PID controller on
``avg(gpu_utilization_percent)`` read from the local Prometheus (scale-metric-source) corrects the replica
count of the serving blue/green Deployment through its ``scale`` subresource (scale-patch-deployment),
within 1..32 replicas (scale-replica-bounds). The source's controller used ``int(pid(util))`` as the replica
count; with simple-pid's error (setpoint - utilisation) high load gave a negative output and pinned replicas
at the minimum. Here the output corrects the current count, in the direction that scales out above the
setpoint, with limits and anti-windup (the catalog's correction of scale-pid-controller).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ironserve_service.kube import KubeError, cluster_client
from ironserve_service.kube_objects import deployment_name
from ironserve_service.settings import COLOURS, ScalerSettings, ServiceSettings

LOG = logging.getLogger(__name__)

# What bounded a decision: "deadband" = the current count is already the closest to the setpoint; "direction" =
# the correction pointed against the error's sign (never lower replicas above the setpoint, nor raise them below);
# "load_cap" = more replicas than the serving ones' load would fill (ReplicaController).
Limit = Literal[
    "none", "deadband", "direction", "load_cap", "max_step_up", "max_step_down", "min_replicas", "max_replicas"
]

# The blue/green Deployments the scaler reads; only the one with replicas is scaled.
DEPLOYMENTS = tuple(deployment_name(colour) for colour in COLOURS)


class MetricUnavailable(Exception):
    """No usable utilisation (Prometheus down, no series, NaN, ...): the scaler holds the replica count."""


@dataclass(frozen=True)
class Decision:
    """One decision: what the controller saw, its correction term by term, and the count it asks for.

    ``proportional``, ``integral`` and ``derivative`` are this decision's share of the correction (velocity
    form, see ReplicaController), in natural-log units of the replica count: 0.1 is about 10 % more replicas.
    ``target`` is the continuous count after the limits, of which ``desired`` is the nearest integer.
    """

    utilisation_percent: float
    current: int
    starting: int
    desired: int
    proportional: float
    integral: float
    derivative: float
    target: float
    limit: Limit

    @property
    def correction(self) -> float:
        return self.proportional + self.integral + self.derivative

    def describe(self) -> str:
        return (
            f"utilisation {self.utilisation_percent:.1f}% replicas {self.current} ({self.starting} starting) -> "
            f"{self.desired} "
            f"(P {self.proportional:+.4f} I {self.integral:+.4f} D {self.derivative:+.4f}, "
            f"target {self.target:.2f}, limit {self.limit})"
        )


def _nearest(value: float) -> int:
    return math.floor(value + 0.5)


class ReplicaController:
    """A PID on GPU utilisation whose output corrects the current replica count. Pure: time comes in as dt.

    Units: the error is (utilisation - setpoint) in percentage points / 100, time is in seconds (simple-pid's,
    for which the catalog gave its gains), and the output is the natural log of the replica count, so a
    correction multiplies the count: one replica changes utilisation by 1/n of itself, and a correction in
    proportion to n gives the loop the same gain at 2 replicas as at 32. Then Ti = Kp/Ki = 8 s outlasts the
    metric's lag (a few seconds and the scrape interval) and a step settles without overshoot; the price is
    speed: at full utilisation a proportional step of about +27 %, then at most about +3 % a second.

    Velocity form: each decision applies dP = Kp*(e - e_prev), I = Ki*e*dt and dD = D - D_prev, with
    D = -Kd*d(utilisation/100)/dt on the measurement (a setpoint change never kicks it), to the count it
    finds. What a limit cuts off is dropped, not stored, so nothing winds up at 32 or at a rate limit
    (anti-windup); the count then moves as soon as the error changes sign.

    Replicas still starting (the caller counts them) serve nothing yet: the count never grows past what the
    load on the serving ones would fill at the setpoint (HPA's ratio), so a pod's start is not waited out by
    adding more pods.
    """

    def __init__(self, settings: ScalerSettings) -> None:
        self.settings = settings
        self.reset()

    def reset(self) -> None:
        """Forget the history (another Deployment, a gap in the metric): the next decision starts bumpless."""
        self._target: float | None = None
        self._error: float | None = None
        self._measurement: float | None = None
        self._derivative = 0.0

    def decide(self, utilisation_percent: float, current: int, dt_s: float, starting: int = 0) -> Decision:
        """`starting`: how many of the `current` replicas do not show in the utilisation yet."""
        if not math.isfinite(utilisation_percent) or not math.isfinite(dt_s) or dt_s <= 0:
            raise ValueError(f"utilisation {utilisation_percent} and dt {dt_s} must be finite, dt positive")
        settings = self.settings
        error = (utilisation_percent - settings.setpoint_percent) / 100
        measurement = utilisation_percent / 100
        derivative = 0.0 if self._measurement is None else -settings.kd * (measurement - self._measurement) / dt_s
        proportional = 0.0 if self._error is None else settings.kp * (error - self._error)
        integral = settings.ki * error * dt_s
        derivative_step = derivative - self._derivative
        self._error, self._measurement, self._derivative = error, measurement, derivative
        if self._target is None or _nearest(self._target) != current:
            # First decision, or someone else scaled: continue from the count found.
            self._target = float(current)

        def decision(target: float, limit: Limit) -> Decision:
            self._target = target
            return Decision(
                utilisation_percent,
                current,
                starting,
                _nearest(target),
                proportional,
                integral,
                derivative_step,
                target,
                limit,
            )

        in_bounds = settings.min_replicas <= current <= settings.max_replicas
        if in_bounds and self._closest_count(utilisation_percent, current):
            return decision(float(current), "deadband")
        target = self._target * math.exp(proportional + integral + derivative_step)
        limit: Limit = "none"
        if (error > 0 and target < current) or (error < 0 and target > current):
            target, limit = float(current), "direction"
        # No more replicas than the load the serving ones show would keep at the setpoint (HPA's ratio, with
        # replicas still starting counted as serving nothing): a pod's start is not waited out by adding more.
        filled = (current - starting) * utilisation_percent / settings.setpoint_percent
        # Past the deadband one more replica is closer to the setpoint, even where the ratio rounds down (one
        # replica at 95 % fills 1.36), unless replicas are still starting.
        allowed = max(filled, float(current + 1 if error > 0 and starting == 0 else current))
        if target > allowed:
            target, limit = allowed, "load_cap"
        if target > current + settings.max_step_up:
            target, limit = float(current + settings.max_step_up), "max_step_up"
        if target < current - settings.max_step_down:
            target, limit = float(current - settings.max_step_down), "max_step_down"
        # The bounds come last: they hold even for a count someone else set outside them.
        if target > settings.max_replicas:
            target, limit = float(settings.max_replicas), "max_replicas"
        if target < settings.min_replicas:
            target, limit = float(settings.min_replicas), "min_replicas"
        return decision(target, limit)

    def _closest_count(self, utilisation_percent: float, replicas: int) -> bool:
        """True when neither one replica more nor one fewer would bring utilisation (which goes as 1/replicas
        under the same load) closer to the setpoint; holding there keeps the integral from walking an integer
        count back and forth between two neighbours."""
        setpoint = self.settings.setpoint_percent
        # Above `upper` the predicted utilisation at n+1 is closer to the setpoint; below `lower`, at n-1.
        upper = 2 * setpoint * (replicas + 1) / (2 * replicas + 1)
        lower = 2 * setpoint * (replicas - 1) / (2 * replicas - 1)
        return lower <= utilisation_percent <= upper


def utilisation_from_answer(answer: Any) -> float:
    """The one value of a Prometheus /api/v1/query answer, in percent; MetricUnavailable saying why not."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise MetricUnavailable(f"Prometheus answered an error: {error or answer!r}")
    data = answer.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar" and isinstance(result, list) and len(result) == 2:
        raw = result[1]
    elif kind == "vector" and isinstance(result, list):
        if not result:
            raise MetricUnavailable("the query returned no series (exporter not scraped, or stale)")
        if len(result) > 1:
            raise MetricUnavailable(f"the query returned {len(result)} series; it must aggregate them to one")
        raw = (result[0].get("value") or [None, None])[1]
    else:
        raise MetricUnavailable(f"unexpected result type {kind!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise MetricUnavailable(f"value {raw!r} is not a number") from None
    if not math.isfinite(value) or not 0 <= value <= 100:
        raise MetricUnavailable(f"value {raw} is not a utilisation in 0..100 %")
    return value


def read_prometheus(url: str, query: str, timeout_s: float) -> float:
    """The query's value from Prometheus's instant-query API."""
    address = f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    # The local Prometheus is never reached through a proxy, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(address, timeout=timeout_s) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as error:
        # Prometheus answers a bad query (400/422) with its JSON error body.
        try:
            answer = json.load(error)
        except ValueError:
            raise MetricUnavailable(f"Prometheus {url}: HTTP {error.code}") from None
    except (OSError, ValueError) as error:
        raise MetricUnavailable(f"Prometheus {url}: {error}") from None
    return utilisation_from_answer(answer)


class Scaler:
    """One decision at a time: find the serving colour's Deployment, read utilisation, decide, patch."""

    def __init__(
        self,
        settings: ScalerSettings,
        read_utilisation: Callable[[], float],
        get_replicas: Callable[[str], int],
        set_replicas: Callable[[str, int], int],
        deployments: Sequence[str] = DEPLOYMENTS,
    ) -> None:
        self.settings = settings
        self.deployments = deployments
        self.read_utilisation = read_utilisation
        self.get_replicas = get_replicas
        self.set_replicas = set_replicas
        self.controller = ReplicaController(settings)
        self.active: str | None = None
        self._last_decision_at: float | None = None
        # When each replica added to the active Deployment shows in the utilisation (ascending), and the count
        # last seen or set.
        self._visible_at: list[float] = []
        self._known: int | None = None

    def step(self, now: float) -> Decision | None:
        """One decision at monotonic time `now`, logged in one line; None when it held (the line says why)."""
        names = list(self.deployments)
        counts: dict[str, int] = {}
        for deployment in names:
            try:
                counts[deployment] = self.get_replicas(deployment)
            except KubeError as error:
                if error.status != 404:
                    self._hold(f"cannot read the Deployments' scale: {error}")
                    return None
                counts[deployment] = 0  # not created yet: the swap creates a colour the first time it serves it
            except OSError as error:
                self._hold(f"cannot read the Deployments' scale: {error}")
                return None
        serving = [name for name in names if counts[name] > 0]
        if len(serving) != 1:
            which = "both Deployments have replicas (a swap in progress)" if serving else "no Deployment has replicas"
            self._hold(f"{which}: " + ", ".join(f"{name}={counts[name]}" for name in names))
            return None
        name = serving[0]
        if name != self.active:
            # Another Deployment serves: its count, its starting replicas and the history are not the old one's.
            self.active, self._visible_at, self._known = name, [], None
            self._forget()
        self._track(counts[name], now)
        try:
            utilisation = self.read_utilisation()
        except MetricUnavailable as error:
            self._hold(f"{name} stays at {counts[name]}: no utilisation: {error}")
            return None
        dt_s = self.settings.interval_s if self._last_decision_at is None else now - self._last_decision_at
        decision = self.controller.decide(utilisation, counts[name], dt_s, starting=len(self._visible_at))
        self._last_decision_at = now
        if decision.desired != decision.current:
            try:
                self.set_replicas(name, decision.desired)
            except (KubeError, OSError) as error:
                self._forget()
                LOG.warning("%s: %s; patching the scale failed: %s", name, decision.describe(), error)
                return None
            self._track(decision.desired, now)
        LOG.info("%s: %s", name, decision.describe())
        return decision

    def _track(self, replicas: int, now: float) -> None:
        """Follow the active count, ours or someone else's: added replicas show after replica_ready_s, removed ones
        go newest first (the ReplicaSet deletes pods that are not ready first)."""
        if self._known is not None and replicas > self._known:
            self._visible_at += [now + self.settings.replica_ready_s] * (replicas - self._known)
        elif self._known is not None and replicas < self._known:
            del self._visible_at[max(0, len(self._visible_at) - (self._known - replicas)) :]
        self._visible_at = [at for at in self._visible_at if at > now]
        self._known = replicas

    def _forget(self) -> None:
        self.controller.reset()
        self._last_decision_at = None

    def _hold(self, reason: str) -> None:
        self._forget()
        LOG.warning("hold: %s", reason)


def run_scaler(
    settings: ScalerSettings,
    read_utilisation: Callable[[], float],
    get_replicas: Callable[[str], int],
    set_replicas: Callable[[str, int], int],
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    stop: Callable[[], bool],
) -> None:
    """Decide every `interval_s` of `clock` (monotonic seconds) until `stop()`; `sleep` waits between decisions."""
    scaler = Scaler(settings, read_utilisation, get_replicas, set_replicas)
    while not stop():
        started = clock()
        scaler.step(started)
        sleep(max(0.0, settings.interval_s - (clock() - started)))


def serve(service: ServiceSettings) -> int:
    """The scaler against the local Prometheus and the Kubernetes API, until SIGTERM or SIGINT."""
    settings, namespace = service.scaler, service.kubernetes.namespace
    client = cluster_client(service.kubernetes, settings.request_timeout_s)
    # Blocked signals wait in sigtimedwait: one that comes during a decision ends the loop after that decision.
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    received: list[int] = []

    def sleep(seconds: float) -> None:
        if (info := signal.sigtimedwait(signals, seconds)) is not None:
            received.append(info.si_signo)

    run_scaler(
        settings,
        lambda: read_prometheus(settings.prometheus_url, settings.query, settings.request_timeout_s),
        lambda name: client.get_scale(namespace, name),
        lambda name, replicas: client.set_scale(namespace, name, replicas),
        sleep,
        time.monotonic,
        lambda: bool(received),
    )
    LOG.info("stopped by signal %s", received[0])
    return 0
