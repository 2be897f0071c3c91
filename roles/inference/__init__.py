"""The inference service on the host: the locked Python environment (vLLM, torch, ironserve-service,
Envoy), the sealed model, etcd, Envoy router, control loop, exporter, Prometheus with the SLO rules,
and blue/green engine units; the configured version is brought into service by the hot swap itself.

The service's own settings model validated /etc/ironserve/service.yaml before any host was touched
(ironserve/config_inference.py). The engines run as the service user inside the service slice under the
seccomp filter of roles/security (its drop-in for `ai-service@.service`).
"""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ironserve_service.settings import COLOURS, ServiceSettings
from ironserve_service.slo import render_rules
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.api.operation import operation
from pyinfra.context import host, state
from pyinfra.facts.files import Directory, File
from pyinfra.operations import apt, files, systemd

from ironserve.config_inference import CONFIG_PATH, ENGINE_UNIT, RUN_DIR
from ironserve.inference import (
    ServingStatus,
    StaleUnits,
    UnitsNeedingReload,
    VenvPackages,
    environment_drift,
    lock_pins,
    prometheus_config,
    service_wheel,
    service_yaml,
)
from roles.inference.defaults import DEFAULTS

if TYPE_CHECKING:  # the config model imports this package's defaults
    from ironserve.config import StackConfig

TEMPLATES = Path(__file__).resolve().parent / "templates"
LOCK_PATH = "/opt/ironserve/requirements.lock"
WHEEL_DIR = "/opt/ironserve/wheels"
TMPFILES = "/etc/tmpfiles.d/ironserve.conf"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_RULES = "/etc/prometheus/ironserve-rules.yml"
COMPONENTS = {  # unit -> (ironserve-service command, what it is, units it starts after)
    "ironserve-router.service": ("router", "Envoy router in front of the blue/green engines", ()),
    "ironserve-control.service": (
        "control",
        "control loop: etcd's active version -> Envoy's route",
        ("etcd.service", "ironserve-router.service"),
    ),
    "ironserve-exporter.service": ("exporter", "five-dimension metrics exporter", ()),
}
SERVE_UNIT = "ironserve-serve.service"
UNIT_DIR = "/etc/systemd/system"
ENGINE_TEMPLATE = ENGINE_UNIT.format(colour="")
ENGINES = [ENGINE_UNIT.format(colour=colour) for colour in COLOURS]
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


@operation()
def locked_environment(venv: str, python: str, lock: str, pins: dict[str, str], index_url: str):  # type: ignore[no-untyped-def]
    """The venv holds exactly the lock: created from the distribution's Python, installed with
    --require-hashes from the configured index, packages beside the lock removed."""
    installed = host.get_fact(VenvPackages, venv=venv)
    if installed is None:
        yield StringCommand(python, "-m", "venv", QuoteString(venv))
        installed = {}
    wrong, extra = environment_drift(pins, installed)
    if not wrong and not extra:
        host.noop(f"{venv}: {len(pins)} packages at their locked versions")
        return
    pip = f"{venv}/bin/pip"
    if extra:
        yield StringCommand(pip, "uninstall", "--yes", *map(QuoteString, extra))
    if wrong:
        # The index URL may carry a site's credentials: hidden in pyinfra's output and logs. A plain-HTTP
        # index (a mirror on the site's own network) is trusted explicitly: every wheel is hash-checked.
        trust = (
            ("--trusted-host", QuoteString(urlsplit(index_url).netloc.rpartition("@")[2]))
            if index_url.startswith("http:")
            else ()
        )
        yield StringCommand(
            pip, "install", "--quiet", "--disable-pip-version-check", "--require-hashes", "--no-deps",
            "--index-url", QuoteString(HiddenValue(index_url)), *trust, "-r", QuoteString(lock),  # type: ignore[no-untyped-call]
        )  # fmt: skip


@operation()
def service_package(venv: str, wheel: str, digest: str):  # type: ignore[no-untyped-def]
    """ironserve-service from the wheel built from this checkout (its dependencies are in the lock)."""
    marker = f"{venv}/.ironserve-service-{digest}"
    installed = host.get_fact(VenvPackages, venv=venv) or {}
    if "ironserve-service" in installed and host.get_fact(File, path=marker):
        host.noop(f"ironserve-service {installed['ironserve-service']} from sources {digest}")
        return
    yield StringCommand(
        f"{venv}/bin/pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--force-reinstall",
        QuoteString(wheel),
    )  # fmt: skip
    yield f"rm -f {venv}/.ironserve-service-* && touch {marker}"


@operation()
def runtime_dirs(config_file: str, paths: list[str]):  # type: ignore[no-untyped-def]
    """Create the tmpfiles.d directories now when any is missing (systemd creates them at every boot)."""
    missing = [p for p in paths if not host.get_fact(Directory, path=p)]
    if not missing:
        host.noop("runtime directories exist: " + ", ".join(paths))
        return
    yield StringCommand("systemd-tmpfiles", "--create", QuoteString(config_file))


@operation()
def restarted_when_stale(unit: str, inputs: list[str], check: str | None = None):  # type: ignore[no-untyped-def]
    """Restart a running unit that started before one of its inputs changed (unit file, configuration).
    Read from the host's state, not a handler: a run that failed between the write and the restart is
    completed by the next. `check` (e.g. promtool) runs first and stops the restart when it fails."""
    if unit not in host.get_fact(StaleUnits, inputs={unit: inputs}):
        host.noop(f"{unit} started after its inputs last changed")
        return
    if check:
        yield check
    yield StringCommand("systemctl", "restart", unit)


@operation()
def daemon_reloaded(units: list[str]):  # type: ignore[no-untyped-def]
    """systemctl daemon-reload when systemd holds an older copy of any of these unit files."""
    if not host.get_fact(UnitsNeedingReload, units=units):
        host.noop("systemd has loaded the current unit files")
        return
    yield "systemctl daemon-reload"


@operation()
def serving(venv: str, config: str, model: str, version: str):  # type: ignore[no-untyped-def]
    """The configured version serves, ready: else the blue/green swap brings it in (verify, start the idle
    colour, readiness, compare-and-swap in etcd, route switch, drain, stop the old colour)."""
    if not state.is_executing:
        host.noop("checked after the service is installed, while the deploy runs")
        return
    status = host.get_fact(ServingStatus, venv=venv, config=config)
    if status and status.get("active") == version and status.get("ready"):
        host.noop(f"{model} {version} serving on {status['colour']}")
        return
    yield StringCommand(f"{venv}/bin/ironserve-service", "swap", model, version, "--config", config)


def _unit(template: str, unit: str, name: str, **context: Any) -> None:
    files.template(name=name, src=str(TEMPLATES / template), dest=f"{UNIT_DIR}/{unit}", mode="644", **context)


def _install_service(config: StackConfig) -> None:
    inference = config.inference
    assert inference.requirements is not None and inference.pip_index_url is not None  # check_deployable
    venv = inference.venv
    apt.packages(
        name="Python venv, libnuma, etcd" + (", Prometheus" if inference.prometheus else ""),
        # libnuma1: vLLM's compiled ops link it (NUMA-aware CPU binding), on GPU and CPU builds alike.
        packages=["python3-venv", "libnuma1", "etcd-server", *(["prometheus"] if inference.prometheus else [])],
        no_recommends=True,
        update=True,
        cache_time=3600,
        _env=APT_ENV,
    )
    files.directory(name="ironserve's directory", path=str(Path(LOCK_PATH).parent), mode="755")
    files.put(name="Hash-locked requirements", src=str(inference.requirements), dest=LOCK_PATH, mode="644")
    locked_environment(
        name="Python environment exactly as locked",
        venv=venv,
        python=inference.python,
        lock=LOCK_PATH,
        pins=lock_pins(inference.requirements.read_text()),
        index_url=inference.pip_index_url,
    )
    wheel, digest = service_wheel()
    remote_wheel = f"{WHEEL_DIR}/{wheel.name}"
    files.directory(name="Service wheel directory", path=WHEEL_DIR, mode="755")
    files.put(name="ironserve-service wheel", src=str(wheel), dest=remote_wheel, mode="644")
    service_package(name="Install ironserve-service", venv=venv, wheel=remote_wheel, digest=digest)


def _install_model(config: StackConfig, settings: ServiceSettings, version: str) -> None:
    security = config.security
    source = config.inference.model_source
    assert source is not None  # check_deployable
    root = settings.swap.models_root
    files.directory(name="Model versions", path=str(root), user="root", group=security.group, mode="750")
    files.sync(
        name=f"Model version {version}",
        src=str(source),
        dest=str(root / version),
        user="root",
        group=security.group,
        mode="640",
        dir_mode="750",
        delete=True,
    )


def _configure(config: StackConfig, settings: ServiceSettings) -> None:
    security = config.security
    colours_dirs = [str(RUN_DIR / colour) for colour in COLOURS]
    files.directory(name="/etc/ironserve", path=str(CONFIG_PATH.parent), mode="755")
    files.put(name="Service configuration", src=StringIO(service_yaml(settings)), dest=str(CONFIG_PATH), mode="644")
    files.directory(
        name="Envoy's dynamic configuration (written by the control loop)",
        path=str(settings.swap.router_dir),
        user=security.user,
        group=security.group,
        mode="750",
    )
    files.template(
        name="Runtime directories (tmpfiles.d)",
        src=str(TEMPLATES / "tmpfiles.conf.j2"),
        dest=TMPFILES,
        mode="644",
        run_dir=str(RUN_DIR),
        colours=COLOURS,
        account=security.user,
        account_group=security.group,
    )
    runtime_dirs(name="Create the runtime directories", config_file=TMPFILES, paths=[str(RUN_DIR), *colours_dirs])


def _units(config: StackConfig, settings: ServiceSettings, version: str) -> None:
    inference, security = config.inference, config.security
    common = {"venv": inference.venv, "config": str(CONFIG_PATH), "model_name": inference.model_name}
    _unit(
        "engine.service.j2",
        ENGINE_TEMPLATE,
        "Engine unit template (blue/green)",
        run_dir=str(RUN_DIR),
        state_dir=security.state_dir,
        environment=inference.engine_environment,
        stop_timeout_s=int(settings.readiness.drain_timeout_s) + 30,
        **common,
    )
    _unit(
        "serve.service.j2",
        SERVE_UNIT,
        "Serve the configured version at boot",
        version=version,
        start_timeout_s=int(settings.swap.ready_timeout_s + settings.swap.drain_max_s) + 60,
        **common,
    )
    for unit, (command, description, after) in COMPONENTS.items():
        _unit(
            "component.service.j2",
            unit,
            f"Unit {unit}",
            command=command,
            description=description,
            after=after,
            account=security.user,
            account_group=security.group,
            **common,
        )


def _prometheus(settings: ServiceSettings) -> None:
    files.put(
        name="SLO recording and alerting rules",
        src=StringIO(render_rules(settings.slo, settings.quality)),
        dest=PROMETHEUS_RULES,
        mode="644",
    )
    files.put(
        name="Prometheus scrape jobs",
        src=StringIO(prometheus_config(settings, PROMETHEUS_RULES)),
        dest=PROMETHEUS_CONFIG,
        mode="644",
    )
    systemd.service(name="Prometheus", service="prometheus.service", running=True, enabled=True)
    restarted_when_stale(
        name="Prometheus runs the current rules and scrape jobs (promtool-checked)",
        unit="prometheus.service",
        inputs=[PROMETHEUS_CONFIG, PROMETHEUS_RULES],
        check=f"promtool check config {PROMETHEUS_CONFIG}",
    )


@deploy("Inference service", data_defaults=DEFAULTS)
def inference(config: StackConfig) -> None:
    settings = config.inference.service_settings(config.security.model_dir)
    version = config.inference.version()

    _install_service(config)
    _install_model(config, settings, version)
    _configure(config, settings)
    _units(config, settings, version)
    daemon_reloaded(name="systemd runs the current unit files", units=[*COMPONENTS, SERVE_UNIT, *ENGINES])

    systemd.service(name="etcd", service="etcd.service", running=True, enabled=True)
    for unit in COMPONENTS:
        systemd.service(name=unit, service=unit, running=True, enabled=True)
        restarted_when_stale(
            name=f"{unit} runs its current unit and configuration",
            unit=unit,
            inputs=[f"{UNIT_DIR}/{unit}", str(CONFIG_PATH)],
        )
    if config.inference.prometheus:
        _prometheus(settings)

    serving(
        name=f"Serve {config.inference.model_name} {version} (blue/green swap when it changes)",
        venv=config.inference.venv,
        config=str(CONFIG_PATH),
        model=config.inference.model_name,
        version=version,
    )
    systemd.service(name="Serve again at boot", service=SERVE_UNIT, running=None, enabled=True)
