"""Prometheus recording and alerting rules compiled from the typed SLO settings.

Latency is judged by quantiles of histograms whose buckets include the SLO boundaries (the
launcher configures vLLM so), never by averages. The latency SLO is on time to first token and time
per output token, which do not grow with the answer's length; end-to-end latency is recorded for
dashboards and pages only together with errors (the 003 rule). There are no generic resource alerts.
"""

from __future__ import annotations

from typing import Any

import yaml

from ironserve_service.settings import QualitySettings, SloSettings

LATENCY_HISTOGRAM = "vllm:e2e_request_latency_seconds"
FIRST_TOKEN_HISTOGRAM = "vllm:time_to_first_token_seconds"
# vLLM's V1 engine calls the per-token histogram inter_token_latency; V0 (vllm 0.6) time_per_output_token.
PER_TOKEN_BUCKETS = '{__name__=~"vllm:(inter_token_latency|time_per_output_token)_seconds_bucket"}'


def _rule(record: str, expr: str) -> dict[str, str]:
    return {"record": record, "expr": expr}


def _alert(name: str, expr: str, duration: str, severity: str, summary: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary},
    }


def _p95(buckets: str, window: str) -> str:
    return f"histogram_quantile(0.95, sum by (job, le) (rate({buckets}[{window}])))"


def recording_rules(slo: SloSettings) -> list[dict[str, str]]:
    first_token = f"{FIRST_TOKEN_HISTOGRAM}_bucket"
    return [
        _rule(
            f"ironserve:request_latency_seconds:p95_{slo.slo_window}",
            _p95(f"{LATENCY_HISTOGRAM}_bucket", slo.slo_window),
        ),
        _rule(f"ironserve:time_to_first_token_seconds:p95_{slo.slo_window}", _p95(first_token, slo.slo_window)),
        _rule(f"ironserve:time_to_first_token_seconds:p95_{slo.fast_window}", _p95(first_token, slo.fast_window)),
        _rule(f"ironserve:time_per_output_token_seconds:p95_{slo.slo_window}", _p95(PER_TOKEN_BUCKETS, slo.slo_window)),
        _rule(
            "semantic_success_rate",
            f"sum by (job) (rate(semantic_success_total[{slo.quality_window}]))"
            f" / (sum by (job) (rate(semantic_evaluations_total[{slo.quality_window}])) > 0)",
        ),
        # "> 0" drops the series while idle, so an idle server has no cost per token instead of +Inf.
        _rule(
            "cost_per_token",
            "sum by (job) (ironserve_gpu_cost_usd_per_hour) / 3600"
            f" / (sum by (job) (rate(ironserve_tokens_total[{slo.slo_window}])) > 0)",
        ),
        # Derived instead of patching vLLM's engine for a blocks-used counter.
        _rule("vllm:kv_cache_blocks_used", "ironserve_kv_cache_usage_ratio * ironserve_kv_cache_blocks"),
        _rule(
            "ironserve:gpu_memory_growth_bytes_per_hour",
            f"deriv(gpu_memory_used_bytes[{slo.leak_window}]) * 3600",
        ),
    ]


def alerting_rules(slo: SloSettings, quality: QualitySettings) -> list[dict[str, Any]]:
    fast_under = f'rate(http_request_duration_seconds_bucket{{handler=~"/v1/.+",le="{slo.paging_latency_s}"}}[5m])'
    all_requests = 'rate(http_request_duration_seconds_count{handler=~"/v1/.+"}[5m])'
    errors = 'rate(http_requests_total{status=~"5.."}[5m])'
    return [
        _alert(
            "TimeToFirstTokenP95AboveSLO",
            f"ironserve:time_to_first_token_seconds:p95_{slo.slo_window} > {slo.ttft_p95_s}",
            slo.slo_window, "ticket", f"P95 time to first token above {slo.ttft_p95_s * 1000:.0f} ms",
        ),
        _alert(
            "TimeToFirstTokenP95AboveSLOFast",
            f"ironserve:time_to_first_token_seconds:p95_{slo.fast_window} > {2 * slo.ttft_p95_s}",
            slo.fast_window, "page", f"P95 time to first token above twice the SLO over {slo.fast_window}",
        ),
        _alert(
            "TimePerOutputTokenP95AboveSLO",
            f"ironserve:time_per_output_token_seconds:p95_{slo.slo_window} > {slo.tpot_p95_s}",
            slo.slo_window, "ticket", f"P95 time per output token above {slo.tpot_p95_s * 1000:.0f} ms",
        ),
        _alert(
            "ServingEngineDown",
            "ironserve_vllm_up == 0",
            slo.target_down_for, "page", "the engine Envoy routes to does not answer /metrics",
        ),
        _alert(
            "ExporterDown",
            f'up{{job="{slo.job}", component="exporter"}} == 0',
            slo.target_down_for, "page", "the exporter does not answer: every SLO alert is blind",
        ),
        _alert(
            "LatencyTailAndErrors",
            f"(sum by (job) ({fast_under}) / sum by (job) ({all_requests})) < {slo.paging_fast_ratio}"
            f" and (sum by (job) ({errors}) / sum by (job) (rate(http_requests_total[5m]))) > {slo.paging_error_ratio}",
            "5m", "page",
            f"fewer than {slo.paging_fast_ratio:.1%} of requests under {slo.paging_latency_s}s and 5xx above "
            f"{slo.paging_error_ratio:.1%}",
        ),
        _alert(
            "SemanticSuccessBelowSLO",
            f"semantic_success_rate < {slo.semantic_success_min}",
            "15m", "ticket", f"semantic success below {slo.semantic_success_min:.1%}",
        ),
        _alert(
            "SemanticSuccessCritical",
            f"semantic_success_rate < {slo.semantic_success_page}",
            "5m", "page",
            f"semantic success below {slo.semantic_success_page:.0%}: page; a switch to the Q4_K_S model is a"
            " manual hot swap, never automatic (it is the lower-quality model)",
        ),
        _alert(
            "CostPerTokenAboveSLO",
            f"cost_per_token > {slo.cost_per_token_max_usd}",
            "15m", "ticket", f"cost per token above ${slo.cost_per_token_max_usd}",
        ),
        _alert(
            "GpuMemoryHeadroomLow",
            f"gpu_memory_used_bytes > {slo.gpu_memory_alert_bytes}",
            "5m", "ticket",
            f"GPU memory used above {slo.gpu_memory_alert_bytes} bytes ({slo.gpu_memory_alert_bytes / 1e9} GB)",
        ),
        _alert(
            "KvCacheSaturated",
            f"vllm:kv_cache_blocks_used / ironserve_kv_cache_blocks > {slo.kv_cache_usage_max}",
            slo.kv_cache_for, "ticket",
            "KV cache nearly full: shed load or scale out (blocks free as sequences finish; never clear them)",
        ),
        _alert(
            "GpuMemoryLeak",
            f"ironserve:gpu_memory_growth_bytes_per_hour > {slo.memory_leak_max_bytes_per_hour}",
            "1h", "ticket", f"GPU memory growing faster than {slo.memory_leak_max_bytes_per_hour / 1e6} MB/hour",
        ),
        _alert(
            "GpuMemoryLeakSignature",
            "(gpu_memory_used_bytes / gpu_memory_total_bytes > 0.9) and on (job, instance, device)"
            " (gpu_utilization_percent < 20)",
            "15m", "ticket", "GPU memory nearly full while the GPU is mostly idle: leak signature",
        ),
        _alert(
            "LogprobVarianceHigh",
            "histogram_quantile(0.95, sum by (job, le) (rate(model_logprob_std_bucket[10m])))"
            f" > {quality.logprob_std_alert}",
            "10m", "ticket", "High logprobs variance: prompt injection or model collapse",
        ),
    ]  # fmt: skip


def rules_document(slo: SloSettings, quality: QualitySettings) -> dict[str, Any]:
    return {
        "groups": [
            {"name": "ironserve-recording", "rules": recording_rules(slo)},
            {"name": "ironserve-slo-alerts", "rules": alerting_rules(slo, quality)},
        ]
    }


def render_rules(slo: SloSettings, quality: QualitySettings) -> str:
    return yaml.safe_dump(rules_document(slo, quality), sort_keys=False, width=1000)
