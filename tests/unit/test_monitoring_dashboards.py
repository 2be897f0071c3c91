"""Grafana dashboards (roles/monitoring/render_dashboards.py): every panel's PromQL passes the real promtool, every
metric name a panel reads is one the exporters really publish (the service's own modules, real captures of vLLM,
Envoy 1.40 and node exporter 1.5, vLLM 0.32's source), the SLO panels use the alerts' thresholds, and the files in
files/monitoring/ are the ones the functions render."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from ironserve_service import exporter
from ironserve_service.quality import QualityMetrics
from ironserve_service.serving import ServingEngine
from ironserve_service.settings import EngineSettings, QualitySettings, ServiceSettings, SloSettings
from ironserve_service.slo import alerting_rules, recording_rules
from prometheus_client import CollectorRegistry, generate_latest

from ironserve.paths import REPO_ROOT
from roles.monitoring import render_dashboards
from roles.monitoring.render_dashboards import (
    DATASOURCE,
    HOST,
    SCHEMA_VERSION,
    dashboard_json,
    dashboards,
    file_name,
    render,
    stale_files,
)
from roles.monitoring.settings import MonitoringSettings

DATA = Path(__file__).parent / "data" / "monitoring"
PROMTOOL = shutil.which("promtool")

# ---- GPU health metrics: ironserve_service/gpu_health.py is new and still being written; these are the names of its
# ---- contract. REPLACE this set with the names its collector exposes, scraped like exporter_names() scrapes
# ---- exporter.py (NVML replaced by readings), once the module settles.
GPU_HEALTH_CONTRACT = {
    "gpu_info",
    "gpu_xid_errors_total",
    "gpu_ecc_errors",
    "gpu_retired_pages",
    "gpu_retired_pages_pending",
    "gpu_remapped_rows",
    "gpu_remapped_rows_pending",
    "gpu_remapped_rows_failure",
    "gpu_throttle_reason_active",
    "gpu_power_watts",
    "gpu_power_limit_watts",
    "gpu_temperature_celsius",
    "gpu_pcie_link_generation",
    "gpu_pcie_link_width",
    "gpu_lost",
    "gpu_visible_count",
    "gpu_expected_count",
}
# ---- end of the contract list.

# Prometheus' own series for every target (docs: "Jobs and instances", automatically generated labels and series).
PROMETHEUS_SYNTHETIC = {"up"}

# Grafana's variables, replaced by concrete values before promtool parses a query ($__range_s before $__range).
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range_s": "3600",
    "$__range": "1h",
    "$instance": "127.0.0.1",
}
PROMQL_WORDS = {
    # binary operators, modifiers and literals that look like names
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
    "atan2", "inf", "nan", "start", "end",
    # aggregation operators (they may be followed by `by (...)` rather than by a parenthesis)
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "limitk", "limit_ratio",
}  # fmt: skip
# A whole name (not inside a number or a longer name) that no parenthesis follows (that would be a function).
NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")


def concrete(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: strings, label matchers, ranges and label lists removed
    first, then every name that is not followed by a parenthesis (a function) and is no PromQL word."""
    text = concrete(expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'|`[^`]*`", '""', text)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    return {name for name in NAME.findall(text) if name.lower() not in PROMQL_WORDS}


def exposition_names(text: str) -> set[str]:
    """Sample names, HELP and TYPE names of a Prometheus text exposition; a TYPE line's histogram or summary adds
    the series it is exposed as."""
    names: set[str] = set()
    for line in text.splitlines():
        if typed := re.match(r"# TYPE (\S+) (\w+)", line):
            name, kind = typed.groups()
            names.add(name)
            suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}.get(kind, ())
            names.update(name + suffix for suffix in suffixes)
        elif helped := re.match(r"# HELP (\S+)", line):
            names.add(helped.group(1))
        elif sample := re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line):
            names.add(sample.group())
    return names


def family(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def exporter_names() -> set[str]:
    """What exporter.py's registry exposes, scraped from the real collectors with one GPU and an engine answering
    every figure (NVML and the engine's /metrics replaced by readings)."""
    gpu = exporter.GpuReading(index=0, used_bytes=1, total_bytes=2, utilization_percent=3.0, process_bytes={42: 1})
    figures = {field.name: 1.0 for field in dataclasses.fields(exporter.FrameworkReading)}
    settings = ServiceSettings(engine=EngineSettings(model_dir=Path("/nonexistent")))
    with (
        mock.patch.object(exporter, "read_gpus", return_value=[gpu]),
        mock.patch.object(exporter, "serving_engine", return_value=ServingEngine("blue", "v1", "http://127.0.0.1:1")),
        mock.patch.object(exporter, "fetch_text", return_value=""),
        mock.patch.object(exporter, "parse_vllm_metrics", return_value=exporter.FrameworkReading(**figures)),
    ):
        return exposition_names(generate_latest(exporter.build_registry(settings)).decode())


def quality_names() -> set[str]:
    registry = CollectorRegistry()
    QualityMetrics(registry, QualitySettings())
    return exposition_names(generate_latest(registry).decode())


def recorded_names() -> set[str]:
    return {rule["record"] for rule in recording_rules(SloSettings())}


def capture(name: str) -> set[str]:
    return exposition_names((DATA / name).read_text())


def known_names() -> dict[str, set[str]]:
    return {
        "service exporter (exporter.py)": exporter_names(),
        "quality (quality.py)": quality_names(),
        "recording rules (slo.py)": recorded_names(),
        "GPU health contract": GPU_HEALTH_CONTRACT,
        "vLLM captures": capture("vllm-metrics-captures.txt"),
        "vLLM 0.32.0 source": capture("vllm-0.32.0-families.txt"),
        "Envoy 1.40.0 capture": capture("envoy-1.40.0.txt"),
        "node exporter 1.5.0 capture": capture("node-exporter-1.5.0.txt"),
        "Prometheus": PROMETHEUS_SYNTHETIC,
    }


KNOWN = set().union(*known_names().values())
RENDERED = {d.name: dashboard_json(d) for d in dashboards()}


def targets() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        (name, panel, target) for name, d in RENDERED.items() for panel in d["panels"] for target in panel["targets"]
    ]


def unknown_names(expr: str, known: set[str]) -> set[str]:
    return metric_names(expr) - known


def test_the_name_extractor_reads_selectors_not_functions_labels_or_keywords() -> None:
    expr = (
        'sum by (device, le) (rate(a_bucket{instance=~"$instance(:[0-9]+)?", le="0.5", job!~"x|y"}[$__rate_interval]))'
        " / on (job) group_left (colour) b > bool 0.9 and ignoring (device) c offset 5m"
        " or histogram_quantile(0.95, d_bucket[5m]) * 1e6 unless max without (pid) (e) + vector(1) - time()"
        ' or count_values("value", f) or absent(g{device="gpu0"})'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c", "d_bucket", "e", "f", "g"}
    assert metric_names("vllm:kv_cache_blocks_used / ironserve_kv_cache_blocks > 0.95") == {
        "vllm:kv_cache_blocks_used",
        "ironserve_kv_cache_blocks",
    }


def test_the_checker_catches_a_misspelt_metric_name() -> None:
    good = f"rate({render_dashboards.on_host('gpu_xid_errors_total')}[$__rate_interval])"
    assert unknown_names(good, KNOWN) == set()
    assert unknown_names(good.replace("gpu_xid_errors_total", "gpu_xid_error_total"), KNOWN) == {"gpu_xid_error_total"}
    # The seed's name for the KV cache gauge is no vLLM name (obs-vllm-cache-usage).
    assert unknown_names("vllm:gpu_cache_usage_ratio", KNOWN) == {"vllm:gpu_cache_usage_ratio"}


@pytest.mark.invariant("obs-metric-inventory", "obs-vllm-cache-usage")
def test_every_metric_a_panel_reads_is_a_real_name() -> None:
    unknown = sorted(
        f"{name} / {panel['title']}: {sorted(unknown_names(target['expr'], KNOWN))}"
        for name, panel, target in targets()
        if unknown_names(target["expr"], KNOWN)
    )
    assert unknown == []
    # The host variable's query reads a real metric too.
    for dashboard in RENDERED.values():
        instance = next(v for v in dashboard["templating"]["list"] if v["name"] == "instance")
        metric = re.fullmatch(r"label_values\((\S+), instance\)", instance["query"])
        assert metric and metric.group(1) in exporter_names()


def test_every_vllm_name_a_panel_reads_is_in_a_real_capture_and_in_the_pinned_source() -> None:
    used = {n for _, _, t in targets() for n in metric_names(t["expr"])} - recorded_names()
    engine = {n for n in used if n.startswith(("vllm:", "http_"))}
    assert engine, "the dashboards read vLLM's own /metrics"
    captured = {family(n) for n in capture("vllm-metrics-captures.txt")}
    assert sorted(n for n in engine if family(n) not in captured) == []
    assert sorted(engine - capture("vllm-0.32.0-families.txt")) == []


def test_the_known_names_come_from_every_source() -> None:
    sources = known_names()
    assert {"gpu_memory_used_bytes", "ironserve_tokens_total", "ironserve_gpu_cost_usd_per_hour"} <= sources[
        "service exporter (exporter.py)"
    ]
    assert {"semantic_success_total", "model_logprob_std_bucket"} <= sources["quality (quality.py)"]
    assert "ironserve:time_to_first_token_seconds:p95_5m" in sources["recording rules (slo.py)"]
    assert "vllm:num_preemptions_total" in sources["vLLM 0.32.0 source"]
    assert "envoy_http_downstream_rq_time_bucket" in sources["Envoy 1.40.0 capture"]
    assert "node_timex_sync_status" in sources["node exporter 1.5.0 capture"]
    for name in (
        "vllm-metrics-captures.txt",
        "vllm-0.32.0-families.txt",
        "envoy-1.40.0.txt",
        "node-exporter-1.5.0.txt",
    ):
        assert (DATA / f"{name}.source").read_text().strip(), f"{name} says where it comes from"


def test_the_gpu_health_contract_is_what_gpu_health_py_names_where_it_exists() -> None:
    """Until GPU_HEALTH_CONTRACT is replaced by the module's names: each contract name is a string gpu_health.py
    writes (read as text, so a module still being edited cannot break the other checks)."""
    spec = importlib.util.find_spec("ironserve_service.gpu_health")
    if spec is None or spec.origin is None:
        pytest.skip("ironserve_service/gpu_health.py does not exist yet")
    written = set(re.findall(r'"(gpu_[a-z_]+)"', Path(spec.origin).read_text()))
    assert sorted(GPU_HEALTH_CONTRACT - written) == []


def test_raw_series_are_filtered_to_the_chosen_host() -> None:
    by_job = recorded_names() - {"vllm:kv_cache_blocks_used", "ironserve:gpu_memory_growth_bytes_per_hour"}
    unfiltered = sorted(
        f"{name} / {panel['title']}: {metric}"
        for name, panel, target in targets()
        for metric in metric_names(target["expr"]) - by_job
        if f"{metric}{{{HOST}" not in target["expr"]
    )
    assert unfiltered == []


@pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (apt-get install prometheus)")
def test_every_panel_query_passes_promtool(tmp_path: Path) -> None:
    groups: list[dict[str, Any]] = [
        {
            "name": f"dashboard-{name}",
            "rules": [
                {
                    "record": f"dashboard:{name.replace('-', '_')}:panel{panel['id']}_{target['refId']}",
                    "expr": concrete(target["expr"]),
                }
                for panel in dashboard["panels"]
                for target in panel["targets"]
            ],
        }
        for name, dashboard in RENDERED.items()
    ]
    leftover = sorted({v for g in groups for r in g["rules"] for v in re.findall(r"\$\w+", str(r["expr"]))})
    assert leftover == [], "a Grafana variable promtool would not parse"
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000))
    result = subprocess.run([PROMTOOL or "promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(targets())} rules found" in result.stdout


@pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (apt-get install prometheus)")
def test_promtool_refuses_a_broken_query(tmp_path: Path) -> None:
    path = tmp_path / "broken.rules.yml"
    rule = {"record": "dashboard:broken", "expr": concrete('sum(rate(gpu_power_watts{instance=~"$instance"}[5m])')}
    path.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [rule]}]}))
    result = subprocess.run([PROMTOOL or "promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode != 0


@pytest.mark.invariant("obs-five-dimensions")
def test_the_five_dimensions_and_the_slos_each_have_a_dashboard() -> None:
    dimensions = {tag for d in RENDERED.values() for tag in d["tags"]} - {"ironserve"}
    assert dimensions == {"hardware", "framework", "model", "business", "cost", "slo"}
    assert len({d["uid"] for d in RENDERED.values()}) == len(RENDERED)
    assert len({d["title"] for d in RENDERED.values()}) == len(RENDERED)


def test_every_panel_has_a_title_a_unit_a_unique_id_and_the_datasource_variable() -> None:
    for name, dashboard in RENDERED.items():
        assert dashboard["schemaVersion"] == SCHEMA_VERSION
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in dashboard["panels"]:
            where = f"{name} / {panel['title']}"
            assert panel["title"].strip() and panel["description"].strip(), where
            assert panel["type"] in {"timeseries", "stat"}, where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert panel["datasource"] == DATASOURCE == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"], where
            assert all(target["datasource"] == DATASOURCE for target in panel["targets"]), where
            assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), where
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, where


def test_every_dashboard_has_the_datasource_and_instance_variables() -> None:
    for name, dashboard in RENDERED.items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", name
        assert variables["datasource"]["query"] == "prometheus", name
        instance = variables["instance"]
        assert instance["type"] == "query" and instance["query"].startswith("label_values("), name
        assert instance["datasource"] == DATASOURCE, name
        # The regex keeps the host part of an instance label, so one choice matches every target on the host.
        pattern = re.compile(instance["regex"].strip("/"))
        for label, host in (("127.0.0.1:9400", "127.0.0.1"), ("gpu-07.example:9100", "gpu-07.example"), ("h", "h")):
            match = pattern.fullmatch(label)
            assert match and match.group(1) == host


@pytest.mark.invariant("obs-gpu-mem-alert-20-8gb", "obs-gpu-mem-absolute")
def test_gpu_memory_is_drawn_in_bytes_against_the_20_8_gb_line() -> None:
    panel = next(p for p in RENDERED["hardware"]["panels"] if p["title"].startswith("GPU memory used"))
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "decbytes"
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 20_800_000_000]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    assert {t["expr"].split("{")[0] for t in panel["targets"]} == {"gpu_memory_used_bytes", "gpu_memory_total_bytes"}


def test_windows_and_filters_are_the_alerts_and_the_latency_buckets_exist() -> None:
    alerts = {rule["alert"]: rule["expr"] for rule in alerting_rules(SloSettings(), QualitySettings())}
    assert render_dashboards.OPENAI_HANDLERS in alerts["LatencyTailAndErrors"]
    assert f"[{render_dashboards.PAGING_WINDOW}]" in alerts["LatencyTailAndErrors"]
    assert f"[{render_dashboards.LOGPROB_WINDOW}]" in alerts["LogprobVarianceHigh"]
    # Envoy's request time is in milliseconds: the paging threshold is one of its buckets.
    envoy = (DATA / "envoy-1.40.0.txt").read_text()
    assert f'{render_dashboards.ENVOY_INGRESS},le="{SloSettings().paging_latency_s * 1000:g}"}}' in envoy


def test_host_panels_use_the_host_alerts_thresholds() -> None:
    panels = {p["title"]: p["fieldConfig"]["defaults"] for p in RENDERED["hardware"]["panels"]}
    disk_free = [s["value"] for s in panels["Disk free"]["thresholds"]["steps"]]
    assert disk_free == [None, MonitoringSettings().disk_free_min_ratio]
    assert [s["value"] for s in panels["NTP synchronised"]["thresholds"]["steps"]] == [None, 1]


def test_each_slo_panel_uses_its_alerts_threshold() -> None:
    """Every alert of the form `<metric> <op> <number>` has an SLO panel reading that metric with that threshold."""
    slo_panels = RENDERED["slo"]["panels"]
    missing = []
    for rule in alerting_rules(SloSettings(), QualitySettings()):
        simple = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*) [<>] ([0-9.e+-]+)", rule["expr"])
        if not simple:
            continue
        metric, value = simple.group(1), float(simple.group(2))
        if not any(
            metric in metric_names(t["expr"])
            and value in [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]
            for panel in slo_panels
            for t in panel["targets"]
        ):
            missing.append(f"{rule['alert']}: {metric} at {value}")
    assert missing == []


def test_the_json_round_trips() -> None:
    for dashboard in dashboards():
        text = render(dashboard)
        assert json.loads(text) == dashboard_json(dashboard)
        assert text.endswith("}\n")


def test_the_checked_in_files_are_the_generated_ones() -> None:
    assert stale_files() == [], "run python -m roles.monitoring.render_dashboards --write"
    checked_in = {path.name for path in (REPO_ROOT / "files" / "monitoring").glob("dashboard-*.json")}
    assert checked_in == {file_name(d) for d in dashboards()}
    assert render_dashboards.main(["--check"]) == 0


def test_a_stale_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    changed = [*dashboards()[:1], dataclasses.replace(dashboards()[1], title="changed")]
    monkeypatch.setattr(render_dashboards, "dashboards", lambda: changed)
    assert stale_files() == ["dashboard-engine.json"]
    assert render_dashboards.main(["--check"]) == 1
    assert [p.name for p in render_dashboards.write(tmp_path)] == ["dashboard-hardware.json", "dashboard-engine.json"]
    assert render_dashboards.write(tmp_path) == []
