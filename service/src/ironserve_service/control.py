"""Control plane: etcd (source of truth) -> readiness gate -> Envoy route file.

etcd is reached through its v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/watch``) with the
standard library: no gRPC stack or protobuf pin in the engine venv, and the same calls work against
any etcd >= 3.4. Keys under ``/models/<name>/``: ``active`` (the serving version) and
``colours/<blue|green>`` (the version each colour runs) and ``proofs/<blue|green>`` (what ``swap`` proved about the
colour's readiness right before its write), written together in one transaction by ``swap``; ``traffic`` (the
host's traffic state, router.py: serving, draining or closed; absent means serving), written by ``traffic`` and
``drain`` and rendered into the same route file; ``traffic/reason`` (why the host left serving, rendered into
/health's answer while it is out) and ``traffic/gpu-guard`` (the GPU guard's record), both written with ``traffic``
by the GPU guard (gpu_guard.py).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import queue
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from ironserve_service import router
from ironserve_service.health import ProbeResult, check_engine, http_json, marker_pid, probe_ready
from ironserve_service.settings import COLOURS, Colour, ReadinessSettings, ServiceSettings, SwapSettings


class EtcdError(OSError):
    """etcd unreachable or answered something unusable."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class Snapshot:
    revision: int
    values: dict[str, str]
    mod_revisions: dict[str, int] = field(default_factory=dict)  # key -> the revision of its last write


def same_revision(key: str, mod_revision: int) -> dict[str, Any]:
    """A txn comparison: key last written at mod_revision (0: absent, as etcd compares a missing key)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


# Kept over the `etcd3gw` package (2.7.0, measured 2026-12-06 with `benchmarks/hot_swap.py --etcd3gw`; figures in
# benchmarks/RESULTS.md): it holds one open watch stream too and is as fast, but a stream that ends or that etcd
# cancels is never reported (after an etcd restart its iterator stayed blocked, the watch dead; a compacted start
# revision: silent; an error line dies in its worker thread), its watch request has no timeout, events come one key
# at a time without the response's revision (a swap's txn of active, colour and proof has no boundary), and its
# iterator has no timeout for the full read every RESYNC_S: a port would rebuild Watch around it.
class Etcd:
    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.url = url.rstrip("/")
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 2379
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except (OSError, ValueError) as error:
            raise EtcdError(f"etcd {self.url}{path}: {error}") from error
        return answer

    def get_prefix(self, prefix: str) -> Snapshot:
        answer = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        kvs = answer.get("kvs", [])
        values = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in kvs}
        revisions = {_unb64(kv["key"]): int(kv["mod_revision"]) for kv in kvs}
        return Snapshot(int(answer["header"]["revision"]), values, revisions)

    def put(self, key: str, value: str) -> int:
        answer = self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
        return int(answer["header"]["revision"])

    def compare_and_swap(self, key: str, previous: str | None, puts: dict[str, str]) -> tuple[bool, int]:
        """One transaction: all puts happen only if key still holds previous (None: key absent)."""
        if previous is None:
            compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(previous)}
        return self.txn([compare], puts)

    def txn(
        self, compare: list[dict[str, Any]], puts: dict[str, str], deletes: tuple[str, ...] = ()
    ) -> tuple[bool, int]:
        """One transaction: the puts and deletes happen only if every comparison holds; (succeeded, revision)."""
        success = [{"requestPut": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        success += [{"requestDeleteRange": {"key": _b64(key)}} for key in deletes]
        answer = self._post("/v3/kv/txn", {"compare": compare, "success": success})
        # The gateway omits false booleans.
        return bool(answer.get("succeeded", False)), int(answer["header"]["revision"])

    def watch(self, prefix: str, start_revision: int) -> Watch:
        """A watch stream on the keys under prefix from start_revision on, open until closed (use with `with`)."""
        return Watch(self.host, self.port, self.timeout_s, prefix, start_revision)


# What a watch stream hands over: the revision, {key: value or None when deleted}, and when the line was parsed.
WatchEvent = tuple[int, dict[str, str | None], float]


def parse_watch_line(line: bytes) -> tuple[int, dict[str, str | None]] | None:
    """One line of the gateway's /v3/watch stream: (revision, changes), or None for a line without events (the
    "created" answer); raises EtcdError when etcd cancels the watch (a compacted start revision, a server-side
    cancel) or answers an error, since the stream then stays open but delivers nothing more."""
    try:
        document = json.loads(line)
    except ValueError as error:
        raise EtcdError(f"etcd watch sent {line[:200]!r}") from error
    if "error" in document:
        raise EtcdError(f"etcd watch failed: {document['error']}")
    result = document.get("result", {})
    if result.get("canceled"):
        reason = result.get("cancel_reason") or f"revision compacted up to {result.get('compact_revision', '?')}"
        raise EtcdError(f"etcd cancelled the watch: {reason}")
    events = result.get("events", [])
    if not events:
        return None
    changes: dict[str, str | None] = {}
    try:
        for event in events:
            kv = event["kv"]
            changes[_unb64(kv["key"])] = None if event.get("type") == "DELETE" else _unb64(kv.get("value", ""))
        return int(result["header"]["revision"]), changes
    except (KeyError, TypeError, ValueError) as error:  # base64 and UTF-8 errors are ValueErrors
        raise EtcdError(f"etcd watch sent an unreadable event ({error!r}): {line[:200]!r}") from error


class Watch:
    """One watch stream, read by a thread of its own: the caller waits for the next event with a timeout and
    makes other requests meanwhile while the stream stays open (a socket read that timed out cannot go on, so a
    reader that waited with a timeout would have to reopen the stream, and a write landing then would wait)."""

    def __init__(self, host: str, port: int, timeout_s: float, prefix: str, start_revision: int) -> None:
        self.connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self.events: queue.SimpleQueue[WatchEvent | EtcdError | None] = queue.SimpleQueue()  # None: wake()
        self.closed = threading.Event()
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}  # fmt: skip
        try:
            self.connection.request("POST", "/v3/watch", body=json.dumps(body))
            response = self.connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            self.connection.close()
            raise EtcdError(f"etcd watch: {error}") from error
        if response.status != 200:
            self.connection.close()
            raise EtcdError(f"etcd watch answered HTTP {response.status}")
        if self.connection.sock is not None:
            self.connection.sock.settimeout(None)  # quiet for hours is normal; close() ends the wait
        self.reader = threading.Thread(target=self._read, args=(response,), name="etcd-watch", daemon=True)
        self.reader.start()

    def _read(self, response: http.client.HTTPResponse) -> None:
        try:
            while True:
                line = response.readline()
                if not line:
                    raise EtcdError("etcd closed the watch stream")
                parsed = parse_watch_line(line)
                if parsed is not None:
                    self.events.put((*parsed, time.time()))
        except (OSError, http.client.HTTPException) as error:
            if not self.closed.is_set():  # else close() ended the read
                self.events.put(error if isinstance(error, EtcdError) else EtcdError(f"etcd watch: {error}"))

    def next(self, timeout_s: float) -> WatchEvent | None:
        """The next event, or None after timeout_s without one or after wake(); raises EtcdError once the stream
        has ended."""
        try:
            item = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, EtcdError):
            raise item
        return item

    def wake(self) -> None:
        """Ends a wait in next() now (from another thread)."""
        self.events.put(None)

    def close(self) -> None:
        self.closed.set()
        if self.connection.sock is not None:
            # shutdown, not close, wakes the reader blocked in recv; the connection is closed once it has returned.
            with contextlib.suppress(OSError):
                self.connection.sock.shutdown(socket.SHUT_RDWR)
        self.reader.join(timeout=5)
        self.connection.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EnvoyAdmin:
    def __init__(self, port: int, timeout_s: float = 2.0) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.timeout_s = timeout_s

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.base}{path}", timeout=self.timeout_s) as response:
            text: str = response.read().decode()
            return text

    def active_requests(self, cluster: str) -> int:
        text = self._get(f"/stats?filter=^cluster\\.{cluster}\\.upstream_rq_active$")
        match = re.search(rf"^cluster\.{cluster}\.upstream_rq_active: (\d+)$", text, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def counter(self, name: str) -> int:
        text = self._get(f"/stats?filter=^{re.escape(name)}$")
        match = re.search(rf"^{re.escape(name)}: (\d+)$", text, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def route_traffic(self) -> router.Traffic | None:
        """The traffic state of the route Envoy serves (router.route_traffic); None before it serves one."""
        dump = json.loads(self._get("/config_dump?resource=dynamic_route_configs"))
        for config in dump.get("configs", []):
            if "route_config" in config:
                return router.route_traffic(config["route_config"])
        return None

    def route_version(self) -> str | None:
        applied = self.route_applied()
        return applied[0] if applied else None

    def route_applied(self) -> tuple[str, float] | None:
        """The served route's version_info and when Envoy applied it (its own clock, epoch seconds, 1 ms steps)."""
        dump = json.loads(self._get("/config_dump?resource=dynamic_route_configs"))
        for config in dump.get("configs", []):
            version = config.get("version_info")
            if version:
                return str(version), datetime.fromisoformat(config["last_updated"]).timestamp()
        return None

    def ready(self) -> bool:
        try:
            return self._get("/ready").strip() == "LIVE"
        except OSError:
            return False


def colour_readiness(settings: ServiceSettings, colour: Colour) -> ReadinessSettings:
    directory = settings.swap.colour_dir(colour)
    return settings.readiness.model_copy(
        update={"loading_marker": directory / "model_loading", "ready_marker": directory / "model_ready"}
    )


def check_colour(settings: ServiceSettings, colour: Colour, full: bool = True) -> ProbeResult:
    """The launcher's ready marker (written after a completion; launcher alive), then either the engine
    answering a completion again (full: `swap`'s gates) or its /health answering 200 now (`status`, and the
    control loop when no fresh proof from `swap` vouches for the colour)."""
    marker = probe_ready(colour_readiness(settings, colour))
    if not marker.ok:
        return marker
    engine = settings.engine.model_copy(update={"port": settings.swap.port(colour)})
    if full:
        return check_engine(engine, settings.readiness.probe_timeout_s)
    try:
        status, _ = http_json(f"{engine.base_url}/health", settings.readiness.probe_timeout_s)
    except OSError as error:
        return ProbeResult(False, f"engine unreachable: {error}")
    return ProbeResult(status == 200, f"ready marker present, /health answered {status}")


# How long the control loop trusts swap's readiness proof: the watch delivers it within milliseconds, and an older
# one (a control loop that was down during the swap) is checked live instead.
PROOF_TRUSTED_S = 10.0


def proof_key(swap: SwapSettings, colour: Colour) -> str:
    return f"{swap.key_prefix}proofs/{colour}"


@dataclass(frozen=True)
class ReadinessProof:
    """What `swap` proved right before its etcd write, carried in the same transaction: this launcher's engine
    answered a completion for this version at checked_at (time.time() on this host)."""

    version: str
    launcher_pid: int
    checked_at: float

    def to_text(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_text(cls, text: str | None) -> ReadinessProof | None:
        try:
            document = json.loads(text or "")
            return cls(str(document["version"]), int(document["launcher_pid"]), float(document["checked_at"]))
        except (ValueError, KeyError, TypeError):
            return None

    def vouches_for(self, version: str, launcher_pid: int, now: float) -> bool:
        fresh = 0 <= now - self.checked_at <= PROOF_TRUSTED_S
        return fresh and self.version == version and self.launcher_pid == launcher_pid


def check_switch(
    settings: ServiceSettings, colour: Colour, version: str, proof: ReadinessProof | None, now: float
) -> ProbeResult:
    """The control loop's gate before it moves traffic: the ready marker of a live launcher, then either swap's
    fresh proof for that very launcher and version (no request: an engine on a busy host can take hundreds of ms
    to answer even /health) or, without one, /health answering 200 now."""
    readiness = colour_readiness(settings, colour)
    marker = probe_ready(readiness)
    if not marker.ok:
        return marker
    launcher = marker_pid(readiness.ready_marker)
    if proof is not None and launcher is not None and proof.vouches_for(version, launcher, now):
        age_ms = (now - proof.checked_at) * 1000
        return ProbeResult(True, f"{marker.reason}, its completion checked by swap {age_ms:.0f} ms before")
    return check_colour(settings, colour, full=False)


def desired(swap: SwapSettings, values: dict[str, str]) -> tuple[Colour | None, str | None]:
    """(colour, version) that the etcd values ask to serve; colour None when no colour runs that version."""
    version = values.get(swap.active_key)
    if version is None:
        return None, None
    for colour in COLOURS:
        if values.get(swap.colour_key(colour)) == version:
            return colour, version
    return None, version


def traffic_state(swap: SwapSettings, values: dict[str, str]) -> router.Traffic:
    """The traffic state the etcd values ask for: absent is serving; a value naming no state (put by hand) is
    draining, which keeps the host out of its load balancer and still serves."""
    value = values.get(swap.traffic_key, "serving")
    return next((state for state in router.TRAFFIC_STATES if state == value), "draining")


def traffic_reason(swap: SwapSettings, values: dict[str, str]) -> str | None:
    """Why the host is out of serving (SwapSettings.traffic_reason_key), while it is; None when it serves: a reason
    left behind by an admin's `traffic serving` says nothing about the host any more."""
    if traffic_state(swap, values) == "serving":
        return None
    return values.get(swap.traffic_reason_key) or None


@dataclass(frozen=True)
class SwitchTiming:
    """Wall-clock times (time.time()) of one switch inside the control loop, logged with the switch so that
    a benchmark can line them up with the etcd write and Envoy's apply."""

    event_at: float  # the watch event (or full read) asking for the switch was parsed
    checked_at: float  # the readiness check passed
    written_at: float  # rds.json was renamed into place

    def log_text(self) -> str:
        return f"event_at={self.event_at:.6f} checked_at={self.checked_at:.6f} written_at={self.written_at:.6f}"


# How often the control loop reads every key again, on its open watch: it retries a refused switch (a ready marker
# that came after the write), re-reads the API keys file, and catches what the stream did not deliver.
RESYNC_S = 5.0


class Controller:
    """Watches etcd and moves the route after a fresh readiness check; keeps the last good route otherwise."""

    def __init__(
        self,
        settings: ServiceSettings,
        check: Callable[[Colour], ProbeResult] | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
        resync_s: float = RESYNC_S,
    ) -> None:
        self.settings = settings
        self.resync_s = resync_s
        self.swap = settings.swap
        self.etcd = Etcd(self.swap.etcd_url, self.swap.etcd_timeout_s)
        self.check = check or self.check_with_proof
        self.log = log
        self.values: dict[str, str] = {}
        self.revision = 0  # the etcd revision self.values stand at
        self.stopped = threading.Event()
        self.stream: Watch | None = None
        self.route_revision, self.colour, self.version = router.current_route(self.swap)
        self.keys: list[tuple[str, str]] = []
        self.keys_shown: str | None = None
        self.unknown_traffic: str | None = None  # the last traffic value logged as naming no state

    def apply(self, revision: int, received_at: float | None = None) -> None:
        """Moves the route to what the etcd values ask for; received_at is when they arrived (for the timing)."""
        event_at = time.time() if received_at is None else received_at
        colour, version = desired(self.swap, self.values)
        if version is None:
            return
        if (colour, version) == (self.colour, self.version):
            self.apply_settings()
            return
        if colour is None:
            self.log(f"active={version} but no colour runs it; keeping {self.colour}/{self.version}")
            return
        result = self.check(colour)
        if not result.ok:
            self.log(f"refusing switch to {colour}/{version}: {result.reason}; keeping {self.colour}/{self.version}")
            return
        checked_at = time.time()
        path = self.swap.router_dir / router.RDS_FILE
        router.write_route(path, self.route(colour, version, revision))
        timing = SwitchTiming(event_at, checked_at, time.time())
        self.log(f"route -> {colour}/{version} (etcd revision {revision}) {result.reason}; {timing.log_text()}")
        router.prune_routes(path)
        self.route_revision, self.colour, self.version = revision, colour, version

    def check_with_proof(self, colour: Colour) -> ProbeResult:
        proof = ReadinessProof.from_text(self.values.get(proof_key(self.swap, colour)))
        return check_switch(self.settings, colour, self.values.get(self.swap.active_key, ""), proof, time.time())

    def api_keys(self) -> list[tuple[str, str]]:
        """The keys file now: none when it is absent (every API request 401), the last good keys when it is
        malformed (a botched edit locks nobody out). Each change of state is logged once, never a key."""
        path = self.swap.api_keys_file
        if path is None:
            return []
        problem = None
        try:
            self.keys = router.read_api_keys(path)
        except FileNotFoundError:
            self.keys, problem = [], f"{path} absent: every API request is refused (401)"
        except (OSError, ValueError) as error:
            problem = f"{error}; keeping the previous {len(self.keys)} keys"
        shown = problem or f"{len(self.keys)} API keys from {path}"
        if shown != self.keys_shown:
            self.log(shown)
            self.keys_shown = shown
        return self.keys

    def route(self, colour: Colour, version: str | None, revision: int) -> router.JSON:
        """The route file's content for this colour with the current settings, API keys and traffic state."""
        traffic = self.traffic()
        return router.routes(self.swap, colour, version, revision, self.settings.quality, self.api_keys(), traffic,
                             traffic_reason(self.swap, self.values))  # fmt: skip

    def traffic(self) -> router.Traffic:
        """The traffic state etcd asks for (traffic_state); a value naming no state is logged once."""
        value = self.values.get(self.swap.traffic_key)
        state = traffic_state(self.swap, self.values)
        unknown = None if value in (None, state) else value
        if unknown is not None and unknown != self.unknown_traffic:
            self.log(f"{self.swap.traffic_key} is {unknown!r}, not one of {', '.join(router.TRAFFIC_STATES)}: "
                     "served as draining (out of the load balancer, requests still served)")  # fmt: skip
        self.unknown_traffic = unknown
        return state

    def apply_settings(self) -> None:
        """Re-render the route the colour already serves when the settings (e.g. swap.routing, applied by
        restarting this loop), the API keys or the traffic state changed, so that they reach Envoy without a switch.
        Prod traffic keeps its target, so no readiness check is needed; an unchanged route is not rewritten."""
        if self.colour is None:
            return
        path = self.swap.router_dir / router.RDS_FILE
        wanted = self.route(self.colour, self.version, self.route_revision)  # type: ignore[arg-type]
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text(encoding="utf-8")) == wanted:
                return
        router.write_route(path, wanted)
        router.prune_routes(path)
        traffic, reason = self.traffic(), traffic_reason(self.swap, self.values)
        shown = f"{traffic} ({reason})" if reason else traffic
        self.log(f"route re-rendered for the current settings, keys and traffic {shown} ({self.colour}/{self.version})")

    def resync(self) -> bool:
        """A full read of every key, applied; True when it held values that the watch had not delivered."""
        snapshot = self.etcd.get_prefix(self.swap.key_prefix)
        missed = snapshot.values != self.values
        self.values, self.revision = dict(snapshot.values), snapshot.revision
        self.apply(snapshot.revision)
        return missed

    def follow(self, event: WatchEvent) -> None:
        revision, changes, received_at = event
        if revision <= self.revision:
            return  # already in the last full read
        for key, value in changes.items():
            if value is None:
                self.values.pop(key, None)
            else:
                self.values[key] = value
        self.revision = revision
        self.apply(revision, received_at)

    def run_once(self) -> None:
        """A full read, then the watch from the next revision, with a full read every resync_s on the open stream;
        returns when stopped, or to open a new stream when a full read found a change the stream had not delivered
        (applied already, from the full read); raises EtcdError on etcd trouble."""
        self.resync()
        with self.etcd.watch(self.swap.key_prefix, self.revision + 1) as self.stream:
            next_resync = time.monotonic() + self.resync_s
            while not self.stopped.is_set():
                event = self.stream.next(max(0.0, next_resync - time.monotonic()))
                if event is not None:
                    self.follow(event)
                    continue
                if self.stopped.is_set():
                    return
                next_resync = time.monotonic() + self.resync_s
                if self.resync():
                    self.log(f"a full read found changes the etcd watch had not delivered (revision {self.revision}); "
                             "opening a new watch")  # fmt: skip
                    return

    def run(self) -> None:
        unreachable = False
        while not self.stopped.is_set():
            try:
                self.run_once()
                unreachable = False
            except EtcdError as error:
                if not unreachable:
                    self.log(f"etcd unreachable ({error}); serving last good route {self.colour}/{self.version}")
                unreachable = True
                self.stopped.wait(1.0)

    def stop(self) -> None:
        """Ends run() (from another thread)."""
        self.stopped.set()
        if self.stream is not None:
            self.stream.wake()


def run_controller(settings: ServiceSettings) -> int:
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    controller = Controller(settings)
    with contextlib.suppress(KeyboardInterrupt):
        controller.run()
    return 0


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if predicate():
                return True
        time.sleep(interval_s)
    return False
