"""The one place that starts processes: vLLM, with loading/ready markers and a graceful drain."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from ironserve_service.health import ProbeResult, check_engine
from ironserve_service.settings import ServiceSettings, SloSettings

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# Seconds vLLM's server (uvicorn) keeps an idle keep-alive connection (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vLLM's default
# 5). Envoy closes its idle upstream connections after router.UPSTREAM_IDLE_TIMEOUT_S (4), but uvicorn's timer
# fires late only, never early: an event loop busy past it (the API server starved of CPU while the other colour
# starts) runs the timer before reading a request that came in meanwhile, and closes a connection carrying it
# (issue 33). A minute leaves the close to Envoy however long the engine stalls.
ENGINE_KEEP_ALIVE_S = 60


def latency_buckets(slo: SloSettings) -> dict[str, list[float]]:
    """vLLM's latency histograms' buckets, with boundaries exactly at the SLO thresholds (and twice them, for
    the fast-window page) so that histogram_quantile is exact there; the rest follows vLLM's own spacing."""
    request = {0.05, 0.1, 0.2, 0.3, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0}
    first_token = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0}
    per_token = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0}
    return {
        "request_latency": sorted(request | {slo.paging_latency_s}),
        "time_to_first_token": sorted(first_token | {slo.ttft_p95_s, 2 * slo.ttft_p95_s}),
        "inter_token_latency": sorted(per_token | {slo.tpot_p95_s, 2 * slo.tpot_p95_s}),
    }


def build_command(settings: ServiceSettings, python: Path) -> list[str]:
    engine = settings.engine
    command = [
        str(python), "-m", ENGINE_MODULE,
        "--model", str(engine.model_dir),
        "--served-model-name", engine.served_model_name,
        "--host", engine.host,
        "--port", str(engine.port),
        "--max-model-len", str(engine.max_model_len),
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
        "--dtype", engine.dtype,
        "--custom-histogram-buckets", json.dumps(latency_buckets(settings.slo)),
    ]  # fmt: skip
    if engine.cudagraph_capture_sizes:
        command += ["--cudagraph-capture-sizes", *map(str, engine.cudagraph_capture_sizes)]
    if engine.enforce_eager:
        command.append("--enforce-eager")
    return command + engine.extra_args


def engine_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    # Weights are local and verified; the engine must never reach for a hub.
    fixed = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE_S),
    }
    return {**base, **fixed, **extra}


def write_marker(path: Path, content: str) -> None:
    """Atomic: a probe sees either no marker or a complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(content, encoding="utf-8")
    os.replace(staging, path)


def remove_marker(path: Path) -> None:
    path.unlink(missing_ok=True)


class Launcher:
    def __init__(
        self,
        settings: ServiceSettings,
        environment: Mapping[str, str] | None = None,
        check: Callable[[], ProbeResult] | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    ) -> None:
        self.settings = settings
        self.environment = dict(environment or {})
        self.check = check or (lambda: check_engine(settings.engine, settings.readiness.probe_timeout_s))
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def run(self) -> int:
        readiness = self.settings.readiness
        remove_marker(readiness.ready_marker)
        write_marker(readiness.loading_marker, f"{os.getpid()}\n")
        previous = {sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        python = self.settings.engine.engine_python or Path(sys.executable)
        command = build_command(self.settings, python)
        self.log("starting engine: " + " ".join(command))
        try:
            # Own process group, so a stuck drain can kill vLLM's engine-core and worker children too; the
            # launcher's session, whose autogroup is the colour's CPU share where no unit's cgroup is (swap.cpu_share).
            self.process = subprocess.Popen(
                command, env=engine_environment(os.environ, self.environment), process_group=0
            )
            if self._wait_until_ready():
                write_marker(readiness.ready_marker, f"{os.getpid()}\n")
                remove_marker(readiness.loading_marker)
                self.log("engine ready: model answers")
            return self._wait_for_exit()
        finally:
            remove_marker(readiness.ready_marker)
            remove_marker(readiness.loading_marker)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait_until_ready(self) -> bool:
        assert self.process is not None
        readiness = self.settings.readiness
        deadline = time.monotonic() + readiness.startup_timeout_s
        while not self.stopping and self.process.poll() is None:
            result = self.check()
            if result.ok:
                return True
            if time.monotonic() > deadline:
                self.log(f"engine not ready after {readiness.startup_timeout_s}s ({result.reason}); stopping it")
                self._stop()
                return False
            time.sleep(readiness.poll_interval_s)
        return False

    def _wait_for_exit(self) -> int:
        assert self.process is not None
        code = self.process.wait()
        self.log(f"engine exited with {code}")
        # A drain we asked for is a clean stop, whatever code the engine reports for SIGTERM.
        return 0 if self.stopping and code in (0, -signal.SIGTERM) else (code if code > 0 else 1)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.log(f"received signal {signum}: draining")
        # Leave the load balancer first, then let vLLM finish in-flight requests.
        remove_marker(self.settings.readiness.ready_marker)
        self.stopping = True
        self._stop()

    def _stop(self) -> None:
        # Signal handlers must not wait on the child (the main loop may be inside wait()), so a timer
        # enforces the drain deadline instead.
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        timer = threading.Timer(self.settings.readiness.drain_timeout_s, self._kill, args=(self.process.pid,))
        timer.daemon = True
        timer.start()

    def _kill(self, pid: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.log("engine did not drain in time; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
