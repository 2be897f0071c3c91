"""Exporter dimensions without an engine, and a real Prometheus scraping the exporter."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ironserve_service import exporter, quality
from ironserve_service.settings import EngineSettings, ExporterSettings, QualitySettings

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


@pytest.mark.invariant("obs-vllm-cache-usage", "obs-five-dimensions")
def test_framework_reads_todays_and_older_vllm_names() -> None:
    today = exporter.parse_vllm_metrics(V1_METRICS)
    assert today.kv_cache_usage_ratio == 0.25 and today.num_gpu_blocks == 2048
    assert (today.requests_running, today.requests_waiting) == (3.0, 1.0)
    assert (today.prompt_tokens, today.generation_tokens) == (170.0, 50.0)
    older = exporter.parse_vllm_metrics(V0_METRICS)
    assert older.kv_cache_usage_ratio == 0.5 and older.prompt_tokens is None


@pytest.mark.invariant("obs-hardware-exporter", "obs-gpu-mem-absolute")
def test_host_without_gpu_reports_it_and_does_not_crash() -> None:
    registry = exporter.build_registry(ExporterSettings(vllm_metrics_url="http://127.0.0.1:1/metrics"))
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
def test_semantic_scoring_with_fake_embedder_and_replayed_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    settings = QualitySettings(queue_size=1)
    metrics = quality.QualityMetrics(registry, settings)
    vectors = {"what is a gpu?": [1.0, 0.0], "a graphics processor": [0.8, 0.6]}
    scorer = quality.QualityScorer(settings, EngineSettings(model_dir=Path("/m")), metrics, lambda: None)
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
    settings = ExporterSettings(port=free_port(), vllm_metrics_url="http://127.0.0.1:1/metrics")
    registry = exporter.build_registry(settings)
    quality.QualityMetrics(registry, QualitySettings())
    exporter.serve(settings, registry)
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "ironserve", "static_configs": [{"targets": [f"127.0.0.1:{settings.port}"]}]}],
    }))  # fmt: skip
    server = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        prometheus = f"http://127.0.0.1:{web}"
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
    finally:
        server.terminate()
        server.wait(timeout=30)
