"""Background servers of the lab edge (Redfish emulator, apt mirror, pip index): start, wait, follow the host, stop.

One mechanism for every such server, so each starts detached in its own session, is known to answer
before `start` returns, exits by itself once its lab host is gone, and is stopped only if the pid is
still the process the lab started (a recycled pid is left alone).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

START_TIMEOUT_S = 15.0


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((bind, 0))
        port: int = sock.getsockname()[1]
        return port


def start(argv: list[str], bind: str, port: int, log: Path, what: str) -> int:
    """Start `argv` detached, logging to `log`; return its pid once `bind:port` accepts connections."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection((bind, port), timeout=0.5).close()
            return proc.pid
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start; see {log}") from None
            time.sleep(0.1)


def running(pid: int, module: str) -> bool:
    """Whether `pid` is still the server started as `python -m module` (not a recycled pid)."""
    try:
        return module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def stop(pid: int, module: str) -> None:
    """SIGTERM the server, reap it if it is our child, SIGKILL it after 5 s."""
    if not running(pid, module):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not running(pid, module):
                return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def exit_with(watch_pid: int | None, shutdown: Callable[[], None]) -> None:
    """In the server: call `shutdown` once the lab host's process `watch_pid` is gone, however it stopped."""
    if not watch_pid:
        return

    def watch() -> None:
        while True:
            time.sleep(1)
            try:
                os.kill(watch_pid, 0)
            except ProcessLookupError:
                shutdown()
                return

    threading.Thread(target=watch, daemon=True).start()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_directory(root: Path, bind: str, port: int, watch_pid: int | None) -> None:
    """In the server: serve the files under `root` over HTTP until SIGTERM or until `watch_pid` is gone."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer((bind, port), handler)
    exit_with(watch_pid, lambda: os._exit(0))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server.serve_forever()


def start_directory(module: str, root: Path, bind: str, watch_pid: int | None, log: Path, what: str) -> tuple[int, str]:
    """Start `python -m <module> serve` for `root` on `bind` (see add_serve_command); return (pid, base URL)."""
    port = free_port(bind)
    argv = [sys.executable, "-m", module, "serve", "--root", str(root), "--bind", bind, "--port", str(port)]
    if watch_pid:
        argv += ["--watch-pid", str(watch_pid)]
    return start(argv, bind, port, log, what), f"http://{bind}:{port}"


def add_serve_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The `serve` command a module started by start_directory offers (run it with serve_directory)."""
    serve = commands.add_parser("serve")
    serve.add_argument("--root", type=Path, required=True)
    serve.add_argument("--bind", required=True)
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--watch-pid", type=int, help="exit when this process (the lab host) is gone")
