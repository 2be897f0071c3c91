"""The load-and-chaos gate's parts, each run for real: locust against a local HTTP server, stress-ng on this
machine; the verdict as a pure function. The gate on vLLM behind a swap is in test_hot_swap.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from ironserve_service import chaos
from ironserve_service.chaos import LoadResult
from ironserve_service.settings import ChaosSettings

QUICK = ChaosSettings(users=4, wait_min_s=0.01, wait_max_s=0.02, warmup_s=1, load_s=3, settle_s=1, min_requests=10)


class Chat(ThreadingHTTPServer):
    """Answers POST /v1/chat/completions with `status`; records each request's prompt."""

    def __init__(self, status: int, delay_s: float = 0.0) -> None:
        self.status = status
        self.delay_s = delay_s
        self.prompts: list[str] = []
        super().__init__(("127.0.0.1", 0), ChatHandler)


class ChatHandler(BaseHTTPRequestHandler):
    server: Chat

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.prompts.append(body["messages"][0]["content"])
        time.sleep(self.server.delay_s)
        answer = json.dumps({"choices": [{"message": {"content": "pong"}}]}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(status: int, delay_s: float = 0.0) -> Iterator[Chat]:
    server = Chat(status, delay_s)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def chat_ok() -> Iterator[Chat]:
    yield from serve(200)


@pytest.fixture
def chat_failing() -> Iterator[Chat]:
    yield from serve(503)


def url(server: Chat) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.invariant("rel-locust-load-test")
def test_locust_loads_the_chat_route_and_its_stats_are_read(chat_ok: Chat) -> None:
    result = chaos.run_load(QUICK, url(chat_ok), "qwen2-7b", QUICK.load_s)
    assert result.requests >= 10 and result.failures == 0 and result.p99_ms is not None
    # Locust counts every request the server saw, the ones still running when the phase ended too.
    assert result.requests == len(chat_ok.prompts)
    assert set(chat_ok.prompts) == {"ping"}  # no queries file: the canary's prompt


def test_requests_still_running_when_the_phase_ends_are_counted() -> None:
    """Answers take 1.5 s and the phase 2 s: each user's second request ends after the phase; cutting it off would
    drop the slowest answers from the P99."""
    for server in serve(200, delay_s=1.5):
        result = chaos.run_load(QUICK.model_copy(update={"users": 2}), url(server), "qwen2-7b", 2)
        assert result.requests == len(server.prompts) > 2
        assert result.p99_ms is not None and result.p99_ms >= 1500


def test_every_failed_answer_is_counted(chat_failing: Chat) -> None:
    result = chaos.run_load(QUICK, url(chat_failing), "qwen2-7b", 2)
    assert result.requests > 0 and result.failures == result.requests


@pytest.mark.invariant("rel-locust-load-test")
def test_queries_are_sampled_from_the_queries_file(chat_ok: Chat, tmp_path: Path) -> None:
    queries = tmp_path / "queries.txt"
    queries.write_text("".join(f"question {n}\n\n" for n in range(50)), encoding="utf-8")
    settings = QUICK.model_copy(update={"queries_file": queries, "sample_queries": 5})
    chaos.run_load(settings, url(chat_ok), "qwen2-7b", 2)
    asked = set(chat_ok.prompts)
    assert asked <= {f"question {n}" for n in range(50)} and 1 <= len(asked) <= 5


def test_a_load_run_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    missing = QUICK.model_copy(update={"queries_file": tmp_path / "absent.txt"})
    with pytest.raises(RuntimeError, match="locust wrote no stats"):
        chaos.run_load(missing, "http://127.0.0.1:9", "qwen2-7b", 1)


def test_the_p99_is_read_from_locusts_histograms() -> None:
    def entry(requests: int, failures: int, times: dict[str, int]) -> dict[str, object]:
        return {"num_requests": requests, "num_failures": failures, "response_times": times}

    # 100 requests: 98 at 10 ms, one at 250 ms, one at 3000 ms; the 99th is the one at 250 ms.
    assert chaos.summarise([entry(60, 0, {"10": 59, "250": 1}), entry(40, 2, {"10": 39, "3000": 1})]) == LoadResult(
        100, 2, 250.0
    )
    assert chaos.summarise([entry(1, 0, {"42": 1})]) == LoadResult(1, 0, 42.0)
    assert chaos.summarise([]) == LoadResult(0, 0, None)


@pytest.mark.invariant("rel-chaos-p99-gate")
@pytest.mark.parametrize(
    ("baseline", "under_chaos", "ok", "said"),
    [
        (LoadResult(200, 0, 100.0), LoadResult(200, 0, 115.0), True, "+15%"),
        (LoadResult(200, 0, 100.0), LoadResult(200, 0, 116.0), False, "+16%"),
        (LoadResult(200, 0, 100.0), LoadResult(200, 0, 60.0), True, "-40%"),
        (LoadResult(200, 0, 100.0), LoadResult(200, 3, 100.0), False, "chaos: 3 of 200 requests failed"),
        (LoadResult(200, 1, 100.0), LoadResult(200, 0, 100.0), False, "baseline: 1 of 200 requests failed"),
        (LoadResult(99, 0, 100.0), LoadResult(200, 0, 100.0), False, "baseline: 99 requests, fewer than"),
        (LoadResult(200, 0, 100.0), LoadResult(0, 0, None), False, "chaos: 0 requests"),
    ],
)
def test_the_verdict(baseline: LoadResult, under_chaos: LoadResult, ok: bool, said: str) -> None:
    verdict, detail = chaos.verdict(ChaosSettings(), baseline, under_chaos)
    assert verdict is ok and said in detail


@pytest.mark.invariant("rel-chaos-memory-pressure")
def test_stress_ng_runs_the_catalog_command_in_the_service_slice() -> None:
    assert chaos.stress_command(ChaosSettings()) == [
        "stress-ng", "--vm", "2", "--vm-bytes", "4G", "--timeout", "60s", "--quiet",
    ]  # fmt: skip
    in_slice = chaos.stress_command(ChaosSettings(slice="ai-service.slice"))
    assert in_slice[:5] == ["systemd-run", "--quiet", "--scope", "--slice=ai-service.slice", "--"]


def stress_processes() -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(b"stress-ng"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _resident_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.invariant("rel-chaos-memory-pressure")
def test_memory_pressure_holds_memory_while_the_block_runs_and_ends_with_it() -> None:
    settings = QUICK.model_copy(update={"vm_workers": 1, "vm_bytes": "64M", "settle_s": 1.5})
    before = set(stress_processes())
    with chaos.memory_pressure(settings):
        running = set(stress_processes()) - before
        assert running, "no stress-ng process"
        # A vm worker maps, touches and unmaps its 64 MiB in a loop: the most it holds over a second.
        peak = 0
        for _ in range(50):
            peak = max(peak, *(_resident_kib(pid) for pid in running))
            time.sleep(0.02)
        assert peak > 48 * 1024
    assert not set(stress_processes()) & running


def test_stress_ng_that_cannot_start_fails_the_chaos_phase() -> None:
    hostile = QUICK.model_copy(update={"vm_bytes": "999999G", "settle_s": 1.5})
    with pytest.raises(RuntimeError, match="stress-ng exited"), chaos.memory_pressure(hostile):
        pass


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"wait_min_s": 0.5, "wait_max_s": 0.1}, "below wait_min_s"),
        ({"vm_bytes": "4G; rm -rf /"}, "vm_bytes"),
        ({"slice": "ai-service"}, "slice"),
        ({"slice": "../x.slice --user"}, "slice"),
        ({"max_p99_increase": -0.1}, "max_p99_increase"),
    ],
)
def test_mistaken_chaos_settings_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChaosSettings.model_validate(change)


def test_no_stress_ng_outlives_a_failed_load() -> None:
    """A load run that raises inside the block still ends stress-ng (the chaos phase's `finally`)."""
    settings = QUICK.model_copy(update={"vm_workers": 1, "vm_bytes": "16M", "settle_s": 0.5})
    before = set(stress_processes())
    with pytest.raises(RuntimeError), chaos.memory_pressure(settings):
        raise RuntimeError("the load run failed")
    leftover = set(stress_processes()) - before
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover
