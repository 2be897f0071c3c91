"""Print blue/green hot-swap figures under load: failed requests, switch latency, Envoy's added latency, drain time.

Usage: ~/.cache/ironserve/venv/bin/python benchmarks/hot_swap.py [--swaps 10] [--clients 12]
Starts its own etcd, Envoy, control loop and two CPU vLLM instances (tiny test model, engine venv), all
on 127.0.0.1, and stops them all. Figures only; no assertions.

- switch latency: the etcd compare-and-swap write -> the first request answered through Envoy by the new
  colour (`swap` polls /health through Envoy every 5 ms; this includes the control loop's fresh readiness
  check of the new instance, a one-token completion).
- Envoy's added latency: the same requests sent alternately to vLLM directly and through Envoy, no load.
- drain: route switch -> old colour idle for drain_idle_s in Envoy's stats (>= 10 s by design), then
  SIGTERM -> the old launcher gone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
sys.path.insert(0, str(SERVICE / "tests"))

from conftest import ENGINE_PYTHON, SERVICE_DIR, TINY_MODEL_DIR  # noqa: E402
from hotswap_stack import Load, build_stack, failures  # noqa: E402
from ironserve_service import swap  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--clients", type=int, default=12)
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
            load = Load(stack.url("/v1/chat/completions"), clients=args.clients, h2c_clients=2, max_s=3600).start()
            results = []
            started = time.monotonic()
            try:
                for index in range(args.swaps):
                    version = "v2" if index % 2 == 0 else "v1"
                    result = swap.swap(stack.settings, "qwen2-7b", version, log=lambda line: None)
                    results.append(result)
                    print(f"swap {index + 1}/{args.swaps} -> {version}: {result.gate} "
                          f"{ {k: round(v, 3) for k, v in result.timings.items()} }", flush=True)  # fmt: skip
                    if not result.ok:
                        break
            finally:
                outcomes = load.stop()
            elapsed = time.monotonic() - started
            direct_port = stack.settings.swap.port(results[-1].colour or "blue")
            direct, proxied, direct_chat, proxied_chat = [], [], [], []
            for _ in range(args.samples):
                direct.append(timed_get(f"http://127.0.0.1:{direct_port}/v1/models"))
                proxied.append(timed_get(stack.url("/v1/models")))
                direct_chat.append(timed_chat(f"http://127.0.0.1:{direct_port}/v1/chat/completions"))
                proxied_chat.append(timed_chat(stack.url("/v1/chat/completions")))
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
    print(f"requests                   {len(outcomes)} ({streamed} streaming, {h2c} over h2c), failed {len(bad)}")
    print(f"switch latency ms          p50 {percentile(switch, 50):.1f}  p99 {percentile(switch, 99):.1f}  "
          f"max {max(switch, default=float('nan')):.1f}")  # fmt: skip
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
    for outcome in bad[:5]:
        print("failed:", outcome)


if __name__ == "__main__":
    main()
