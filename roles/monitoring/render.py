"""What roles/monitoring writes: Alertmanager's configuration, the host rules, Prometheus' discovery files.

Pure functions of the settings. Secrets are never in these texts: Alertmanager reads them from files of their own
(`routing_key_file`, `auth_password_file`, both in Debian 12's Alertmanager 0.25).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import yaml
from ironserve_service.slo import alert_rule

from roles.monitoring.settings import MonitoringSettings

ALERTMANAGER_CONFIG = "/etc/prometheus/alertmanager.yml"  # Debian's --config.file default
ALERTMANAGER_DEFAULTS = "/etc/default/prometheus-alertmanager"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"
PAGERDUTY_KEY_FILE = "/etc/prometheus/alertmanager-pagerduty.key"
SMTP_PASSWORD_FILE = "/etc/prometheus/alertmanager-smtp.password"
# Prometheus' extension directories (rendered into its configuration by the role that installs it): rules, scraped
# targets, probed hosts (only `up` kept) and Alertmanagers, each read from files a role drops there.
HOST_RULES = "/etc/prometheus/rules.d/ironserve-host.yml"
NODE_TARGETS = "/etc/prometheus/targets.d/node-exporter.yml"
WATCHED_HOSTS = "/etc/prometheus/probes.d/watched-hosts.yml"
ALERTMANAGERS = "/etc/prometheus/alertmanagers.d/site.yml"
HOST_DOWN = "HostDown"
# Grafana's file provider (docs: administration/provisioning, "Dashboards"): the provider file names the folder it
# loads dashboards from and re-reads every updateIntervalSeconds, so no restart is needed.
GRAFANA_PROVIDER = "/etc/grafana/provisioning/dashboards/ironserve.yaml"
GRAFANA_DASHBOARDS = "/var/lib/ironserve/grafana-dashboards"
# Who may read the secrets: Debian's units run Alertmanager as user prometheus.
SERVICE_GROUP = "prometheus"
HEADER = "# Managed by ironserve (roles/monitoring)\n"


def _dump(document: Any) -> str:
    return HEADER + yaml.safe_dump(document, sort_keys=False, width=1000)


def alertmanager_config(settings: MonitoringSettings) -> str:
    """Routes by severity (page: every receiver, PagerDuty included; ticket: webhooks and e-mail), grouped by
    monitoring_group_by; a host that does not answer silences its other alerts."""
    webhooks = [{"url": url, "send_resolved": True} for url in settings.webhook_urls]
    emails: list[dict[str, Any]] = [{"to": address, "send_resolved": True} for address in settings.email_to]
    page: dict[str, Any] = {"name": "page"}
    ticket: dict[str, Any] = {"name": "ticket"}
    for receiver in (page, ticket):
        if webhooks:
            receiver["webhook_configs"] = webhooks
        if emails:
            receiver["email_configs"] = emails
    if settings.pagerduty:
        page["pagerduty_configs"] = [{"routing_key_file": PAGERDUTY_KEY_FILE, "send_resolved": True}]
    config: dict[str, Any] = {}
    if settings.email_to:
        smtp: dict[str, Any] = {"smtp_smarthost": settings.smtp_smarthost, "smtp_from": settings.email_from}
        if settings.smtp_username:
            smtp |= {"smtp_auth_username": settings.smtp_username, "smtp_auth_password_file": SMTP_PASSWORD_FILE}
        config["global"] = {**smtp, "smtp_require_tls": True}
    config["route"] = {
        "receiver": "ticket",
        "group_by": list(settings.group_by),
        "group_wait": settings.group_wait,
        "group_interval": settings.group_interval,
        "repeat_interval": settings.repeat_interval,
        "routes": [{"receiver": "page", "matchers": ['severity="page"']}],
    }
    config["inhibit_rules"] = [
        {
            "source_matchers": [f'alertname="{HOST_DOWN}"'],
            "target_matchers": [f'alertname!="{HOST_DOWN}"'],
            "equal": ["host"],
        }
    ]
    config["receivers"] = [page, ticket]
    return _dump(config)


def alertmanager_arguments(settings: MonitoringSettings) -> str:
    """Debian's defaults file: the port, and no cluster listener (one Alertmanager per site here; its gossip port
    9094 would otherwise listen on every address)."""
    args = f"--web.listen-address=:{settings.alertmanager_port} --cluster.listen-address="
    return f'{HEADER}ARGS="{args}"\n'


def node_exporter_arguments(settings: MonitoringSettings) -> str:
    return f'{HEADER}ARGS="--web.listen-address=:{settings.node_exporter_port}"\n'


def host_rules(settings: MonitoringSettings) -> str:
    """The host invariants that matter while serving, as alerts; no generic resource alert (slo-no-cpu-alerts)."""
    local = 'job="node"'
    disks = f'{local}, fstype!~"tmpfs|ramfs|overlay|squashfs|nsfs|fuse.*"'
    rules = [
        alert_rule(
            HOST_DOWN, 'up{job="host-probe"} == 0', "1m", "page",
            "host {{ $labels.host }} does not answer: its node exporter at {{ $labels.instance }} is unreachable",
        ),
        alert_rule(
            "NodeExporterDown", f"up{{{local}}} == 0", "5m", "ticket",
            "the node exporter does not answer: the host alerts are blind",
        ),
        alert_rule(
            "FilesystemAlmostFull",
            f"node_filesystem_avail_bytes{{{disks}}} / node_filesystem_size_bytes{{{disks}}}"
            f" < {settings.disk_free_min_ratio}",
            "10m", "ticket",
            f"{{{{ $labels.mountpoint }}}} has less than {settings.disk_free_min_ratio:.0%} free",
        ),
        alert_rule(
            "ClockNotSynchronised", f"node_timex_sync_status{{{local}}} == 0", "15m", "ticket",
            "the clock is not synchronised (NTP): logs, certificates and latency figures drift",
        ),
        alert_rule(
            "NetworkErrors",
            f'rate(node_network_receive_errs_total{{{local}, device!="lo"}}[5m])'
            f' + rate(node_network_transmit_errs_total{{{local}, device!="lo"}}[5m]) > 0',
            "15m", "ticket", "{{ $labels.device }} counts receive or transmit errors",
        ),
        alert_rule(
            "OomKill", f"increase(node_vmstat_oom_kill{{{local}}}[10m]) > 0", "0m", "ticket",
            "the kernel killed a process for memory",
        ),
    ]  # fmt: skip
    return _dump({"groups": [{"name": "ironserve-host", "rules": rules}]})


def node_targets(settings: MonitoringSettings) -> str:
    return _dump([{"targets": [f"127.0.0.1:{settings.node_exporter_port}"], "labels": {"job": "node"}}])


def watched_hosts(settings: MonitoringSettings) -> str:
    groups = [
        {
            "targets": [f"{_bracketed(address)}:{settings.node_exporter_port}"],
            "labels": {"job": "host-probe", "host": name},
        }
        for name, address in sorted(settings.watch_hosts.items())
    ]
    return _dump(groups)


def alertmanagers(settings: MonitoringSettings) -> str:
    """Where this host's Prometheus sends alerts: monitoring_alertmanager_urls, else this host's own."""
    urls = settings.alertmanager_urls or (f"http://127.0.0.1:{settings.alertmanager_port}",)
    groups = []
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        groups.append({"targets": [parts.netloc], "labels": {"__scheme__": parts.scheme}})
    return _dump(groups)


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def grafana_provider() -> str:
    provider = {
        "name": "ironserve",
        "folder": "ironserve",
        "type": "file",
        "disableDeletion": True,
        "allowUiUpdates": False,
        "updateIntervalSeconds": 30,
        "options": {"path": GRAFANA_DASHBOARDS},
    }
    return _dump({"apiVersion": 1, "providers": [provider]})


def loaded_differences(loaded: dict[str, Any], settings: MonitoringSettings) -> list[str]:
    """How the configuration Alertmanager reports in force (/api/v2/status, its own YAML with its defaults filled in
    and secrets shown as <secret>) differs from what these settings render: receivers and their integrations,
    routes, grouping and inhibitions. Empty when it runs what the role wrote."""
    expected = yaml.safe_load(alertmanager_config(settings))

    def integrations(config: dict[str, Any]) -> dict[str, dict[str, int]]:
        return {
            r["name"]: {k: len(v) for k, v in r.items() if k.endswith("_configs") and v} for r in config["receivers"]
        }

    def route(config: dict[str, Any]) -> tuple[Any, ...]:
        top = config["route"]
        children = [(r["receiver"], r.get("matchers")) for r in top.get("routes", [])]
        return (top["receiver"], top["group_by"], top["group_wait"], top["group_interval"], top["repeat_interval"],
                children)  # fmt: skip

    def inhibitions(config: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(r.get("source_matchers"), r.get("target_matchers"), r.get("equal")) for r in config["inhibit_rules"]]

    problems = []
    for what, read in (("receivers", integrations), ("route", route), ("inhibitions", inhibitions)):
        if read(loaded) != read(expected):
            problems.append(f"{what}: in force {read(loaded)}, rendered {read(expected)}")
    return problems
