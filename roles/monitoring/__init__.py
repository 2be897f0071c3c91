"""Alerts that reach a person: Alertmanager (Debian's prometheus-alertmanager) routing the host's Prometheus alerts
to webhooks, e-mail and PagerDuty, and the node exporter (prometheus-node-exporter) with the host's run-time rules.

The Prometheus that evaluates the rules is the one the inference role installs; this role fills its extension
directories (rules.d, targets.d, probes.d, alertmanagers.d), which Prometheus reads by file discovery without a
restart, and restarts it only when the host rules change. Secrets come from the deploy machine's environment and
go to root:prometheus 0640 files, never into a configuration or any output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyinfra.api.deploy import deploy

from ironserve.apt import installed
from ironserve.operations import restarted_when_stale, service_state
from ironserve.owned import owned_directory, owned_file, unmasked
from ironserve.run import HostRun
from ironserve.secrets import secret_upload
from roles.monitoring.render import (
    ALERTMANAGER_CONFIG,
    ALERTMANAGER_DEFAULTS,
    ALERTMANAGERS,
    GRAFANA_DASHBOARDS,
    GRAFANA_PROVIDER,
    HOST_RULES,
    NODE_EXPORTER_DEFAULTS,
    NODE_TARGETS,
    PAGERDUTY_KEY_FILE,
    SERVICE_GROUP,
    SMTP_PASSWORD_FILE,
    WATCHED_HOSTS,
    alertmanager_arguments,
    alertmanager_config,
    alertmanagers,
    grafana_provider,
    host_rules,
    node_exporter_arguments,
    node_targets,
    watched_hosts,
)
from roles.monitoring.render_dashboards import rendered_files

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig

ALERTMANAGER_UNIT = "prometheus-alertmanager.service"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
PROMETHEUS_UNIT = "prometheus.service"


def monitoring_deployable(config: StackConfig) -> None:
    """The rules need the host's Prometheus; an Alertmanager needs somewhere to send; every secret is exported."""
    settings = config.monitoring
    if not config.inference.prometheus:
        raise ValueError(
            "monitoring needs the host's Prometheus, which the inference role installs: inference_prometheus is "
            "false on this host"
        )
    if settings.alertmanager and not settings.receivers_named():
        raise ValueError(
            "monitoring_alertmanager is on but no receiver is set, so a paging alert would reach no one; accepted: "
            "monitoring_webhook_urls, monitoring_email_to or monitoring_pagerduty"
        )
    settings.secrets()  # ValueError naming the unset variable


def _secrets(config: StackConfig) -> None:
    settings = config.monitoring
    values = settings.secrets()
    for enabled, variable, path in (
        (settings.pagerduty, settings.pagerduty_routing_key_env, PAGERDUTY_KEY_FILE),
        (bool(settings.smtp_username), settings.smtp_password_env, SMTP_PASSWORD_FILE),
    ):
        if enabled:
            secret_upload(
                name=f"{path} from ${variable} (content not shown)",
                src=values[variable].encode(),
                dest=path,
                group=SERVICE_GROUP,
            )


def _daemon(what: str, unit: str, files: dict[str, str], frozen: bool, check: str | None = None) -> None:
    """A Debian daemon run from `files` (its configuration, its defaults file's arguments): written, the unit running
    and enabled, restarted only when a file changed since it started (after `check` passes)."""
    for path, content in files.items():
        owned_file(name=f"{what}: {path}", path=path, content=content, clear_immutable=frozen)
    unmasked(name=f"{what} not masked", unit=unit)
    service_state(name=what, unit=unit)
    restarted_when_stale(
        name=f"{what} runs its current files" + (" (checked first)" if check else ""),
        unit=unit,
        inputs=list(files),
        check=check,
    )


@deploy("Monitoring")
def monitoring(config: StackConfig, run: HostRun) -> None:
    settings = config.monitoring
    frozen = config.clear_immutable
    installed(
        name="Node exporter" + (" and Alertmanager" if settings.alertmanager else ""),
        packages=["prometheus-node-exporter", *(["prometheus-alertmanager"] if settings.alertmanager else [])],
        recommends=False,
    )
    _daemon("Node exporter", NODE_EXPORTER_UNIT, {NODE_EXPORTER_DEFAULTS: node_exporter_arguments(settings)}, frozen)
    if settings.alertmanager:
        _secrets(config)
        files = {
            ALERTMANAGER_CONFIG: alertmanager_config(settings),
            ALERTMANAGER_DEFAULTS: alertmanager_arguments(settings),
        }
        _daemon("Alertmanager", ALERTMANAGER_UNIT, files, frozen, check=f"amtool check-config {ALERTMANAGER_CONFIG}")
    # Prometheus' extension directories, read by file discovery (targets, Alertmanagers) or at start (rules).
    for path, content in (
        (NODE_TARGETS, node_targets(settings)),
        (WATCHED_HOSTS, watched_hosts(settings)),
        (ALERTMANAGERS, alertmanagers(settings)),
        (HOST_RULES, host_rules(settings)),
    ):
        directory = path.rpartition("/")[0]
        owned_directory(name=f"{directory}/", path=directory, clear_immutable=frozen)
        owned_file(name=f"Prometheus reads {path}", path=path, content=content, clear_immutable=frozen)
    restarted_when_stale(
        name="Prometheus runs the current host rules (promtool-checked)",
        unit=PROMETHEUS_UNIT,
        inputs=[HOST_RULES],
        check=f"promtool check rules {HOST_RULES}",
    )
    if settings.grafana:
        owned_directory(name="ironserve's dashboards for Grafana", path=GRAFANA_DASHBOARDS, clear_immutable=frozen)
        for name, text in rendered_files().items():
            owned_file(
                name=f"Dashboard {name}", path=f"{GRAFANA_DASHBOARDS}/{name}", content=text, clear_immutable=frozen
            )
        owned_directory(
            name="Grafana's dashboard providers", path=GRAFANA_PROVIDER.rpartition("/")[0], clear_immutable=frozen
        )
        owned_file(name="Grafana loads them", path=GRAFANA_PROVIDER, content=grafana_provider(), clear_immutable=frozen)
