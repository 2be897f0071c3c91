"""Control plane: etcd (source of truth) -> readiness gate -> Envoy route file.

etcd is reached through its v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/watch``) with the
standard library: no gRPC stack or protobuf pin in the engine venv, and the same calls work against
any etcd >= 3.4. Keys under ``/models/<name>/``: ``active`` (the serving version) and
``colours/<blue|green>`` (the version each colour runs) and ``proofs/<blue|green>`` (what ``swap`` proved about the
colour's readiness right before its write), written together in one transaction by ``swap``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
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
        values = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in answer.get("kvs", [])}
        return Snapshot(int(answer["header"]["revision"]), values)

    def put(self, key: str, value: str) -> int:
        answer = self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
        return int(answer["header"]["revision"])

    def compare_and_swap(self, key: str, previous: str | None, puts: dict[str, str]) -> tuple[bool, int]:
        """One transaction: all puts happen only if key still holds previous (None: key absent)."""
        if previous is None:
            compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(previous)}
        success = [{"requestPut": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        answer = self._post("/v3/kv/txn", {"compare": [compare], "success": success})
        # The gateway omits false booleans.
        return bool(answer.get("succeeded", False)), int(answer["header"]["revision"])

    def watch(self, prefix: str, start_revision: int, idle_s: float) -> Iterator[tuple[int, dict[str, str | None]]]:
        """Yields (revision, {key: value or None when deleted}); raises EtcdError/TimeoutError when the stream ends."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}  # fmt: skip
        try:
            connection.request("POST", "/v3/watch", body=json.dumps(body))
            response = connection.getresponse()
            if response.status != 200:
                raise EtcdError(f"etcd watch answered HTTP {response.status}")
            if connection.sock is not None:
                connection.sock.settimeout(idle_s)
            while True:
                line = response.readline()
                if not line:
                    raise EtcdError("etcd closed the watch stream")
                result = json.loads(line).get("result", {})
                events = result.get("events", [])
                if not events:
                    continue
                changes: dict[str, str | None] = {}
                for event in events:
                    kv = event["kv"]
                    changes[_unb64(kv["key"])] = None if event.get("type") == "DELETE" else _unb64(kv.get("value", ""))
                yield int(result["header"]["revision"]), changes
        except (http.client.HTTPException, ValueError, ConnectionError) as error:
            raise EtcdError(f"etcd watch: {error}") from error
        finally:
            connection.close()


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


@dataclass(frozen=True)
class SwitchTiming:
    """Wall-clock times (time.time()) of one switch inside the control loop, logged with the switch so that
    a benchmark can line them up with the etcd write and Envoy's apply."""

    event_at: float  # the watch event (or full read) asking for the switch was parsed
    checked_at: float  # the readiness check passed
    written_at: float  # rds.json was renamed into place

    def log_text(self) -> str:
        return f"event_at={self.event_at:.6f} checked_at={self.checked_at:.6f} written_at={self.written_at:.6f}"


class Controller:
    """Watches etcd and moves the route after a fresh readiness check; keeps the last good route otherwise."""

    def __init__(
        self,
        settings: ServiceSettings,
        check: Callable[[Colour], ProbeResult] | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    ) -> None:
        self.settings = settings
        self.swap = settings.swap
        self.etcd = Etcd(self.swap.etcd_url, self.swap.etcd_timeout_s)
        self.check = check or self.check_with_proof
        self.log = log
        self.values: dict[str, str] = {}
        self.stopped = threading.Event()
        self.route_revision, self.colour, self.version = router.current_route(self.swap)
        self.keys: list[tuple[str, str]] = []
        self.keys_shown: str | None = None

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
        router.write_route(path, router.routes(self.swap, colour, version, revision, self.settings.quality,
                                               self.api_keys()))  # fmt: skip
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

    def apply_settings(self) -> None:
        """Re-render the route the colour already serves when the settings (e.g. swap.routing, applied by
        restarting this loop) or the API keys changed, so that they reach Envoy without a switch. Prod traffic
        keeps its target, so no readiness check is needed; an unchanged route is not rewritten."""
        if self.colour is None:
            return
        path = self.swap.router_dir / router.RDS_FILE
        wanted = router.routes(self.swap, self.colour, self.version, self.route_revision,  # type: ignore[arg-type]
                               self.settings.quality, self.api_keys())  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text(encoding="utf-8")) == wanted:
                return
        router.write_route(path, wanted)
        router.prune_routes(path)
        self.log(f"route re-rendered for the current settings and keys ({self.colour}/{self.version})")

    def run_once(self, idle_s: float = 5.0) -> None:
        """Resynchronise from a full read, then follow the watch until it ends (raises on etcd trouble)."""
        snapshot = self.etcd.get_prefix(self.swap.key_prefix)
        self.values = dict(snapshot.values)
        self.apply(snapshot.revision)
        for revision, changes in self.etcd.watch(self.swap.key_prefix, snapshot.revision + 1, idle_s):
            received_at = time.time()
            for key, value in changes.items():
                if value is None:
                    self.values.pop(key, None)
                else:
                    self.values[key] = value
            self.apply(revision, received_at)
            if self.stopped.is_set():
                return

    def run(self) -> None:
        unreachable = False
        while not self.stopped.is_set():
            try:
                self.run_once()
                unreachable = False
            except TimeoutError:
                # Quiet watch: reconnect and resynchronise (also retries a refused switch).
                unreachable = False
            except EtcdError as error:
                if not unreachable:
                    self.log(f"etcd unreachable ({error}); serving last good route {self.colour}/{self.version}")
                unreachable = True
                self.stopped.wait(1.0)

    def stop(self) -> None:
        self.stopped.set()


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
