"""Grafana dashboards as code: one per dimension of obs-five-dimensions (hardware, framework, model, business,
cost) and one of the SLOs against their thresholds, as plain dashboard JSON any Grafana (10.4 and later) imports.

The generated files are checked in as `files/monitoring/dashboard-<name>.json`; regenerate them with
`python -m roles.monitoring.render_dashboards --write` (tests/unit/test_monitoring_dashboards.py fails while the
checked-in files differ from these functions, checks every query with promtool and every metric name against the
exporters' real names).

Why plain dicts and not grafana-foundation-sdk (PyPI, checked 2026-12): it installs cleanly on Python 3.11 (no
dependencies, typed), but it is an alpha ("Development Status :: 3 - Alpha"), its last PyPI release is of
2026-01-29, its builds target Grafana 10.1-11.6 and "next" only (no Grafana 12 build: grafana-foundation-sdk#912),
versions are pinned as `<timestamp>!<grafana version>` epochs, and it would be one more dependency of the
admin's install for six files that are generated once and checked in. It also leaves panel ids and refIds to the
caller. What these dashboards use of Grafana's model is small: typed dataclasses below, rendered to the JSON.

Queries follow two conventions:
- raw series are filtered to the chosen host with `instance=~"$instance(:[0-9]+)?"`: the `instance` variable
  holds host names without ports, so one choice matches the exporter, both engine colours, Envoy and the node
  exporter on that host;
- the SLO recording rules aggregate `by (job)`, so they have no instance label: they are per Prometheus, i.e. per
  host with ironserve's local Prometheus on each serving host (pick the host with the data source variable).
Thresholds come from the service's own settings (SloSettings, QualitySettings defaults, as ServiceSettings has
them) and this role's (MonitoringSettings: the host alerts), the recording rules' names from the same settings as
slo.py builds them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ironserve_service.settings import QualitySettings, SloSettings

from ironserve.layout import role_file
from ironserve.paths import CHECKOUT
from roles.monitoring.settings import MonitoringSettings

# The dashboard schema of Grafana 10.x/11.0: Grafana migrates an older schema forward when it loads a dashboard,
# never a newer one back, so an older current schema imports into every Grafana still supported (11.x, 12.x).
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The host part of `instance` (address or name, no port), so one host matches all its targets.
HOST = 'instance=~"$instance(:[0-9]+)?"'
# Grafana's rate window: at least four scrape intervals of the data source.
RATE = "$__rate_interval"
# The metric whose instances name the hosts: the service exporter runs on every serving host, and only there
# (Prometheus' `up` would also list the hosts roles/monitoring only probes).
HOST_METRIC = "gpu_nvml_available"
# As slo.py's LatencyTailAndErrors (003's paging rule): OpenAI endpoints, 5 minutes.
OPENAI_HANDLERS = 'handler=~"/v1/.+"'
PAGING_WINDOW = "5m"
# As slo.py's LogprobVarianceHigh: mirrored samples are sparse, a shorter window is mostly empty.
LOGPROB_WINDOW = "10m"
# router.py's http_connection_manager stat_prefix: the ingress listener, not the admin one.
ENVOY_INGRESS = 'envoy_http_conn_manager_prefix="ingress"'
FOLDER = "monitoring"

Kind = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Threshold:
    value: float
    color: str = "red"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str
    kind: Kind = "timeseries"
    # Colour below the first threshold; "red" with a green threshold reads "below the line is bad".
    base_color: str = "green"
    thresholds: tuple[Threshold, ...] = ()
    decimals: int | None = None
    min: float | None = None
    max: float | None = None
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Dashboard:
    name: str  # files/monitoring/dashboard-<name>.json
    uid: str
    title: str
    description: str
    tags: tuple[str, ...]
    panels: tuple[Panel, ...]


def on_host(metric: str, *matchers: str) -> str:
    """`metric{instance=~..., matchers}`: the series of the hosts the instance variable picks."""
    return f"{metric}{{{', '.join((HOST, *matchers))}}}"


def stat(title: str, unit: str, description: str, *queries: Query, **options: Any) -> Panel:
    return Panel(title, unit, queries, description, kind="stat", width=6, height=5, **options)


def above_is_bad(value: float, warn: float | None = None) -> dict[str, Any]:
    steps = (*((Threshold(warn, "orange"),) if warn is not None else ()), Threshold(value, "red"))
    return {"base_color": "green", "thresholds": steps}


def below_is_bad(value: float, page: float | None = None) -> dict[str, Any]:
    steps = (*((Threshold(page, "orange"),) if page is not None else ()), Threshold(value, "green"))
    return {"base_color": "red", "thresholds": steps}


def slo_names(slo: SloSettings) -> dict[str, str]:
    """The recording rules' names as slo.recording_rules(slo) builds them."""
    return {
        "ttft": f"ironserve:time_to_first_token_seconds:p95_{slo.slo_window}",
        "ttft_fast": f"ironserve:time_to_first_token_seconds:p95_{slo.fast_window}",
        "tpot": f"ironserve:time_per_output_token_seconds:p95_{slo.slo_window}",
        "e2e": f"ironserve:request_latency_seconds:p95_{slo.slo_window}",
        "semantic": "semantic_success_rate",
        "cost": "cost_per_token",
        "blocks_used": "vllm:kv_cache_blocks_used",
        "growth": "ironserve:gpu_memory_growth_bytes_per_hour",
    }


def _fast_ratio_engine(slo: SloSettings) -> str:
    under = on_host("http_request_duration_seconds_bucket", OPENAI_HANDLERS, f'le="{slo.paging_latency_s}"')
    everything = on_host("http_request_duration_seconds_count", OPENAI_HANDLERS)
    return f"sum(rate({under}[{PAGING_WINDOW}])) / sum(rate({everything}[{PAGING_WINDOW}]))"


def _fast_ratio_envoy(slo: SloSettings) -> str:
    # Envoy's downstream_rq_time is in milliseconds; its buckets are written without a decimal point.
    under = on_host("envoy_http_downstream_rq_time_bucket", ENVOY_INGRESS, f'le="{slo.paging_latency_s * 1000:g}"')
    everything = on_host("envoy_http_downstream_rq_time_count", ENVOY_INGRESS)
    return f"sum(rate({under}[{PAGING_WINDOW}])) / sum(rate({everything}[{PAGING_WINDOW}]))"


def _error_ratio_engine(window: str) -> str:
    errors = on_host("http_requests_total", OPENAI_HANDLERS, 'status=~"5.."')
    return f"sum(rate({errors}[{window}])) / sum(rate({on_host('http_requests_total', OPENAI_HANDLERS)}[{window}]))"


def _error_ratio_envoy(window: str) -> str:
    errors = on_host("envoy_http_downstream_rq_xx", ENVOY_INGRESS, 'envoy_response_code_class="5"')
    total = on_host("envoy_http_downstream_rq_total", ENVOY_INGRESS)
    return f"sum(rate({errors}[{window}])) / sum(rate({total}[{window}]))"


def _logprob_std_p95() -> str:
    return f"histogram_quantile(0.95, sum by (le) (rate({on_host('model_logprob_std_bucket')}[{LOGPROB_WINDOW}])))"


def _tokens_per_second() -> str:
    return f"sum by (kind) (rate({on_host('ironserve_tokens_total')}[{RATE}]))"


def hardware_dashboard(slo: SloSettings, monitoring: MonitoringSettings) -> Dashboard:
    alert_gb = slo.gpu_memory_alert_bytes / 1e9
    xid_errors = on_host("gpu_xid_errors_total")
    gpus = (
        Panel(
            "GPUs (index, model, serial, PCI bus)", "none",
            (Query(on_host("gpu_info"), "{{device}} {{name}} {{serial}} {{pci_bus_id}}"),),
            "The GPUs NVML enumerates, by the serial the GPU alerts name: the card to pull when one fails.",
            kind="stat",
        ),
        Panel(
            f"GPU memory used vs the {alert_gb:g} GB alert line",
            "decbytes",
            (Query(on_host("gpu_memory_used_bytes"), "{{device}} used"),
             Query(on_host("gpu_memory_total_bytes"), "{{device}} total")),
            f"Absolute bytes from NVML (obs-gpu-mem-absolute). The red line is GpuMemoryHeadroomLow's threshold, "
            f"{slo.gpu_memory_alert_bytes} bytes (decimal GB, a headroom alert on a 24 GB A10).",
            min=0, **above_is_bad(slo.gpu_memory_alert_bytes),
        ),
        Panel(
            "GPU utilisation", "percent", (Query(on_host("gpu_utilization_percent"), "{{device}}"),),
            "Share of time a kernel ran (NVML utilization.gpu): busy, not how much of the GPU is used.",
            min=0, max=100,
        ),
        Panel(
            "Power draw vs limit", "watt",
            (Query(on_host("gpu_power_watts"), "{{device}} draw"),
             Query(on_host("gpu_power_limit_watts"), "{{device}} limit")),
            "Board power against the enforced limit; a draw pinned at the limit comes with the power-cap throttle "
            "reason.",
            min=0,
        ),
        Panel(
            "GPU temperature", "celsius", (Query(on_host("gpu_temperature_celsius"), "{{device}}"),),
            "Core temperature; rising with thermal throttle reasons active points at cooling (fans, airflow).",
        ),
        Panel(
            "Active throttle reasons", "none",
            (Query(f"{on_host('gpu_throttle_reason_active')} > 0", "{{device}} {{reason}}"),),
            "Reasons NVML reports active (1). Idle and application-clock reasons are normal; hardware slowdown, "
            "thermal and power-brake reasons cost latency.",
            min=0,
        ),
        Panel(
            "ECC errors", "none",
            (Query(on_host("gpu_ecc_errors"), "{{device}} {{error_type}} {{counter}}"),),
            "Corrected and uncorrected ECC errors, volatile (since the driver loaded) and aggregate (lifetime). "
            "Any uncorrected error is a reason to drain the GPU (obs-gpu-mem-alert-20-8gb's correction: alert on "
            "ECC counters, not on memory used).",
            min=0,
        ),
        stat(
            "XID errors in the range", "none",
            "Driver XID events per GPU and code in the selected time range (e.g. 48: double-bit ECC, 79: fell off "
            "the bus).",
            Query(f"sum by (device, xid) (increase({xid_errors}[$__range]))", "{{device}} XID {{xid}}"),
            **above_is_bad(1),
        ),
        stat(
            "GPUs visible vs expected", "none",
            "GPUs NVML enumerates against the count the host should have.",
            Query(on_host("gpu_visible_count"), "visible"), Query(on_host("gpu_expected_count"), "expected"),
        ),
        stat(
            "GPUs missing or lost", "none",
            "Expected minus visible, and GPUs NVML reports lost: any is a page-worthy hardware fault.",
            Query(f"{on_host('gpu_expected_count')} - {on_host('gpu_visible_count')}", "missing"),
            Query(f"sum({on_host('gpu_lost')})", "lost"),
            **above_is_bad(1),
        ),
        stat(
            "NVML answering", "none",
            "1 when the exporter reached NVML; 0 on a host whose driver or GPUs are gone.",
            Query(on_host("gpu_nvml_available"), "{{instance}}"),
            **below_is_bad(1),
        ),
        Panel(
            "Retired pages (pre-Ampere GPUs)", "none",
            (Query(on_host("gpu_retired_pages"), "{{device}} {{cause}}"),
             Query(on_host("gpu_retired_pages_pending"), "{{device}} pending")),
            "Pages retired for single- or double-bit errors; pending ones need a GPU reset. The A10 (Ampere) "
            "remaps rows instead, next panel.",
            min=0,
        ),
        Panel(
            "Remapped rows (Ampere: A10)", "none",
            (Query(on_host("gpu_remapped_rows"), "{{device}} {{kind}}"),
             Query(on_host("gpu_remapped_rows_pending"), "{{device}} pending reset"),
             Query(on_host("gpu_remapped_rows_failure"), "{{device}} remap failure")),
            "Rows remapped for correctable/uncorrectable errors; pending needs a GPU reset, a failure means the "
            "GPU is out of spare rows (replace it).",
            min=0,
        ),
        stat(
            "PCIe link generation (current / max)", "none",
            "Idle GPUs lower the generation to save power; under load current should equal max (Gen3 in an R740).",
            Query(on_host("gpu_pcie_link_generation"), "{{device}} {{bound}}"),
        ),
        stat(
            "PCIe link width (current / max)", "none",
            "Lanes: a current width below max (x8 instead of x16) is a seating or riser fault and halves bandwidth.",
            Query(on_host("gpu_pcie_link_width"), "{{device}} {{bound}}"),
        ),
    )  # fmt: skip
    real_filesystems = 'fstype!~"tmpfs|ramfs|overlay|squashfs|nsfs|fuse.*"'
    not_loopback = 'device!="lo"'
    host = (
        Panel(
            "Host memory available vs total", "bytes",
            (Query(on_host("node_memory_MemAvailable_bytes"), "available"),
             Query(on_host("node_memory_MemTotal_bytes"), "total")),
            "MemAvailable (node exporter): what can be allocated without swapping.",
            min=0,
        ),
        Panel(
            "Disk free", "percentunit",
            (Query(f"{on_host('node_filesystem_avail_bytes', real_filesystems)}"
                   f" / {on_host('node_filesystem_size_bytes', real_filesystems)}", "{{mountpoint}}"),),
            f"Share of each real filesystem still available to unprivileged users (model store, logs, images); "
            f"FilesystemAlmostFull below {monitoring.disk_free_min_ratio:.0%}.",
            min=0, max=1, **below_is_bad(monitoring.disk_free_min_ratio),
        ),
        Panel(
            "Network errors", "cps",
            (Query(f"rate({on_host('node_network_receive_errs_total', not_loopback)}[{RATE}])", "{{device}} receive"),
             Query(f"rate({on_host('node_network_transmit_errs_total', not_loopback)}[{RATE}])",
                   "{{device}} transmit")),
            "Receive and transmit errors per second per interface; any sustained rate is a cable, optic or NIC fault.",
            min=0,
        ),
        stat(
            "NTP synchronised", "none",
            "node_timex_sync_status: 1 when the kernel clock is synchronised (chrony/timesyncd); "
            "ClockNotSynchronised at 0.",
            Query(on_host("node_timex_sync_status"), "{{instance}}"),
            **below_is_bad(1),
        ),
        stat(
            "Clock offset", "s",
            "Kernel's estimate of the offset from the reference clock.",
            Query(on_host("node_timex_offset_seconds"), "{{instance}}"),
        ),
    )  # fmt: skip
    return Dashboard(
        "hardware",
        "ironserve-hardware",
        "ironserve / Hardware: GPUs and host",
        "Hardware dimension: NVML GPU health from the service exporter, host health from the node exporter.",
        ("ironserve", "hardware"),
        (*gpus, *host),
    )


def engine_dashboard(slo: SloSettings) -> Dashboard:
    names = slo_names(slo)
    panels = (
        stat(
            "Serving engine up", "none", "ironserve_vllm_up: the engine Envoy routes to answers /metrics.",
            Query(on_host("ironserve_vllm_up"), "{{instance}}"), **below_is_bad(1),
        ),
        stat(
            "Serving colour and version", "none", "The colour and model version Envoy routes to.",
            Query(on_host("ironserve_serving_colour_info"), "{{colour}} {{version}}"),
        ),
        Panel(
            "Requests running and waiting", "none",
            (Query(on_host("ironserve_requests_running"), "running"),
             Query(on_host("ironserve_requests_waiting"), "waiting")),
            "vLLM's scheduler: in the running batch, and queued. Waiting above zero for long means the batch is full.",
            min=0,
        ),
        Panel(
            "KV cache usage", "percentunit", (Query(on_host("ironserve_kv_cache_usage_ratio"), "used"),),
            f"vllm:kv_cache_usage_perc (0-1). The line is KvCacheSaturated's {slo.kv_cache_usage_max:.0%} for "
            f"{slo.kv_cache_for}: shed load or scale out; blocks free as sequences finish.",
            min=0, max=1, **above_is_bad(slo.kv_cache_usage_max),
        ),
        Panel(
            "KV cache blocks used vs total", "none",
            (Query(on_host(names["blocks_used"]), "used"), Query(on_host("ironserve_kv_cache_blocks"), "total")),
            "Blocks used (usage ratio x num_gpu_blocks, a recording rule instead of patching vLLM) against the "
            "blocks vLLM allocated.",
            min=0,
        ),
        Panel(
            "Time to first token p95", "s",
            (Query(names["ttft"], f"p95 over {slo.slo_window}"),
             Query(names["ttft_fast"], f"p95 over {slo.fast_window}")),
            f"From vLLM's histogram (recording rules). SLO: p95 at most {slo.ttft_p95_s} s.",
            min=0, **above_is_bad(slo.ttft_p95_s),
        ),
        Panel(
            "Time per output token p95", "s", (Query(names["tpot"], f"p95 over {slo.slo_window}"),),
            f"Inter-token latency once streaming (recording rule). SLO: p95 at most {slo.tpot_p95_s} s.",
            min=0, **above_is_bad(slo.tpot_p95_s),
        ),
        Panel(
            "End-to-end request latency p95", "s", (Query(names["e2e"], f"p95 over {slo.slo_window}"),),
            "Whole request in vLLM; grows with the answer's length, so it is shown, not alerted on.",
            min=0,
        ),
        Panel(
            "Tokens per second", "suffix: tok/s", (Query(_tokens_per_second(), "{{kind}}"),),
            "Prompt (prefill) and generation tokens vLLM processed, per second.",
            min=0,
        ),
        Panel(
            "Preemptions per second", "cps",
            (Query(f"sum(rate({on_host('vllm:num_preemptions_total')}[{RATE}]))", "preemptions"),),
            "Sequences vLLM evicted from the KV cache to make room (recomputed later): nonzero means the cache is "
            "too small for the batch.",
            min=0,
        ),
    )  # fmt: skip
    return Dashboard(
        "engine",
        "ironserve-engine",
        "ironserve / Framework: vLLM engine",
        "Framework dimension: the serving vLLM engine's scheduler, KV cache, latency and throughput.",
        ("ironserve", "framework"),
        panels,
    )


def model_quality_dashboard(slo: SloSettings, quality: QualitySettings) -> Dashboard:
    names = slo_names(slo)
    similarity = on_host("semantic_similarity_bucket")
    panels = (
        Panel(
            "Semantic success rate", "percentunit", (Query(names["semantic"], f"over {slo.quality_window}"),),
            f"Share of mirrored answers whose embedding similarity to the question is at least "
            f"{quality.semantic_threshold}. Ticket below {slo.semantic_success_min:.1%}, page below "
            f"{slo.semantic_success_page:.0%}.",
            min=0, max=1, **below_is_bad(slo.semantic_success_min, page=slo.semantic_success_page),
        ),
        Panel(
            "Logprob std p95", "none", (Query(_logprob_std_p95(), f"p95 over {LOGPROB_WINDOW}"),),
            f"Per-response standard deviation of token logprobs: normal below {quality.logprob_std_normal_max}, "
            f"alert above {quality.logprob_std_alert} (prompt injection or model collapse).",
            min=0, **above_is_bad(quality.logprob_std_alert, warn=quality.logprob_std_normal_max),
        ),
        Panel(
            "Semantic similarity (median and 5th percentile)", "none",
            (Query(f"histogram_quantile(0.5, sum by (le) (rate({similarity}[{slo.quality_window}])))", "median"),
             Query(f"histogram_quantile(0.05, sum by (le) (rate({similarity}[{slo.quality_window}])))", "p5")),
            f"Cosine similarity of question and answer; the line is the success threshold "
            f"{quality.semantic_threshold}.",
            **below_is_bad(quality.semantic_threshold),
        ),
        Panel(
            "Mirrored responses scored, dropped, failed", "cps",
            (Query(f"sum(rate({on_host('semantic_evaluations_total')}[{RATE}]))", "scored"),
             Query(f"sum(rate({on_host('quality_mirror_dropped_total')}[{RATE}]))", "dropped (queue full)"),
             Query(f"sum(rate({on_host('quality_mirror_errors_total')}[{RATE}]))", "could not score")),
            "The quality signal's own health: without scored responses the success rate has no data.",
            min=0,
        ),
        stat(
            "Responses above the logprob std alert", "none",
            "Responses in the selected range whose logprob std exceeded the alert threshold.",
            Query(f"sum(increase({on_host('model_logprob_std_high_total')}[$__range]))", "responses"),
            **above_is_bad(1),
        ),
    )  # fmt: skip
    return Dashboard(
        "model-quality",
        "ironserve-model-quality",
        "ironserve / Model quality",
        "Model dimension: semantic success and logprob variance, scored on a mirrored sample of live traffic.",
        ("ironserve", "model"),
        panels,
    )


def business_dashboard(slo: SloSettings) -> Dashboard:
    panels = (
        Panel(
            "Requests per second by endpoint (engine)", "reqps",
            (Query(f"sum by (handler) (rate({on_host('http_requests_total', OPENAI_HANDLERS)}[{RATE}]))",
                   "{{handler}}"),),
            "OpenAI endpoints as vLLM counts them (both colours).",
            min=0,
        ),
        Panel(
            "Requests per second by status class (Envoy ingress)", "reqps",
            (Query(f"sum by (envoy_response_code_class) (rate({on_host('envoy_http_downstream_rq_xx', ENVOY_INGRESS)}"
                   f"[{RATE}]))", "{{envoy_response_code_class}}xx"),),
            "What clients got from the front door, including refusals Envoy answers itself (401 without a key, "
            "503 without a ready engine).",
            min=0,
        ),
        Panel(
            "5xx error ratio", "percentunit",
            (Query(_error_ratio_engine(PAGING_WINDOW), "engine"), Query(_error_ratio_envoy(PAGING_WINDOW), "Envoy")),
            f"Share of requests answered 5xx over {PAGING_WINDOW}. The line is the paging rule's "
            f"{slo.paging_error_ratio:.1%}.",
            min=0, **above_is_bad(slo.paging_error_ratio),
        ),
        Panel(
            f"Requests under {slo.paging_latency_s} s", "percentunit",
            (Query(_fast_ratio_engine(slo), "engine"), Query(_fast_ratio_envoy(slo), "Envoy")),
            f"Share of requests completed within {slo.paging_latency_s} s over {PAGING_WINDOW}, in vLLM and at "
            f"Envoy (adds the proxy). The paging rule wants at least {slo.paging_fast_ratio:.1%} together with "
            "5xx above its line.",
            max=1, **below_is_bad(slo.paging_fast_ratio),
        ),
        stat(
            "Requests in the range", "short", "OpenAI requests vLLM served in the selected time range.",
            Query(f"sum(increase({on_host('http_requests_total', OPENAI_HANDLERS)}[$__range]))", "requests"),
        ),
    )  # fmt: skip
    return Dashboard(
        "business",
        "ironserve-business",
        "ironserve / Business: requests, errors, latency",
        "Business dimension: what clients get, at the engine (vLLM's http metrics) and at the Envoy ingress.",
        ("ironserve", "business"),
        panels,
    )


def cost_dashboard(slo: SloSettings) -> Dashboard:
    names = slo_names(slo)
    panels = (
        Panel(
            "Cost per token", "currencyUSD", (Query(names["cost"], f"over {slo.slo_window}"),),
            f"GPU price per second over tokens per second (no data while idle). SLO: at most "
            f"${slo.cost_per_token_max_usd}.",
            decimals=6, min=0, **above_is_bad(slo.cost_per_token_max_usd),
        ),
        stat(
            "Cost per million tokens", "currencyUSD", "The same figure per million tokens.",
            Query(f"{names['cost']} * 1e6", "per 1M tokens"),
            decimals=2, **above_is_bad(slo.cost_per_token_max_usd * 1e6),
        ),
        stat(
            "GPU cost per hour", "currencyUSD", "Configured GPU-hour price times the GPUs billed (exporter settings).",
            Query(on_host("ironserve_gpu_cost_usd_per_hour"), "{{instance}}"),
            decimals=2,
        ),
        stat(
            "GPU spend in the range", "currencyUSD", "GPU cost of the selected time range at the configured price.",
            Query(f"sum(avg_over_time({on_host('ironserve_gpu_cost_usd_per_hour')}[$__range])) * $__range_s / 3600",
                  "spend"),
            decimals=2,
        ),
        Panel(
            "Tokens per second", "suffix: tok/s",
            (Query(_tokens_per_second(), "{{kind}}"),
             Query(f"sum(rate({on_host('ironserve_tokens_total')}[{RATE}]))", "total")),
            "The denominator of cost per token: fewer tokens per second at the same price cost more per token.",
            min=0,
        ),
    )  # fmt: skip
    return Dashboard(
        "cost",
        "ironserve-cost",
        "ironserve / Cost",
        "Cost dimension: cost per token against its SLO, the GPU price and the token rate behind it.",
        ("ironserve", "cost"),
        panels,
    )


def slo_dashboard(slo: SloSettings, quality: QualitySettings) -> Dashboard:
    """Each SLO's current value coloured against its threshold; the thresholds are slo.py's alert thresholds."""
    names = slo_names(slo)
    panels = (
        stat(f"TTFT p95 ({slo.slo_window}) <= {slo.ttft_p95_s} s", "s",
             "Time to first token, TimeToFirstTokenP95AboveSLO (ticket).",
             Query(names["ttft"], "p95"), **above_is_bad(slo.ttft_p95_s)),
        stat(f"TTFT p95 ({slo.fast_window}) <= {2 * slo.ttft_p95_s} s", "s",
             "Twice the SLO over the fast window: TimeToFirstTokenP95AboveSLOFast (page).",
             Query(names["ttft_fast"], "p95"), **above_is_bad(2 * slo.ttft_p95_s)),
        stat(f"TPOT p95 <= {slo.tpot_p95_s} s", "s", "Time per output token, TimePerOutputTokenP95AboveSLO (ticket).",
             Query(names["tpot"], "p95"), **above_is_bad(slo.tpot_p95_s)),
        stat(f"Semantic success >= {slo.semantic_success_min:.1%}", "percentunit",
             f"Ticket below {slo.semantic_success_min:.1%} (orange), page below {slo.semantic_success_page:.0%} (red).",
             Query(names["semantic"], "success"),
             decimals=1, **below_is_bad(slo.semantic_success_min, page=slo.semantic_success_page)),
        stat(f"Cost per token <= ${slo.cost_per_token_max_usd}", "currencyUSD", "CostPerTokenAboveSLO (ticket).",
             Query(names["cost"], "USD/token"), decimals=6, **above_is_bad(slo.cost_per_token_max_usd)),
        stat(f"GPU memory growth <= {slo.memory_leak_max_bytes_per_hour / 1e6:g} MB/h", "decbytes",
             f"Growth per hour over {slo.leak_window} (deriv), largest GPU: GpuMemoryLeak (ticket).",
             Query(f"max({on_host(names['growth'])})", "bytes/h"),
             **above_is_bad(slo.memory_leak_max_bytes_per_hour)),
        stat(f"GPU memory used <= {slo.gpu_memory_alert_bytes / 1e9:g} GB", "decbytes",
             "Largest GPU's used memory: GpuMemoryHeadroomLow (ticket).",
             Query(f"max({on_host('gpu_memory_used_bytes')})", "used"),
             **above_is_bad(slo.gpu_memory_alert_bytes)),
        stat(f"KV cache usage <= {slo.kv_cache_usage_max:.0%}", "percentunit",
             f"KvCacheSaturated after {slo.kv_cache_for} (ticket).",
             Query(f"max({on_host('ironserve_kv_cache_usage_ratio')})", "used"),
             **above_is_bad(slo.kv_cache_usage_max)),
        stat(f"Requests under {slo.paging_latency_s} s >= {slo.paging_fast_ratio:.1%}", "percentunit",
             "003's paging rule, first half (LatencyTailAndErrors pages when both halves fail).",
             Query(_fast_ratio_engine(slo), "engine"), decimals=2, **below_is_bad(slo.paging_fast_ratio)),
        stat(f"5xx ratio <= {slo.paging_error_ratio:.1%}", "percentunit",
             "003's paging rule, second half.",
             Query(_error_ratio_engine(PAGING_WINDOW), "engine"), decimals=2, **above_is_bad(slo.paging_error_ratio)),
        stat(f"Logprob std p95 <= {quality.logprob_std_alert}", "none", "LogprobVarianceHigh (ticket).",
             Query(_logprob_std_p95(), "p95"), decimals=2,
             **above_is_bad(quality.logprob_std_alert, warn=quality.logprob_std_normal_max)),
        stat("Engine and exporter up", "none",
             f"ServingEngineDown and ExporterDown page after {slo.target_down_for} at 0.",
             Query(on_host("ironserve_vllm_up"), "engine"),
             Query(on_host("up", f'job="{slo.job}"', 'component="exporter"'), "exporter"),
             **below_is_bad(1)),
    )  # fmt: skip
    return Dashboard(
        "slo",
        "ironserve-slo",
        "ironserve / SLOs",
        "Each SLO's current value against the threshold its alert uses (green: met).",
        ("ironserve", "slo"),
        panels,
    )


def dashboards(
    slo: SloSettings | None = None, quality: QualitySettings | None = None, monitoring: MonitoringSettings | None = None
) -> list[Dashboard]:
    slo = slo or SloSettings()
    quality = quality or QualitySettings()
    return [
        hardware_dashboard(slo, monitoring or MonitoringSettings()),
        engine_dashboard(slo),
        model_quality_dashboard(slo, quality),
        business_dashboard(slo),
        cost_dashboard(slo),
        slo_dashboard(slo, quality),
    ]


def _thresholds(panel: Panel) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": panel.base_color, "value": None}]
    steps += [{"color": t.color, "value": t.value} for t in panel.thresholds]
    return {"mode": "absolute", "steps": steps}


def _field_defaults(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "thresholds": _thresholds(panel)}
    for key in ("decimals", "min", "max"):
        if getattr(panel, key) is not None:
            defaults[key] = getattr(panel, key)
    if panel.kind == "timeseries":
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "thresholdsStyle": {"mode": "line" if panel.thresholds else "off"},
        }
    else:
        defaults["color"] = {"mode": "thresholds"}
    return defaults


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "value_and_name",
    }


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    instant = panel.kind == "stat"
    targets = [
        {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + index),
            "expr": query.expr,
            "legendFormat": query.legend or "__auto",
            "range": not instant,
            "instant": instant,
        }
        for index, query in enumerate(panel.queries)
    ]
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": _field_defaults(panel), "overrides": []},
        "options": _options(panel),
        "targets": targets,
    }


def layout(panels: Sequence[Panel]) -> list[dict[str, Any]]:
    """Left to right on Grafana's 24-column grid, a new row when a panel does not fit; ids from 1."""
    rendered, x, y, row_height = [], 0, 0, 0
    for panel_id, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        rendered.append(panel_json(panel, panel_id, x, y))
        x, row_height = x + panel.width, max(row_height, panel.height)
    return rendered


def variables() -> list[dict[str, Any]]:
    datasource = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }
    query = f"label_values({HOST_METRIC}, instance)"
    instance = {
        "name": "instance",
        "label": "Host",
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": query,
        # The host part of instance (a lazy match before an optional :port); the value is the capture group.
        "regex": "/^(.*?)(?::[0-9]+)?$/",
        "current": {},
        "hide": 0,
        "includeAll": True,
        "allValue": ".+",
        "multi": True,
        "options": [],
        "refresh": 2,
        "skipUrlSync": False,
        "sort": 1,
    }
    return [datasource, instance]


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": dashboard.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "title": "ironserve",
                "type": "dashboards",
                "tags": ["ironserve"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "panels": layout(dashboard.panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": list(dashboard.tags),
        "templating": {"list": variables()},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": dashboard.title,
        "uid": dashboard.uid,
        "version": 1,
        "weekStart": "",
    }


def file_name(dashboard: Dashboard) -> str:
    return f"dashboard-{dashboard.name}.json"


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard_json(dashboard), indent=2, ensure_ascii=False) + "\n"


def rendered_files() -> dict[str, str]:
    return {file_name(d): render(d) for d in dashboards()}


def stale_files() -> list[str]:
    """The dashboard files under files/monitoring/ that are missing or differ from what these functions render."""
    stale = []
    for name, text in rendered_files().items():
        try:
            current = role_file("monitoring", name).read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text:
            stale.append(name)
    return stale


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered_files().items():
        path = folder / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roles.monitoring.render_dashboards", description="ironserve's Grafana dashboards as code"
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate files/monitoring/dashboard-*.json")
    action.add_argument("--check", action="store_true", help="exit 1 when a checked-in dashboard is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"files/{FOLDER}/{name} is stale: run python -m roles.monitoring.render_dashboards --write")
        return 1 if stale else 0
    if CHECKOUT is None:
        print("render_dashboards: --write regenerates a checkout's files/; this ironserve is not a checkout")
        return 2
    for path in write(CHECKOUT / "files" / FOLDER):
        print(f"render_dashboards: wrote {path.relative_to(CHECKOUT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
