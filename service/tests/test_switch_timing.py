"""The switch's breakdown: the control loop's timestamps, read back from its log line, and the step arithmetic;
`swap`'s questions through the listener, on one kept-alive connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hotswap_stack import SWITCH_STEPS, control_switches, free_port, percentile, switch_breakdown

from ironserve_service import router, swap
from ironserve_service.control import Controller, SwitchTiming
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, ServiceSettings, SwapSettings


def test_the_control_loops_switch_line_gives_back_its_timestamps(tmp_path: Path) -> None:
    swap = SwapSettings(router_dir=tmp_path / "envoy", run_dir=tmp_path / "run")
    lines: list[str] = []
    controller = Controller(
        ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap),
        check=lambda colour: ProbeResult(True, "checked"),
        log=lines.append,
    )
    controller.values = {swap.active_key: "v2", swap.colour_key("green"): "v2"}
    received_at = round(time.time() - 0.001, 6)
    controller.apply(41, received_at)
    [switch] = control_switches("etcd unreachable (a line of another kind)\n" + "\n".join(lines)).values()
    assert list(control_switches("\n".join(lines))) == [41]
    assert switch.event_at == received_at
    assert switch.event_at <= switch.checked_at <= switch.written_at


def test_the_steps_add_up_to_the_switch_latency() -> None:
    control = SwitchTiming(event_at=100.0012, checked_at=100.0015, written_at=100.0031)
    steps = switch_breakdown(100.0, control, envoy_applied_at=100.005, asked_at=100.0056, served_at=100.0125)
    assert tuple(steps) == SWITCH_STEPS
    expected = {"etcd watch": 1.2, "readiness check": 0.3, "route file write": 1.6, "Envoy apply": 1.9,
                "question": 0.6, "first answer": 6.9}  # fmt: skip
    assert steps == pytest.approx(expected)
    assert sum(steps.values()) == pytest.approx(12.5)


def test_nearest_rank_percentiles() -> None:
    ten = [float(v) for v in (5, 1, 9, 3, 7, 2, 8, 4, 10, 6)]
    assert (percentile(ten, 50), percentile(ten, 99), percentile(ten, 0)) == (5.0, 10.0, 1.0)
    assert percentile([], 99) != percentile([], 99)  # NaN: nothing measured


@dataclass
class Listener:
    """A real HTTP/1.1 listener standing in for Envoy's: /health answered by blue until `switch_at`
    (time.monotonic()), by green from then on (the route switch, seen from outside); counts connections and
    questions, and closes each connection after one answer when `close_each` (as a listener may)."""

    switch_at: float = float("inf")
    close_each: bool = False
    connections: int = 0
    questions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def listener() -> Iterator[tuple[Listener, ServiceSettings]]:
    state = Listener()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with state.lock:
                state.connections += 1

        def do_GET(self) -> None:
            with state.lock:
                state.questions += 1
            self.send_response(200)
            self.send_header(router.COLOUR_HEADER, "green" if time.monotonic() >= state.switch_at else "blue")
            self.send_header("Content-Length", "0")
            if state.close_each:
                self.send_header("Connection", "close")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, ServiceSettings(engine=EngineSettings(model_dir=Path("/absent")), swap=SwapSettings(listen_port=port))
    server.shutdown()
    server.server_close()


def test_the_questions_share_one_kept_alive_connection_until_the_new_colour_answers(
    listener: tuple[Listener, ServiceSettings],
) -> None:
    state, settings = listener
    state.switch_at = time.monotonic() + 0.1
    answer = swap.first_answer_from(settings, "green", timeout_s=5)
    assert answer is not None
    assert answer.asked_at <= answer.answered_at and state.switch_at <= answer.answered_at
    assert state.questions > 10 and state.connections == 1


def test_a_connection_the_listener_closes_is_opened_again(listener: tuple[Listener, ServiceSettings]) -> None:
    state, settings = listener
    state.close_each = True
    state.switch_at = time.monotonic() + 0.05
    answer = swap.first_answer_from(settings, "green", timeout_s=5)
    assert answer is not None
    assert state.connections == state.questions > 1


def test_the_questions_stop_at_the_timeout(listener: tuple[Listener, ServiceSettings]) -> None:
    started = time.monotonic()
    assert swap.first_answer_from(listener[1], "green", timeout_s=0.3) is None
    assert 0.3 <= time.monotonic() - started < 1.5


def test_no_listener_is_no_answer_until_the_timeout() -> None:
    settings = ServiceSettings(
        engine=EngineSettings(model_dir=Path("/absent")), swap=SwapSettings(listen_port=free_port())
    )
    assert swap.first_answer_from(settings, "green", timeout_s=0.2) is None
