"""Exporter dimensions without an engine, and a real Prometheus scraping the exporter."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ironserve_service import exporter, quality, router
from ironserve_service.settings import (
    Colour,
    EngineSettings,
    ExporterSettings,
    QualitySettings,
    ServiceSettings,
    SwapSettings,
)

V1_METRICS = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen2-7b"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen2-7b"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen2-7b"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="qwen2-7b"} 170.0
vllm:prompt_tokens_created{engine="0",model_name="qwen2-7b"} 1.79e+09
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="qwen2-7b"} 50.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1.0
"""
V0_METRICS = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="qwen2-7b"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="qwen2-7b"} 2.0
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def service_settings(
    tmp_path: Path,
    engine_port: int,
    quality: QualitySettings | None = None,
    exporter_settings: ExporterSettings | None = None,
    blue_port: int = 8000,
    green_port: int = 8001,
) -> ServiceSettings:
    return ServiceSettings(
        engine=EngineSettings(model_dir=Path("/m"), port=engine_port),
        quality=quality or QualitySettings(),
        exporter=exporter_settings or ExporterSettings(),
        swap=SwapSettings(router_dir=tmp_path / "envoy", blue_port=blue_port, green_port=green_port),
    )


@pytest.mark.invariant("obs-vllm-cache-usage", "obs-five-dimensions")
def test_framework_reads_todays_and_older_vllm_names() -> None:
    today = exporter.parse_vllm_metrics(V1_METRICS)
    assert today.kv_cache_usage_ratio == 0.25 and today.num_gpu_blocks == 2048
    assert (today.requests_running, today.requests_waiting) == (3.0, 1.0)
    assert (today.prompt_tokens, today.generation_tokens) == (170.0, 50.0)
    older = exporter.parse_vllm_metrics(V0_METRICS)
    assert older.kv_cache_usage_ratio == 0.5 and older.prompt_tokens is None


@pytest.mark.invariant("obs-hardware-exporter", "obs-gpu-mem-absolute")
def test_host_without_gpu_reports_it_and_does_not_crash(tmp_path: Path) -> None:
    registry = exporter.build_registry(service_settings(tmp_path, engine_port=1))
    text = generate_latest(registry).decode()
    if shutil.which("nvidia-smi") is None:
        assert "gpu_nvml_available 0.0" in text and "gpu_memory_used_bytes{" not in text
    assert "ironserve_vllm_up 0.0" in text
    assert "ironserve_gpu_cost_usd_per_hour 1.7" in text


@pytest.mark.invariant("obs-cost-per-token")
def test_cost_per_token_is_safe_when_idle() -> None:
    assert exporter.cost_per_token(1.7, 0.0) is None
    assert exporter.cost_per_token(0.85 * 2, 10.0) == pytest.approx(1.7 / 3600 / 10)


@pytest.mark.invariant("obs-logprobs-std")
def test_logprob_std_drops_sentinels() -> None:
    assert quality.logprob_std([-1.0, -9999.0, -3.0, float("-inf"), None]) == pytest.approx(1.0)
    assert quality.logprob_std([-1.0]) is None


@pytest.mark.invariant("obs-semantic-success")
def test_semantic_scoring_with_fake_embedder_and_replayed_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    settings = service_settings(tmp_path, engine_port=8000, quality=QualitySettings(queue_size=1))
    metrics = quality.QualityMetrics(registry, settings.quality)
    vectors = {"what is a gpu?": [1.0, 0.0], "a graphics processor": [0.8, 0.6]}
    scorer = quality.QualityScorer(settings, metrics, lambda: None)
    scorer.embedder = lambda texts: [vectors[t] for t in texts]
    answer = {"choices": [{"message": {"content": "a graphics processor"},
                           "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -6.1}]}}]}  # fmt: skip
    monkeypatch.setattr(quality, "http_json", lambda *args: (200, answer))
    scorer.score({"messages": [{"role": "user", "content": "what is a gpu?"}]})
    assert registry.get_sample_value("semantic_evaluations_total") == 1
    assert registry.get_sample_value("semantic_success_total") == 1  # cosine 0.8 >= 0.65
    assert registry.get_sample_value("model_logprob_std_high_total") == 1  # std 3.0 > 2.5
    assert scorer.offer({}) and not scorer.offer({})  # full queue drops instead of blocking
    assert registry.get_sample_value("quality_mirror_dropped_total") == 1


@contextlib.contextmanager
def prometheus_scraping(target: str, work: Path) -> Iterator[str]:
    """A real Prometheus scraping `target` (host:port) every second, its data in `work`; yields its URL."""
    config = work / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "ironserve", "static_configs": [{"targets": [target]}]}],
    }))  # fmt: skip
    web = free_port()
    server = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{web}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def query(prometheus: str, expr: str) -> list[dict[str, object]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        result: list[dict[str, object]] = json.load(response)["data"]["result"]
        return result


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus absent: apt-get install prometheus")
@pytest.mark.invariant(
    "obs-prometheus-local", "obs-exporter-http-server", "obs-five-dimensions", "obs-no-prometheus-operator"
)
def test_real_prometheus_scrapes_the_exporter(tmp_path: Path) -> None:
    service = service_settings(tmp_path, engine_port=1, exporter_settings=ExporterSettings(port=free_port()))
    settings = service.exporter
    registry = exporter.build_registry(service)
    quality.QualityMetrics(registry, QualitySettings())
    exporter.serve(settings, registry)
    with prometheus_scraping(f"127.0.0.1:{settings.port}", tmp_path) as prometheus:
        deadline = time.monotonic() + 60
        dimensions = {
            "hardware": "gpu_nvml_available",
            "framework": "ironserve_vllm_up",
            "model": "model_logprob_std_count",
            "business": "semantic_evaluations_total",
            "cost": "ironserve_gpu_cost_usd_per_hour",
        }
        missing = set(dimensions)
        while missing and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # Prometheus still starting
                missing = {d for d in missing if not query(prometheus, dimensions[d])}
            time.sleep(0.5)
        assert not missing, f"dimensions never scraped: {missing}"
        assert query(prometheus, 'up{job="ironserve"} == 1')


class MetricsEngine(ThreadingHTTPServer):
    """An engine's /metrics (vLLM's names, as test_engine reads them from a real CPU vLLM), one per colour."""

    daemon_threads = True

    def __init__(self, generation_tokens: int) -> None:
        self.text = V1_METRICS.replace("} 50.0", f"}} {generation_tokens}.0")
        super().__init__(("127.0.0.1", 0), _MetricsHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsEngine

    def do_GET(self) -> None:
        body = self.server.text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.mark.invariant("obs-five-dimensions", "hot-swap-envoy-follows-etcd")
def test_exporter_follows_the_route_envoy_serves(tmp_path: Path) -> None:
    blue, green = MetricsEngine(111), MetricsEngine(222)
    try:
        settings = service_settings(tmp_path, engine_port=9, blue_port=blue.server_port, green_port=green.server_port)
        registry = exporter.build_registry(settings)

        def scrape() -> tuple[float | None, float | None, str | None]:
            text = generate_latest(registry).decode()
            up = registry.get_sample_value("ironserve_vllm_up")
            tokens = registry.get_sample_value("ironserve_tokens_total", {"kind": "generation"})
            colours = [c for c in ("blue", "green") if f'ironserve_serving_colour_info{{colour="{c}"' in text]
            return up, tokens, (colours[0] if colours else None)

        # No route file: no router on this host, the configured engine (nothing listens on port 9).
        assert scrape() == (0.0, None, None)
        path = settings.swap.router_dir / router.RDS_FILE
        router.write_atomic(path, router.routes(settings.swap, None, None, 0))
        assert scrape() == (0.0, None, None)  # the route serves nothing yet
        expected: list[tuple[Colour, float]] = [("blue", 111.0), ("green", 222.0), ("blue", 111.0)]
        for colour, tokens in expected:
            router.write_atomic(path, router.routes(settings.swap, colour, "v1", 7))
            assert scrape() == (1.0, tokens, colour)
    finally:
        blue.shutdown()
        green.shutdown()
