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


def series(name: str, values: str, /, **labels: str) -> dict[str, str]:
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


# GPU health series in the shapes of the real captures in tests/data/gpu_health (each .source names the capture).
A10 = {"uuid": "GPU-14705cc6-2e5b-ae28-e00a-0f87622e4299", "serial": "1325221009692", "name": "NVIDIA A10",
       "pci_bus_id": "00000000:08:00.0"}  # fmt: skip
A10_SECOND = {"uuid": "GPU-51ae0086-e1ac-4a20-f062-9caa44e4df6d", "serial": "1324722021038", "name": "NVIDIA A10",
              "pci_bus_id": "00000000:06:00.0"}  # fmt: skip
GPU0, GPU1 = "host:9400 gpu0 serial 1325221009692", "host:9400 gpu1 serial 1324722021038"


def gpu_info(device: str = "gpu0", identity: dict[str, str] = A10) -> dict[str, str]:
    return series("gpu_info", "1x40", device=device, **identity)


def gpu_fires(alert: str, at: str, summary: str, device: str = "gpu0", **labels: str) -> dict[str, Any]:
    """An alert named by host, GPU and serial: its summary as Prometheus renders the template."""
    serial = labels.pop("serial", {"gpu0": A10["serial"], "gpu1": A10_SECOND["serial"]}[device])
    expected = {**JOB, "device": device, **labels, "severity": ALERTS[alert]["labels"]["severity"]}
    if serial:  # "": gpu_info missing, the alert carries no serial label
        expected["serial"] = serial
    alert_test = {"exp_labels": expected, "exp_annotations": {"summary": summary}}
    return {"eval_time": at, "alertname": alert, "exp_alerts": [alert_test]}


def ecc(volatile: str, aggregate: str = "5x30") -> list[dict[str, str]]:
    return [
        series("gpu_ecc_errors", volatile, device="gpu0", error_type="uncorrected", counter="volatile"),
        series("gpu_ecc_errors", aggregate, device="gpu0", error_type="uncorrected", counter="aggregate"),
    ]


def throttle(**active: str) -> list[dict[str, str]]:
    reasons = ("gpu_idle", "sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
               "sw_thermal_slowdown")  # fmt: skip
    return [series("gpu_throttle_reason_active", active.get(r, "0x30"), device="gpu0", reason=r) for r in reasons]


def power(draw: str, limit: str = "150x30", default: str = "150x30") -> list[dict[str, str]]:
    return [series("gpu_power_watts", draw, device="gpu0"), series("gpu_power_limit_watts", limit, device="gpu0"),
            series("gpu_power_default_limit_watts", default, device="gpu0")]  # fmt: skip


def link(generation: str, util: str) -> list[dict[str, str]]:
    return [
        series("gpu_pcie_link_generation", generation, device="gpu0", bound="current"),
        series("gpu_pcie_link_generation", "4x30", device="gpu0", bound="max"),
        series("gpu_utilization_percent", util, device="gpu0"),
    ]


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
    # GPU health. A volatile uncorrectable count going 0 -> 1, over a lifetime (aggregate) count of 5 (stas00's A100).
    ("gpu-ecc-uncorrectable", ("obs-gpu-mem-alert-20-8gb",),
     case([*ecc("0x10 1x20"), gpu_info()],
          [gpu_fires("GpuUncorrectableEccError", "12m", f"{GPU0}: new uncorrectable (double-bit) ECC errors within "
                     "10m: drain the host and reset the GPU", error_type="uncorrected", counter="volatile")])),
    # gpu_info missing: the page still fires, the serial unknown.
    ("gpu-ecc-uncorrectable-without-info", ("obs-gpu-mem-alert-20-8gb",),
     case(ecc("0x10 1x20"),
          [gpu_fires("GpuUncorrectableEccError", "12m", "host:9400 gpu0 serial unknown: new uncorrectable "
                     "(double-bit) ECC errors within 10m: drain the host and reset the GPU", serial="",
                     error_type="uncorrected", counter="volatile")])),
    # The same GPU after an exporter restart: the old error is counted, nothing new happened.
    ("gpu-ecc-old-errors", ("obs-gpu-mem-alert-20-8gb",),
     case([*ecc("1x30"), gpu_info()], [silent("GpuUncorrectableEccError", "12m")])),
    ("gpu-xid-48", (),
     case([series("gpu_xid_errors_total", "0x10 1x20", device="gpu0", xid="48"), gpu_info()],
          [gpu_fires("GpuFatalXid", "12m", f"{GPU0}: XID 48, which NVIDIA's Xid catalog clears only by a GPU reset "
                     "or a reboot", xid="48")])),
    # Xid 63 (a row remap recorded: IGNORE in the catalog) does not page; its pending remap makes a ticket.
    ("gpu-xid-63", (),
     case([series("gpu_xid_errors_total", "0x10 1x20", device="gpu0", xid="63"),
           series("gpu_xid_errors_total", "0x30", device="gpu0", xid="48"), gpu_info()],
          [silent("GpuFatalXid", "12m")])),
    ("gpu-lost", (),
     case([series("gpu_lost", "0x5 1x10", device="gpu1"), gpu_info("gpu1", A10_SECOND)],
          [silent("GpuLost", "4m"),
           gpu_fires("GpuLost", "8m", f"{GPU1}: NVML cannot reach the GPU (off the bus): drain and reboot the host; "
                     "reseat or replace the card if it recurs", device="gpu1")])),
    ("gpu-present", (), case([series("gpu_lost", "0x20", device="gpu1"), gpu_info("gpu1", A10_SECOND)],
                             [silent("GpuLost", "10m")])),
    ("gpu-missing", (),
     case([series("gpu_visible_count", "2x3 1x10"), series("gpu_expected_count", "2x13")],
          [{"eval_time": "8m", "alertname": "GpuMissing", "exp_alerts": [{"exp_labels": {**JOB, "severity": "page"},
            "exp_annotations": {"summary": "host:9400: NVML shows 1 GPUs, fewer than gpu_health.expected_gpus: a card "
                                "is off the bus since the driver loaded, so NVML cannot name it; its serial is in "
                                "gpu_info before the drop"}}]}])),
    ("gpu-all-visible", (),
     case([series("gpu_visible_count", "2x13"), series("gpu_expected_count", "2x13")], [silent("GpuMissing", "8m")])),
    # The A10G capture's link: Max 16x, Current 8x.
    ("gpu-pcie-x8", ("hw-pcie-link-width-x16",),
     case([series("gpu_pcie_link_width", "8x20", device="gpu0", bound="current"),
           series("gpu_pcie_link_width", "16x20", device="gpu0", bound="max"), gpu_info()],
          [silent("GpuPcieLinkDegraded", "3m"),
           gpu_fires("GpuPcieLinkDegraded", "10m", f"{GPU0}: PCIe link at x8 for 5m, expected x16: reseat the card or "
                     "check its slot and riser", bound="current")])),
    ("gpu-pcie-x16", ("hw-pcie-link-width-x16",),
     case([series("gpu_pcie_link_width", "16x20", device="gpu0", bound="current"), gpu_info()],
          [silent("GpuPcieLinkDegraded", "10m")])),
    ("gpu-remap-failure", (),
     case([series("gpu_remapped_rows_failure", "0x3 1x10", device="gpu0"), gpu_info()],
          [gpu_fires("GpuRowRemapFailure", "6m", f"{GPU0}: a row remapping failed, the memory can no longer repair "
                     "itself: drain the host, replace the card")])),
    ("gpu-remap-no-failure", (),
     case([series("gpu_remapped_rows_failure", "0x13", device="gpu0"), gpu_info()],
          [silent("GpuRowRemapFailure", "6m")])),
    # stas00's "Pending Page Blacklist : Yes"; the V100 capture's "No".
    ("gpu-retired-pages-pending", (),
     case([series("gpu_retired_pages_pending", "1x10", device="gpu0"), gpu_info()],
          [gpu_fires("GpuRetiredPagesPending", "5m", f"{GPU0}: memory pages are pending retirement after ECC errors: "
                     "drain and reboot the host to retire them")])),
    ("gpu-retired-pages-none-pending", (),
     case([series("gpu_retired_pages_pending", "0x10", device="gpu0"), gpu_info()],
          [silent("GpuRetiredPagesPending", "5m")])),
    # The A100 capture: Remapped Rows Pending: Yes.
    ("gpu-remap-pending", (),
     case([series("gpu_remapped_rows_pending", "1x10", device="gpu0"), gpu_info()],
          [gpu_fires("GpuRowRemapPending", "5m", f"{GPU0}: a memory row remap waits for a GPU reset: reset the GPU at "
                     "a convenient time (drained)")])),
    ("gpu-remap-not-pending", (),
     case([series("gpu_remapped_rows_pending", "0x10", device="gpu0"), gpu_info()],
          [silent("GpuRowRemapPending", "5m")])),
    # The Dell C4130 capture: HW Slowdown and HW Power Brake Slowdown active together.
    ("gpu-power-brake", (),
     case([*throttle(hw_slowdown="1x30", hw_power_brake_slowdown="1x30"), gpu_info()],
          [silent("GpuClocksSlowdown", "10m"),
           {"eval_time": "20m", "alertname": "GpuClocksSlowdown", "exp_alerts": [
               {"exp_labels": {**JOB, "device": "gpu0", "serial": A10["serial"], "reason": reason,
                               "severity": "ticket"},
                "exp_annotations": {"summary": f"{GPU0}: clocks held down by {reason} for 15m: check cooling, and for "
                                               "a power brake the power supplies and the BMC"}}
               for reason in ("hw_power_brake_slowdown", "hw_slowdown")]}])),
    # The idle A10 capture: SW Power Cap active at 15.65 W of 150 W, nothing held down.
    ("gpu-idle-sw-power-cap", (),
     case([*throttle(sw_power_cap="1x30"), *power("15.65x30"), gpu_info()],
          [silent("GpuClocksSlowdown", "20m"), silent("GpuPowerCapped", "20m")])),
    ("gpu-power-capped", (),
     case([*throttle(sw_power_cap="1x30"), *power("149.3x30"), gpu_info()],
          [gpu_fires("GpuPowerCapped", "20m", f"{GPU0}: drawing at its power limit with the SW power cap engaged for "
                     "15m: clocks are held down by power; check gpu_power_limit_watts and airflow",
                     reason="sw_power_cap")])),
    # The A10 captures' link: generation 1 of 4. Idle (0 %) that is power saving; at 95 % busy it is a slow link.
    ("gpu-pcie-generation-under-load", ("hw-pcie-link-gen",),
     case([*link("1x30", "95x30"), gpu_info()],
          [gpu_fires("GpuPcieGenerationBelowMaxUnderLoad", "20m", f"{GPU0}: PCIe generation 1 below what the slot "
                     "allows while over 80% busy for 15m: check the slot, riser and BIOS link speed")])),
    ("gpu-pcie-generation-idle", ("hw-pcie-link-gen",),
     case([*link("1x30", "0x30"), gpu_info()], [silent("GpuPcieGenerationBelowMaxUnderLoad", "20m")])),
    ("gpu-pcie-generation-at-max", ("hw-pcie-link-gen",),
     case([*link("4x30", "95x30"), gpu_info()], [silent("GpuPcieGenerationBelowMaxUnderLoad", "20m")])),
    # The A10's Min Power Limit (100 W) set against its 150 W default; then the captures' 150 of 150.
    ("gpu-power-limit-capped", ("hw-gpu-power-limit",),
     case([*power("60x30", limit="100x30"), gpu_info()],
          [gpu_fires("GpuPowerLimitChanged", "20m", f"{GPU0}: enforced power limit 100 W differs from the board "
                     "default for 15m: restore it (nvidia-smi -pl) unless the cap is deliberate")])),
    ("gpu-power-limit-default", ("hw-gpu-power-limit",),
     case([*power("60x30"), gpu_info()], [silent("GpuPowerLimitChanged", "20m")])),
    # The GPU guard's drain for gpu1's ECC error (tests/test_gpu_guard.py), then the host serving again: the series
    # is gone (stale 5 m after its last scrape).
    ("gpu-guard-drained", (),
     case([series("ironserve_gpu_guard_drained", "1x10", device="gpu1", serial=A10_SECOND["serial"],
                  reason="new uncorrectable (double-bit) ECC error")],
          [gpu_fires("GpuGuardDrained", "5m", "host:9400 out of its load balancer, drained by the GPU guard: gpu1 "
                     "serial 1324722021038 new uncorrectable (double-bit) ECC error; it serves again once the GPU is "
                     "fit and the model answers, or after `ironserve-service traffic serving`",
                     device="gpu1", reason="new uncorrectable (double-bit) ECC error")])),
    ("gpu-guard-back-in-service", (),
     case([series("ironserve_gpu_guard_drained", "1x2", device="gpu1", serial=A10_SECOND["serial"],
                  reason="new uncorrectable (double-bit) ECC error")],
          [silent("GpuGuardDrained", "10m")])),
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
