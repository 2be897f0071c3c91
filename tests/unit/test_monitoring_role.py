"""roles/monitoring: mistakes refused before any host is contacted; the rendered Alertmanager configuration checked
by the real amtool and run by the real Alertmanager (Debian's prometheus-alertmanager) on loopback, where a webhook
receiver sees grouping, routing by severity, inhibition by HostDown and resolution; the host rules by promtool."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from ironserve.config import ConfigError
from ironserve_lab.inference import REQUIREMENTS, model_versions
from ironserve_lab.webhook import WebhookReceiver
from roles import check_deployable, stack_config
from roles.monitoring.render import (
    GRAFANA_DASHBOARDS,
    PAGERDUTY_KEY_FILE,
    SMTP_PASSWORD_FILE,
    alertmanager_config,
    alertmanagers,
    grafana_provider,
    host_rules,
    loaded_differences,
    watched_hosts,
)
from roles.monitoring.settings import MonitoringSettings

AMTOOL = shutil.which("amtool")
ALERTMANAGER = shutil.which("prometheus-alertmanager")
PROMTOOL = shutil.which("promtool")
HOOK = "https://hooks.example.internal/alerts"
INFERENCE = {
    "inference_pip_index_url": "https://pypi.example.internal/simple/",
    "inference_requirements": str(REQUIREMENTS),
    "inference_model_source": str(model_versions()["lab-v1"]),
    "inference_listen_address": "10.0.0.5",
}
ROLES = "security,monitoring,inference"
KEY_SENTINEL = "s3ntinel-PAGERDUTY-41c7"
# Webhook, e-mail with SMTP authentication and PagerDuty: every receiver kind and both secrets.
EVERY_RECEIVER: dict[str, Any] = {
    "monitoring_pagerduty": True,
    "monitoring_email_to": ["oncall@example.com"],
    "monitoring_email_from": "alerts@example.com",
    "monitoring_smtp_smarthost": "smtp.example.com:587",
    "monitoring_smtp_username": "alerts",
}
SMTP_SENTINEL = "s3ntinel-SMTP-88e0"


def settings(**data: Any) -> MonitoringSettings:
    return MonitoringSettings.model_validate({"monitoring_webhook_urls": [HOOK], **data})


def config(**data: Any) -> Any:
    return stack_config("gpu1", {**INFERENCE, "ironserve_roles": ROLES, "monitoring_webhook_urls": [HOOK], **data})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"monitoring_webhook_urls": ["https://user:pw@hooks.example.internal/x"]}, "credential"),
        ({"monitoring_webhook_urls": ["http://hooks.example.internal/x"]}, "plain http"),
        ({"monitoring_webhook_urls": ["hooks.example.internal/x"]}, "is not an http"),
        ({"monitoring_email_to": ["oncall@example.com"]}, "needs monitoring_email_from"),
        ({"monitoring_email_to": ["On Call <oncall@example.com>"]}, "one e-mail address"),
        ({"monitoring_smtp_smarthost": "smtp.example.com"}, "HOST:PORT"),
        ({"monitoring_smtp_smarthost": "smtp.example.com:99999"}, "HOST:PORT"),
        ({"monitoring_group_by": ["host", "team"]}, "team"),
        ({"monitoring_group_wait": "30 s"}, "not a Prometheus duration"),
        ({"monitoring_alertmanager": False}, "reach no one"),
        ({"monitoring_alertmanager_urls": ["http://10.0.0.5:9093/alertmanager"]}, "has a path"),
        ({"monitoring_alertmanager_port": True}, "boolean is not a number"),
        ({"monitoring_watch_hosts": {"gpu2": "10.0.0.7; rm -rf /"}}, "gpu2"),
        ({"monitoring_pagerduty_routing_key_env": "lower-case"}, "environment variable name"),
        (
            {"monitoring_pagerduty_routing_key": "abc"},
            r"unknown key \(got \*\*\*\); did you mean monitoring_pagerduty_routing_key_env",
        ),
    ],
)
def test_mistakes_are_refused_at_inventory_load(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**data)


def test_deployable_needs_a_receiver_the_prometheus_and_every_secret() -> None:
    check_deployable(config())
    with pytest.raises(ConfigError, match="no receiver is set"):
        check_deployable(config(monitoring_webhook_urls=[]))
    with pytest.raises(ConfigError, match="inference_prometheus is false on this host"):
        check_deployable(config(inference_prometheus=False))
    with pytest.raises(ConfigError, match=r"\$IRONSERVE_PAGERDUTY_ROUTING_KEY is unset"):
        check_deployable(config(monitoring_pagerduty=True))


def test_secrets_come_from_the_environment_and_never_reach_the_rendered_files() -> None:
    chosen = settings(**EVERY_RECEIVER)
    environ = {"IRONSERVE_PAGERDUTY_ROUTING_KEY": KEY_SENTINEL, "IRONSERVE_SMTP_PASSWORD": SMTP_SENTINEL}
    assert chosen.secrets(environ) == environ
    rendered = alertmanager_config(chosen)
    document = yaml.safe_load(rendered)
    page = next(r for r in document["receivers"] if r["name"] == "page")
    assert page["pagerduty_configs"] == [{"routing_key_file": PAGERDUTY_KEY_FILE, "send_resolved": True}]
    assert document["global"]["smtp_auth_password_file"] == SMTP_PASSWORD_FILE
    assert KEY_SENTINEL not in rendered and SMTP_SENTINEL not in rendered
    with pytest.raises(ValueError, match=r"\$IRONSERVE_SMTP_PASSWORD holds whitespace") as caught:
        chosen.secrets({**environ, "IRONSERVE_SMTP_PASSWORD": f"{SMTP_SENTINEL} x"})
    assert SMTP_SENTINEL not in str(caught.value)


def test_one_variable_may_not_carry_two_secrets() -> None:
    with pytest.raises(ConfigError, match="a variable of its own for each secret"):
        config(
            monitoring_pagerduty=True,
            monitoring_smtp_username="alerts",
            monitoring_smtp_password_env="IRONSERVE_PAGERDUTY_ROUTING_KEY",
        )


@pytest.mark.skipif(AMTOOL is None, reason="amtool absent (apt-get install prometheus-alertmanager)")
@pytest.mark.invariant("slo-pagerduty")
def test_amtool_accepts_every_receiver_kind_and_pagerduty_pages(tmp_path: Path) -> None:
    chosen = settings(**EVERY_RECEIVER)
    path = tmp_path / "alertmanager.yml"
    path.write_text(alertmanager_config(chosen))
    result = subprocess.run([str(AMTOOL), "check-config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 inhibit rules" in result.stdout and "2 receivers" in result.stdout
    routes = yaml.safe_load(path.read_text())["route"]["routes"]
    assert routes == [{"receiver": "page", "matchers": ['severity="page"']}]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (apt-get install prometheus)")
def test_host_rules_pass_promtool_and_host_down_fires_on_a_silent_probe(tmp_path: Path) -> None:
    rules = tmp_path / "host.yml"
    rules.write_text(host_rules(settings()))
    checked = subprocess.run([str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    cases = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": 'up{job="host-probe", host="gpu2", instance="10.0.0.7:9100"}', "values": "1 1 0x8"},
                    {"series": 'up{job="host-probe", host="gpu3", instance="10.0.0.8:9100"}', "values": "1x10"},
                    {"series": 'node_timex_sync_status{job="node", instance="127.0.0.1:9100"}', "values": "0x80"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "2m",
                        "alertname": "HostDown",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "page", "job": "host-probe", "host": "gpu2",
                                               "instance": "10.0.0.7:9100"},
                                "exp_annotations": {"summary": "host gpu2 does not answer: its node exporter at "
                                                    "10.0.0.7:9100 is unreachable"},
                            }
                        ],
                    },
                    {"eval_time": "10m", "alertname": "ClockNotSynchronised", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "ClockNotSynchronised",
                        "exp_alerts": [{"exp_labels": {"severity": "ticket", "job": "node",
                                                       "instance": "127.0.0.1:9100"},
                                        "exp_annotations": {"summary": "the clock is not synchronised (NTP): logs, "
                                                            "certificates and latency figures drift"}}],
                    },
                ],
            }
        ],
    }  # fmt: skip
    tests = tmp_path / "tests.yml"
    tests.write_text(yaml.safe_dump(cases))
    result = subprocess.run([str(PROMTOOL), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_discovery_files_name_the_watched_hosts_and_the_sites_alertmanagers() -> None:
    chosen = settings(
        monitoring_watch_hosts={"gpu2": "10.0.0.7", "gpu3": "fd00::8"},
        monitoring_alertmanager_urls=["https://alerts.example.internal:9093"],
    )
    assert yaml.safe_load(watched_hosts(chosen)) == [
        {"targets": ["10.0.0.7:9100"], "labels": {"job": "host-probe", "host": "gpu2"}},
        {"targets": ["[fd00::8]:9100"], "labels": {"job": "host-probe", "host": "gpu3"}},
    ]
    assert yaml.safe_load(alertmanagers(chosen)) == [
        {"targets": ["alerts.example.internal:9093"], "labels": {"__scheme__": "https"}}
    ]
    assert yaml.safe_load(alertmanagers(settings())) == [
        {"targets": ["127.0.0.1:9093"], "labels": {"__scheme__": "http"}}
    ]


def test_grafanas_file_provider_reads_the_dashboards_folder() -> None:
    provider = yaml.safe_load(grafana_provider())
    assert provider["apiVersion"] == 1
    assert [(p["type"], p["options"]["path"]) for p in provider["providers"]] == [("file", GRAFANA_DASHBOARDS)]


# --- the real Alertmanager on loopback ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def fast(hook: str) -> MonitoringSettings:
    return settings(
        monitoring_webhook_urls=[hook],
        monitoring_allow_plain_http=[hook],
        monitoring_group_wait="1s",
        monitoring_group_interval="1s",
    )


@contextlib.contextmanager
def running_alertmanager(tmp_path: Path, hook: str) -> Iterator[str]:
    chosen = fast(hook)
    path = tmp_path / "alertmanager.yml"
    path.write_text(alertmanager_config(chosen))
    port = free_port()
    process = subprocess.Popen(
        [str(ALERTMANAGER), f"--config.file={path}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


def post_alerts(url: str, alerts: list[dict[str, Any]]) -> None:
    request = urllib.request.Request(
        f"{url}/api/v2/alerts", data=json.dumps(alerts).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200


def alert(name: str, host: str, severity: str, resolved: bool = False) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": name, "host": host, "severity": severity},
        "annotations": {"summary": f"{name} on {host}"},
        "startsAt": (now - timedelta(minutes=5)).isoformat(),
        **({"endsAt": now.isoformat()} if resolved else {}),
    }


@pytest.mark.skipif(ALERTMANAGER is None, reason="Alertmanager absent (apt-get install prometheus-alertmanager)")
def test_the_real_alertmanager_groups_routes_inhibits_and_resolves(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver, running_alertmanager(tmp_path, receiver.url) as url:
        # What the gate reads: the configuration in force, as Alertmanager reports it (its defaults filled in).
        status = json.load(urllib.request.urlopen(f"{url}/api/v2/status", timeout=5))
        loaded = yaml.safe_load(status["config"]["original"])
        assert loaded_differences(loaded, fast(receiver.url)) == []
        assert loaded_differences(loaded, fast(receiver.url).model_copy(update={"group_by": ("host",)})) != []
        # gpu1: two paging alerts at once; gpu2: HostDown with an alert of the same host it silences.
        post_alerts(url, [alert("ServingEngineDown", "gpu1", "page"), alert("LatencyTailAndErrors", "gpu1", "page"),
                          alert("HostDown", "gpu2", "page"), alert("ServingEngineDown", "gpu2", "page"),
                          alert("FilesystemAlmostFull", "gpu1", "ticket")])  # fmt: skip
        first = receiver.wait_for(3, 30)
        groups = {(n["groupLabels"]["host"], n["groupLabels"]["severity"]): n for n in first}
        assert len(first) == 3 and set(groups) == {("gpu1", "page"), ("gpu2", "page"), ("gpu1", "ticket")}
        assert {n["receiver"] for k, n in groups.items() if k[1] == "page"} == {"page"}
        assert groups["gpu1", "ticket"]["receiver"] == "ticket"
        assert sorted(a["labels"]["alertname"] for a in groups["gpu1", "page"]["alerts"]) == [
            "LatencyTailAndErrors",
            "ServingEngineDown",
        ]
        assert [a["labels"]["alertname"] for a in groups["gpu2", "page"]["alerts"]] == ["HostDown"]
        held = json.load(urllib.request.urlopen(f'{url}/api/v2/alerts?filter=host="gpu2"', timeout=5))
        states = {a["labels"]["alertname"]: (a["status"]["state"], bool(a["status"]["inhibitedBy"])) for a in held}
        assert states == {"HostDown": ("active", False), "ServingEngineDown": ("suppressed", True)}
        # The causes go: the gpu1 page group resolves in one notification.
        post_alerts(url, [alert("ServingEngineDown", "gpu1", "page", resolved=True),
                          alert("LatencyTailAndErrors", "gpu1", "page", resolved=True)])  # fmt: skip
        later = receiver.wait_for(4, 30)[3:]
        assert [(n["groupLabels"]["host"], n["status"]) for n in later] == [("gpu1", "resolved")]
        assert {a["status"] for a in later[0]["alerts"]} == {"resolved"}
