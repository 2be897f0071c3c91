"""The inference service on the host: the locked Python environment (vLLM, torch, ironserve-service,
Envoy), the sealed model, etcd, Envoy router, control loop, exporter, Prometheus with the SLO rules,
and blue/green engine units; the configured version is brought into service by the hot swap itself.

The service's own settings model validated /etc/ironserve/service.yaml before any host was touched
(roles/inference/settings.py). The engines run as the service user inside the service slice under the
seccomp filter of roles/security (its drop-in for `ai-service@.service`).
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ironserve_service import router
from ironserve_service.settings import COLOURS, ServiceSettings
from ironserve_service.slo import render_rules
from pyinfra.api.deploy import deploy
from pyinfra.operations import files, systemd

from ironserve import manifests
from ironserve.apt import installed
from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.kubectl import ADMIN_KUBECONFIG, objects_applied
from ironserve.layout import role_template
from ironserve.operations import daemon_reloaded, live_sysctl, restarted_when_stale
from ironserve.owned import owned_directory, owned_file, render_template, unmasked
from ironserve.run import HostRun
from ironserve.sysctl_boot import boot_sysctls_win
from ironserve.traffic import TrafficControl
from ironserve.validators import check_environment, systemd_quoted
from roles.inference.operations import (
    RESERVED_PORTS_KEY,
    api_keys_present,
    locked_environment,
    model_store_ready,
    model_version_dir,
    port_list,
    runtime_dirs,
    service_package,
    serving,
)
from roles.inference.render import PROMETHEUS_EXTENSIONS, lock_pins, prometheus_config, service_wheel, service_yaml
from roles.inference.render_kubernetes import deploy_objects, host_settings, kubernetes_layout, kubernetes_problems
from roles.inference.settings import API_KEYS_PATH, CONFIG_PATH, ENGINE_UNIT, RUN_DIR, check_deployable

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig

LOCK_PATH = "/opt/ironserve/requirements.lock"
WHEEL_DIR = "/opt/ironserve/wheels"
TMPFILES = "/etc/tmpfiles.d/ironserve.conf"
# After host_tuning's and container_runtime's sysctl.d files (90-, 91-), before a hardening baseline's 99-.
PORTS_SYSCTL_FILE = "/etc/sysctl.d/92-ironserve-inference.conf"
KUBERNETES_DIR = Path("/etc/ironserve/kubernetes")
KUBERNETES_OBJECTS = KUBERNETES_DIR / "ai-service.yaml"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_RULES = "/etc/prometheus/ironserve-rules.yml"
ROUTER_UNIT = "ironserve-router.service"
COMPONENTS = {  # unit -> (ironserve-service command, what it is, units it starts after)
    ROUTER_UNIT: ("router", "Envoy router in front of the blue/green engines", ()),
    "ironserve-control.service": (
        "control",
        "control loop: etcd's active version -> Envoy's route",
        ("etcd.service", ROUTER_UNIT),
    ),
    "ironserve-exporter.service": ("exporter", "five-dimension metrics exporter", ()),
}
SERVE_UNIT = "ironserve-serve.service"
UNIT_DIR = "/etc/systemd/system"
ENGINE_TEMPLATE = ENGINE_UNIT.format(colour="")
ENGINES = [ENGINE_UNIT.format(colour=colour) for colour in COLOURS]


def environment_assignments(env: Mapping[str, str]) -> list[str]:
    """Each variable as one quoted `Environment=` word ("NAME=value", backslash and quote escaped, % doubled),
    checked again: no control character can end the line and add a directive to the unit."""
    return [systemd_quoted(f"{name}={value}") for name, value in check_environment(env).items()]


def _unit(template: str, unit: str, name: str, frozen: bool, **context: Any) -> None:
    content = render_template(role_template("inference", template), **context)
    owned_file(name=name, path=f"{UNIT_DIR}/{unit}", content=content, clear_immutable=frozen)


def _install_service(config: StackConfig) -> None:
    inference = config.inference
    assert inference.requirements is not None and inference.pip_index_url is not None  # check_deployable
    venv = inference.venv
    installed(
        name="Python venv and headers, C++ compiler, libnuma, etcd, stress-ng"
        + (", Prometheus" if inference.prometheus else ""),
        # libnuma1: vLLM's compiled ops link it (NUMA-aware CPU binding), on GPU and CPU builds alike.
        # g++ and python3-dev: torch's Inductor compiles the kernels vLLM's torch.compile generates at run time
        # (C++ on CPU, Triton's launcher stubs on GPU) against Python.h; without them the first request that needs
        # a new kernel (logprobs: the sampler's batched_count_greater_than) kills the engine.
        # stress-ng: the memory pressure of the swap's load-and-chaos gate.
        packages=[
            "python3-venv", "python3-dev", "g++", "libnuma1", "etcd-server", "stress-ng",
            *(["prometheus"] if inference.prometheus else []),
        ],
        recommends=False,
    )  # fmt: skip
    frozen = config.clear_immutable
    owned_directory(name="ironserve's directory", path=str(Path(LOCK_PATH).parent), clear_immutable=frozen)
    owned_file(
        name="Hash-locked requirements",
        path=LOCK_PATH,
        content=inference.requirements.read_bytes(),
        clear_immutable=frozen,
    )
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
    owned_directory(name="Service wheel directory", path=WHEEL_DIR, clear_immutable=frozen)
    owned_file(name="ironserve-service wheel", path=remote_wheel, content=wheel.read_bytes(), clear_immutable=frozen)
    service_package(name="Install ironserve-service", venv=venv, wheel=remote_wheel, digest=digest)


def _install_model(config: StackConfig, settings: ServiceSettings, version: str) -> None:
    security = config.security
    source = config.inference.model_source
    assert source is not None  # check_deployable
    # The deletion guard, right before the sync: the destination is <models root>/<version>, both validated.
    dest = model_version_dir(str(settings.swap.models_root), version)
    root = posixpath.dirname(dest)
    owned_directory(
        name="Model versions", path=root, mode="750", group=security.group, clear_immutable=config.clear_immutable
    )
    files.sync(
        name=f"Model version {version}",
        src=str(source),
        dest=dest,
        user="root",
        group=security.group,
        mode="640",
        dir_mode="750",
        delete=True,
    )


def _reserved_ports(config: StackConfig) -> None:
    """The service's listening ports kept out of the kernel's ephemeral range (an outgoing connection bound to
    one before the service starts would make it fail to listen): in a sysctl.d file the role owns, winning at boot
    and in force now."""
    ports = port_list(listener.port for listener in config.inference.listeners() if listener.reserved)
    if not ports:
        return
    owned_file(
        name="The service's ports reserved (sysctl.d)",
        path=PORTS_SYSCTL_FILE,
        content=f"# Managed by ironserve (roles/inference): the service's ports.\n{RESERVED_PORTS_KEY} = {ports}\n",
        clear_immutable=config.clear_immutable,
    )
    boot_sysctls_win(
        name="The reserved ports win at boot", own_file=PORTS_SYSCTL_FILE, sysctls={RESERVED_PORTS_KEY: ports}
    )
    live_sysctl(name="The service's ports reserved now", key=RESERVED_PORTS_KEY, value=ports)


def _configure(config: StackConfig, settings: ServiceSettings) -> None:
    security = config.security
    colours_dirs = [str(RUN_DIR / colour) for colour in COLOURS]
    frozen = config.clear_immutable
    owned_directory(name="/etc/ironserve", path=str(CONFIG_PATH.parent), clear_immutable=frozen)
    owned_file(
        name="Service configuration", path=str(CONFIG_PATH), content=service_yaml(settings), clear_immutable=frozen
    )
    api_keys_present(
        name="API keys (a first one generated on the host when there is none)",
        venv=config.inference.venv,
        config=str(CONFIG_PATH),
        path=str(API_KEYS_PATH),
        group=security.group,
    )
    owned_directory(
        name="Envoy's dynamic configuration (written by the control loop)",
        path=str(settings.swap.router_dir),
        mode="750",
        user=security.user,
        group=security.group,
        clear_immutable=frozen,
    )
    tmpfiles = render_template(
        role_template("inference", "tmpfiles.conf.j2"),
        run_dir=str(RUN_DIR),
        colours=COLOURS,
        account=security.user,
        account_group=security.group,
    )
    owned_file(name="Runtime directories (tmpfiles.d)", path=TMPFILES, content=tmpfiles, clear_immutable=frozen)
    runtime_dirs(name="Create the runtime directories", config_file=TMPFILES, paths=[str(RUN_DIR), *colours_dirs])


def _units(config: StackConfig, settings: ServiceSettings, version: str) -> None:
    inference, security = config.inference, config.security
    common = {"venv": inference.venv, "config": str(CONFIG_PATH), "model_name": inference.model_name}
    frozen = config.clear_immutable
    _unit(
        "engine.service.j2",
        ENGINE_TEMPLATE,
        "Engine unit template (blue/green)",
        frozen,
        run_dir=str(RUN_DIR),
        state_dir=security.state_dir,
        environment=environment_assignments(inference.engine_environment),
        stop_timeout_s=int(settings.readiness.drain_timeout_s) + 30,
        **common,
    )
    _unit(
        "serve.service.j2",
        SERVE_UNIT,
        "Serve the configured version at boot",
        frozen,
        version=version,
        start_timeout_s=int(settings.swap.ready_timeout_s + settings.swap.drain_max_s) + 60,
        **common,
    )
    for unit, (command, description, after) in COMPONENTS.items():
        _unit(
            "component.service.j2",
            unit,
            f"Unit {unit}",
            frozen,
            command=command,
            description=description,
            after=after,
            account=security.user,
            account_group=security.group,
            **common,
        )


def _prometheus(settings: ServiceSettings, host: str, frozen: bool) -> None:
    for directory in PROMETHEUS_EXTENSIONS.values():
        owned_directory(name=f"Prometheus reads {directory}/", path=directory, clear_immutable=frozen)
    owned_file(
        name="SLO recording and alerting rules",
        path=PROMETHEUS_RULES,
        content=render_rules(settings.slo, settings.quality, settings.gpu_health),
        clear_immutable=frozen,
    )
    owned_file(
        name="Prometheus scrape jobs",
        path=PROMETHEUS_CONFIG,
        content=prometheus_config(settings, PROMETHEUS_RULES, host),
        clear_immutable=frozen,
    )
    unmasked(name="Prometheus not masked", unit="prometheus.service")
    systemd.service(name="Prometheus", service="prometheus.service", running=True, enabled=True)
    restarted_when_stale(
        name="Prometheus runs the current rules and scrape jobs (promtool-checked)",
        unit="prometheus.service",
        inputs=[PROMETHEUS_CONFIG, PROMETHEUS_RULES],
        check=f"promtool check config {PROMETHEUS_CONFIG}",
    )


def _kubernetes_host(config: StackConfig, settings: ServiceSettings, version: str) -> None:
    """A cluster host in kubernetes mode: the model store the pods mount (read as security_uid/security_gid,
    which roles/security gives the account), and the service's static objects (strictly validated at inventory
    load, with both colours' Deployments), applied server-side from each control plane when the cluster differs;
    the colours are applied by the swap. No engine unit, router or control loop runs on the host."""
    _install_model(config, settings, version)
    frozen = config.clear_immutable
    owned_directory(name="/etc/ironserve", path=str(CONFIG_PATH.parent), clear_immutable=frozen)
    owned_directory(name="The service's Kubernetes objects", path=str(KUBERNETES_DIR), clear_immutable=frozen)
    objects = manifests.dump_all(deploy_objects(config))
    owned_file(
        name="Kubernetes objects of the service (strictly validated)",
        path=str(KUBERNETES_OBJECTS),
        content=objects,
        clear_immutable=frozen,
    )
    if config.kubernetes.role == "control-plane":  # every control plane has the admin kubeconfig; one apply wins
        objects_applied(
            name="The service's objects applied (server-side, field manager ironserve)",
            path=str(KUBERNETES_OBJECTS),
            objects=objects,
            kubeconfig=ADMIN_KUBECONFIG,
        )


# What `describe` prints from `ironserve-service status`: the version served, its colour and the traffic state (or
# the line itself when it is no status, such as before the first deploy).
DESCRIBE_STATUS = """import json, sys
line = (sys.stdin.read().splitlines() or [""])[-1]
try:
    s = json.loads(line)
    print(f"{s['model']} {s['active']} on {s['colour']}, traffic {s['traffic']}")
except (ValueError, KeyError, TypeError):
    print(line)
"""


def inference_traffic(
    host: str, fleet: Mapping[str, StackConfig], drain_timeout_s: float | None
) -> TrafficControl | None:
    """`ironserve rollout`'s commands for this host: the service's own drain (Envoy's /health says draining for
    swap.host_drain_notice_s, then new work is refused and in-flight requests finish), hold (/health still draining,
    the API open for the gate) and return. In kubernetes mode the host's traffic is its pods': None (roles/kubernetes
    cordons and drains the node)."""
    config = fleet[host]
    if config.inference.mode != "systemd":
        return None
    cli = f"{config.inference.venv}/bin/ironserve-service"
    python = f"{config.inference.venv}/bin/python"

    def command(*args: str) -> str:
        run = shlex.join([cli, *args, "--config", str(CONFIG_PATH)])
        # Before the first deploy there is no service here: nothing to drain, hold or return.
        installed = f"[ -x {shlex.quote(cli)} ] && [ -f {shlex.quote(str(CONFIG_PATH))} ]"
        return f"if {installed}; then {run}; else echo 'no inference service installed yet'; fi"

    timeout = ["--timeout", f"{drain_timeout_s:g}"] if drain_timeout_s is not None else []
    describe = f"{command('status')} | {shlex.quote(python)} -c {shlex.quote(DESCRIBE_STATUS)}"
    return TrafficControl(
        role="inference",
        drain=command("drain", *timeout),
        hold=command("traffic", "draining"),
        restore=command("traffic", "serving"),
        describe=describe,
    )


def inference_deployable(config: StackConfig) -> None:
    """The index, the lock and the sealed model have no default; the engines need the security drop-in; in
    kubernetes mode the cluster role and objects that pass strict validation at its pinned version."""
    security = config.security
    kubernetes = config.inference.mode == "kubernetes"
    if kubernetes and "kubernetes" not in config.roles:
        raise ValueError(
            "inference_mode kubernetes needs the kubernetes role on this host (ironserve_roles): the engines are "
            "Deployments on its cluster"
        )
    if kubernetes and (security.uid is None or security.gid is None):
        raise ValueError(
            "inference_mode kubernetes needs security_uid and security_gid: the pods run as numbers, and read the "
            "model store through the group, so the account must have the same numbers on every node"
        )
    check_deployable(
        config.inference,
        security.model_dir,
        security.group,
        security.slice,
        security.service_units,
        (security.state_dir, security.log_dir),
        kubernetes_layout(config) if kubernetes else None,
    )
    hardware = config.profile.hardware
    parallel = host_settings(config).engine.tensor_parallel_size
    if hardware is not None and parallel > hardware.serving_gpus:
        raise ValueError(
            f"inference_service: engine.tensor_parallel_size {parallel} is more than the {hardware.serving_gpus} "
            f"serving GPUs of profile {config.profile.name} (vLLM would wait for GPUs that never come); accepted: "
            f"1 to {hardware.serving_gpus}"
        )
    problems = kubernetes_problems(config) if kubernetes else []
    if problems:
        raise ValueError("its Kubernetes objects are invalid: " + "; ".join(problems))


@deploy("Inference service")
def inference(config: StackConfig, run: HostRun) -> None:
    settings = host_settings(config)
    version = config.inference.version()

    model_store_ready(
        name="Model store: on its mount, on NVMe, room for two versions",
        models_root=str(settings.swap.models_root),
        version=version,
        version_bytes=config.inference.model_bytes(),
        nvme=config.inference.model_store_nvme,
        mount=config.inference.model_store_mount,
        headroom=config.inference.model_store_headroom,
    )
    if config.inference.mode == "kubernetes":
        _kubernetes_host(config, settings, version)
        return
    _reserved_ports(config)
    _install_service(config)
    _install_model(config, settings, version)
    _configure(config, settings)
    _units(config, settings, version)
    # The engines' drop-ins are roles/security's; these units are the role's own and take none but their file.
    dropins = foreign_dropins_moved_aside(
        name="No foreign drop-in on the service's units",
        units=["etcd.service", *COMPONENTS, SERVE_UNIT],
        own=[],
        why="overrides a unit of the inference service (set it through inference_*)",
    )
    systemd.daemon_reload(name="systemd drops the foreign drop-ins", _if=dropins.did_change)
    daemon_reloaded(name="systemd runs the current unit files", units=[*COMPONENTS, SERVE_UNIT, *ENGINES])

    for unit in ("etcd.service", *COMPONENTS, SERVE_UNIT):
        unmasked(name=f"{unit} not masked", unit=unit)
    systemd.service(name="etcd", service="etcd.service", running=True, enabled=True)
    systemd.service(
        name="etcd without the foreign drop-in", service="etcd.service", restarted=True, _if=dropins.did_change
    )
    for unit in COMPONENTS:
        systemd.service(name=unit, service=unit, running=True, enabled=True)
        systemd.service(
            name=f"{unit} without the foreign drop-in", service=unit, restarted=True, _if=dropins.did_change
        )
        # A restart of Envoy cuts the requests in flight: the router follows the files it starts from, not the
        # whole service.yaml.
        router_files = router.startup_files(settings.swap, settings.quality) if unit == ROUTER_UNIT else None
        restarted_when_stale(
            name=f"{unit} runs its current unit and configuration",
            unit=unit,
            inputs=[f"{UNIT_DIR}/{unit}", *([] if router_files else [str(CONFIG_PATH)])],
            written={str(path): text for path, text in router_files.items()} if router_files else None,
        )
    if config.inference.prometheus:
        _prometheus(settings, config.host, config.clear_immutable)

    serving(
        name=f"Serve {config.inference.model_name} {version} (blue/green swap when it changes)",
        venv=config.inference.venv,
        config=str(CONFIG_PATH),
        model=config.inference.model_name,
        version=version,
    )
    systemd.service(name="Serve again at boot", service=SERVE_UNIT, running=None, enabled=True)
