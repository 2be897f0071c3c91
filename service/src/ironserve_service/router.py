"""Envoy configuration for the blue/green router: pure functions, plus the atomic file write.

Choice: Envoy's filesystem dynamic configuration, not an xDS server. The bootstrap holds a static
listener whose HTTP connection manager takes its routes from ``rds.json`` (RDS over a
``path_config_source`` with a ``watched_directory``) and ``cds.json`` (CDS, same mechanism) holds the
blue and green clusters. A switch is one ``os.replace`` of ``rds.json``, a symlink to the route's content,
inside the watched directory: Envoy sees the move, loads the whole file and applies the new RouteConfiguration
to every new stream, including those on already-open keep-alive and HTTP/2 connections, while streams in
flight finish on the cluster they started on. No extra long-running process, nothing to authenticate, and the
last good route survives a restart of the control loop or of etcd because it is a file.

X-Env colouring (``SwapSettings.routing``): requests with ``X-Env: staging`` go to the ``staging`` cluster,
``X-Env: canary`` to a weighted split between the ``canary`` cluster and the active colour (prod), anything
else (no header, unknown value, or a colour that is not configured) to the active colour. The header routes
are part of the same route file, so every rewrite by the control loop moves the canary split's prod share
to the new colour too.

Host traffic state (etcd's ``SwapSettings.traffic_key``, ``ironserve-service traffic`` and ``drain``), also part of
the route file: ``serving`` as above; ``draining``: ``/health`` answers 503 ``draining`` from Envoy itself, so the
site load balancer takes the host out, while the API paths are still served; ``closed``: every API path answers
503 ``draining`` too, new work is refused while the streams in flight finish on the route they started on. X-Env
routes follow the same state; the API keys still apply. When the host left serving for a reason (the GPU guard's,
etcd's ``SwapSettings.traffic_reason_key``), Envoy's 503 answers carry it in the ``x-ironserve-drain-reason`` header.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

from ironserve_service.settings import COLOURS, Colour, QualitySettings, RoutingSettings, SwapSettings

ROUTE_CONFIG_NAME = "ironserve"
COLOUR_HEADER = "x-ironserve-colour"
# The seed's x-backend header, kept for observability (hot-swap-lua-filter correction).
BACKEND_HEADER = "x-backend"
# X-Env request header (route-header-map): value -> cluster; Envoy matches header names case-insensitively.
ENV_HEADER = "x-env"
STAGING = "staging"
CANARY = "canary"
RDS_FILE = "rds.json"
CDS_FILE = "cds.json"
BOOTSTRAP_FILE = "bootstrap.json"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
BUFFER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
HEADER_MUTATION_TYPE = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
HEADER_MUTATION_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute"
)
UPSTREAM_CODEC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
# The upstream filter that adds x-ironserve-colour and x-backend, configured per route (answer_headers()). Envoy
# adds a route's own response_headers_to_add to its local replies too, the api_key_auth filter's 401 included (its
# filter manager's sendLocalReply finalizes them); an upstream filter runs only on an answer from an upstream,
# which a request reaches only once every listener filter, the key check first, has passed it.
ANSWER_HEADERS_FILTER = "ironserve.answer_headers"
UPSTREAM_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
API_KEY_FILTER = "envoy.filters.http.api_key_auth"
API_KEY_TYPE = "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"
API_KEY_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuthPerRoute"
FILTER_CONFIG_TYPE = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
# A client name and a key: what curl or the OpenAI SDK can send in a header, long enough not to be guessed.
API_CLIENT = r"[A-Za-z0-9_.-]{1,64}"
API_KEY_LINE = re.compile(rf"^(?P<client>{API_CLIENT})\s+(?P<key>[A-Za-z0-9._~+/=-]{{32,256}})$")
UPSTREAM_IDLE_TIMEOUT_S = 4
# Retried only when Envoy knows the engine never got the request (Envoy's router filter docs, x-envoy-retry-on):
# the connection could not be made (connect-failure), an HTTP/2 upstream refused the stream (refused-stream), or
# the connection failed before the request was sent on it (reset-before-request, Envoy >= 1.31). Not `reset`:
# it also retries a request the engine had and was generating for, which would run the generation twice.
RETRY_POLICY = {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 2}
# Concurrent retries per cluster: Envoy's default circuit breaker allows 3 (max_retries; Envoy's circuit
# breaking docs), which turned 7 of 10 connections lost at once under a swap into 503s (issue 33). A retry budget
# of 100 % of the cluster's active and pending requests lets every one of them retry at once: a retry here is
# only of a request the engine never saw, so it costs the engine nothing. min_retry_concurrency: the floor
# when few requests are active (Envoy's default floor is 3).
RETRY_BUDGET = {"budget_percent": {"value": 100.0}, "min_retry_concurrency": 64}
# The OpenAI routes the service offers, matched exactly: any other path (vLLM's management endpoints such as
# /v1/load_lora_adapter, which an engine flag can open) is 404 at Envoy and never reaches an engine.
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
HEALTH_PATH = "/health"
CHAT_PATH = "/v1/chat/completions"
# The quality sink (quality.py) receives a sampled copy of prod chat requests; Envoy never waits for it.
MIRROR_CLUSTER = "quality"
# The host's traffic state (module docstring): what the site load balancer and new requests get from this Envoy.
Traffic = Literal["serving", "draining", "closed"]
TRAFFIC_STATES: tuple[Traffic, ...] = ("serving", "draining", "closed")
# Envoy's own answer on /health while the host leaves its load balancer, and on the API paths once it is closed.
DRAINING_BODY = "draining"
DRAINING = {"status": 503, "body": {"inline_string": DRAINING_BODY}}
# Why the host is out of serving, on Envoy's own 503 answers: the body stays `draining`, which load balancers and
# traffic.envoy_traffic compare.
DRAIN_REASON_HEADER = "x-ironserve-drain-reason"
# A /health request carrying this header reaches the active colour in every traffic state: `swap` on a drained host
# must see the new colour answer through Envoy, which the load balancer's plain /health never reaches then.
PROBE_HEADER = "x-ironserve-probe"

JSON = dict[str, Any]


def _file_source(settings: SwapSettings, name: str) -> JSON:
    return {
        "path_config_source": {
            "path": str(settings.router_dir / name),
            "watched_directory": {"path": str(settings.router_dir)},
        },
        "resource_api_version": "V3",
    }


def bootstrap(settings: SwapSettings) -> JSON:
    """Static listener (HTTP/1.1 and h2c downstream), admin on loopback, routes and clusters from files."""
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "ingress",
        # AUTO: HTTP/1.1, and HTTP/2 by prior knowledge (h2c) on the same port.
        "codec_type": "AUTO",
        # Explicit, so the HTTP/2 side is visible in config_dump (ingress-envoy-http2); Envoy's defaults.
        "http2_protocol_options": {},
        # On the connection manager, not the router filter (catalog correction); streams idle > 300 s end.
        "stream_idle_timeout": f"{settings.stream_idle_timeout_s}s",
        "rds": {"route_config_name": ROUTE_CONFIG_NAME, "config_source": _file_source(settings, RDS_FILE)},
        # Requests are held until their end, responses (SSE token streams) forwarded as they arrive. Without the
        # buffer an HTTP/1.1 engine can answer a request whose body it has before the client's closing (empty)
        # END_STREAM frame reaches Envoy; Envoy then ends the stream with RST_STREAM(NO_ERROR) after the response
        # (RFC 9113 §8.1), and httpx/httpcore, the openai SDK's HTTP/2 stack, fails that request although
        # clients must keep the response (tests/test_h2_load.py shows both).
        "http_filters": [
            *_key_filter(settings),
            {
                "name": "envoy.filters.http.buffer",
                "typed_config": {"@type": BUFFER_TYPE, "max_request_bytes": settings.max_request_bytes},
            },
            {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}},
        ],
    }
    return {
        "node": {"id": f"ironserve-{settings.model_name}", "cluster": "ironserve"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": settings.admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {
                        "socket_address": {"address": settings.listen_host, "port_value": settings.listen_port}
                    },
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ]
        },
        "dynamic_resources": {"cds_config": _file_source(settings, CDS_FILE)},
    }


def _key_filter(settings: SwapSettings) -> list[JSON]:
    """With api_keys_file, every request needs a key: the listener's own list is empty (deny by default) and
    each API route brings the current keys (routes()), so a rotation is a route-file rename, like a switch."""
    if settings.api_keys_file is None:
        return []
    config = {"@type": API_KEY_TYPE, "credentials": [], "key_sources": [{"header": "authorization"}]}
    return [{"name": API_KEY_FILTER, "typed_config": config}]


def read_api_keys(path: Path) -> list[tuple[str, str]]:
    """(client, key) pairs of the keys file; ValueError naming the line (never the key) when one is malformed."""
    return parse_api_keys(path.read_text(encoding="utf-8"), str(path))


def parse_api_keys(text: str, source: str) -> list[tuple[str, str]]:
    """(client, key) pairs of a keys file's `text` (read where it lies: here, or on a host over SSH); ValueError
    naming `source` and the line (never the key) when one is malformed."""
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = API_KEY_LINE.match(stripped)
        if match is None:
            raise ValueError(
                f"{source} line {number}: not '<client> <key>' (a key is 32-256 of A-Z a-z 0-9 . _ ~ + / = -)"
            )
        pairs.append((match["client"], match["key"]))
    clients, keys = [c for c, _ in pairs], [k for _, k in pairs]
    if len(set(clients)) != len(clients) or len(set(keys)) != len(keys):
        raise ValueError(f"{source}: a client or a key appears twice")
    return pairs


def write_api_keys(path: Path, pairs: list[tuple[str, str]]) -> None:
    """Replace the keys file by rename (the control loop never reads half of it), mode 0640, group kept."""
    group = path.stat().st_gid if path.exists() else -1
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    with os.fdopen(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640), "w", encoding="utf-8") as handle:
        handle.write("# <client> <key>, one per line; `ironserve-service api-key add|remove|list`\n")
        handle.writelines(f"{client} {key}\n" for client, key in pairs)
    os.chown(staging, -1, group)
    os.replace(staging, path)


def _with_keys(served: list[JSON], api_keys: list[tuple[str, str]]) -> list[JSON]:
    """Every route asks for one of the keys (an unknown path answers 404 only to a client with one); /health
    stays open (readiness only, no model access)."""
    credentials = [{"client": client, "key": key} for client, key in api_keys]
    keyed = {API_KEY_FILTER: {"@type": API_KEY_ROUTE_TYPE, "credentials": credentials}}
    open_route = {API_KEY_FILTER: {"@type": FILTER_CONFIG_TYPE, "disabled": True}}
    return [
        {**r, "typed_per_filter_config": {**r.get("typed_per_filter_config", {}),
                                          **(open_route if r["match"].get("path") == HEALTH_PATH else keyed)}}
        for r in served
    ]  # fmt: skip


def _endpoint(host: str, port: int) -> JSON:
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cluster(colour: Colour, port: int) -> JSON:
    return upstream_cluster(colour, [("127.0.0.1", port)])


def upstream_cluster(name: str, addresses: list[tuple[str, int]]) -> JSON:
    """Round-robin over the addresses; DNS names resolve with STRICT_DNS, IP literals stay STATIC."""
    return {
        "@type": CLUSTER_TYPE,
        "name": name,
        "type": "STATIC" if all(_is_ip(host) for host, _ in addresses) else "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [_endpoint(host, port) for host, port in addresses]}],
        },
        # Envoy closes its idle upstream connections after 4 s; the engine keeps them for
        # launcher.ENGINE_KEEP_ALIVE_S, so only Envoy closes an idle connection and never writes a request on one
        # the engine is closing.
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": UPSTREAM_OPTIONS_TYPE,
                "common_http_protocol_options": {"idle_timeout": f"{UPSTREAM_IDLE_TIMEOUT_S}s"},
                "explicit_http_config": {"http_protocol_options": {}},
                "http_filters": [
                    {"name": ANSWER_HEADERS_FILTER, "typed_config": {"@type": HEADER_MUTATION_TYPE, "mutations": {}}},
                    {"name": "envoy.filters.http.upstream_codec", "typed_config": {"@type": UPSTREAM_CODEC_TYPE}},
                ],
            }
        },
        # Envoy's default of 1024 pending/active requests per cluster stays; vLLM queues beyond max_num_seqs.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "retry_budget": RETRY_BUDGET}]},
    }


def _colours(routing: RoutingSettings) -> dict[str, list[str]]:
    """The configured X-Env colours (cluster name -> backends); unconfigured ones are absent."""
    return {name: backends for name, backends in ((STAGING, routing.staging), (CANARY, routing.canary)) if backends}


def served_clusters(settings: SwapSettings) -> list[str]:
    """The clusters that requests are routed to: blue, green and the configured X-Env colours (not the mirror sink)."""
    return [*COLOURS, *_colours(settings.routing)]


def clusters(settings: SwapSettings, quality: QualitySettings | None = None) -> JSON:
    """blue and green (one local engine each), staging and canary when configured, the quality sink when mirrored."""
    extra = [
        upstream_cluster(name, [RoutingSettings.address(b) for b in backends])
        for name, backends in _colours(settings.routing).items()
    ]
    if quality is not None and quality.mirror_percent > 0:
        extra.append(upstream_cluster(MIRROR_CLUSTER, [(quality.mirror_host, quality.mirror_port)]))
    return {"version_info": "1", "resources": [*(cluster(c, settings.port(c)) for c in COLOURS), *extra]}


def route_version(colour: Colour | None, version: str | None, revision: int) -> str:
    return f"{revision}:{colour or 'none'}:{version or 'none'}"


def parse_route_version(text: str) -> tuple[int, str | None, str | None]:
    revision, colour, version = text.split(":", 2)
    return int(revision), (None if colour == "none" else colour), (None if version == "none" else version)


def answer_headers(colour: str, backend: str) -> JSON:
    """typed_per_filter_config of a route or weighted cluster: the colour headers on the engine's answers only."""
    added = [
        {"append": {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}
        for key, value in ((COLOUR_HEADER, colour), (BACKEND_HEADER, backend))
    ]
    return {ANSWER_HEADERS_FILTER: {"@type": HEADER_MUTATION_ROUTE_TYPE, "mutations": {"response_mutations": added}}}


def _env_match(match: JSON, value: str) -> JSON:
    # Values compare case-insensitively (nginx's map of the seed does too); any other value means prod.
    header = {"name": ENV_HEADER, "string_match": {"exact": value, "ignore_case": True}}
    return {**match, "headers": [header]}


def _x_env_routes(settings: SwapSettings, colour: Colour, matches: list[JSON], prod: JSON) -> list[JSON]:
    """Header routes placed before the prod ones: staging, and the canary split whose prod share is `colour`.

    The colour headers sit on each route or weighted cluster: Envoy takes the most specific filter config.
    """
    routing = settings.routing
    served: list[JSON] = []
    for name in _colours(routing):
        # The upstream address the request went to, filled in by Envoy (per-backend observability).
        headers = answer_headers(name, f"{name}/%UPSTREAM_REMOTE_ADDRESS%")
        if name == STAGING:
            action: JSON = {"cluster": STAGING}
            route_headers = headers
        else:
            split: list[JSON] = [
                {"name": CANARY, "weight": routing.canary_weight, "typed_per_filter_config": headers},
                {"name": colour, "weight": routing.prod_weight, "typed_per_filter_config": prod},
            ]
            action = {"weighted_clusters": {"clusters": [c for c in split if c["weight"] > 0]}}
            route_headers = {}
        action.update({"timeout": "0s", "retry_policy": RETRY_POLICY})
        for match in matches:
            route: JSON = {"match": _env_match(match, name), "route": action}
            if route_headers:
                route["typed_per_filter_config"] = route_headers
            served.append(route)
    return served


def mirror_policies(quality: QualitySettings | None) -> list[JSON]:
    """A copy of quality.mirror_percent of the requests to the sink, sampled by Envoy per request."""
    if quality is None or quality.mirror_percent <= 0:
        return []
    share = {"numerator": round(quality.mirror_percent * 10_000), "denominator": "MILLION"}
    return [{"cluster": MIRROR_CLUSTER, "runtime_fraction": {"default_value": share}}]


def drain_reason_headers(reason: str) -> list[JSON]:
    """response_headers_to_add naming the reason. Envoy reads `%` in these values as the start of a command operator
    (docs: "Custom request/response headers", `%%` for a literal one) and refuses control characters in a header
    value (RFC 9110 field-value), so `%` is doubled and anything but printable ASCII becomes `?`."""
    text = "".join(c if " " <= c <= "~" else "?" for c in reason).replace("%", "%%")
    return [{"header": {"key": DRAIN_REASON_HEADER, "value": text}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]


def _refused(match: JSON, traffic: Traffic) -> bool:
    """Whether Envoy answers a served path itself in this traffic state: /health unless serving, all when closed."""
    return traffic == "closed" or (traffic == "draining" and match["path"] == HEALTH_PATH)


def routes(
    settings: SwapSettings,
    colour: Colour | None,
    version: str | None,
    revision: int,
    quality: QualitySettings | None = None,
    api_keys: list[tuple[str, str]] | None = None,
    traffic: Traffic = "serving",
    traffic_reason: str | None = None,
) -> JSON:
    """Only the OpenAI API paths and /health reach the active colour; everything else is 404.

    X-Env: staging / canary (when configured) go to the staging cluster / the canary-vs-`colour` split on the
    same paths. colour None: no model is active yet, every served path gets 503 (X-Env included). With
    `quality`, prod chat requests are mirrored to the quality sink (staging and canary are not: their answers
    would be scored as prod's). With `settings.api_keys_file`, the API routes accept only `api_keys`.
    `traffic` draining: /health (X-Env included) answers 503 `draining`; closed: every served path does; either way
    a /health request with PROBE_HEADER still reaches the colour (swap's proof that the route moved). Envoy's own
    503 answers carry `traffic_reason`, when given, in DRAIN_REASON_HEADER.
    """
    matches: list[JSON] = [{"path": path} for path in (*API_PATHS, HEALTH_PATH)]
    if colour is None:
        no_model = {"status": 503, "body": {"inline_string": "no model"}}
        served: list[JSON] = [{"match": match, "direct_response": no_model} for match in matches]
    else:
        # timeout 0s: no route timeout, streams are bounded by the connection manager's idle timeout.
        action = {"cluster": colour, "timeout": "0s", "retry_policy": RETRY_POLICY}
        mirrored = {**action, "request_mirror_policies": mirror_policies(quality)}
        headers = answer_headers(colour, f"{settings.model_name}-{version}:{settings.port(colour)}")

        def prod(match: JSON) -> JSON:
            chat = match["path"] == CHAT_PATH and mirrored["request_mirror_policies"]
            return {"match": match, "route": mirrored if chat else action, "typed_per_filter_config": headers}

        refusal: JSON = {"direct_response": DRAINING}
        if traffic_reason:
            refusal["response_headers_to_add"] = drain_reason_headers(traffic_reason)
        served = [
            {"match": route["match"], **refusal} if _refused(route["match"], traffic) else route
            for route in (*_x_env_routes(settings, colour, matches, headers), *map(prod, matches))
        ]
        if traffic != "serving":
            probe = {"path": HEALTH_PATH, "headers": [{"name": PROBE_HEADER, "present_match": True}]}
            served.insert(0, prod(probe))
    served.append({"match": {"prefix": "/"}, "direct_response": {"status": 404}})
    if settings.api_keys_file is not None:
        served = _with_keys(served, api_keys or [])
    return {
        "version_info": route_version(colour, version, revision),
        "resources": [
            {
                "@type": ROUTE_TYPE,
                "name": ROUTE_CONFIG_NAME,
                "virtual_hosts": [
                    {
                        "name": settings.model_name,
                        "domains": ["*"],
                        "routes": served,
                    }
                ],
            }
        ],
    }


def route_traffic(route_config: JSON) -> Traffic:
    """The traffic state a RouteConfiguration rendered by routes() is in, read from its prod /health and chat
    routes: the same reading for the route file's resource and for the route Envoy's config_dump shows in force."""
    refused = {
        route["match"].get("path")
        for host in route_config.get("virtual_hosts", [])
        for route in host.get("routes", [])
        if "headers" not in route["match"] and route.get("direct_response") == DRAINING
    }
    if CHAT_PATH in refused:
        return "closed"
    return "draining" if HEALTH_PATH in refused else "serving"


def document_text(document: JSON) -> str:
    """A configuration file's text as the router writes it."""
    return json.dumps(document, indent=1)


def write_atomic(path: Path, document: JSON) -> None:
    """Write beside the target, then rename into the watched directory: Envoy never reads half a file.

    Mode 0640: the route file carries the API keys; Envoy runs as the owner or in the group."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    with os.fdopen(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640), "w", encoding="utf-8") as handle:
        handle.write(document_text(document))
    os.replace(staging, path)


def write_route(path: Path, document: JSON) -> None:
    """Write the route to a new file beside `path`, then flip `path`, a symlink, to it (the swap Envoy documents
    for watched files): the rename of the link into the watched directory makes Envoy reload. Renaming a regular
    file over the old one makes ext4 flush the new file's data first (auto_da_alloc), 100+ ms on a host with
    busy disks, on the switch's hot path; a symlink has no data to flush."""
    path.parent.mkdir(parents=True, exist_ok=True)
    content = path.with_name(f".{path.stem}-{time.time_ns()}-{os.getpid()}{path.suffix}")
    with os.fdopen(os.open(content, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640), "w", encoding="utf-8") as handle:
        handle.write(document_text(document))
    link = path.with_name(f".{path.name}.{os.getpid()}.link")
    link.unlink(missing_ok=True)
    os.symlink(content.name, link)
    os.replace(link, path)


def prune_routes(path: Path) -> None:
    """Removes the route contents the link at `path` no longer names, after the switch: an unlink can wait on
    a busy disk's journal."""
    served = os.readlink(path) if path.is_symlink() else None
    for old in path.parent.glob(f".{path.stem}-*{path.suffix}"):
        if old.name != served:
            old.unlink(missing_ok=True)


def startup_files(settings: SwapSettings, quality: QualitySettings | None = None) -> dict[Path, str]:
    """What `ironserve-service router` writes before it starts Envoy, path -> text: the bootstrap and the clusters.
    Envoy runs the current settings when these files are these texts; a settings change that leaves them as they
    are (a swap bound, a chaos phase) needs no restart of Envoy, which would cut the requests in flight."""
    return {
        settings.router_dir / BOOTSTRAP_FILE: document_text(bootstrap(settings)),
        settings.router_dir / CDS_FILE: document_text(clusters(settings, quality)),
    }


def write_initial(settings: SwapSettings, bootstrap_path: Path, quality: QualitySettings | None = None) -> None:
    """Bootstrap and clusters; a route file only when none exists (the last good route is kept)."""
    write_atomic(bootstrap_path, bootstrap(settings))
    write_atomic(settings.router_dir / CDS_FILE, clusters(settings, quality))
    if not (settings.router_dir / RDS_FILE).exists():
        write_route(settings.router_dir / RDS_FILE, routes(settings, None, None, 0))
        prune_routes(settings.router_dir / RDS_FILE)


def current_route(settings: SwapSettings) -> tuple[int, str | None, str | None]:
    """(etcd revision, colour, version) of the route file Envoy serves; (0, None, None) when absent."""
    try:
        document = json.loads((settings.router_dir / RDS_FILE).read_text(encoding="utf-8"))
        return parse_route_version(str(document["version_info"]))
    except (OSError, ValueError, KeyError):
        return 0, None, None


def envoy_command(binary: Path, bootstrap_path: Path, extra: list[str] | None = None) -> list[str]:
    return [str(binary), "-c", str(bootstrap_path), "--disable-hot-restart", "--log-level", "warning", *(extra or [])]
