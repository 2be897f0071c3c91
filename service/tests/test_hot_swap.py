"""Blue/green hot swap with real processes: etcd, Envoy, the control loop, two CPU vLLM instances, clients.

Order matters (one stack for the module, like the engine tests): deploy v1 on blue, swaps under load,
a version that fails readiness, etcd down, then the active instance SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx2
import openai
import pytest
import yaml
from conftest import ENGINE_PYTHON
from hotswap_stack import (
    CHAT,
    MODEL,
    Load,
    Stack,
    build_stack,
    complete,
    engine_core_pid,
    engine_pid,
    failures,
    h2c_request,
    missing_reason,
    one_request,
)
from prometheus_client.parser import text_string_to_metric_families
from test_chaos import stress_processes
from test_exporter import prometheus_scraping, query

from ironserve_service import exporter, swap
from ironserve_service.control import EnvoyAdmin, Etcd, wait_for
from ironserve_service.health import http_json
from ironserve_service.settings import COLOURS, ChaosSettings, Colour

pytestmark = [pytest.mark.engine, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU backend pins its OpenMP worker to core 0 by default: two instances on one core starve
    # the loading one. Unpinned, single-threaded engines share the cores (CPU test hosts only).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    running = build_stack(tmp_path_factory.mktemp("hotswap"), tiny_model, ENGINE_PYTHON)
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def prometheus(stack: Stack) -> Iterator[str]:
    """A real Prometheus scraping the stack's exporter every second; yields its URL."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus absent: apt-get install prometheus")
    with prometheus_scraping(f"127.0.0.1:{stack.settings.exporter.port}", stack.work) as prometheus:
        yield prometheus


def scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The exporter's samples as {(name, sorted labels): value}."""
    text = exporter.fetch_text(f"http://127.0.0.1:{stack.settings.exporter.port}/metrics", 10)
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}  # fmt: skip


def engine_reading(stack: Stack, colour: Colour) -> exporter.FrameworkReading:
    """vLLM's own /metrics of one colour, read directly (not through the exporter)."""
    url = f"http://127.0.0.1:{stack.settings.swap.port(colour)}/metrics"
    return exporter.parse_vllm_metrics(exporter.fetch_text(url, 5))


def assert_observers_follow(stack: Stack, prometheus: str, colour: Colour, version: str) -> None:
    """The exporter, the mirror's quality replay and Prometheus all read the colour Envoy serves."""

    def engine_tokens() -> float:
        tokens = engine_reading(stack, colour).generation_tokens
        assert tokens is not None
        return tokens

    before = engine_tokens()
    samples = scrape(stack)
    after = engine_tokens()
    seen = samples[("ironserve_tokens_total", (("kind", "generation"),))]
    # Counters only grow: the exporter's figure lies between two direct reads of the serving engine.
    assert before <= seen <= after, (colour, before, seen, after)
    assert samples[("ironserve_serving_colour_info", (("colour", colour), ("version", version)))] == 1
    assert samples[("ironserve_vllm_up", ())] == 1
    errors, scored = samples[("quality_mirror_errors_total", ())], samples[("model_logprob_std_count", ())]
    mirror = f"http://127.0.0.1:{stack.settings.quality.mirror_port}/v1/chat/completions"
    status, _ = http_json(mirror, 5, CHAT)
    assert status == 202
    # The old colour is stopped: a replay sent there would count an error, not a score. (Envoy's own sampled
    # mirror of the load is scored too, so the count may grow by more than this one.)
    assert wait_for(lambda: scrape(stack)[("model_logprob_std_count", ())] > scored, 60, 0.2)
    assert scrape(stack)[("quality_mirror_errors_total", ())] == errors
    serving = f'ironserve_serving_colour_info{{colour="{colour}",version="{version}"}} == 1'
    assert wait_for(lambda: bool(query(prometheus, serving)), 30, 0.5), serving
    assert wait_for(lambda: bool(query(prometheus, "ironserve_vllm_up == 1")), 30, 0.5)


def etcd_values(stack: Stack) -> dict[str, str]:
    return Etcd(stack.settings.swap.etcd_url).get_prefix(stack.settings.swap.key_prefix).values


def get(url: str) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers)


def listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.invariant("hot-swap-health-gate")
def test_verify_gate_refuses_a_corrupt_version(stack: Stack) -> None:
    command = [sys.executable, "-m", "ironserve_service", "swap", "qwen2-7b", "vcorrupt", "--config", str(stack.config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "FAILED gate verify" in result.stderr, result.stderr
    assert "model.safetensors" in result.stderr
    assert stack.settings.swap.active_key not in etcd_values(stack)
    assert stack.launcher_pid("blue") is None and stack.launcher_pid("green") is None
    status, _ = get(stack.url("/v1/models"))
    assert status == 503  # nothing active yet: Envoy answers, no engine behind it


@pytest.mark.invariant("hot-swap-envoy-follows-etcd", "hot-swap-etcd-key", "hot-swap-lua-filter")
def test_first_swap_deploys_v1_on_blue_and_routes_only_the_api(stack: Stack) -> None:
    result = swap.swap(stack.settings, "qwen2-7b", "v1")
    assert result.ok and result.colour == "blue", result
    assert etcd_values(stack)[stack.settings.swap.active_key] == "v1"
    status, headers = get(stack.url("/v1/models"))
    assert status == 200 and headers["x-ironserve-colour"] == "blue"
    assert headers["x-backend"] == f"qwen2-7b-v1:{stack.settings.swap.blue_port}"
    assert get(stack.url("/health"))[0] == 200
    # vLLM's other endpoints exist on the engine but are never reachable through Envoy.
    for path in ("/metrics", "/version", "/reset_prefix_cache", "/tokenize", "/"):
        assert get(stack.url(path))[0] == 404, path
    assert get(f"http://127.0.0.1:{stack.settings.swap.blue_port}/metrics")[0] == 200
    version = EnvoyAdmin(stack.settings.swap.admin_port).route_version()
    assert version is not None and version.endswith(":blue:v1")
    for streaming in (False, True):
        outcome = h2c_request(stack.url("/v1/chat/completions"), streaming)
        assert outcome.ok and outcome.complete and outcome.colour == "blue", outcome


# About 27 s of generation (the engine decodes ~600 tokens/s on a 2-core CPU). On a busy 2-core host vLLM's API
# server trails its engine core by seconds, so a client's first chunks can arrive when thousands of tokens are already
# generated: the budget leaves room for that, and a request that was not aborted ends at exactly max_tokens.
LONG: dict[str, Any] = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 16000, "ignore_eos": True}


def _h1_close(url: str) -> Iterator[None]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.netloc, timeout=30)
    connection.request("POST", parts.path, json.dumps({**LONG, "stream": True}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read1(256)  # a few chunks arrived
    yield
    response.close()  # the client goes away mid-stream: the response's file holds the socket open until closed
    connection.close()
    yield


def _raw_h2(url: str, close_connection: bool) -> Iterator[None]:
    """A request over h2c by prior knowledge with the h2 library: some data read, then RST_STREAM(CANCEL) with the
    connection kept open until the engine has been checked, or the TCP connection closed."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((str(parts.hostname), parts.port or 80), timeout=30)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = json.dumps({**LONG, "stream": True}).encode()
    headers = [(":method", "POST"), (":path", parts.path), (":scheme", "http"), (":authority", parts.netloc),
               ("content-type", "application/json"), ("content-length", str(len(body)))]  # fmt: skip
    conn.send_headers(1, headers)
    conn.send_data(1, body, end_stream=True)
    sock.sendall(conn.data_to_send())
    received = 0
    while received < 256:
        for event in conn.receive_data(sock.recv(65535)):
            if isinstance(event, h2.events.DataReceived):
                received += len(event.data)
                conn.acknowledge_received_data(event.flow_controlled_length, 1)
        sock.sendall(conn.data_to_send())
    yield
    if close_connection:
        sock.close()
        yield
        return
    conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    sock.sendall(conn.data_to_send())
    yield  # only the stream went: the test checks the engine while the connection is still open
    conn.ping(b"ironserv")
    sock.sendall(conn.data_to_send())
    while True:
        data = sock.recv(65535)
        assert data, "Envoy closed the connection after a stream's reset"
        if any(isinstance(event, h2.events.PingAckReceived) for event in conn.receive_data(data)):
            break
    sock.close()


def _client_timeout(url: str) -> Iterator[None]:
    """Not streaming: the client gives up after 2 s and closes its connection (the openai SDK's `timeout`). Its request
    goes to a stopped engine core (QUEUED_WHEN_LEAVING), so the client leaves before the engine could finish it."""
    failed: list[Exception] = []

    def post() -> None:
        try:
            with httpx2.Client(timeout=2.0) as client:
                client.post(url, json=LONG)
        except httpx2.TimeoutException as error:
            failed.append(error)

    thread = threading.Thread(target=post)
    thread.start()
    yield
    thread.join()
    assert failed, "the request finished before the client's timeout"
    yield


def _sdk_h2_close_then_client_close(url: str) -> Iterator[None]:
    """The openai SDK over h2c closing a stream it has read from, then its client: the stream's close sends no reset
    (test_client_h2_close.py proves that against a plain HTTP/2 server), closing the client, the documented
    workaround, frees the engine."""
    client = openai.OpenAI(base_url=url.removesuffix("/completions"), api_key="unused", max_retries=0,
                           http_client=httpx2.Client(http1=False, http2=True, timeout=30))  # fmt: skip
    stream = client.completions.create(
        model=MODEL, prompt=LONG["prompt"], max_tokens=LONG["max_tokens"], stream=True, extra_body={"ignore_eos": True}
    )
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    yield
    client.close()
    yield


def _running(stack: Stack) -> float:
    return engine_reading(stack, "blue").requests_running or 0.0


# Each client yields once its request runs in the engine, once it has gone away, and ends after the engine is checked.
DISCONNECTS = {
    "HTTP/1.1 connection closed mid-stream": _h1_close,
    "HTTP/2 RST_STREAM": lambda url: _raw_h2(url, close_connection=False),
    "HTTP/2 connection closed": lambda url: _raw_h2(url, close_connection=True),
    "client timeout, not streaming": _client_timeout,
    "openai SDK over h2c: stream closed, then the client": _sdk_h2_close_then_client_close,
}


# How long the engine core stays stopped once Envoy has closed the upstream request's connection: the API server,
# with no engine output to process, turns the closed connection into an abort in milliseconds (0.03-0.25 s measured
# with the engine running, output included).
ABORT_GRACE_S = 1.0


@contextlib.contextmanager
def engine_core_stopped(stack: Stack, colour: Colour) -> Iterator[None]:
    """`colour`'s vLLM engine core stopped (SIGSTOP), its API server running. The tiny CPU model decodes up to ~10,000
    tokens/s, so the whole request can finish before a client's going-away reaches the engine; a GPU serving a 7B
    model decodes some tens of tokens a second. Stopped, the engine cannot outrun the abort, and what it generates
    after SIGCONT says whether the abort arrived."""
    launcher = stack.launcher_pid(colour)
    server = engine_pid(launcher) if launcher else None
    core = engine_core_pid(server) if server else None
    assert core, f"no vLLM engine core under {colour}'s launcher"
    os.kill(core, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core, signal.SIGCONT)


# A client that reads nothing before it leaves gives no moment at which its request is known to run: the tiny model can
# start and finish it between two readings of the engine's counters (CI's stop 38: 16,000 tokens done when first seen
# running, then never seen running). Its request is sent to a stopped engine core instead and waits there, admitted by
# the API server, when the client leaves.
QUEUED_WHEN_LEAVING = {"client timeout, not streaming"}


def _goes_away(stack: Stack, shape: str) -> tuple[str, str]:
    """("aborted" | "too late" | "not aborted", what happened): one client of `shape` against blue, judged by vLLM's
    own counters; the client leaves while blue's engine core is stopped."""
    url = stack.url("/v1/completions")
    admin = EnvoyAdmin(stack.settings.swap.admin_port)
    assert wait_for(lambda: _running(stack) == 0, 30, 0.1)
    before = engine_reading(stack, "blue").generation_tokens or 0.0
    # Envoy ends an HTTP/1.1 upstream request by closing its connection; counted from before the request, since a
    # client on a timer of its own may leave before the engine is stopped.
    closed = "cluster.blue.upstream_cx_destroy_local_with_active_rq"
    closed_before = admin.counter(closed)
    client = DISCONNECTS[shape](url)
    queued = shape in QUEUED_WHEN_LEAVING
    try:
        if not queued:
            next(client)  # the request runs in the engine
            if not wait_for(lambda: _running(stack) >= 1, 10, 0.05):
                return "not aborted", "the request never showed as running"
        with engine_core_stopped(stack, "blue"):
            if queued:
                next(client)  # the request waits at the stopped engine core
            at_leave = (engine_reading(stack, "blue").generation_tokens or 0.0) - before
            if at_leave >= LONG["max_tokens"] / 2:
                return "too late", f"the client could leave only after {at_leave:.0f} tokens"
            next(client)  # the client goes away
            if not wait_for(lambda: admin.counter(closed) > closed_before, 10.0, 0.02):
                return "not aborted", "Envoy did not close the upstream request's connection within 10 s"
            time.sleep(ABORT_GRACE_S)
        resumed = time.monotonic()
        if not wait_for(lambda: _running(stack) == 0, 10.0, 0.05):
            return "not aborted", "still running 10 s after the engine resumed"
        tokens = engine_reading(stack, "blue").generation_tokens or 0.0
        freed_after_s = time.monotonic() - resumed
        time.sleep(0.5)
        if engine_reading(stack, "blue").generation_tokens != tokens:
            return "not aborted", "tokens still growing after running went to 0"
        if tokens - before >= LONG["max_tokens"]:
            return "not aborted", f"ran to max_tokens, leaving after {at_leave:.0f} tokens"
        left = f"the client went away at {at_leave:.0f} tokens"
        return "aborted", f"freed {freed_after_s:.2f} s after the engine resumed, {left}, {tokens - before:.0f} in all"
    finally:
        next(client, None)  # the client's last step: its checks and the close of what it still holds


@pytest.mark.parametrize("shape", DISCONNECTS)
def test_a_client_that_goes_away_frees_the_engine(stack: Stack, shape: str) -> None:
    """Proved with vLLM's own counters: the client leaves while the engine core is stopped (its request running, or for
    a client that reads nothing first, waiting at the engine), Envoy closes the upstream request's connection, and
    once the engine resumes, requests running go back to 0 within 10 s and generated tokens stop short of max_tokens
    (ignore_eos: only an abort ends the request early). Under CPU contention a client's first chunks can arrive when
    the engine has already decoded most of the request; such an attempt (half of max_tokens or more when the client
    leaves) cannot show an abort either way and is run again, at most twice, and said so."""
    for attempt in range(1, 4):
        outcome, what = _goes_away(stack, shape)
        if outcome == "aborted":
            print(f"\n{shape}: {what} (attempt {attempt})")
            return
        assert outcome == "too late", f"{shape}: {what}"
        print(f"\n{shape}: {what}: inconclusive, again")
    pytest.fail(f"{shape}: in each of 3 attempts the client could leave only after half of max_tokens")


def test_500_concurrent_h2c_streams_on_one_connection_complete(stack: Stack) -> None:
    """Half streaming, half not, all at once over one h2c connection from httpx2 (the openai SDK's stack), through
    Envoy to vLLM: none fails, and Envoy resets no stream (test_h2_load.py: why it once did)."""
    admin = EnvoyAdmin(stack.settings.swap.admin_port)
    resets = admin.counter("http2.tx_reset")

    async def one(client: httpx2.AsyncClient, streaming: bool) -> bool:
        url = stack.url("/v1/chat/completions")
        if streaming:
            async with client.stream("POST", url, json={**CHAT, "stream": True}) as response:
                text = "".join([chunk async for chunk in response.aiter_text()])
                return response.status_code == 200 and complete(text, streaming=True)
        response = await client.post(url, json=CHAT)
        return response.status_code == 200 and complete(response.text, streaming=False)

    async def burst() -> list[bool | BaseException]:
        async with httpx2.AsyncClient(http1=False, http2=True, timeout=120) as client:
            return await asyncio.gather(*(one(client, i % 2 == 0) for i in range(500)), return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert outcomes.count(True) == 500, Counter(repr(o) for o in outcomes if o is not True).most_common(3)
    assert admin.counter("http2.tx_reset") == resets


@pytest.mark.invariant(
    "hot-swap-load-atomicity",
    "hot-swap-route-atomicity",
    "hot-swap-cleanup-atomicity",
    "hot-swap-cleanup-after-ready",
    "hot-swap-dual-instances",
    "hot-swap-protocol-steps",
    "hot-swap-old-instance-unload",
)
def test_a_swap_under_load_fails_no_request(stack: Stack, prometheus: str) -> None:
    """32 clients that only stream (issue 33's 503s came at 50, none at 16) and 4 that alternate with plain
    requests, through a swap: no request fails, and the engines never close a connection Envoy holds. One swap:
    the code is the same each way, and each swap under this load costs 2-3 minutes of the suite; many swaps under
    load are benchmarks/hot_swap.py's (benchmarks/RESULTS.md)."""
    admin = EnvoyAdmin(stack.settings.swap.admin_port)
    closed = {colour: admin.counter(f"cluster.{colour}.upstream_cx_destroy_remote") for colour in COLOURS}
    load = Load(stack.url(""), clients=32, streaming_only=True, max_s=1800).start()
    plain = Load(stack.url(""), clients=4, max_s=1800).start()
    observed: dict[str, bool] = {}

    def log(line: str) -> None:
        if line.startswith("OK route-switch"):
            # At the switch both instances run; the old one is still alive (cleanup after ready).
            swap_settings = stack.settings.swap
            observed["dual"] = listening(swap_settings.blue_port) and listening(swap_settings.green_port)
            observed["old_alive"] = all(stack.launcher_pid(c) is not None for c in COLOURS)

    try:
        before = len(load.snapshot())
        result = swap.swap(stack.settings, "qwen2-7b", "v2", log)
        assert result.ok, result
        assert len(load.snapshot()) > before, "no traffic during the swap"
        assert observed == {"dual": True, "old_alive": True}
        assert result.previous_colour is not None and stack.launcher_pid(result.previous_colour) is None
        assert result.timings["drain_s"] >= stack.settings.swap.drain_idle_s
        assert result.colour is not None
        assert_observers_follow(stack, prometheus, result.colour, "v2")
    finally:
        outcomes = load.stop() + plain.stop()
    bad = failures(outcomes)
    assert not bad, f"{len(bad)} of {len(outcomes)} failed: {bad[:5]}"
    # Only Envoy closes idle upstream connections (launcher.ENGINE_KEEP_ALIVE_S): none was lost under a request.
    assert {c: admin.counter(f"cluster.{c}.upstream_cx_destroy_remote") for c in COLOURS} == closed
    # Traffic went on through the swap: both colours answered, over both protocols, streaming and not.
    assert {o.colour for o in outcomes} == {"blue", "green"}
    assert {(o.protocol, o.streaming) for o in outcomes} == {(p, s) for p in ("http/1.1", "h2c") for s in (True, False)}
    # Envoy mirrored part of the load to the exporter's sink (quality.mirror_percent, 2 %).
    assert EnvoyAdmin(stack.settings.swap.admin_port).counter("cluster.quality.upstream_rq_total") > 0
    # Each switch was vouched for by swap's proof from the same transaction: no engine request on the hot path.
    switched = [line for line in (stack.logs / "control.log").read_text().splitlines() if line.startswith("route ->")]
    assert switched and "checked by swap" in switched[-1], switched[-1:]
    # The switch under this load is printed, not asserted: its tail on a 2-core host is scheduling (the catalog's
    # 100 ms is asserted on unloaded switches in test_a_rollback_to_the_colour_kept_warm_starts_nothing).
    print(f"\n{len(outcomes)} requests, 0 failed; switch {result.timings['switch_s'] * 1000:.0f} ms; "
          f"drain {result.timings['drain_s']:.1f} s")  # fmt: skip


@pytest.mark.invariant("hot-swap-health-gate")
def test_version_failing_readiness_never_gets_traffic(stack: Stack) -> None:
    key = stack.settings.swap.active_key
    before = etcd_values(stack)
    serving = [c for c in COLOURS if stack.launcher_pid(c) is not None]
    assert len(serving) == 1
    load = Load(stack.url(""), clients=8, max_s=200).start()
    try:
        result = swap.swap(stack.settings, "qwen2-7b", "vbad")
    finally:
        outcomes = load.stop()
    assert not result.ok and result.gate == "readiness", result
    assert "key untouched, new instance stopped" in result.detail
    assert etcd_values(stack) == before and before[key] in ("v1", "v2")
    assert stack.launcher_pid(swap.other(serving[0])) is None and stack.launcher_pid(serving[0]) is not None
    assert not failures(outcomes) and outcomes
    assert {o.colour for o in outcomes} == {serving[0]}


@pytest.mark.invariant("rel-checklist-gate", "release-check-08")
def test_a_failed_release_check_refuses_the_swap(stack: Stack) -> None:
    """One check broken (the port range the gate expects differs from the kernel's): the swap stops before the
    etcd write, naming the check and what it saw, and the serving colour keeps all traffic."""
    before = etcd_values(stack)
    serving = next(c for c in COLOURS if stack.launcher_pid(c) is not None)
    target = "v1" if before[stack.settings.swap.active_key] == "v2" else "v2"
    strict = stack.settings.release.model_copy(update={"port_range": "1024 65535"})
    result = swap.swap(stack.settings.model_copy(update={"release": strict}), "qwen2-7b", target)
    assert not result.ok and result.gate == "release-check", result
    observed = " ".join(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert f"08 port-range: {observed} (expected 1024 65535)" in result.detail
    assert "key untouched, new instance stopped" in result.detail
    assert etcd_values(stack) == before
    assert stack.launcher_pid(swap.other(serving)) is None and stack.launcher_pid(serving) is not None
    assert one_request(stack.url("/v1/chat/completions"), False).colour == serving


# Phases of a few hundred requests, so that the P99 is not one straggler (with ~110 requests a phase it moved
# between -7 % and +407 % here).
CHAOS = {"enabled": True, "users": 8, "warmup_s": 5, "load_s": 20, "settle_s": 2, "min_requests": 100,
         "vm_workers": 4 * (os.cpu_count() or 1), "vm_bytes": "128M"}  # fmt: skip
# The engine's stall while stress-ng runs: frozen this long, then running as long, over and over. A second stands
# above a loaded machine's noise: 0.4 s moved the P99 only +14 % (490 to 560 ms) with the lab's VMs running beside
# it (make test's lanes), where 1 s was refused.
STALL_S = 1.0


@contextlib.contextmanager
def engine_stalled_while_stressed(stack: Stack, colour: Colour) -> Iterator[list[float]]:
    """While stress-ng runs, `colour`'s engine (vLLM's process group) is stopped for STALL_S of every 2 * STALL_S
    (SIGSTOP, SIGCONT), a slowdown its P99 must show; yields the stalls' start times.

    stress-ng alone does not move a CPU engine's P99 predictably here: without a slice it runs in a session of its
    own, which the kernel's autogroup scheduling (sched(7)) gives one share of the CPUs beside the engine's session,
    and its busy workers keep this VM's vCPUs from idling, which speeds up the engine's wake-ups. Its P99 moved
    -24 %, +0 %, +6 % (CI), +52 %, +57 %, +69 % and +77 % in runs of this test."""
    done, stalls = threading.Event(), []

    def stall() -> None:
        while not done.is_set() and not stress_processes():
            time.sleep(0.02)
        while not done.is_set() and stress_processes():
            launcher = stack.launcher_pid(colour)
            engine = engine_pid(launcher) if launcher else None
            if engine is None:
                time.sleep(0.02)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine, signal.SIGSTOP)
                stalls.append(time.time())
                try:
                    done.wait(STALL_S)
                finally:
                    os.killpg(engine, signal.SIGCONT)
            done.wait(STALL_S)

    staller = threading.Thread(target=stall, daemon=True)
    staller.start()
    try:
        yield stalls
    finally:
        done.set()
        staller.join(timeout=5)


@pytest.mark.invariant("rel-chaos-p99-gate", "rel-chaos-memory-pressure", "rel-locust-load-test")
def test_a_p99_that_moves_under_memory_pressure_refuses_the_swap(stack: Stack) -> None:
    """locust on the candidate, then again under stress-ng with the candidate's engine stalling: the P99 rises by
    more than 15 %, so the swap stops before the etcd write, the candidate is stopped and the serving colour keeps
    all traffic."""
    before = etcd_values(stack)
    serving = next(c for c in COLOURS if stack.launcher_pid(c) is not None)
    target = "v1" if before[stack.settings.swap.active_key] == "v2" else "v2"
    lines: list[str] = []
    with engine_stalled_while_stressed(stack, swap.other(serving)) as stalls:
        result = swap.swap(stack.settings.model_copy(update={"chaos": ChaosSettings(**CHAOS)}), "qwen2-7b", target,
                           log=lines.append)  # fmt: skip
    print("\n" + "\n".join(line for line in lines if "load-chaos" in line) + f"\n{result.detail}\n{len(stalls)} stalls")
    assert stalls, "the candidate's engine was never stalled: stress-ng did not run"
    assert not result.ok and result.gate == "load-chaos", result
    assert re.search(r"ms under stress-ng \(\+\d+%, allowed \+15%", result.detail), result.detail
    assert "key untouched, new instance stopped" in result.detail
    assert etcd_values(stack) == before
    assert stack.launcher_pid(swap.other(serving)) is None and stack.launcher_pid(serving) is not None
    assert one_request(stack.url("/v1/chat/completions"), False).colour == serving
    assert not stress_processes(), "stress-ng outlived the gate"


@pytest.mark.invariant("rel-chaos-p99-gate")
def test_load_chaos_reports_the_served_colour_and_passes_within_its_bound(stack: Stack) -> None:
    """`ironserve-service load-chaos` on the colour being served, with a bound this machine can meet: JSON with
    both phases, exit 0."""
    config = yaml.safe_load(stack.config.read_text())
    config["chaos"] = {**CHAOS, "users": 4, "warmup_s": 2, "load_s": 10, "min_requests": 20, "vm_workers": 1,
                       "vm_bytes": "64M", "max_p99_increase": 100.0}  # fmt: skip
    permissive = stack.work / "service-chaos.yaml"
    permissive.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "ironserve_service", "load-chaos", "--config", str(permissive)],
                          capture_output=True, text=True, check=False, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["baseline"]["requests"] >= 20 and report["chaos"]["requests"] >= 20
    assert report["baseline"]["failures"] == report["chaos"]["failures"] == 0


@pytest.mark.invariant("rel-rollback-git-tag", "rel-prev-tag-derivation", "hot-swap-switch-latency")
def test_a_rollback_to_the_colour_kept_warm_starts_nothing(stack: Stack) -> None:
    """With swap.keep_previous, a swap leaves the drained colour running its version and records it as `previous`;
    `rollback` then moves traffic back to that same engine (same launcher PID): readiness, the release checks, the
    etcd write and the route switch, no engine start. Prints the rollback's time (the seed measured 8.3 s).
    Both switches (etcd write -> the first answer from the new colour through Envoy) are timed against the catalog's
    100 ms: at least one must hold it, one outlier on a shared 2-core host being scheduling, not design."""
    settings = stack.settings.model_copy(
        update={"swap": stack.settings.swap.model_copy(update={"keep_previous": True})}
    )
    swap_settings = settings.swap
    active = etcd_values(stack)[swap_settings.active_key]
    target = "v1" if active == "v2" else "v2"
    forward = swap.swap(settings, "qwen2-7b", target, log=lambda line: None)
    assert forward.ok and forward.colour is not None and forward.previous_colour is not None, forward
    kept = stack.launcher_pid(forward.previous_colour)
    assert kept is not None, "the drained colour was stopped"
    assert etcd_values(stack)[swap_settings.previous_key] == active

    lines: list[str] = []
    started, started_at = time.monotonic(), time.time()
    back = swap.rollback(settings, "qwen2-7b", log=lines.append)
    elapsed = time.monotonic() - started
    assert back.ok and back.colour == forward.previous_colour and back.written_at is not None, back
    traffic_back_s = back.written_at + back.timings["switch_s"] - started_at
    print(
        f"\nrollback {target} -> {active}: traffic back after {traffic_back_s:.2f} s, command done after "
        f"{elapsed:.1f} s (drain of the colour rolled away from included)\n" + "\n".join(lines)
    )
    switch_ms = [round(result.timings["switch_s"] * 1000) for result in (forward, back)]
    print(f"switch ms {switch_ms}")
    assert min(switch_ms) <= 100, switch_ms
    assert stack.launcher_pid(back.colour) == kept, "rollback started a new engine"
    assert not any(line.startswith("started ") for line in lines), lines
    values = etcd_values(stack)
    assert values[swap_settings.active_key] == active and values[swap_settings.previous_key] == target
    assert one_request(stack.url("/v1/chat/completions"), False).colour == back.colour

    # The rest of the module runs one colour at a time: stop the colour kept warm and unname its version.
    swap.stop_colour(settings, forward.colour)
    Etcd(swap_settings.etcd_url).compare_and_swap(
        swap_settings.active_key, active, {swap_settings.colour_key(forward.colour): ""}
    )
    assert stack.launcher_pid(forward.colour) is None


def test_a_rollback_with_no_previous_version_names_the_key_and_changes_nothing(stack: Stack) -> None:
    """A model never swapped away from has no `previous` key: the rollback says so and writes nothing."""
    swap_settings = stack.settings.swap.model_copy(update={"model_name": "never-swapped"})
    before = etcd_values(stack)
    refused = swap.rollback(stack.settings.model_copy(update={"swap": swap_settings}), "never-swapped")
    assert not refused.ok and refused.gate == "rollback", refused
    assert "/models/never-swapped/previous" in refused.detail
    assert etcd_values(stack) == before


def test_etcd_down_keeps_serving_and_a_later_swap_works(stack: Stack) -> None:
    active = etcd_values(stack)[stack.settings.swap.active_key]
    target = "v1" if active == "v2" else "v2"
    load = Load(stack.url(""), clients=8, max_s=240).start()
    try:
        stack.stop_etcd()
        time.sleep(4)
        refused = swap.swap(stack.settings, "qwen2-7b", target)
        assert not refused.ok and refused.gate == "etcd", refused
        during = len(load.snapshot())
        time.sleep(2)
        assert len(load.snapshot()) > during
        assert stack.control is not None and stack.control.poll() is None, "control loop died with etcd"
        stack.start_etcd()
        result = swap.swap(stack.settings, "qwen2-7b", target)
        assert result.ok, result
    finally:
        outcomes = load.stop()
    bad = failures(outcomes)
    assert not bad, f"{len(bad)} of {len(outcomes)} failed: {bad[:5]}"
    assert "etcd unreachable" in (stack.logs / "control.log").read_text()


def test_sigkilled_active_instance_fails_fast_then_recovers_by_swap(stack: Stack) -> None:
    """Documented behaviour: no standby exists after a drain, so a SIGKILLed engine means Envoy answers 503
    at once (connection refused, no hang) until `swap` to the same version brings it up on the other colour.
    The recovery runs with swap.keep_previous, which must not keep the dead colour's key: it names the same version,
    and the route would follow blue."""
    values = etcd_values(stack)
    version = values[stack.settings.swap.active_key]
    colour = next(c for c in COLOURS if stack.launcher_pid(c) is not None)
    launcher = stack.launcher_pid(colour)
    assert launcher is not None
    engine = engine_pid(launcher)
    assert engine is not None
    killed = time.monotonic()
    os.killpg(engine, signal.SIGKILL)
    url = stack.url("/v1/chat/completions")
    outcome = one_request(url, False)
    while outcome.ok and time.monotonic() - killed < 10:
        outcome = one_request(url, False)
    first_failure = time.monotonic() - killed
    assert not outcome.ok and "503" in outcome.error and outcome.latency_s < 1.0, outcome
    deadline = time.monotonic() + 30
    while stack.launcher_pid(colour) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.launcher_pid(colour) is None, "launcher did not exit after its engine died"
    keep_previous = stack.settings.model_copy(
        update={"swap": stack.settings.swap.model_copy(update={"keep_previous": True})}
    )
    result = swap.swap(keep_previous, "qwen2-7b", version)
    assert result.ok and result.colour == swap.other(colour), result
    recovered = time.monotonic() - killed
    assert etcd_values(stack)[stack.settings.swap.colour_key(colour)] == ""
    outcome = one_request(url, True)
    assert outcome.ok and outcome.complete and outcome.colour == swap.other(colour)
    switch_ms = result.timings["switch_s"] * 1000
    print(f"\nSIGKILL: first 503 after {first_failure * 1000:.0f} ms; serving again after {recovered:.1f} s "
          f"(recovery swap to the same version; route switch {switch_ms:.0f} ms)")  # fmt: skip
