"""A webhook receiver for Alertmanager's notifications, as a site's chat or ticket hook would get them: keeps each
POSTed JSON body, in arrival order. Listens on the address given (loopback, or the lab bridge's for lab hosts)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver(ThreadingHTTPServer):
    """Started by `with WebhookReceiver(address) as receiver:`; `receiver.url` is what a webhook setting names."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0, path: str = "/alerts") -> None:
        self.notifications: list[dict[str, Any]] = []
        self._arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._arrived:
                    receiver.notifications.append(json.loads(body))
                    receiver._arrived.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass  # the test prints what matters

        super().__init__((address, port), Handler)
        self.path = path
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}{self.path}"

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    def wait_for(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """The notifications once `count` have arrived, or all that did within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while len(self.notifications) < count and (left := deadline - time.monotonic()) > 0:
                self._arrived.wait(left)
            return list(self.notifications)
