"""Prometheus recording and alerting rules compiled from the typed SLO settings.

Latency is judged by quantiles of histograms whose buckets include the SLO boundaries (the
launcher configures vLLM so), never by averages. The latency SLO is on time to first token and time
per output token, which do not grow with the answer's length; end-to-end latency is recorded for
dashboards and pages only together with errors (the 003 rule). There are no generic resource alerts.

The GPU health rules (`gpu_rules`) page on hardware faults that take a GPU out of serving (NVIDIA's Xid catalog and
memory error management guide decide which) and make tickets for conditions that slow it; every one names the host,
the GPU's index and its serial, joined from `gpu_info`.
"""

from __future__ import annotations

from typing import Any

import yaml

from ironserve_service.settings import GpuHealthSettings, QualitySettings, SloSettings

LATENCY_HISTOGRAM = "vllm:e2e_request_latency_seconds"
FIRST_TOKEN_HISTOGRAM = "vllm:time_to_first_token_seconds"
# vLLM's V1 engine calls the per-token histogram inter_token_latency; V0 (vllm 0.6) time_per_output_token.
PER_TOKEN_BUCKETS = '{__name__=~"vllm:(inter_token_latency|time_per_output_token)_seconds_bucket"}'


def _rule(record: str, expr: str) -> dict[str, str]:
    return {"record": record, "expr": expr}


def alert_rule(name: str, expr: str, duration: str, severity: str, summary: str) -> dict[str, Any]:
    """One alerting rule as Prometheus' rule files have it; `severity` is what Alertmanager routes on (page, ticket)."""
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
        alert_rule(
            "TimeToFirstTokenP95AboveSLO",
            f"ironserve:time_to_first_token_seconds:p95_{slo.slo_window} > {slo.ttft_p95_s}",
            slo.slo_window, "ticket", f"P95 time to first token above {slo.ttft_p95_s * 1000:.0f} ms",
        ),
        alert_rule(
            "TimeToFirstTokenP95AboveSLOFast",
            f"ironserve:time_to_first_token_seconds:p95_{slo.fast_window} > {2 * slo.ttft_p95_s}",
            slo.fast_window, "page", f"P95 time to first token above twice the SLO over {slo.fast_window}",
        ),
        alert_rule(
            "TimePerOutputTokenP95AboveSLO",
            f"ironserve:time_per_output_token_seconds:p95_{slo.slo_window} > {slo.tpot_p95_s}",
            slo.slo_window, "ticket", f"P95 time per output token above {slo.tpot_p95_s * 1000:.0f} ms",
        ),
        alert_rule(
            "ServingEngineDown",
            "ironserve_vllm_up == 0",
            slo.target_down_for, "page", "the engine Envoy routes to does not answer /metrics",
        ),
        alert_rule(
            "ExporterDown",
            f'up{{job="{slo.job}", component="exporter"}} == 0',
            slo.target_down_for, "page", "the exporter does not answer: every SLO alert is blind",
        ),
        alert_rule(
            "LatencyTailAndErrors",
            f"(sum by (job) ({fast_under}) / sum by (job) ({all_requests})) < {slo.paging_fast_ratio}"
            f" and (sum by (job) ({errors}) / sum by (job) (rate(http_requests_total[5m]))) > {slo.paging_error_ratio}",
            "5m", "page",
            f"fewer than {slo.paging_fast_ratio:.1%} of requests under {slo.paging_latency_s}s and 5xx above "
            f"{slo.paging_error_ratio:.1%}",
        ),
        alert_rule(
            "SemanticSuccessBelowSLO",
            f"semantic_success_rate < {slo.semantic_success_min}",
            "15m", "ticket", f"semantic success below {slo.semantic_success_min:.1%}",
        ),
        alert_rule(
            "SemanticSuccessCritical",
            f"semantic_success_rate < {slo.semantic_success_page}",
            "5m", "page",
            f"semantic success below {slo.semantic_success_page:.0%}: page; a switch to the Q4_K_S model is a"
            " manual hot swap, never automatic (it is the lower-quality model)",
        ),
        alert_rule(
            "CostPerTokenAboveSLO",
            f"cost_per_token > {slo.cost_per_token_max_usd}",
            "15m", "ticket", f"cost per token above ${slo.cost_per_token_max_usd}",
        ),
        alert_rule(
            "GpuMemoryHeadroomLow",
            f"gpu_memory_used_bytes > {slo.gpu_memory_alert_bytes}",
            "5m", "ticket",
            f"GPU memory used above {slo.gpu_memory_alert_bytes} bytes ({slo.gpu_memory_alert_bytes / 1e9} GB)",
        ),
        alert_rule(
            "KvCacheSaturated",
            f"vllm:kv_cache_blocks_used / ironserve_kv_cache_blocks > {slo.kv_cache_usage_max}",
            slo.kv_cache_for, "ticket",
            "KV cache nearly full: shed load or scale out (blocks free as sequences finish; never clear them)",
        ),
        alert_rule(
            "GpuMemoryLeak",
            f"ironserve:gpu_memory_growth_bytes_per_hour > {slo.memory_leak_max_bytes_per_hour}",
            "1h", "ticket", f"GPU memory growing faster than {slo.memory_leak_max_bytes_per_hour / 1e6} MB/hour",
        ),
        alert_rule(
            "GpuMemoryLeakSignature",
            "(gpu_memory_used_bytes / gpu_memory_total_bytes > 0.9) and on (job, instance, device)"
            " (gpu_utilization_percent < 20)",
            "15m", "ticket", "GPU memory nearly full while the GPU is mostly idle: leak signature",
        ),
        alert_rule(
            "LogprobVarianceHigh",
            "histogram_quantile(0.95, sum by (job, le) (rate(model_logprob_std_bucket[10m])))"
            f" > {quality.logprob_std_alert}",
            "10m", "ticket", "High logprobs variance: prompt injection or model collapse",
        ),
    ]  # fmt: skip


# The labels one GPU's series share (the exporter's target, and device="gpuN").
GPU_KEYS = "job, instance, device"
# How each GPU alert names the GPU: host, index and serial (serial "unknown" only when gpu_info is missing).
GPU = (
    "{{ $labels.instance }} {{ $labels.device }} serial "
    "{{ if $labels.serial }}{{ $labels.serial }}{{ else }}unknown{{ end }}"
)


# GpuMissing's `for:`, here because the GPU guard (gpu_guard.py) holds the same condition as long before it drains.
MISSING_FOR = "1m"


def with_serial(expr: str) -> str:
    """`expr` carrying the GPU's serial from gpu_info, and still firing, without it, where gpu_info is missing."""
    return f"({expr}) * on ({GPU_KEYS}) group_left (serial) gpu_info or ({expr}) unless on ({GPU_KEYS}) gpu_info"


def gpu_rules(gpu: GpuHealthSettings) -> list[dict[str, Any]]:
    window, xids = gpu.error_window, "|".join(map(str, gpu.fatal_xids))
    width = gpu.expected_pcie_width
    checked = gpu.full_width_devices
    devices = "" if checked is None else ', device=~"{}"'.format("|".join(f"gpu{i}" for i in checked))
    held = gpu.sustained_for
    return [
        # Pages: the GPU is out of serving or its memory is no longer trustworthy.
        alert_rule(
            "GpuUncorrectableEccError",
            with_serial(f'increase(gpu_ecc_errors{{error_type="uncorrected", counter="volatile"}}[{window}]) > 0'),
            "0m", "page",
            f"{GPU}: new uncorrectable (double-bit) ECC errors within {window}: drain the host and reset the GPU",
        ),
        alert_rule(
            "GpuFatalXid",
            with_serial(f'increase(gpu_xid_errors_total{{xid=~"{xids}"}}[{window}]) > 0'),
            "0m", "page",
            f"{GPU}: XID {{{{ $labels.xid }}}}, which NVIDIA's Xid catalog clears only by a GPU reset or a reboot",
        ),
        alert_rule(
            "GpuLost",
            with_serial("gpu_lost == 1"),
            "0m", "page",
            f"{GPU}: NVML cannot reach the GPU (off the bus): drain and reboot the host; reseat or replace the card "
            "if it recurs",
        ),
        alert_rule(
            "GpuMissing",
            "gpu_visible_count < gpu_expected_count",
            MISSING_FOR, "page",
            "{{ $labels.instance }}: NVML shows {{ $value }} GPUs, fewer than gpu_health.expected_gpus: a card is off "
            "the bus since the driver loaded, so NVML cannot name it; its serial is in gpu_info before the drop",
        ),
        alert_rule(
            "GpuPcieLinkDegraded",
            with_serial(f'gpu_pcie_link_width{{bound="current"{devices}}} < {width}'),
            gpu.degraded_link_for, "page",
            f"{GPU}: PCIe link at x{{{{ $value }}}} for {gpu.degraded_link_for}, expected x{width}: reseat the card or "
            "check its slot and riser",
        ),
        alert_rule(
            "GpuRowRemapFailure",
            with_serial("gpu_remapped_rows_failure == 1"),
            "0m", "page",
            f"{GPU}: a row remapping failed, the memory can no longer repair itself: drain the host, replace the card",
        ),
        alert_rule(
            "GpuRetiredPagesPending",
            with_serial("gpu_retired_pages_pending == 1"),
            "0m", "page",
            f"{GPU}: memory pages are pending retirement after ECC errors: drain and reboot the host to retire them",
        ),
        # Tickets: the GPU serves, slower or at risk.
        alert_rule(
            "GpuRowRemapPending",
            with_serial("gpu_remapped_rows_pending == 1"),
            "0m", "ticket",
            f"{GPU}: a memory row remap waits for a GPU reset: reset the GPU at a convenient time (drained)",
        ),
        alert_rule(
            "GpuClocksSlowdown",
            with_serial(
                'gpu_throttle_reason_active{reason=~"hw_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown|'
                'sw_thermal_slowdown"} == 1'
            ),
            held, "ticket",
            f"{GPU}: clocks held down by {{{{ $labels.reason }}}} for {held}: check cooling, and for a power brake "
            "the power supplies and the BMC",
        ),
        alert_rule(
            "GpuPowerCapped",
            with_serial(
                f'(gpu_throttle_reason_active{{reason="sw_power_cap"}} == 1) and on ({GPU_KEYS})'
                f" (gpu_power_watts >= {gpu.power_limit_ratio} * gpu_power_limit_watts)"
            ),
            held, "ticket",
            f"{GPU}: drawing at its power limit with the SW power cap engaged for {held}: clocks are held down by "
            "power; check gpu_power_limit_watts and airflow",
        ),
        alert_rule(
            "GpuPcieGenerationBelowMaxUnderLoad",
            with_serial(
                'gpu_pcie_link_generation{bound="current"} < ignoring (bound) gpu_pcie_link_generation{bound="max"}'
                f" and on ({GPU_KEYS}) gpu_utilization_percent > {gpu.busy_utilization_percent}"
            ),
            held, "ticket",
            f"{GPU}: PCIe generation {{{{ $value }}}} below what the slot allows while over "
            f"{gpu.busy_utilization_percent:g}% busy for {held}: check the slot, riser and BIOS link speed",
        ),
        # The GPU guard (gpu_guard.py) took the host out of serving on one of the pages above; a ticket, since that
        # page has paged, and the host stays out until the GPU is fit and the model answers, or an admin says so.
        alert_rule(
            "GpuGuardDrained",
            "ironserve_gpu_guard_drained == 1",
            "0m", "ticket",
            "{{ $labels.instance }} out of its load balancer, drained by the GPU guard: {{ $labels.device }} serial "
            "{{ $labels.serial }} {{ $labels.reason }}; it serves again once the GPU is fit and the model answers, "
            "or after `ironserve-service traffic serving`",
        ),
        alert_rule(
            "GpuPowerLimitChanged",
            with_serial("gpu_power_limit_watts != gpu_power_default_limit_watts"),
            held, "ticket",
            f"{GPU}: enforced power limit {{{{ $value }}}} W differs from the board default for {held}: restore it "
            "(nvidia-smi -pl) unless the cap is deliberate",
        ),
    ]  # fmt: skip


def rules_document(
    slo: SloSettings, quality: QualitySettings, gpu_health: GpuHealthSettings | None = None
) -> dict[str, Any]:
    return {
        "groups": [
            {"name": "ironserve-recording", "rules": recording_rules(slo)},
            {"name": "ironserve-slo-alerts", "rules": alerting_rules(slo, quality)},
            {"name": "ironserve-gpu-health", "rules": gpu_rules(gpu_health or GpuHealthSettings())},
        ]
    }


def render_rules(slo: SloSettings, quality: QualitySettings, gpu_health: GpuHealthSettings | None = None) -> str:
    return yaml.safe_dump(rules_document(slo, quality, gpu_health), sort_keys=False, width=1000)
