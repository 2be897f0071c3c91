"""The launcher, probes, exporter and quality scorer against a real CPU vLLM serving the tiny Qwen2 model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import ENGINE_PYTHON, SERVICE_DIR

from ironserve_service import exporter, health
from ironserve_service.settings import ServiceSettings, SwapSettings, load_settings

pytestmark = pytest.mark.engine
READY_TIMEOUT_S = 300


@dataclass
class RunningService:
    config: Path
    settings: ServiceSettings
    process: subprocess.Popen[bytes]
    log: Path
    observations: list[tuple[bool, bool, bool]] = field(default_factory=list)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ironserve_service", *args, "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def service(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    work = tmp_path_factory.mktemp("engine")
    config = work / "service.yaml"
    config.write_text(yaml.safe_dump({
        "engine": {
            "model_dir": str(tiny_model), "served_model_name": "qwen2-7b", "port": free_port(),
            "max_model_len": 512, "max_num_seqs": 4, "tensor_parallel_size": 1, "enforce_eager": True,
            "engine_python": str(ENGINE_PYTHON),
        },
        "readiness": {"loading_marker": str(work / "model_loading"), "ready_marker": str(work / "model_ready"),
                      "startup_timeout_s": READY_TIMEOUT_S, "poll_interval_s": 0.5, "drain_timeout_s": 20},
    }))  # fmt: skip
    settings = load_settings(config)
    log = work / "launcher.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "ironserve_service", "launch", "--config", str(config)],
            stdout=sink, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    running = RunningService(config, settings, process, log)
    readiness = settings.readiness
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline and process.poll() is None:
            ready = health.probe_ready(readiness).ok
            running.observations.append((readiness.loading_marker.exists(), ready, readiness.ready_marker.exists()))
            if ready:
                break
            time.sleep(0.2)
        assert health.probe_ready(readiness).ok, log.read_text()[-4000:]
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.mark.invariant("svc-readiness-file", "svc-engine-vllm")
def test_readiness_false_while_loading_true_only_after_a_completion(service: RunningService) -> None:
    loading = [o for o in service.observations if o[0]]
    assert len(loading) >= 3, "never observed the loading phase"
    assert not any(ready for _, ready, _ in loading[:-1])
    log = service.log.read_text(errors="replace")
    completion = log.find('"POST /v1/chat/completions HTTP/1.1" 200')
    ready = log.find("engine ready: model answers")
    assert 0 <= completion < ready, "ready marker written before a completion succeeded"
    assert not service.settings.readiness.loading_marker.exists()


@pytest.mark.invariant("svc-readiness-file", "svc-health-endpoint", "svc-port", "model-id", "svc-max-model-len")
def test_probes_and_openai_endpoints(service: RunningService) -> None:
    assert cli(service.config, "probe", "ready").returncode == 0
    assert cli(service.config, "probe", "live").returncode == 0
    engine = service.settings.engine
    status, _ = health.http_json(f"{engine.base_url}/health", 5)
    assert status == 200
    _, models = health.http_json(f"{engine.base_url}/v1/models", 5)
    assert models["data"][0]["id"] == "qwen2-7b" and models["data"][0]["max_model_len"] == 512


@pytest.mark.invariant("obs-vllm-cache-usage", "obs-http-metric-names", "obs-vllm-kv-blocks-used", "svc-no-cpu-offload")
def test_exporter_rereads_real_vllm_metrics(service: RunningService) -> None:
    engine = service.settings.engine
    text = exporter.fetch_text(f"{engine.base_url}/metrics", 5)
    reading = exporter.parse_vllm_metrics(text)
    assert reading.kv_cache_usage_ratio is not None and 0.0 <= reading.kv_cache_usage_ratio <= 1.0
    assert reading.num_gpu_blocks and reading.generation_tokens and reading.generation_tokens >= 1
    # The launcher's buckets reached vLLM: the SLO thresholds are bucket boundaries.
    for histogram, boundary in (("e2e_request_latency", "0.5"), ("time_to_first_token", "0.4"),
                                ("time_to_first_token", "0.8"), ("inter_token_latency", "0.2")):  # fmt: skip
        assert f'vllm:{histogram}_seconds_bucket{{engine="0",le="{boundary}"' in text, histogram
    assert 'http_request_duration_seconds_bucket{handler="/v1/chat/completions",le="0.5"' in text
    # No router on this host: the exporter reads the configured engine.
    settings = service.settings.model_copy(update={"swap": SwapSettings(router_dir=service.log.parent / "no-router")})
    from prometheus_client import generate_latest

    scraped = generate_latest(exporter.build_registry(settings)).decode()
    assert "ironserve_vllm_up 1.0" in scraped and 'ironserve_tokens_total{kind="generation"}' in scraped


@pytest.mark.invariant(
    "obs-logprobs-std", "obs-semantic-success", "pipe-tokenizer-rust", "pipe-tokenizer-special-tokens"
)
def test_mirror_scoring_with_real_engine_and_sentence_bert(service: RunningService) -> None:
    engine = service.settings.engine
    script = f"""
from pathlib import Path
from prometheus_client import CollectorRegistry
from ironserve_service import quality
from ironserve_service.settings import EngineSettings, ServiceSettings, SwapSettings
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(engine.model_dir)!r})
assert tokenizer.is_fast and tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
registry = CollectorRegistry()
settings = ServiceSettings(engine=EngineSettings(model_dir=Path("/m"), port={engine.port},
    served_model_name={engine.served_model_name!r}), swap=SwapSettings(router_dir=Path("/nonexistent")))
scorer = quality.QualityScorer(settings, quality.QualityMetrics(registry, settings.quality), quality.sentence_bert)
scorer.embedder = quality.sentence_bert()
a, b = scorer.embedder(["What is the capital of France?", "Paris is the capital of France."])
assert quality.cosine(a, b) >= 0.65, quality.cosine(a, b)
scorer.score({{"messages": [{{"role": "user", "content": "Hello, how are you today?"}}], "max_tokens": 8}})
assert registry.get_sample_value("semantic_evaluations_total") == 1
assert registry.get_sample_value("model_logprob_std_count") == 1
print("scored")
"""
    env = {**os.environ, "PYTHONPATH": str(SERVICE_DIR / "src"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(ENGINE_PYTHON), "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0 and "scored" in result.stdout, result.stderr[-3000:]


@pytest.mark.invariant("svc-readiness-file")
def test_sigterm_drains_and_clears_readiness(service: RunningService) -> None:
    service.process.send_signal(signal.SIGTERM)
    assert service.process.wait(timeout=60) == 0
    readiness = service.settings.readiness
    assert not readiness.ready_marker.exists() and not readiness.loading_marker.exists()
    assert cli(service.config, "probe", "ready").returncode == 1
    assert cli(service.config, "probe", "live").returncode == 1
