"""Why an SDK client over h2c that stops reading a stream keeps the engine busy: the client never says so.

A minimal reproduction against a plain HTTP/2 server (the `h2` library on a socket, no Envoy, no vLLM): the
server sends an endless event stream and records what the client sends back. httpx2/httpcore2 (what the
openai SDK uses) closing a response early over HTTP/2 sends no RST_STREAM: httpcore2's `_response_closed`
only forgets the stream (`httpcore2/_sync/http2.py`), so every proxy in between sees a stream that is
still open, and the engine generates to the end. Closing the client (its connection) is seen at once, and
so is an HTTP/1.1 client closing early (the connection goes). Envoy forwards a client's RST_STREAM or a
closed connection to the upstream as a reset, which makes vLLM abort the request. The workaround for SDK
users is therefore: over h2c, close the client (or the `http_client`) to abandon a stream, or stream over
HTTP/1.1. When this test starts failing, httpcore2 sends the reset and the workaround can go.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import httpx2
import pytest


@dataclass
class Seen:
    resets: list[int] = field(default_factory=list)
    closed: threading.Event = field(default_factory=threading.Event)
    requests: int = 0


def _serve(sock: socket.socket, seen: Seen) -> None:
    """One connection: answer each request with an event stream, a chunk every 20 ms, until told to stop."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.settimeout(0.02)
    streaming: set[int] = set()
    try:
        while True:
            try:
                data = sock.recv(65535)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        seen.requests += 1
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "text/event-stream")])
                        streaming.add(event.stream_id)
                    elif isinstance(event, h2.events.StreamReset):
                        seen.resets.append(event.stream_id)
                        streaming.discard(event.stream_id)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        return
            except TimeoutError:
                pass
            for stream_id in list(streaming):
                if conn.local_flow_control_window(stream_id) > 64:
                    conn.send_data(stream_id, b"data: {}\n\n")
            sock.sendall(conn.data_to_send())
    except OSError:
        return
    finally:
        seen.closed.set()
        sock.close()


@pytest.fixture
def h2_server() -> Iterator[tuple[str, Seen]]:
    listener = socket.create_server(("127.0.0.1", 0))
    seen = Seen()

    def accept() -> None:
        with listener:
            connection, _ = listener.accept()
            _serve(connection, seen)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions", seen


def _read_a_little(client: httpx2.Client, url: str) -> None:
    with client.stream("POST", url, json={"stream": True}) as response:
        assert response.http_version == "HTTP/2"
        for index, _ in enumerate(response.iter_lines()):
            if index == 3:
                break  # the application stops reading, as an SDK user closing the stream does


def test_httpx2_closing_an_h2_stream_early_sends_no_reset(h2_server: tuple[str, Seen]) -> None:
    url, seen = h2_server
    with httpx2.Client(http1=False, http2=True, timeout=10) as client:
        _read_a_little(client, url)
        time.sleep(0.5)
        assert seen.requests == 1
        assert seen.resets == [], "httpcore2 now resets an abandoned stream: drop the workaround in the README"
        assert not seen.closed.is_set()  # the connection stays open and the server keeps sending
    # The workaround: closing the client ends the connection, which a proxy forwards as a reset.
    assert seen.closed.wait(5)
