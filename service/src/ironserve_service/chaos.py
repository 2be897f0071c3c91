"""The load-and-chaos gate: locust's load on a candidate colour, a baseline P99, then the P99 of the same load
under stress-ng memory pressure; the second may exceed the first by `chaos.max_p99_increase` at most.

The catalog's rel-locust-load-test (wait between 0.1 and 0.5 s, a 30 s timeout, queries sampled from up to
1000 logged ones), rel-chaos-memory-pressure (`stress-ng --vm 2 --vm-bytes 4G --timeout 60s`) and
rel-chaos-p99-gate (P99 within 15 %, else roll back), with its corrections: the OpenAI chat route instead of
`/infer`; stress-ng in the engines' systemd slice (`systemd-run --scope`) instead of `kubectl exec` into a
pod, as the engines run as systemd units; and `swap` runs the gate before its etcd write, so a failed gate
refuses the swap (the candidate never took traffic) rather than rolling back. A failed request in either
phase fails the gate too: degrading means answering more slowly, never not answering.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ironserve_service.settings import ChaosSettings

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


@dataclass(frozen=True)
class LoadResult:
    """One locust run: requests (failed ones included), failures, and the 99th percentile response time in ms."""

    requests: int
    failures: int
    p99_ms: float | None


@dataclass(frozen=True)
class GateResult:
    ok: bool
    detail: str
    baseline: LoadResult
    chaos: LoadResult | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarise(entries: list[dict[str, Any]]) -> LoadResult:
    """Pure: locust's final statistics (`--json-file`: one entry per request name, each with its histogram of
    response times in ms, rounded as locust rounds them) as one result; no answered request, no P99.

    The JSON file, written after the run has stopped, holds every request; the `--csv` files are written by a
    periodic writer and missed the run's last second when tried."""
    requests = sum(int(entry["num_requests"]) for entry in entries)
    failures = sum(int(entry["num_failures"]) for entry in entries)
    histogram: Counter[float] = Counter()
    for entry in entries:
        histogram.update({float(ms): int(count) for ms, count in entry["response_times"].items()})
    return LoadResult(requests, failures, percentile(histogram, 0.99))


def percentile(histogram: Counter[float], share: float) -> float | None:
    """The smallest response time at or below which `share` of all requests finished."""
    total = sum(histogram.values())
    if not total:
        return None
    needed, seen = math.ceil(share * total), 0
    for ms in sorted(histogram):
        seen += histogram[ms]
        if seen >= needed:
            return ms
    raise AssertionError("unreachable: the histogram's counts add up to its total")


def locust_command(settings: ChaosSettings, url: str, seconds: float, json_file: Path) -> list[str]:
    return [
        sys.executable, "-m", "locust", "--locustfile", str(LOCUSTFILE), "--headless", "--host", url,
        "--users", str(settings.users), "--spawn-rate", str(settings.users), "--run-time", f"{round(seconds)}s",
        "--json-file", str(json_file), "--loglevel", "WARNING",
        # Requests still running when the phase ends are awaited and counted: cutting them off would drop the
        # slowest answers from the P99.
        "--stop-timeout", str(round(settings.request_timeout_s)),
    ]  # fmt: skip


def locust_environment(settings: ChaosSettings, model: str) -> dict[str, str]:
    """What locustfile.py reads: locust parses its own command line, so the user's settings travel here."""
    return {
        **os.environ,
        "IRONSERVE_LOAD_MODEL": model,
        "IRONSERVE_LOAD_WAIT": f"{settings.wait_min_s} {settings.wait_max_s}",
        "IRONSERVE_LOAD_TIMEOUT_S": str(settings.request_timeout_s),
        "IRONSERVE_LOAD_MAX_TOKENS": str(settings.max_tokens),
        "IRONSERVE_LOAD_QUERIES": str(settings.queries_file or ""),
        "IRONSERVE_LOAD_SAMPLE": str(settings.sample_queries),
    }


def run_load(settings: ChaosSettings, url: str, model: str, seconds: float) -> LoadResult:
    with tempfile.TemporaryDirectory(prefix="ironserve-load-") as work:
        stem = Path(work) / "load"
        done = subprocess.run(
            locust_command(settings, url, seconds, stem), env=locust_environment(settings, model),
            capture_output=True, text=True, check=False, timeout=seconds + settings.request_timeout_s + 60,
        )  # fmt: skip
        stats = stem.with_suffix(".json")  # locust adds the suffix
        if not stats.exists():
            raise RuntimeError(f"locust wrote no stats (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        result = summarise(json.loads(stats.read_text()))
        if result.requests == 0:
            raise RuntimeError(f"locust sent no request in {seconds:.0f}s (exit {done.returncode}): "
                               f"{done.stderr.strip()[-400:]}")  # fmt: skip
        return result


def stress_command(settings: ChaosSettings) -> list[str]:
    stress = [
        "stress-ng", "--vm", str(settings.vm_workers), "--vm-bytes", settings.vm_bytes,
        "--timeout", f"{settings.stress_timeout_s}s", "--quiet",
    ]  # fmt: skip
    if settings.slice is None:
        return stress
    return ["systemd-run", "--quiet", "--scope", f"--slice={settings.slice}", "--", *stress]


def verdict(settings: ChaosSettings, baseline: LoadResult, chaos: LoadResult) -> tuple[bool, str]:
    """Pure: does the P99 under chaos stay within max_p99_increase of the baseline's, with every request answered?"""
    for phase, result in (("baseline", baseline), ("chaos", chaos)):
        if result.failures:
            return False, f"{phase}: {result.failures} of {result.requests} requests failed"
        if result.requests < settings.min_requests or result.p99_ms is None:
            return False, f"{phase}: {result.requests} requests, fewer than min_requests {settings.min_requests}"
    assert baseline.p99_ms is not None and chaos.p99_ms is not None
    increase = chaos.p99_ms / baseline.p99_ms - 1 if baseline.p99_ms > 0 else 0.0
    detail = (
        f"P99 {baseline.p99_ms:.0f} ms baseline, {chaos.p99_ms:.0f} ms under stress-ng ({increase:+.0%}, "
        f"allowed +{settings.max_p99_increase:.0%}; {baseline.requests}+{chaos.requests} requests)"
    )
    return increase <= settings.max_p99_increase, detail


@contextlib.contextmanager
def memory_pressure(settings: ChaosSettings) -> Iterator[None]:
    """stress-ng for the duration of the block (its own --timeout bounds it if this process dies)."""
    process = subprocess.Popen(
        stress_command(settings), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(settings.settle_s)
        if process.poll() is not None:
            error = process.stderr.read().decode(errors="replace").strip() if process.stderr else ""
            raise RuntimeError(f"stress-ng exited {process.returncode} before the chaos phase: {error[-300:]}")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if process.stderr:
            process.stderr.close()


def gate(settings: ChaosSettings, url: str, model: str, log: Callable[[str], None] = print) -> GateResult:
    """Warm-up, baseline load, then the same load under memory pressure, on `url` (the candidate engine, not
    Envoy)."""
    log(f"load-chaos: {settings.warmup_s:.0f}s warm-up, then baseline, {settings.users} locust users for "
        f"{settings.load_s:.0f}s on {url}")  # fmt: skip
    try:
        if settings.warmup_s:
            run_load(settings, url, model, settings.warmup_s)
        baseline = run_load(settings, url, model, settings.load_s)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
        return GateResult(False, f"baseline: {error}", LoadResult(0, 0, None))
    log(f"load-chaos: baseline P99 {baseline.p99_ms} ms over {baseline.requests} requests; stress-ng starts")
    try:
        with memory_pressure(settings):
            chaos = run_load(settings, url, model, settings.load_s)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
        return GateResult(False, f"chaos: {error}", baseline)
    ok, detail = verdict(settings, baseline, chaos)
    return GateResult(ok, detail, baseline, chaos)
