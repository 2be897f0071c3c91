"""The control loop's etcd watch against a real etcd: one stream stays open across the periodic full reads (a write
never waits for a reconnect), a cancelled or ended stream is reported and reopened, a refused switch is retried at
the next full read. The stream lines parsed here are what etcd 3.4.23's JSON gateway printed on this machine
(a stream from a compacted revision, a replay, a request it could not decode)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hotswap_stack import ETCD, Stack, free_port

from ironserve_service import router
from ironserve_service.control import Controller, Etcd, EtcdError, parse_watch_line, wait_for
from ironserve_service.health import ProbeResult
from ironserve_service.settings import Colour, EngineSettings, ServiceSettings, SwapSettings

CREATED = (b'{"result":{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952",'
           b'"revision":"5","raft_term":"2"},"created":true}}')  # fmt: skip
PUT = (b'{"result":{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952","revision":"5",'
       b'"raft_term":"2"},"events":[{"kv":{"key":"L20vYQ==","create_revision":"2","mod_revision":"5","version":"4",'
       b'"value":"djQ="}}]}}')  # fmt: skip
# A watch from an older revision replays every change since in one line: the put, then the delete.
REPLAYED = (b'{"result":{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952",'
            b'"revision":"3","raft_term":"2"},"events":[{"kv":{"key":"L20vYQ==","create_revision":"2",'
            b'"mod_revision":"2","version":"1","value":"djE="}},{"type":"DELETE","kv":{"key":"L20vYQ==",'
            b'"mod_revision":"3"}}]}}')  # fmt: skip
# A watch from a compacted revision: etcd cancels it and the stream stays open, silent.
CANCELLED = (b'{"result":{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952",'
             b'"raft_term":"2"},"canceled":true,"compact_revision":"4"}}')  # fmt: skip


def test_watch_lines_give_the_revision_and_the_changes() -> None:
    assert parse_watch_line(CREATED) is None
    assert parse_watch_line(PUT) == (5, {"/m/a": "v4"})
    assert parse_watch_line(REPLAYED) == (3, {"/m/a": None})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (CANCELLED, "cancelled the watch: revision compacted up to 4"),
        (
            b'{"error":"illegal base64 data at input byte 9","message":"illegal base64 data at input byte 9","code":2}',
            "illegal base64",
        ),
        (b"<html>", "etcd watch sent"),
        (b'{"result":{"header":{"revision":"3"},"events":[{"type":"DELETE"}]}}', "unreadable event \\(KeyError"),
        (b'{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"not base64"}}]}}', "unreadable event \\(Error"),
    ],
)
def test_a_stream_that_delivers_nothing_more_is_an_error(line: bytes, message: str) -> None:
    with pytest.raises(EtcdError, match=message):
        parse_watch_line(line)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Stack]:
    """A real etcd on a free loopback port (only the etcd part of the hot-swap stack)."""
    if ETCD is None:
        pytest.skip("etcd absent: apt-get install etcd-server etcd-client")
    work = tmp_path / "stack"
    work.mkdir()
    port = free_port()
    swap = SwapSettings(router_dir=tmp_path / "envoy", run_dir=tmp_path / "run", etcd_url=f"http://127.0.0.1:{port}")
    stack = Stack(work, work / "service.yaml", ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap),
                  port, work)  # fmt: skip
    stack.start_etcd()
    try:
        yield stack
    finally:
        stack.stop_etcd()


def watch_streams_opened(stack: Stack) -> int:
    """etcd's own count of the Watch streams it has started (the gateway opens one per /v3/watch request)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.etcd_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    match = re.search(r'^grpc_server_started_total\{grpc_method="Watch",grpc_service="etcdserverpb.Watch".*\} (\d+)$',
                      text, re.MULTILINE)  # fmt: skip
    assert match, "etcd's metrics lack grpc_server_started_total for Watch"
    return int(match.group(1))


class Running:
    """A Controller's run() in a thread, as `ironserve-service control` runs it; its log lines kept. Its gate stands
    in for the ready marker: a colour passes once `ready/<colour>` exists (`ready_colours` to begin with)."""

    def __init__(self, stack: Stack, ready_colours: tuple[Colour, ...], resync_s: float) -> None:
        self.swap = stack.settings.swap
        self.etcd = Etcd(self.swap.etcd_url)
        self.ready = stack.work / "ready"
        self.ready.mkdir()
        for colour in ready_colours:
            (self.ready / colour).touch()
        self.lines: list[str] = []
        self.controller = Controller(
            stack.settings,
            check=lambda colour: ProbeResult((self.ready / colour).exists(), f"{colour} marker"),
            log=self.lines.append,
            resync_s=resync_s,
        )
        self.thread = threading.Thread(target=self.controller.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.controller.stop()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the control loop did not stop"

    def ask(self, colour: Colour, version: str) -> None:
        self.etcd.put(self.swap.colour_key(colour), version)
        self.etcd.put(self.swap.active_key, version)

    def routed(self) -> tuple[str | None, str | None]:
        _, colour, version = router.current_route(self.swap)
        return colour, version


@pytest.mark.invariant("hot-swap-envoy-follows-etcd")
def test_one_watch_stream_stays_open_across_full_reads_and_delivers_the_next_write(etcd: Stack) -> None:
    with Running(etcd, ("blue", "green"), resync_s=0.2) as running:
        running.ask("blue", "v1")
        assert wait_for(lambda: running.routed() == ("blue", "v1"), 10)
        time.sleep(1.2)  # about six full reads on the open stream
        assert watch_streams_opened(etcd) == 1, running.lines
        # Full reads from now on only every minute: the next switch can only come through the stream.
        running.controller.resync_s = 60
        time.sleep(0.5)
        running.ask("green", "v2")
        assert wait_for(lambda: running.routed() == ("green", "v2"), 10), running.lines
        assert watch_streams_opened(etcd) == 1, running.lines
    assert not any("etcd unreachable" in line or "new watch" in line for line in running.lines), running.lines


@pytest.mark.invariant("hot-swap-envoy-follows-etcd", "hot-swap-health-gate")
def test_a_refused_switch_is_retried_at_the_next_full_read(etcd: Stack) -> None:
    with Running(etcd, ("blue",), resync_s=0.2) as running:
        running.ask("blue", "v1")
        assert wait_for(lambda: running.routed() == ("blue", "v1"), 10)
        running.ask("green", "v2")
        assert wait_for(lambda: any("refusing switch to green/v2" in line for line in running.lines), 10)
        assert running.routed() == ("blue", "v1")
        (running.ready / "green").touch()  # green becomes ready; etcd does not change
        assert wait_for(lambda: running.routed() == ("green", "v2"), 10), running.lines
    assert watch_streams_opened(etcd) == 1


@pytest.mark.invariant("hot-swap-envoy-follows-etcd")
def test_etcd_restarted_ends_the_stream_and_the_loop_follows_the_new_one(etcd: Stack) -> None:
    with Running(etcd, ("blue", "green"), resync_s=60) as running:
        running.ask("blue", "v1")
        assert wait_for(lambda: running.routed() == ("blue", "v1"), 10)
        etcd.stop_etcd()
        assert wait_for(lambda: any("etcd unreachable" in line for line in running.lines), 10), running.lines
        assert running.routed() == ("blue", "v1")  # the last good route stays
        etcd.start_etcd()
        running.ask("green", "v2")
        assert wait_for(lambda: running.routed() == ("green", "v2"), 15), running.lines


def test_a_watch_from_a_compacted_revision_is_reported_not_silent(etcd: Stack) -> None:
    client = Etcd(etcd.settings.swap.etcd_url)
    revisions = [client.put("/m/a", f"v{n}") for n in range(4)]
    request = urllib.request.Request(
        f"{client.url}/v3/kv/compaction", data=f'{{"revision":"{revisions[-1]}"}}'.encode(), method="POST"
    )
    urllib.request.urlopen(request, timeout=5).close()
    with client.watch("/m/", revisions[0]) as stream, pytest.raises(EtcdError, match="compacted up to"):
        stream.next(10)


def test_a_full_read_reports_what_the_stream_had_not_delivered(etcd: Stack) -> None:
    controller = Controller(etcd.settings, check=lambda colour: ProbeResult(True, "ready"), log=lambda line: None)
    Etcd(etcd.settings.swap.etcd_url).put(etcd.settings.swap.colour_key("blue"), "v1")
    assert controller.resync() is True
    assert controller.resync() is False
