"""Prometheus exporter: hardware, framework and cost dimensions, plus the quality metrics of quality.py.

Hardware and framework figures are read at scrape time (no background polling), so a scrape
shows the state of that moment and an idle exporter costs nothing. GPU health (gpu_health.py) is read
the same way; only its XID events come from a thread, because NVML delivers them as events. With the GPU guard
on, the GPUs it drained the host for are read from etcd at scrape time too (gpu_guard.GuardCollector).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ironserve_service.gpu_guard import GuardCollector
from ironserve_service.gpu_health import GpuHealthCollector, XidWatcher
from ironserve_service.serving import serving_engine
from ironserve_service.settings import ExporterSettings, ServiceSettings

log = logging.getLogger(__name__)

# Today's vLLM names first, then the V0 names the exporter still understands.
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING_NAMES = ("vllm:num_requests_running",)
WAITING_NAMES = ("vllm:num_requests_waiting",)
PROMPT_TOKEN_NAMES = ("vllm:prompt_tokens_total",)
GENERATION_TOKEN_NAMES = ("vllm:generation_tokens_total",)
CACHE_INFO_NAMES = ("vllm:cache_config_info", "vllm:cache_config")


@dataclass(frozen=True)
class GpuReading:
    index: int
    used_bytes: int
    total_bytes: int
    utilization_percent: float
    process_bytes: dict[int, int]


@dataclass(frozen=True)
class FrameworkReading:
    kv_cache_usage_ratio: float | None
    requests_running: float | None
    requests_waiting: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    num_gpu_blocks: float | None


def read_gpus(max_gpus: int) -> list[GpuReading] | None:
    """The GPUs NVML can read, up to max_gpus; a GPU that cannot be read (off the bus) is skipped and the others still
    read (obs-hardware-exporter: "skipping missing devices"; gpu_health's gpu_lost names it). None when NVML itself
    is unusable (no driver, no GPU): the exporter reports that instead of crashing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVMLError, ImportError, missing libnvidia-ml all mean "no GPU"
        return None
    readings = []
    try:
        count = min(pynvml.nvmlDeviceGetCount(), max_gpus)
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
                processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError as error:
                log.warning("gpu%d: not read: %s", index, error)
                continue
            readings.append(
                GpuReading(
                    index=index,
                    used_bytes=int(memory.used),
                    total_bytes=int(memory.total),
                    utilization_percent=float(utilization.gpu),
                    process_bytes={int(p.pid): int(p.usedGpuMemory or 0) for p in processes},
                )
            )
    except Exception:  # NVML failing as a whole mid-read must not take the exporter down
        return None
    finally:
        pynvml.nvmlShutdown()
    return readings


def parse_vllm_metrics(text: str) -> FrameworkReading:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))

    def total(names: Iterable[str]) -> float | None:
        # Summed over engines and labels (e.g. prompt tokens by source), one figure per signal.
        for name in names:
            if name in samples:
                return sum(value for _, value in samples[name])
        return None

    blocks = None
    for name in CACHE_INFO_NAMES:
        for labels, _ in samples.get(name, []):
            if labels.get("num_gpu_blocks", "None") != "None":
                blocks = float(labels["num_gpu_blocks"])
    usage = None
    for name in KV_USAGE_NAMES:
        values = [value for _, value in samples.get(name, [])]
        if values:
            usage = max(values)
            break
    return FrameworkReading(
        kv_cache_usage_ratio=usage,
        requests_running=total(RUNNING_NAMES),
        requests_waiting=total(WAITING_NAMES),
        prompt_tokens=total(PROMPT_TOKEN_NAMES),
        generation_tokens=total(GENERATION_TOKEN_NAMES),
        num_gpu_blocks=blocks,
    )


def fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body: bytes = response.read()
    return body.decode("utf-8")


class HardwareCollector(Collector):
    def __init__(self, max_gpus: int) -> None:
        self.max_gpus = max_gpus

    def collect(self) -> Iterator[Metric]:
        readings = read_gpus(self.max_gpus)
        available = GaugeMetricFamily("gpu_nvml_available", "1 when NVML answered, 0 on a host without a GPU")
        available.add_metric([], 0.0 if readings is None else 1.0)
        yield available
        if not readings:
            return
        used = GaugeMetricFamily("gpu_memory_used_bytes", "GPU memory used, absolute bytes", labels=["device"])
        total = GaugeMetricFamily("gpu_memory_total_bytes", "GPU memory total, absolute bytes", labels=["device"])
        util = GaugeMetricFamily("gpu_utilization_percent", "GPU utilisation", labels=["device"])
        per_process = GaugeMetricFamily(
            "gpu_process_memory_used_bytes", "GPU memory used per process", labels=["device", "pid"]
        )
        for gpu in readings:
            device = f"gpu{gpu.index}"
            used.add_metric([device], gpu.used_bytes)
            total.add_metric([device], gpu.total_bytes)
            util.add_metric([device], gpu.utilization_percent)
            for pid, used_bytes in gpu.process_bytes.items():
                per_process.add_metric([device, str(pid)], used_bytes)
        yield from (used, total, util, per_process)


class FrameworkCollector(Collector):
    """Re-reads the serving engine's /metrics under stable names, whatever vLLM version produced them.

    The engine is resolved at every scrape (serving.py), so after a swap the figures are the new colour's.
    """

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.timeout_s = settings.exporter.scrape_timeout_s

    def collect(self) -> Iterator[Metric]:
        engine = serving_engine(self.settings)
        serving = GaugeMetricFamily(
            "ironserve_serving_colour_info", "The colour and version Envoy routes to", labels=["colour", "version"]
        )
        if engine.colour is not None:
            serving.add_metric([engine.colour, engine.version or ""], 1.0)
        yield serving
        up = GaugeMetricFamily("ironserve_vllm_up", "1 when the serving engine's /metrics answered")
        try:
            if engine.base_url is None:
                raise ValueError("the route serves no engine")
            reading = parse_vllm_metrics(fetch_text(f"{engine.base_url}/metrics", self.timeout_s))
        except (OSError, ValueError):
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        gauges: dict[str, tuple[str, Any]] = {
            "ironserve_kv_cache_usage_ratio": ("KV cache usage, 0-1 fraction", reading.kv_cache_usage_ratio),
            "ironserve_requests_running": ("Requests running in vLLM", reading.requests_running),
            "ironserve_requests_waiting": ("Requests waiting in vLLM", reading.requests_waiting),
            "ironserve_kv_cache_blocks": ("KV cache blocks (num_gpu_blocks)", reading.num_gpu_blocks),
        }
        for name, (documentation, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value)
        tokens = CounterMetricFamily("ironserve_tokens", "Tokens processed by vLLM", labels=["kind"])
        for kind, value in (("prompt", reading.prompt_tokens), ("generation", reading.generation_tokens)):
            if value is not None:
                tokens.add_metric([kind], value)
        yield tokens


class CostCollector(Collector):
    """The price side of cost per token; the token rate side comes from ironserve_tokens_total."""

    def __init__(self, settings: ExporterSettings) -> None:
        self.usd_per_hour = settings.gpu_hour_usd * settings.gpus_billed

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "ironserve_gpu_cost_usd_per_hour", "Configured GPU price times GPUs billed", value=self.usd_per_hour
        )


def cost_per_token(usd_per_hour: float, tokens_per_second: float) -> float | None:
    """USD per token; None when idle, because an idle server has no per-token cost to report."""
    if tokens_per_second <= 0:
        return None
    return usd_per_hour / 3600.0 / tokens_per_second


def build_registry(
    settings: ServiceSettings, extra: Iterable[Collector] = (), xids: XidWatcher | None = None
) -> CollectorRegistry:
    """`xids`: the running XID watcher whose counts the GPU health families carry (the `exporter` command's)."""
    registry = CollectorRegistry(auto_describe=False)
    exporter = settings.exporter
    collectors = [
        HardwareCollector(exporter.max_gpus),
        GpuHealthCollector(settings.gpu_health, exporter.max_gpus, xids),
        FrameworkCollector(settings),
        CostCollector(exporter),
    ]
    if settings.gpu_health.guard:
        collectors.append(GuardCollector(settings.swap, min(settings.swap.etcd_timeout_s, exporter.scrape_timeout_s)))
    for collector in [*collectors, *extra]:
        registry.register(collector)
    return registry


def serve(settings: ExporterSettings, registry: CollectorRegistry) -> None:
    start_http_server(settings.port, addr=settings.host, registry=registry)
