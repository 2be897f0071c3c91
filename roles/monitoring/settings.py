"""Settings of the monitoring role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Annotated

from ironserve_service.settings import Duration
from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from ironserve.config import Listener, RoleSettings, prefixed
from ironserve.secrets import credentials_refused
from ironserve.validators import ENV_NAME, check_host, fullmatch, plain_http_refused

# Debian 12's prometheus-alertmanager and prometheus-node-exporter listen on their upstream defaults
# (--web.listen-address :9093 and :9100, /etc/default/prometheus-*); the role keeps them unless told otherwise.
ALERTMANAGER_PORT = 9093
NODE_EXPORTER_PORT = 9100
# An address Alertmanager's email integration accepts in to/from: one mailbox, no display name, no list.
MAILBOX = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})+")
# Alert labels the route may group by: those every ironserve alert carries (Prometheus' external label `host`,
# the rules' `severity`, the alert's name) or may carry (`device` for a GPU).
GROUP_LABELS = frozenset({"host", "severity", "alertname", "device", "job", "instance"})
PAGERDUTY_ENV = "IRONSERVE_PAGERDUTY_ROUTING_KEY"
SMTP_PASSWORD_ENV = "IRONSERVE_SMTP_PASSWORD"


def _mailbox(value: str) -> str:
    if not fullmatch(MAILBOX, value):
        raise ValueError("is not one e-mail address; accepted: a bare address such as oncall@example.com")
    return value


def _endpoint(value: str) -> str:
    """HOST:PORT, the host a name or an IP address (IPv6 in brackets)."""
    host, sep, port = value.rpartition(":")
    accepted = "HOST:PORT such as smtp.example.com:587 or [2001:db8::1]:25"
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"is not HOST:PORT; accepted: {accepted}")
    if host.startswith("[") and host.endswith("]"):
        ipaddress.IPv6Address(host[1:-1])
    else:
        check_host(host)
    return value


def _env_name(value: str) -> str:
    if not fullmatch(ENV_NAME, value):
        raise ValueError("is not an environment variable name; accepted: A-Z, 0-9 and _, such as IRONSERVE_X")
    return value


def _url(value: str) -> str:
    if not re.fullmatch(r"https?://[^\s/?#]+(/\S*)?", value):
        raise ValueError("is not an http(s) URL; accepted: https://host[:port]/path")
    credentials_refused(value, "a receiver's credential is never an inventory value")
    return value


def _alertmanager_url(value: str) -> str:
    if urllib.parse.urlsplit(_url(value)).path not in ("", "/"):
        raise ValueError("has a path; accepted: an Alertmanager's root such as http://10.0.0.5:9093")
    return value


Url = Annotated[str, AfterValidator(_url)]


class MonitoringSettings(RoleSettings):
    """Settings of roles/monitoring."""

    model_config = ConfigDict(alias_generator=prefixed("monitoring"))

    alertmanager: bool = Field(
        True,
        description="Run Alertmanager (Debian's prometheus-alertmanager) on this host, routing the alerts of every "
        "Prometheus that names it in monitoring_alertmanager_urls. A site needs one; with none of its own a host "
        "names the site's in monitoring_alertmanager_urls.",
    )
    alertmanager_urls: tuple[Annotated[str, AfterValidator(_alertmanager_url)], ...] = Field(
        (),
        description="The Alertmanagers this host's Prometheus sends its alerts to, such as "
        "`[http://10.0.0.5:9093]`. Empty: this host's own (monitoring_alertmanager must then be true).",
    )
    alertmanager_port: int = Field(ALERTMANAGER_PORT, ge=1, le=65535, description="Alertmanager's port.")
    node_exporter_port: int = Field(
        NODE_EXPORTER_PORT, ge=1, le=65535, description="The node exporter's port (Debian's prometheus-node-exporter)."
    )
    watch_hosts: dict[str, str] = Field(
        default_factory=dict,
        description="Hosts whose node exporter this host's Prometheus probes, name -> address (`{gpu2: 10.0.0.7}`): "
        "one that stops answering raises HostDown (page), which silences that host's other alerts. Usually set on "
        "the host that runs Alertmanager.",
    )
    webhook_urls: tuple[Url, ...] = Field(
        (), description="Webhook receivers: every alert, paging or not, is POSTed to each (Alertmanager's JSON)."
    )
    allow_plain_http: tuple[str, ...] = Field(
        (),
        description="Webhook URLs (exact) accepted over plain http: an alert's labels and annotations then cross the "
        "network readable and forgeable.",
    )
    email_to: tuple[Annotated[str, AfterValidator(_mailbox)], ...] = Field(
        (), description="Addresses that receive every alert by e-mail (SMTP through monitoring_smtp_smarthost)."
    )
    email_from: Annotated[str, AfterValidator(_mailbox)] | None = Field(
        None, description="The sender address of the alert e-mails; required with monitoring_email_to."
    )
    smtp_smarthost: Annotated[str, AfterValidator(_endpoint)] | None = Field(
        None, description="The SMTP relay, HOST:PORT; required with monitoring_email_to. TLS is required."
    )
    smtp_username: str | None = Field(
        None,
        pattern=r"^[^\s:]{1,256}$",
        description="The SMTP user; its password comes from the variable monitoring_smtp_password_env names.",
    )
    smtp_password_env: Annotated[str, AfterValidator(_env_name)] = Field(
        SMTP_PASSWORD_ENV,
        description="The deploy machine's environment variable holding the SMTP password (with "
        "monitoring_smtp_username); written to a root:prometheus 0640 file, never into the config or any output.",
    )
    pagerduty: bool = Field(
        False,
        description="slo-pagerduty: page through PagerDuty (Events API v2). The routing key comes from the variable "
        "monitoring_pagerduty_routing_key_env names, never from the inventory.",
    )
    pagerduty_routing_key_env: Annotated[str, AfterValidator(_env_name)] = Field(
        PAGERDUTY_ENV,
        description="The deploy machine's environment variable holding the PagerDuty routing key; written to a "
        "root:prometheus 0640 file on the host, never into the config or any output.",
    )
    group_by: tuple[str, ...] = Field(
        ("host", "severity"),
        description="Alert labels a notification groups by: one notification per host and severity by default, "
        "however many of its alerts fire. Accepted: host, severity, alertname, device, job, instance.",
    )
    group_wait: Duration = Field("30s", description="How long a new group waits for more alerts before it notifies.")
    group_interval: Duration = Field("5m", description="How long before a group notifies of alerts added to it.")
    repeat_interval: Duration = Field("4h", description="How long before a still-firing group notifies again.")
    grafana: bool = Field(
        False,
        description="A Grafana runs on this host (the site installs it): provision ironserve's dashboards "
        "(files/monitoring/dashboard-*.json) through its file provider, /etc/grafana/provisioning/dashboards/. "
        "Off: import the files by hand.",
    )
    disk_free_min_ratio: float = Field(
        0.10,
        gt=0,
        lt=1,
        description="The host alerts when a local file system has less than this fraction free (model store, logs).",
    )

    @field_validator("group_by")
    @classmethod
    def _group_labels(cls, labels: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(labels) - GROUP_LABELS)
        if unknown or not labels:
            raise ValueError(f"names {unknown or 'no label'}; accepted: some of {', '.join(sorted(GROUP_LABELS))}")
        return labels

    @field_validator("watch_hosts")
    @classmethod
    def _watched(cls, hosts: dict[str, str]) -> dict[str, str]:
        for name, address in hosts.items():
            check_host(name)
            try:
                check_host(address)
            except ValueError as error:
                raise ValueError(f"{name}: {address!r} {error}") from None
        return hosts

    @model_validator(mode="after")
    def _coherent(self) -> MonitoringSettings:
        if not self.alertmanager_urls and not self.alertmanager:
            raise ValueError(
                "monitoring_alertmanager is false and monitoring_alertmanager_urls is empty: this host's alerts would "
                "reach no one; accepted: the site's Alertmanager in monitoring_alertmanager_urls"
            )
        for url in self.webhook_urls:
            plain_http_refused(
                url, self.allow_plain_http, "monitoring_allow_plain_http", "an alert crosses the network readable"
            )
        if self.pagerduty and self.smtp_username and self.pagerduty_routing_key_env == self.smtp_password_env:
            raise ValueError(
                f"monitoring_smtp_password_env: {self.smtp_password_env} is where the PagerDuty routing key is read "
                "from too; accepted: a variable of its own for each secret"
            )
        if self.email_to and (self.email_from is None or self.smtp_smarthost is None):
            raise ValueError("monitoring_email_to needs monitoring_email_from and monitoring_smtp_smarthost")
        return self

    def receivers_named(self) -> list[str]:
        """The kinds of receiver configured, for messages: webhook, email, pagerduty."""
        return [
            kind
            for kind, on in (("webhook", self.webhook_urls), ("email", self.email_to), ("pagerduty", self.pagerduty))
            if on
        ]

    def listeners(self) -> tuple[Listener, ...]:
        ports = [Listener(self.node_exporter_port, "monitoring_node_exporter_port", "the node exporter")]
        if self.alertmanager:
            ports.append(Listener(self.alertmanager_port, "monitoring_alertmanager_port", "Alertmanager"))
        return tuple(ports)

    def secret_variables(self) -> dict[str, tuple[str | None, str]]:
        variables: dict[str, tuple[str | None, str]] = {}
        if self.pagerduty:
            variables[self.pagerduty_routing_key_env] = (
                "monitoring_pagerduty_routing_key_env",
                "the PagerDuty routing key (monitoring)",
            )
        if self.smtp_username:
            variables[self.smtp_password_env] = ("monitoring_smtp_password_env", "the SMTP password (monitoring)")
        return variables

    def secrets(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """{variable: value} of the secrets these settings read, from the deploy machine's environment; ValueError
        naming the variable (never the value) when one is unset, blank or holds whitespace."""
        env = os.environ if environ is None else environ
        values = {}
        for variable, (key, what) in self.secret_variables().items():
            value = env.get(variable, "")
            if not value.strip():
                raise ValueError(f"{key}: ${variable} is unset or blank on this machine; export {what} there")
            if value != value.strip() or any(c.isspace() for c in value):
                raise ValueError(f"{key}: ${variable} holds whitespace; {what} has none")
            values[variable] = value
        return values
