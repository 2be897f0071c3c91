"""`traffic STATE` and `drain`: the host's traffic state, observed in force on Envoy.

The state is etcd's ``SwapSettings.traffic_key``; the control loop renders it into the route file (router.py:
serving, draining, closed), so it survives a restart of the control loop, of Envoy or of the host. `traffic` puts
it and waits until Envoy serves it: the listener's /health (what the site load balancer asks) answers 503
``draining`` or not, and the route Envoy has in force (its admin's config_dump) refuses the API paths or not.
`drain` walks a host out of its load balancer before maintenance: draining, the notice for the load balancer's
health checks, closed, then Envoy's in-flight requests down to zero within a bound.
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from collections.abc import Callable

from ironserve_service import router
from ironserve_service.control import EnvoyAdmin, Etcd, EtcdError, traffic_reason
from ironserve_service.settings import SwapSettings

# Questions to Envoy while waiting for a state: the reported time has a tenth of a second's resolution.
TRAFFIC_POLL_S = 0.05
# How long the listener's /health may take: Envoy's own 503 comes at once, an engine's answer within its probe time.
LISTENER_TIMEOUT_S = 2.0
# How often `drain` says how many requests are still running.
PROGRESS_EVERY_S = 5.0


class TrafficError(Exception):
    """etcd refused the state, or Envoy did not serve it in time."""


class DrainTimeout(Exception):
    def __init__(self, running: int) -> None:
        super().__init__(f"{running} requests still running")
        self.running = running


def listener_health(swap: SwapSettings) -> tuple[int, str]:
    """Status and body of GET /health on Envoy's listener, asked as the site load balancer asks it (one connection,
    no proxy)."""
    listener = urllib.parse.urlsplit(swap.listener_url)
    host, port = listener.hostname or "127.0.0.1", listener.port or 80
    connection = http.client.HTTPConnection(host, port, timeout=LISTENER_TIMEOUT_S)
    try:
        connection.request("GET", router.HEALTH_PATH)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def envoy_traffic(swap: SwapSettings) -> tuple[router.Traffic | None, str]:
    """The state Envoy serves now, and what was seen; None when the listener and the route in force disagree (a
    route Envoy has applied but its workers not yet) or Envoy cannot be read."""
    try:
        in_force = EnvoyAdmin(swap.admin_port).route_traffic()
        try:
            status, body = listener_health(swap)
        except TimeoutError:
            # Envoy answers its own 503 at once: a /health with no answer was forwarded to an engine that holds it
            # (a hung one is what a drain can time out on), so the listener is not refusing.
            status, body = 0, f"no answer within {LISTENER_TIMEOUT_S:g} s, forwarded to the engine"
    except (OSError, http.client.HTTPException, ValueError) as error:
        return None, f"Envoy unreadable: {error}"
    seen = f"/health answered {status} {body.strip()[:60]!r}, the route in force is {in_force or 'none'}"
    out_of_balancer = status == 503 and body.strip() == router.DRAINING_BODY
    if in_force is None or out_of_balancer != (in_force != "serving"):
        return None, seen
    return in_force, seen


def overwritten(swap: SwapSettings, etcd: Etcd, revision: int) -> str | None:
    """What became of the traffic key after the write at `revision`: None while that write stands (or etcd cannot
    say); else the state and reason written since, e.g. by the GPU guard draining a host put back while unfit."""
    try:
        snapshot = etcd.get_prefix(swap.key_prefix)
    except EtcdError:
        return None
    if snapshot.mod_revisions.get(swap.traffic_key) == revision:
        return None
    reason = traffic_reason(swap, snapshot.values)
    now = snapshot.values.get(swap.traffic_key)
    return f"{swap.traffic_key} was written again since: {now}" + (f" ({reason})" if reason else "")


def set_traffic(swap: SwapSettings, state: router.Traffic) -> float:
    """Puts the state into etcd and waits up to swap.switch_timeout_s for Envoy to serve it; returns the seconds that
    took. TrafficError when etcd refuses the write, the key is written again meanwhile, or the state is not in force
    in time."""
    started = time.monotonic()
    etcd = Etcd(swap.etcd_url, swap.etcd_timeout_s)
    try:
        revision = etcd.put(swap.traffic_key, state)
    except EtcdError as error:
        raise TrafficError(f"{swap.traffic_key} not written: {error}") from error
    seen = ""
    while time.monotonic() - started < swap.switch_timeout_s:
        served, seen = envoy_traffic(swap)
        if served == state:
            return time.monotonic() - started
        other = overwritten(swap, etcd, revision)
        if other is not None:
            raise TrafficError(f"{state} not in force: {other}")
        time.sleep(TRAFFIC_POLL_S)
    raise TrafficError(
        f"{swap.traffic_key} is {state} in etcd but not in force on Envoy after {swap.switch_timeout_s:g} s ({seen}); "
        "is `ironserve-service control` running, and a model active?"
    )


def in_flight(swap: SwapSettings) -> int:
    """Requests Envoy has open to the engines and the X-Env backends (upstream_rq_active of their clusters)."""
    admin = EnvoyAdmin(swap.admin_port)
    return sum(admin.active_requests(cluster) for cluster in router.served_clusters(swap))


def drain(swap: SwapSettings, notice_s: float, timeout_s: float, progress: Callable[[str], None]) -> float:
    """draining (in force), notice_s for the load balancer's health checks, closed (in force), then the requests in
    flight down to zero; returns the seconds they took to finish. DrainTimeout after timeout_s with some still
    running, TrafficError when a state does not come into force: the caller decides what the host serves then."""
    progress(f"traffic: draining (in force on Envoy after {set_traffic(swap, 'draining'):.1f} s); "
             f"waiting {notice_s:g} s for the load balancer's health checks")  # fmt: skip
    time.sleep(notice_s)
    progress(f"traffic: closed (in force on Envoy after {set_traffic(swap, 'closed'):.1f} s); new requests refused")
    started = time.monotonic()
    next_progress = started + PROGRESS_EVERY_S
    while (running := in_flight(swap)) > 0:
        now = time.monotonic()
        if now - started >= timeout_s:
            raise DrainTimeout(running)
        if now >= next_progress:
            progress(f"{running} requests still running")
            next_progress = now + PROGRESS_EVERY_S
        time.sleep(min(swap.poll_interval_s, max(0.0, started + timeout_s - now)))
    return time.monotonic() - started
