"""SLO rules: promtool check rules, and promtool test rules with a firing and a not-firing case per alert."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ironserve_service import slo
from ironserve_service.settings import QualitySettings, SloSettings

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent: apt-get install prometheus")

JOB = {"job": "ironserve", "instance": "host:9400"}
SLO, QUALITY = SloSettings(), QualitySettings()
RULES = slo.rules_document(SLO, QUALITY)
ALERTS = {rule["alert"]: rule for group in RULES["groups"] for rule in group["rules"] if "alert" in rule}


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    selector = ",".join(f'{k}="{v}"' for k, v in {**JOB, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def fires(alert: str, at: str, **labels: str) -> dict[str, Any]:
    rule = ALERTS[alert]
    expected = {**labels, "severity": rule["labels"]["severity"]}
    return {
        "eval_time": at,
        "alertname": alert,
        "exp_alerts": [{"exp_labels": expected, "exp_annotations": rule["annotations"]}],
    }


def silent(alert: str, at: str) -> dict[str, Any]:
    return {"eval_time": at, "alertname": alert, "exp_alerts": []}


def latency(le_04: str, le_05: str, total: str, le_2: str | None = None) -> list[dict[str, str]]:
    name = "vllm:e2e_request_latency_seconds_bucket"
    buckets = [series(name, le_04, le="0.4"), series(name, le_05, le="0.5"), series(name, le_2 or total, le="2")]
    return [*buckets, series(name, total, le="+Inf")]


def first_token(le_04: str, le_08: str, total: str, le_2: str | None = None) -> list[dict[str, str]]:
    name = "vllm:time_to_first_token_seconds_bucket"
    buckets = [series(name, le_04, le="0.4"), series(name, le_08, le="0.8"), series(name, le_2 or total, le="2.5")]
    return [*buckets, series(name, total, le="+Inf")]


def per_token(le_02: str, total: str, name: str = "vllm:inter_token_latency_seconds_bucket") -> list[dict[str, str]]:
    return [series(name, le_02, le="0.2"), series(name, total, le="0.4"), series(name, total, le="+Inf")]


def http(fast: str, count: str, errors: str, ok: str) -> list[dict[str, str]]:
    handler = {"handler": "/v1/chat/completions"}
    return [
        series("http_request_duration_seconds_bucket", fast, le="0.5", **handler),
        series("http_request_duration_seconds_count", count, **handler),
        series("http_requests_total", errors, status="5xx", **handler),
        series("http_requests_total", ok, status="2xx", **handler),
    ]


def semantic(successes: str) -> list[dict[str, str]]:
    return [series("semantic_success_total", successes), series("semantic_evaluations_total", "0+64x60")]


def cost(tokens: str) -> list[dict[str, str]]:
    return [
        series("ironserve_gpu_cost_usd_per_hour", "1.7x60"),
        series("ironserve_tokens_total", tokens, kind="generation"),
    ]


def gpu(used: str, util: str = "90x60") -> list[dict[str, str]]:
    return [
        series("gpu_memory_used_bytes", used, device="gpu0"),
        series("gpu_memory_total_bytes", "24000000000x60", device="gpu0"),
        series("gpu_utilization_percent", util, device="gpu0"),
    ]


def kv(ratio: str) -> list[dict[str, str]]:
    return [series("ironserve_kv_cache_usage_ratio", ratio), series("ironserve_kv_cache_blocks", "1000x20")]


def logprob(le_25: str) -> list[dict[str, str]]:
    name = "model_logprob_std_bucket"
    return [series(name, le_25, le="2.5"), series(name, "0+10x30", le="4"), series(name, "0+10x30", le="+Inf")]


def case(
    inputs: list[dict[str, str]], alerts: list[dict[str, Any]], interval: str = "1m", **extra: Any
) -> dict[str, Any]:
    return {"interval": interval, "input_series": inputs, "alert_rule_test": alerts, **extra}


JOB_ONLY = {"job": "ironserve"}
SUCCESS_SERIES = 'semantic_success_rate{job="ironserve"}'
KV_BLOCKS_SERIES = 'vllm:kv_cache_blocks_used{job="ironserve",instance="host:9400"}'
CASES: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
    ("ttft-slow", ("slo-p95-latency", "slo-percentile-alerts-only"),
     case(first_token("0x20", "0+10x20", "0+10x20"), [fires("TimeToFirstTokenP95AboveSLO", "12m", **JOB_ONLY),
                                                      silent("TimeToFirstTokenP95AboveSLOFast", "12m")])),
    ("ttft-ok", ("slo-p95-latency",),
     case(first_token("0+10x20", "0+10x20", "0+10x20"), [silent("TimeToFirstTokenP95AboveSLO", "12m")])),
    # Long answers: every request takes over 2 s end to end, but the first token comes fast: no latency alert.
    ("long-answers-fast-first-token", ("slo-p95-latency",),
     case([*latency("0x20", "0x20", "0+10x20", le_2="0x20"), *first_token("0+10x20", "0+10x20", "0+10x20"),
           *per_token("0+10x20", "0+10x20")],
          [silent("TimeToFirstTokenP95AboveSLO", "12m"), silent("TimeToFirstTokenP95AboveSLOFast", "12m"),
           silent("TimePerOutputTokenP95AboveSLO", "12m")])),
    ("ttft-very-slow-fast-window", ("slo-percentile-alerts-only",),
     case(first_token("0x20", "0x20", "0+10x20", le_2="0x20"),
          [fires("TimeToFirstTokenP95AboveSLOFast", "5m", **JOB_ONLY)])),
    ("tpot-slow", ("slo-percentile-alerts-only",),
     case(per_token("0x20", "0+10x20"), [fires("TimePerOutputTokenP95AboveSLO", "12m", **JOB_ONLY)])),
    ("tpot-slow-vllm-v0-name", ("slo-percentile-alerts-only",),
     case(per_token("0x20", "0+10x20", name="vllm:time_per_output_token_seconds_bucket"),
          [fires("TimePerOutputTokenP95AboveSLO", "12m", **JOB_ONLY)])),
    ("tpot-ok", ("slo-percentile-alerts-only",),
     case(per_token("0+10x20", "0+10x20"), [silent("TimePerOutputTokenP95AboveSLO", "12m")])),
    ("serving-engine-down", ("hot-swap-envoy-follows-etcd",),
     case([series("ironserve_vllm_up", "1x3 0x10")], [silent("ServingEngineDown", "3m"),
                                                      fires("ServingEngineDown", "6m", **JOB)])),
    ("serving-engine-up", ("hot-swap-envoy-follows-etcd",),
     case([series("ironserve_vllm_up", "1x10")], [silent("ServingEngineDown", "8m")])),
    ("exporter-down", ("obs-exporter-http-server",),
     case([series("up", "0x10", component="exporter")], [fires("ExporterDown", "5m", **JOB, component="exporter")])),
    ("exporter-up", ("obs-exporter-http-server",),
     case([series("up", "1x10", component="exporter"), series("up", "0x10", component="vllm", colour="green")],
          [silent("ExporterDown", "5m")])),
    ("tail-and-errors", ("slo-alert-latency-and-errors", "slo-latency-999-under-500ms"),
     case(http("0+90x20", "0+100x20", "0+1x20", "0+99x20"), [fires("LatencyTailAndErrors", "12m", **JOB_ONLY)])),
    ("tail-without-errors", ("slo-alert-latency-and-errors",),
     case(http("0+90x20", "0+100x20", "0x20", "0+100x20"), [silent("LatencyTailAndErrors", "12m")])),
    ("semantic-below-slo", ("slo-semantic-success", "obs-semantic-success"),
     case(semantic("0+58x60"), [fires("SemanticSuccessBelowSLO", "50m", **JOB_ONLY),
                                silent("SemanticSuccessCritical", "50m")],
          promql_expr_test=[{"expr": "semantic_success_rate", "eval_time": "50m",
                             "exp_samples": [{"labels": SUCCESS_SERIES, "value": 58 / 64}]}])),
    ("semantic-critical", ("slo-semantic-degrade-q4ks",),
     case(semantic("0+54x60"), [fires("SemanticSuccessCritical", "50m", **JOB_ONLY)])),
    ("semantic-ok", ("slo-semantic-success",),
     case(semantic("0+62x60"), [silent("SemanticSuccessBelowSLO", "50m")])),
    ("cost-high", ("slo-cost-per-token", "obs-cost-per-token"),
     case(cost("0+60x60"), [fires("CostPerTokenAboveSLO", "40m", **JOB_ONLY)],
          promql_expr_test=[{"expr": "cost_per_token", "eval_time": "40m",
                             "exp_samples": [{"labels": "cost_per_token{job=\"ironserve\"}",
                                              "value": 1.7 / 3600 / 1.0}]}])),
    ("cost-ok", ("slo-cost-per-token",), case(cost("0+600x60"), [silent("CostPerTokenAboveSLO", "40m")])),
    ("cost-idle", ("slo-cost-per-token",),
     case(cost("5x60"), [silent("CostPerTokenAboveSLO", "40m")],
          promql_expr_test=[{"expr": "cost_per_token", "eval_time": "40m", "exp_samples": []}])),
    ("gpu-memory-high", ("obs-gpu-mem-alert-20-8gb", "obs-gpu-mem-absolute"),
     case(gpu("20900000000x20"), [fires("GpuMemoryHeadroomLow", "10m", **JOB, device="gpu0")])),
    ("gpu-memory-ok", ("obs-gpu-mem-alert-20-8gb",),
     case(gpu("20700000000x20"), [silent("GpuMemoryHeadroomLow", "10m")])),
    ("kv-saturated", ("slo-kv-blocks-clear-cache", "obs-vllm-kv-blocks-used"),
     case(kv("0.97x20"), [silent("KvCacheSaturated", "2m"), fires("KvCacheSaturated", "5m", **JOB)],
          promql_expr_test=[{"expr": "vllm:kv_cache_blocks_used", "eval_time": "5m",
                             "exp_samples": [{"labels": KV_BLOCKS_SERIES, "value": 970}]}])),
    ("kv-ok", ("slo-kv-blocks-clear-cache",), case(kv("0.90x20"), [silent("KvCacheSaturated", "10m")])),
    ("memory-leak", ("slo-gpu-mem-leak",),
     case(gpu("10000000000+100000x60"), [fires("GpuMemoryLeak", "8h", **JOB, device="gpu0")], interval="10m")),
    ("memory-flat", ("slo-gpu-mem-leak",),
     case(gpu("10000000000+0x60"), [silent("GpuMemoryLeak", "8h")], interval="10m")),
    ("leak-signature", ("obs-leak-signature",),
     case(gpu("22000000000x30", util="12x30"), [fires("GpuMemoryLeakSignature", "20m", **JOB, device="gpu0")])),
    ("busy-not-leak", ("obs-leak-signature",),
     case(gpu("22000000000x30", util="95x30"), [silent("GpuMemoryLeakSignature", "20m")])),
    ("logprob-variance", ("obs-logprobs-std",),
     case(logprob("0x30"), [fires("LogprobVarianceHigh", "20m", **JOB_ONLY)])),
    ("logprob-normal", ("obs-logprobs-std",), case(logprob("0+10x30"), [silent("LogprobVarianceHigh", "20m")])),
]  # fmt: skip


def write_rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yml"
    path.write_text(slo.render_rules(SLO, QUALITY))
    return path


@pytest.mark.invariant("obs-cost-per-token", "slo-compiled-into-service", "slo-alert-latency-and-errors")
def test_promtool_check_rules(tmp_path: Path) -> None:
    rules = write_rules(tmp_path)
    result = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = rules.read_text()
    assert "cost_per_token" in text and 'le="0.5"' in text and 'status=~"5.."' in text


@pytest.mark.invariant("slo-no-cpu-alerts", "slo-percentile-alerts-only")
def test_rules_are_slo_driven_and_quantile_based(tmp_path: Path) -> None:
    text = write_rules(tmp_path).read_text()
    assert not re.search(r"cpu.*> *(0\.9|90)", text)
    assert not re.search(r"avg\(|_sum\[.*\]\) */", text)
    assert "histogram_quantile(0.95" in text


@pytest.mark.invariant("obs-gpu-mem-alert-20-8gb", "slo-kv-blocks-clear-cache")
def test_thresholds_match_the_catalog(tmp_path: Path) -> None:
    text = write_rules(tmp_path).read_text()
    assert "gpu_memory_used_bytes > 20800000000" in text
    kv_alert = ALERTS["KvCacheSaturated"]
    assert "vllm:kv_cache_blocks_used" in kv_alert["expr"] and kv_alert["for"] == "3m"
    assert "clear" not in kv_alert["expr"]
    assert "semantic_success_rate < 0.9" in text


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fired = {t["alertname"] for _, _, c in CASES for t in c["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for _, _, c in CASES for t in c["alert_rule_test"] if not t["exp_alerts"]}
    assert fired == set(ALERTS) and quiet == set(ALERTS)


@pytest.mark.parametrize(
    ("name", "test_case"),
    [pytest.param(name, test_case, marks=pytest.mark.invariant(*ids), id=name) for name, ids, test_case in CASES],
)
def test_promtool_test_rules(tmp_path: Path, name: str, test_case: dict[str, Any]) -> None:
    write_rules(tmp_path)
    tests = tmp_path / "rules_test.yml"
    tests.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [test_case]}))
    result = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, f"{name}:\n{result.stdout}{result.stderr}"
