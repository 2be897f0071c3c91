"""Print blue/green hot-swap figures under load: failed requests, switch latency, Envoy's added latency, drain time.

Usage: ~/.cache/ironserve/venv/bin/python benchmarks/hot_swap.py [--swaps 10] [--clients 16] [--streaming] [--etcd3gw]
Starts its own etcd, Envoy, control loop, exporter and two CPU vLLM instances (tiny test model, engine
venv), all on 127.0.0.1, each in a session of its own (a CPU share of its own under autogroup scheduling, as a
systemd unit's cgroup on a host), and stops them all. Figures only; no assertions. The load is the official openai
SDK (hotswap_stack.Load: sync and async, HTTP/1.1 and h2c, streaming and not, only streaming with --streaming, no
SDK retries). Failed: an error or a status other than 200; truncated: a 200 whose body ends early (a stream without
its finish_reason and [DONE]).

- Envoy's upstream connections over the run, blue and green together: closed by the engine (with requests in
  flight), and retries (succeeded, refused by the retry budget, over num_retries): issue 33's 503s were engine
  closes with requests in flight, over Envoy's default of 3 concurrent retries.

- switch latency: the etcd compare-and-swap write (as `swap` reads the answer) -> the first request answered
  through Envoy by the new colour (`swap` asks /health through Envoy on one kept-alive connection, a question
  `swap.SWITCH_POLL_S` after each answer). `swap` runs in its own process, as an admin's command does, so the load
  generator's threads do not hold its GIL. Broken down (hotswap_stack.SWITCH_STEPS) with the control loop's own
  timestamps (its switch log line) and Envoy's (the route's `last_updated` in its admin, 1 ms resolution): etcd
  watch (write -> event parsed; below zero when the event arrives before `swap` has read the txn's answer),
  readiness check, route file write, Envoy apply (rename -> applied; below zero when Envoy applies before the
  preempted control loop reads its clock), question (applied -> the question the new colour answered first was
  asked; below zero within Envoy's 1 ms) and first answer (that question -> its answer from the new colour through
  Envoy).
- machine stall: during each switch, the longest a process that only sleeps 1 ms at a time was woken late: a stall
  of the whole machine (CPU saturated, or time stolen by the hypervisor, whose total over the swaps is printed)
  rather than one process of the switch waiting for its CPU share.
- etcd watch, bystander: a second watcher on the same keys, in a session of its own, that only notes when each
  revision arrives (write -> event parsed, like the control loop's step): a late event seen by both is etcd's or
  the machine's, seen only by the control loop is the loop's. With --etcd3gw a third watcher beside it, on the
  `etcd3gw` package's Watcher (not a dependency: pip install etcd3gw==2.7.0), stamps each revision's first event
  the same way: both clients' figures from the same run (the comparison behind control.py's note on etcd3gw).
- Envoy's added latency: the same requests sent alternately to vLLM directly and through Envoy, no load;
  and vLLM's own `vllm bench serve` (random 16-token prompts, 8 output tokens) against the engine and
  through Envoy, side by side.
- drain: route switch -> old colour idle for drain_idle_s in Envoy's stats (>= 10 s by design), then
  SIGTERM -> the old launcher gone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
sys.path.insert(0, str(SERVICE / "tests"))

from conftest import ENGINE_PYTHON, SERVICE_DIR, TINY_MODEL_DIR  # noqa: E402
from hotswap_stack import (  # noqa: E402
    SWITCH_STEPS,
    Load,
    Stack,
    build_stack,
    control_switches,
    failures,
    percentile,
    switch_breakdown,
)
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


# A process that only sleeps 1 ms at a time and prints each wake-up more than 5 ms late (wall clock at the wake-up,
# how late): it needs next to no CPU, so a late wake-up is the machine not running what was ready to run.
STALL_WATCH = """
import sys, time
while True:
    asked = time.perf_counter()
    time.sleep(0.001)
    late = time.perf_counter() - asked - 0.001
    if late > 0.005:
        print(f"{time.time():.6f} {late * 1000:.1f}", flush=True)
"""


# The bystander watcher: the control loop's own Watch, printing "revision wall-clock" as each event is parsed.
ETCD_BYSTANDER = """
import sys
from ironserve_service.control import Etcd
etcd = Etcd(sys.argv[1])
with etcd.watch(sys.argv[2], etcd.get_prefix(sys.argv[2]).revision + 1) as stream:
    while True:
        event = stream.next(3600)
        if event is not None:
            print(event[0], f"{event[2]:.6f}", flush=True)
"""


# The same bystander on etcd3gw (--etcd3gw): its Watcher's reader thread calls back once per event, stamped there.
ETCD3GW_BYSTANDER = """
import sys, threading, time
from urllib.parse import urlsplit
import etcd3gw
from etcd3gw.watch import Watcher
url, prefix = urlsplit(sys.argv[1]), sys.argv[2]
client = etcd3gw.client(host=url.hostname, port=url.port)
Watcher(client, prefix, lambda event: print(event["kv"]["mod_revision"], f"{time.time():.6f}", flush=True),
        range_end=prefix[:-1] + chr(ord(prefix[-1]) + 1))
threading.Event().wait()
"""


def bystander_ms(seen: str, revision: int, written_at: float) -> float:
    """Milliseconds from the etcd write to the bystander's first event for that revision (NaN if it has none)."""
    for line in seen.splitlines():
        seen_revision, parsed_at = line.split()
        if int(seen_revision) == revision:
            return (float(parsed_at) - written_at) * 1000
    return float("nan")


def spread(values: list[float]) -> str:
    """p50, p99 and max of milliseconds, as each line of the switch's breakdown prints them."""
    worst = max(values, default=float("nan"))
    return f"p50 {percentile(values, 50):.1f}  p99 {percentile(values, 99):.1f}  max {worst:.1f}"


def worst_stall_ms(stalls: str, since: float, until: float) -> float:
    """The longest late wake-up of STALL_WATCH's output that overlaps [since, until] (wall clock), 0 if none."""
    worst = 0.0
    for line in stalls.splitlines():
        woke_at, late_ms = map(float, line.split())
        if woke_at - late_ms / 1000 <= until and woke_at >= since:
            worst = max(worst, late_ms)
    return worst


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this machine's CPUs wanted it (/proc/stat, USER_HZ 100)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / 100


# Envoy's counters per upstream cluster (its cluster statistics docs), summed over blue and green.
UPSTREAM_COUNTERS = (
    "upstream_cx_destroy_remote",
    "upstream_cx_destroy_remote_with_active_rq",
    "upstream_rq_retry",
    "upstream_rq_retry_success",
    "upstream_rq_retry_overflow",
    "upstream_rq_retry_limit_exceeded",
)


def upstream_counters(admin: EnvoyAdmin) -> dict[str, int]:
    return {name: sum(admin.counter(f"cluster.{colour}.{name}") for colour in ("blue", "green"))
            for name in UPSTREAM_COUNTERS}  # fmt: skip


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


# `swap MODEL VERSION` as the CLI runs it, in a process of its own, printing its SwapResult as JSON.
SWAP_PROCESS = """
import dataclasses, json, sys
from pathlib import Path
from ironserve_service import settings, swap
result = swap.swap(settings.load_settings(Path(sys.argv[1])), "qwen2-7b", sys.argv[2], log=lambda line: None)
print(json.dumps(dataclasses.asdict(result)))
"""


def swap_in_own_process(stack: Stack, version: str) -> swap.SwapResult:
    command = ["nice", "-n", str(stack.nice), sys.executable, "-c", SWAP_PROCESS, str(stack.config), version]
    # A session of its own, as an admin's command has: under autogroup scheduling a CPU share of its own, not one
    # shared with the load generator's clients.
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900, start_new_session=True)
    if done.returncode != 0:
        raise SystemExit(f"swap to {version} failed in its process: {done.stderr[-3000:]}")
    return swap.SwapResult(**json.loads(done.stdout.splitlines()[-1]))


def breakdown(stack: Stack, result: swap.SwapResult) -> dict[str, float] | None:
    """Milliseconds per SWITCH_STEPS of the swap just done: its etcd write, the control loop's switch line for
    the revision the route names, Envoy's apply of that route, and swap's first answer from the new colour."""
    if result.written_at is None or "switch_s" not in result.timings:
        return None
    revision, colour, version = router.current_route(stack.settings.swap)
    control = control_switches((stack.logs / "control.log").read_text()).get(revision)
    applied = EnvoyAdmin(stack.settings.swap.admin_port).route_applied()
    if control is None or applied is None or applied[0] != router.route_version(colour, version, revision):
        return None
    asked_at = result.written_at + result.timings["switch_asked_s"]
    served_at = result.written_at + result.timings["switch_s"]
    return switch_breakdown(result.written_at, control, applied[1], asked_at, served_at)


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
    parser.add_argument("--streaming", action="store_true", help="every request streams (default: every other)")
    parser.add_argument("--bench-prompts", type=int, default=100, help="prompts per `vllm bench serve` run")
    parser.add_argument("--samples", type=int, default=200, help="requests per path for Envoy's added latency")
    parser.add_argument("--etcd3gw", action="store_true", help="a second bystander watcher on the etcd3gw package")
    parser.add_argument("--nice", type=int, default=0, help="nice value of the stack's processes and of swap's (and so "
                        "of the engines it starts); not of the load generator. Where the kernel schedules by "
                        "autogroup (kernel.sched_autogroup_enabled), it ranks a process only within its session, "
                        "and each engine has a session of its own")  # fmt: skip
    args = parser.parse_args()
    if args.etcd3gw and importlib.util.find_spec("etcd3gw") is None:
        raise SystemExit("--etcd3gw needs the etcd3gw package in this venv: pip install etcd3gw==2.7.0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    subprocess.run([str(ENGINE_PYTHON), str(SERVICE_DIR / "scripts" / "build_tiny_model.py"), str(TINY_MODEL_DIR)],
                   check=True, capture_output=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hot-swap-bench-") as work:
        stall_log = Path(work) / "stalls.txt"
        with stall_log.open("w") as out:
            watch = subprocess.Popen([sys.executable, "-c", STALL_WATCH], stdout=out)
        stack = build_stack(Path(work), TINY_MODEL_DIR, ENGINE_PYTHON, nice=args.nice)
        stack.start()
        # Bystander watchers by name: the control loop's own Watch, and etcd3gw's with --etcd3gw.
        scripts = {"bystander": ETCD_BYSTANDER, **({"etcd3gw": ETCD3GW_BYSTANDER} if args.etcd3gw else {})}
        bystander_logs = {name: Path(work) / f"{name}.txt" for name in scripts}
        bystanders: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, script in scripts.items():
                with bystander_logs[name].open("w") as out:
                    command = [sys.executable, "-c", script, stack.settings.swap.etcd_url,
                               stack.settings.swap.key_prefix]  # fmt: skip
                    bystanders[name] = subprocess.Popen(command, stdout=out, start_new_session=True)
            first = swap_in_own_process(stack, "v1")
            if not first.ok:
                raise SystemExit(f"initial deploy failed: {first}")
            load = Load(stack.url(""), clients=args.clients, max_s=3600, streaming_only=args.streaming).start()
            results: list[swap.SwapResult] = []
            parts: list[dict[str, float]] = []
            stalls: list[float] = []
            seen_ms: dict[str, list[float]] = {name: [] for name in scripts}
            load_before, steal_before = os.getloadavg(), steal_seconds()
            started = time.monotonic()
            try:
                for index in range(args.swaps):
                    version = "v2" if index % 2 == 0 else "v1"
                    result = swap_in_own_process(stack, version)
                    results.append(result)
                    split = breakdown(stack, result)
                    if split is not None:
                        parts.append(split)
                    stall = float("nan")
                    seen: dict[str, float] = {}
                    if result.written_at is not None and "switch_s" in result.timings:
                        until = result.written_at + result.timings["switch_s"]
                        stall = worst_stall_ms(stall_log.read_text(), result.written_at, until)
                        stalls.append(stall)
                        revision = router.current_route(stack.settings.swap)[0]
                        for name, log in bystander_logs.items():
                            seen[name] = bystander_ms(log.read_text(), revision, result.written_at)
                            seen_ms[name].append(seen[name])
                    print(f"swap {index + 1}/{args.swaps} -> {version}: {result.gate} "
                          f"{ {k: round(v, 3) for k, v in result.timings.items()} } "
                          f"switch ms { {k: round(v, 1) for k, v in (split or {}).items()} } "
                          f"machine stall ms {stall:.1f} etcd watch ms "
                          f"{ {name: round(ms, 1) for name, ms in seen.items()} }", flush=True)  # fmt: skip
                    if not result.ok:
                        break
            finally:
                outcomes = load.stop()
            elapsed = time.monotonic() - started
            upstream = upstream_counters(EnvoyAdmin(stack.settings.swap.admin_port))
            load_after, steal = os.getloadavg(), steal_seconds() - steal_before
            # The colour Envoy serves, also after a swap that failed (its colour was stopped).
            served = router.current_route(stack.settings.swap)[1]
            direct_port = stack.settings.swap.port("green" if served == "green" else "blue")
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
            for process in bystanders.values():
                process.terminate()
                process.wait()
            stack.stop()
            watch.terminate()
            watch.wait()
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
    print(f"host                       {os.cpu_count()} CPUs, load average (1 min) {load_before[0]:.1f} before the "
          f"swaps, {load_after[0]:.1f} after, {steal:.1f} s stolen by the hypervisor; stack, swap and engines at nice "
          f"{args.nice}")  # fmt: skip
    print(
        f"requests                   {len(outcomes)} ({streamed} streaming, {h2c} over h2c), "
        f"failed {sum(not o.ok for o in outcomes)}, truncated {sum(o.ok and not o.complete for o in outcomes)}"
    )
    print("Envoy upstream             " + ", ".join(f"{name} {value}" for name, value in upstream.items()))
    by_mode = Counter((o.protocol, o.streaming, o.ok and o.complete) for o in outcomes)
    print("by protocol/streaming      " + ", ".join(f"{p} {'stream' if s else 'plain'} {'ok' if ok else 'FAILED'} {n}"
                                                 for (p, s, ok), n in sorted(by_mode.items())))  # fmt: skip
    print(f"switch latency ms          {spread(switch)}")
    print(f"  broken down over {len(parts)} switches:")
    for step in SWITCH_STEPS:
        print(f"  {step:<24} ms {spread([p[step] for p in parts])}")
    print(f"  {'machine stall (longest)':<24} ms {spread(stalls)}  (a sleeping process woken late)")
    for name, values in seen_ms.items():
        print(f"  {f'etcd watch ({name})':<24} ms {spread(values)}  (a second watcher, its own session)")
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
