"""Print blue/green hot-swap figures under load: failed requests, switch latency, Envoy's added latency, drain time.

Usage: ~/.cache/ironserve/venv/bin/python benchmarks/hot_swap.py [--swaps 10] [--clients 16]
Starts its own etcd, Envoy, control loop, exporter and two CPU vLLM instances (tiny test model, engine
venv), all on 127.0.0.1, and stops them all. Figures only; no assertions. The load is the official openai
SDK (hotswap_stack.Load: sync and async, HTTP/1.1 and h2c, streaming and not, no SDK retries).

- switch latency: the etcd compare-and-swap write -> the first request answered through Envoy by the new
  colour (`swap` polls /health through Envoy every 5 ms), split into the control loop (write -> its
  rename of rds.json, which includes its /health re-check of the new colour), Envoy (rename -> the new
  route_version in its admin, polled every 5 ms) and the first answer (-> a response from the new colour);
  the split is good to about the 5 ms poll, so a first answer can read a few ms below zero.
- Envoy's added latency: the same requests sent alternately to vLLM directly and through Envoy, no load;
  and vLLM's own `vllm bench serve` (random 16-token prompts, 8 output tokens) against the engine and
  through Envoy, side by side.
- drain: route switch -> old colour idle for drain_idle_s in Envoy's stats (>= 10 s by design), then
  SIGTERM -> the old launcher gone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
sys.path.insert(0, str(SERVICE / "tests"))

from conftest import ENGINE_PYTHON, SERVICE_DIR, TINY_MODEL_DIR  # noqa: E402
from hotswap_stack import Load, Stack, build_stack, failures  # noqa: E402
from ironserve_service import router, swap  # noqa: E402
from ironserve_service.control import EnvoyAdmin  # noqa: E402

# vLLM's benchmark client, run with the engine venv's Python (its `vllm` entry point looks up a distribution
# named vllm, which the CPU build is not).
BENCH_SERVE = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: v for k, v in result.items() if isinstance(v, (int, float))}))
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timed_get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        response.read()
    return time.perf_counter() - started


def timed_chat(url: str) -> float:
    body = b'{"model": "qwen2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
    return time.perf_counter() - started


class RouteWatch:
    """Polls Envoy's admin for the route version every 5 ms and keeps when each version first appeared."""

    def __init__(self, admin: EnvoyAdmin) -> None:
        self.admin = admin
        self.seen: dict[str, float] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                version = self.admin.route_version()
            except OSError:
                version = None
            if version is not None and version not in self.seen:
                self.seen[version] = time.time()
            self.stopped.wait(0.005)

    def applied_at(self, version: str) -> float | None:
        return self.seen.get(version)


def breakdown(stack: Stack, watch: RouteWatch, result: swap.SwapResult) -> tuple[float, float, float] | None:
    """(control loop, Envoy, first answer) in ms for one swap: write -> rename -> admin shows -> served."""
    if result.written_at is None or "switch_s" not in result.timings or result.colour is None:
        return None
    revision, colour, version = router.current_route(stack.settings.swap)
    renamed = (stack.settings.swap.router_dir / router.RDS_FILE).stat().st_mtime
    applied = watch.applied_at(router.route_version(colour, version, revision))  # type: ignore[arg-type]
    if applied is None:
        return None
    served = result.written_at + result.timings["switch_s"]
    return (renamed - result.written_at) * 1000, (applied - renamed) * 1000, (served - applied) * 1000


def bench_serve(base_url: str, prompts: int) -> dict[str, float]:
    command = [str(ENGINE_PYTHON), "-c", BENCH_SERVE, "--base-url", base_url, "--backend", "openai-chat",
               "--endpoint", "/v1/chat/completions", "--model", "qwen2-7b", "--tokenizer", str(TINY_MODEL_DIR),
               "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
               "--num-prompts", str(prompts), "--max-concurrency", "4", "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"vllm bench serve failed: {result.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(line.removeprefix("RESULT "))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--bench-prompts", type=int, default=100, help="prompts per `vllm bench serve` run")
    parser.add_argument("--samples", type=int, default=200, help="requests per path for Envoy's added latency")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    subprocess.run([str(ENGINE_PYTHON), str(SERVICE_DIR / "scripts" / "build_tiny_model.py"), str(TINY_MODEL_DIR)],
                   check=True, capture_output=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hot-swap-bench-") as work:
        stack = build_stack(Path(work), TINY_MODEL_DIR, ENGINE_PYTHON)
        stack.start()
        try:
            first = swap.swap(stack.settings, "qwen2-7b", "v1", log=lambda line: None)
            if not first.ok:
                raise SystemExit(f"initial deploy failed: {first}")
            load = Load(stack.url(""), clients=args.clients, max_s=3600).start()
            watch = RouteWatch(EnvoyAdmin(stack.settings.swap.admin_port))
            results, parts = [], []
            started = time.monotonic()
            try:
                for index in range(args.swaps):
                    version = "v2" if index % 2 == 0 else "v1"
                    result = swap.swap(stack.settings, "qwen2-7b", version, log=lambda line: None)
                    results.append(result)
                    split = breakdown(stack, watch, result)
                    if split is not None:
                        parts.append(split)
                    print(f"swap {index + 1}/{args.swaps} -> {version}: {result.gate} "
                          f"{ {k: round(v, 3) for k, v in result.timings.items()} } "
                          f"control/envoy/answer ms {[round(p, 1) for p in split or ()]}", flush=True)  # fmt: skip
                    if not result.ok:
                        break
            finally:
                outcomes = load.stop()
                watch.stopped.set()
            elapsed = time.monotonic() - started
            direct_port = stack.settings.swap.port(results[-1].colour or "blue")
            direct, proxied, direct_chat, proxied_chat = [], [], [], []
            for _ in range(args.samples):
                direct.append(timed_get(f"http://127.0.0.1:{direct_port}/v1/models"))
                proxied.append(timed_get(stack.url("/v1/models")))
                direct_chat.append(timed_chat(f"http://127.0.0.1:{direct_port}/v1/chat/completions"))
                proxied_chat.append(timed_chat(stack.url("/v1/chat/completions")))
            bench_serve(f"http://127.0.0.1:{direct_port}", 10)  # warm-up: the first run pays the engine's warm-up
            served_direct = bench_serve(f"http://127.0.0.1:{direct_port}", args.bench_prompts)
            served_envoy = bench_serve(stack.url(""), args.bench_prompts)
        finally:
            stack.stop()
    ok = [r for r in results if r.ok]
    switch = [r.timings["switch_s"] * 1000 for r in ok]
    drain = [r.timings["drain_s"] for r in ok if "drain_s" in r.timings]
    stop = [r.timings["stop_s"] for r in ok if "stop_s" in r.timings]
    ready = [r.timings["ready_s"] for r in ok]
    bad = failures(outcomes)
    streamed = sum(o.streaming for o in outcomes)
    h2c = sum(o.protocol == "h2c" for o in outcomes)
    print()
    print(f"swaps completed            {len(ok)}/{args.swaps} in {elapsed:.0f} s, {args.clients} clients")
    print(
        f"requests                   {len(outcomes)} ({streamed} streaming, {h2c} over h2c), failed {len(bad)}, "
        f"incomplete {sum(o.ok and not o.complete for o in outcomes)}"
    )
    by_mode = Counter((o.protocol, o.streaming, o.ok and o.complete) for o in outcomes)
    print("by protocol/streaming      " + ", ".join(f"{p} {'stream' if s else 'plain'} {'ok' if ok else 'FAILED'} {n}"
                                                 for (p, s, ok), n in sorted(by_mode.items())))  # fmt: skip
    print(f"switch latency ms          p50 {percentile(switch, 50):.1f}  p99 {percentile(switch, 99):.1f}  "
          f"max {max(switch, default=float('nan')):.1f}")  # fmt: skip
    for index, name in enumerate(("control loop", "Envoy apply", "first answer")):
        values = [p[index] for p in parts]
        print(f"  {name:<24} ms p50 {percentile(values, 50):.1f}  p99 {percentile(values, 99):.1f}  "
              f"max {max(values, default=float('nan')):.1f}")  # fmt: skip
    print(f"new instance ready s       p50 {percentile(ready, 50):.1f}  p99 {percentile(ready, 99):.1f}")
    print(f"drain (switch->idle 10s) s p50 {percentile(drain, 50):.1f}  p99 {percentile(drain, 99):.1f}")
    print(f"stop (SIGTERM->exit) s     p50 {percentile(stop, 50):.1f}  p99 {percentile(stop, 99):.1f}")
    for name, a, b in (("GET /v1/models", direct, proxied), ("chat 1 token", direct_chat, proxied_chat)):
        added = [p - d for d, p in zip(a, b, strict=True)]
        print(f"{name:<15} direct ms p50 {percentile(a, 50) * 1000:.2f} p99 {percentile(a, 99) * 1000:.2f} | "
              f"via Envoy p50 {percentile(b, 50) * 1000:.2f} p99 {percentile(b, 99) * 1000:.2f} | "
              f"added p50 {(percentile(b, 50) - percentile(a, 50)) * 1000:.2f} "
              f"p99 {(percentile(b, 99) - percentile(a, 99)) * 1000:.2f} "
              f"(paired p50 {percentile(added, 50) * 1000:.2f})")  # fmt: skip
    print("vllm bench serve           direct | via Envoy")
    for key in (
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "request_throughput",
    ):
        print(f"  {key:<24} {served_direct.get(key, float('nan')):8.2f} | {served_envoy.get(key, float('nan')):8.2f}")
    for outcome in bad[:5]:
        print("failed:", outcome)


if __name__ == "__main__":
    main()
