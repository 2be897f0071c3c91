"""Prometheus recording and alerting rules compiled from the typed SLO settings.

Latency is judged by quantiles of histograms whose buckets include the SLO boundaries (the
launcher configures vLLM so), never by averages. There are no generic resource alerts.
"""

from __future__ import annotations

from typing import Any

import yaml

from ironserve_service.settings import QualitySettings, SloSettings

LATENCY_HISTOGRAM = "vllm:e2e_request_latency_seconds"


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


def recording_rules(slo: SloSettings) -> list[dict[str, str]]:
    def p95(window: str) -> str:
        return f"histogram_quantile(0.95, sum by (job, le) (rate({LATENCY_HISTOGRAM}_bucket[{window}])))"

    return [
        _rule(f"ironserve:request_latency_seconds:p95_{slo.slo_window}", p95(slo.slo_window)),
        _rule(f"ironserve:request_latency_seconds:p95_{slo.fast_window}", p95(slo.fast_window)),
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
            "LatencyP95AboveSLO",
            f"ironserve:request_latency_seconds:p95_{slo.slo_window} > {slo.p95_latency_s}",
            slo.slo_window, "ticket", f"P95 request latency above {slo.p95_latency_s * 1000:.0f} ms",
        ),
        _alert(
            "LatencyP95AboveSLOFast",
            f"ironserve:request_latency_seconds:p95_{slo.fast_window} > {2 * slo.p95_latency_s}",
            slo.fast_window, "page", f"P95 request latency above twice the SLO over {slo.fast_window}",
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
