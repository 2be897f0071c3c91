"""Which engine clients reach now: the colour of the route Envoy serves.

The exporter, the quality replays and the release gate read an engine; each must read the one traffic goes
to, and switch at the same moment. The route file (``router_dir/rds.json``) is that truth: the control loop
writes it from etcd's active version only after the colour's readiness check, Envoy applies it on the
rename, and it keeps the last good route while etcd or the control loop is down.
"""

from __future__ import annotations

from dataclasses import dataclass

from ironserve_service import router
from ironserve_service.settings import COLOURS, Colour, ServiceSettings


@dataclass(frozen=True)
class ServingEngine:
    # None with a base_url: this host has no blue/green router, the configured engine is the one served.
    colour: Colour | None
    version: str | None
    # None: the route serves nothing yet (503 for every request).
    base_url: str | None


def serving_engine(settings: ServiceSettings) -> ServingEngine:
    if not (settings.swap.router_dir / router.RDS_FILE).exists():
        return ServingEngine(None, None, settings.engine.base_url)
    _, routed, version = router.current_route(settings.swap)
    for colour in COLOURS:
        if routed == colour:
            return ServingEngine(colour, version, f"http://{settings.engine.host}:{settings.swap.port(colour)}")
    return ServingEngine(None, version, None)
