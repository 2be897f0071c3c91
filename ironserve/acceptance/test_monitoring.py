"""Acceptance: roles/monitoring. What is in force, read through each daemon's own API on the host: the configuration
Alertmanager loaded, the Alertmanagers, rules and targets Prometheus uses, the node exporter's metrics; the secret
files' owner and mode (never their content)."""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from typing import Any

import pytest
import yaml

from ironserve.acceptance.checks import admin_dropins
from roles import StackConfig
from roles.monitoring import ALERTMANAGER_UNIT, NODE_EXPORTER_UNIT
from roles.monitoring.render import (
    GRAFANA_DASHBOARDS,
    GRAFANA_PROVIDER,
    PAGERDUTY_KEY_FILE,
    SERVICE_GROUP,
    SMTP_PASSWORD_FILE,
    loaded_differences,
)
from roles.monitoring.render_dashboards import rendered_files

PROMETHEUS = "http://127.0.0.1:9090"
FIRST_SCRAPE_S = 30


def _get(host: Any, url: str) -> Any:
    """The JSON (or text) a GET on the host answers, asked with the host's Python."""
    code = f"import urllib.request, sys\nsys.stdout.write(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    result = host.run(f"python3 -c {shlex.quote(code)}")
    assert result.rc == 0, result.stderr
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return result.stdout


@pytest.mark.parametrize("unit", [NODE_EXPORTER_UNIT, ALERTMANAGER_UNIT])
def test_daemons_run_enabled_without_admin_drop_ins(host: Any, config: StackConfig, unit: str, observe: Any) -> None:
    if unit == ALERTMANAGER_UNIT and not config.monitoring.alertmanager:
        pytest.skip("monitoring_alertmanager is off on this host")
    service = host.service(unit)
    found = admin_dropins(host, unit)
    observe(f"running={service.is_running} enabled={service.is_enabled} drop-ins={found or 'none'}")
    assert service.is_running and service.is_enabled and found == []


def test_node_exporter_publishes_the_host_dimension(
    host: Any, config: StackConfig, container_kind: str | None, observe: Any
) -> None:
    text = _get(host, f"http://127.0.0.1:{config.monitoring.node_exporter_port}/metrics")
    wanted = ["node_timex_sync_status", "node_network_receive_errs_total", "node_memory_MemAvailable_bytes"]
    # A container's root is its runtime's overlay, which the node exporter leaves out by design (its default
    # --collector.filesystem.fs-types-exclude); a host's own file systems are there.
    wanted += [] if container_kind else ["node_filesystem_avail_bytes"]
    missing = [name for name in wanted if f"\n{name}{{" not in text and f"\n{name} " not in text]
    observe(f"missing {missing or 'none'}")
    assert not missing


@pytest.mark.invariant("slo-pagerduty")
def test_alertmanager_runs_the_rendered_routes_receivers_and_inhibitions(
    host: Any, config: StackConfig, observe: Any
) -> None:
    settings = config.monitoring
    if not settings.alertmanager:
        pytest.skip("monitoring_alertmanager is off on this host")
    status = _get(host, f"http://127.0.0.1:{settings.alertmanager_port}/api/v2/status")
    loaded = yaml.safe_load(status["config"]["original"])
    receivers = {r["name"]: sorted(k for k in r if k.endswith("_configs") and r[k]) for r in loaded["receivers"]}
    observe(f"receivers {receivers}; inhibit {len(loaded.get('inhibit_rules', []))}; cluster {status['cluster']}")
    assert loaded_differences(loaded, settings) == []
    assert not status["cluster"].get("peers")
    assert ("pagerduty_configs" in receivers["page"]) == settings.pagerduty


def test_secret_files_are_the_alertmanagers_alone(host: Any, config: StackConfig, observe: Any) -> None:
    settings = config.monitoring
    files = [
        path
        for on, path in ((settings.pagerduty, PAGERDUTY_KEY_FILE), (bool(settings.smtp_username), SMTP_PASSWORD_FILE))
        if on and settings.alertmanager
    ]
    if not files:
        pytest.skip("no PagerDuty key or SMTP password on this host")
    shapes = {path: (host.file(path).user, host.file(path).group, oct(host.file(path).mode)) for path in files}
    observe(shapes)
    assert all(shape == ("root", SERVICE_GROUP, "0o640") for shape in shapes.values())


def test_prometheus_sends_to_the_sites_alertmanagers_with_the_host_label(
    host: Any, config: StackConfig, observe: Any
) -> None:
    settings = config.monitoring
    active = [a["url"] for a in _get(host, f"{PROMETHEUS}/api/v1/alertmanagers")["data"]["activeAlertmanagers"]]
    wanted = [f"{url.rstrip('/')}/api/v2/alerts" for url in settings.alertmanager_urls] or [
        f"http://127.0.0.1:{settings.alertmanager_port}/api/v2/alerts"
    ]
    loaded = yaml.safe_load(_get(host, f"{PROMETHEUS}/api/v1/status/config")["data"]["yaml"])
    label = loaded["global"].get("external_labels", {}).get("host")
    observe(f"alertmanagers {active}; external label host={label}")
    assert sorted(active) == sorted(wanted)
    assert label == config.host


def test_prometheus_evaluates_the_host_rules_and_scrapes_the_node_exporter(
    host: Any, config: StackConfig, observe: Any
) -> None:
    groups = _get(host, f"{PROMETHEUS}/api/v1/rules")["data"]["groups"]
    host_rules = sorted(r["name"] for g in groups if g["name"] == "ironserve-host" for r in g["rules"])
    # Right after a deploy a target is "unknown" until its first scrape (every 5 s, file discovery at once).
    deadline = time.monotonic() + FIRST_SCRAPE_S
    while True:
        targets = _get(host, f"{PROMETHEUS}/api/v1/targets")["data"]["activeTargets"]
        node = [t["health"] for t in targets if t["labels"].get("job") == "node"]
        if "unknown" not in node or time.monotonic() > deadline:
            break
        time.sleep(1)
    probes = {t["labels"].get("host"): t["health"] for t in targets if t["labels"].get("job") == "host-probe"}
    observe(f"host rules {host_rules}; node exporter {node}; watched {probes}")
    assert "HostDown" in host_rules and node == ["up"]
    assert set(probes) == set(config.monitoring.watch_hosts)


def test_grafana_provisions_the_dashboards_as_rendered(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.monitoring.grafana:
        pytest.skip("monitoring_grafana is off on this host: the dashboards are files to import")
    expected = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in rendered_files().items()}
    found = {name: host.file(f"{GRAFANA_DASHBOARDS}/{name}").sha256sum for name in expected}
    provider = yaml.safe_load(host.file(GRAFANA_PROVIDER).content_string)["providers"][0]
    observe(f"{sum(found[n] == d for n, d in expected.items())}/{len(expected)} dashboards as rendered; "
            f"provider path {provider['options']['path']}")  # fmt: skip
    assert found == expected and provider["options"]["path"] == GRAFANA_DASHBOARDS
