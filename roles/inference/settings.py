"""Settings of the inference role: its public API, every inventory key it reads with its default.

The host's /etc/ironserve/service.yaml is validated here, on the machine running the deploy, by the
service's own settings model (ironserve_service.settings), so a bad value fails before any host is touched.
The role owns the keys that tie the service to the host layout (paths, units, the served version); the
inventory may override every other key through `inference_service`.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from ironserve_service.artifacts import MANIFEST_NAME, RELEASE_NAME, ArtifactError, parse_manifest
from ironserve_service.settings import ExporterSettings, QualitySettings, ServiceSettings, SwapSettings
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ironserve.config import LOCAL_PATH, Listener, RoleSettings, prefixed, shown
from ironserve.secrets import credential_paths, credentials_refused
from ironserve.validators import (
    PlainHttpUrl,
    check_environment,
    check_model_version,
    check_path,
    control_characters,
    fullmatch,
    is_within,
    path_rule,
    plain_http_refused,
    release_version,
)

ENGINE_UNIT = "ai-service@{colour}.service"
CONFIG_PATH = Path("/etc/ironserve/service.yaml")
# The API keys Envoy checks: generated on the host, never in the inventory (`ironserve-service api-key`).
API_KEYS_PATH = Path("/etc/ironserve/api-keys")
RUN_DIR = Path("/run/ironserve")
ROUTER_DIR = Path("/etc/ironserve/envoy")
# The distribution's own interpreter (Debian 12: python3.11; Ubuntu 22.04: python3.10), never conda or pyenv.
PYTHON = re.compile(r"/usr/bin/python3(\.[0-9]{1,2})?")
# Model names: etcd keys, a directory under the models root, a unit file's Description= (no % specifiers).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Where the venv and the model versions may live (created root-owned; the sync deletes inside a version).
VENV_ROOTS = ("/opt", "/srv", "/var/lib")
MODELS_ROOTS = ("/srv", "/opt", "/var/lib", "/data", "/mnt")


def _python(value: str) -> str:
    if not fullmatch(PYTHON, value):
        raise ValueError("is not the distribution's Python; accepted: /usr/bin/python3 or /usr/bin/python3.<minor>")
    return value


def _model_name(value: str) -> str:
    if not fullmatch(MODEL_NAME, value):
        raise ValueError("is not a model name; accepted: a letter or digit, then A-Z a-z 0-9 _ . - (at most 64)")
    return value


def _index_url(value: str) -> str:
    accepted = "an http(s)://host[:port]/path/ or file:///path URL of printable ASCII"
    if control_characters(value) or not value.isascii() or " " in value:
        raise ValueError(f"contains spaces, control or non-ASCII characters; accepted: {accepted}")
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError outside 0-65535
    except ValueError as exc:
        problem = "its port is outside 1-65535" if "Port" in str(exc) else "is not a URL"
        raise ValueError(f"{problem}; accepted: {accepted}") from None
    if parts.scheme not in {"http", "https", "file"}:
        raise ValueError(f"scheme {parts.scheme!r} is not http, https or file; accepted: {accepted}")
    if parts.scheme != "file" and not parts.hostname:
        raise ValueError(f"names no host; accepted: {accepted}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1-65535; accepted: {accepted}")
    return value


# Where credentials go instead of a URL (roles/inference keeps none of them in inventory values).
PIP_CREDENTIALS = (
    "give the index URL without them: pip reads the login from /root/.netrc on the host (0600, `machine HOST login "
    "USER password PASS`) or from keyring; ironserve installs neither"
)
SERVICE_CREDENTIALS = (
    "never in inventory values: service.yaml is world-readable (0644) and the service has no credentials setting "
    "(etcd is reached without a login); keep etcd and metrics endpoints on trusted addresses (127.0.0.1, the "
    "management network)"
)


# Keys the role sets from the host layout; an override in inference_service would break the units.
ROLE_OWNED = {
    ("engine", "model_dir"),
    ("engine", "engine_python"),
    ("swap", "model_name"),
    ("swap", "models_root"),
    ("swap", "run_dir"),
    ("swap", "router_dir"),
    ("swap", "colour_unit"),
    ("swap", "envoy_binary"),
    ("swap", "listen_host"),
    ("swap", "api_keys_file"),
    ("release", "service_group"),
    # Derived from the hardware profile and roles/security in kubernetes mode (see kubernetes_layout).
    ("kubernetes", "gpus"),
    ("kubernetes", "seccomp_profile"),
    ("kubernetes", "capabilities"),
    ("kubernetes", "run_as_user"),
    ("kubernetes", "run_as_group"),
}
# Debian 12's etcd-server and prometheus listen on their upstream defaults (etcd.conf.yml.sample's
# listen-client-urls :2379 and listen-peer-urls :2380; prometheus --web.listen-address :9090); the role keeps them.
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
PROMETHEUS_PORT = 9090


def _fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """A settings model's keys, each with the model of its nested section (None for a plain value)."""
    nested = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested[name] = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return nested


def _unknown_keys(values: object, model: type[BaseModel] = ServiceSettings, path: str = "") -> list[str]:
    """Every unknown section or key of inference_service (nested sections too), each naming the accepted ones."""
    if not isinstance(values, dict):
        return []  # a wrong type is the service model's to report
    fields = _fields(model)
    problems = []
    for key, value in values.items():
        if key not in fields:
            what = f"unknown key {key!r} in section {path}" if path else f"unknown section {key!r}"
            problems.append(f"{what}; accepted: {', '.join(sorted(fields))}")
        elif (nested := fields[key]) is not None:
            problems += _unknown_keys(value, nested, f"{path}.{key}" if path else key)
    return problems


def _value_problems(service: object) -> list[str]:
    """Every bad value of inference_service's sections, by the service's own models (the layout the role adds is
    checked with the whole file in check_deployable)."""
    if not isinstance(service, dict):
        return []
    problems = []
    for section, values in service.items():
        model = _fields(ServiceSettings).get(section)
        if model is None or not isinstance(values, dict):
            continue
        # engine.model_dir is the role's (the models root): a stand-in lets the section's own values be checked.
        given = {"model_dir": "/", **values} if section == "engine" else values
        try:
            model.model_validate(given)
        except ValidationError as exc:
            for error in exc.errors():
                if error["type"] == "extra_forbidden":
                    continue  # _unknown_keys names it with the accepted keys
                where = ".".join(str(part) for part in (section, *error["loc"]))
                message = str(error["msg"]).removeprefix("Value error, ")
                problems.append(f"{where}: {message} (got {shown(error['input'], (section, *error['loc']))})")
    return problems


# What kubernetes mode needs in inference_service.kubernetes: nothing on the host can supply it.
KUBERNETES_REQUIRED = ("image",)


LISTEN_ACCEPTED = (
    "this host's address on the serving network, e.g. 10.0.1.11 (0.0.0.0 or :: only to listen on every interface)"
)


def _listen_address(value: str) -> str:
    try:
        address = ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        raise ValueError(f"not an IP address; accepted: {LISTEN_ACCEPTED}") from None
    # A scope (fe80::1%eth0) or a link-local address reaches one link only, and Envoy's listener takes no scope.
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise ValueError(f"an IPv6 address with a scope (%{address.scope_id}); accepted: {LISTEN_ACCEPTED}")
    if address.is_link_local:
        raise ValueError(f"a link-local address: clients beyond this link cannot reach it; accepted: {LISTEN_ACCEPTED}")
    return str(address)


class InferenceSettings(RoleSettings):
    """Settings of roles/inference."""

    model_config = ConfigDict(alias_generator=prefixed("inference"))

    mode: Literal["systemd", "kubernetes"] = Field(
        "systemd",
        description="systemd: the blue/green engines are units on this host behind its Envoy router; kubernetes: "
        "they are Deployments in namespace ai (roles/kubernetes on this host, security_uid and security_gid, the "
        "image in inference_service.kubernetes), rendered from the same service settings and strictly validated at "
        "inventory load; the host keeps the model store, and no engine unit is installed.",
    )

    allow_plain_http: tuple[PlainHttpUrl, ...] = Field(
        (),
        description="Opt-in: an http:// inference_pip_index_url, exactly as given there (pip checks every file "
        "against the lock's hashes, but anyone on the path sees what the hosts install).",
    )
    pip_index_url: Annotated[str, AfterValidator(_index_url)] | None = Field(
        None,
        description="PEP 503 index of the site's PyPI/PyTorch mirror (py-pip-official-index; the lab: its "
        "wheelhouse), masked in pyinfra's output. Required.",
    )
    requirements: Path | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        description="Hash-locked requirements on the deploy machine (pip --require-hashes; lab: "
        "lab/src/ironserve_lab/files/requirements-cpu.lock): vLLM, torch and the service's dependencies "
        "(py-deps, py-torch-sha256). Required.",
    )
    listen_address: Annotated[str, AfterValidator(_listen_address)] | None = Field(
        None,
        description="The address Envoy's listener binds (port `swap.listen_port`): this host's address on the "
        "serving network, so that the API is never on every interface by accident (0.0.0.0 only when written "
        "so). Clients send `Authorization: Bearer <key>`; keys are made on the host (`ironserve-service api-key "
        "add CLIENT`, /etc/ironserve/api-keys). Required.",
    )
    python: Annotated[str, AfterValidator(_python)] = Field(
        "/usr/bin/python3",
        description="The interpreter the venv is created from: the distribution's own Python (Debian 12: "
        "3.11; Ubuntu 22.04: 3.10), never conda or pyenv.",
    )
    venv: Annotated[str, path_rule(VENV_ROOTS, example="/opt/ironserve/venv")] = Field(
        "/opt/ironserve/venv",
        description="Where the environment lives on the host (vLLM, the ironserve-service package, Envoy's binary): "
        "a directory of its own inside /opt, /srv or /var/lib.",
    )
    model_name: Annotated[str, AfterValidator(_model_name)] = Field(
        "qwen2-7b",
        description="The model's name in etcd (/models/<name>/active) and in the OpenAI API (served-model-name).",
    )
    model_source: Path | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        description="A sealed model version directory on the deploy machine (`ironserve-service seal DIR`: "
        "MANIFEST.sha256 + release.json, whose version is checked here), uploaded to <models root>/<version>. "
        "Required.",
    )
    model_version: Annotated[str, AfterValidator(check_model_version)] | None = Field(
        None,
        description="The version to serve, YYYYMMDD-HHMMSS (model-version-naming): its directory name on the host "
        "and etcd's active value; the source's release.json must record the same. None: that version.",
    )
    models_root: Annotated[str, path_rule(MODELS_ROOTS, example="/srv/ai/models/qwen2-7b")] | None = Field(
        None,
        description="Model versions on the host (root:<group> 0750; each version synced with deletion inside it), "
        "inside /srv, /opt, /var/lib, /data or /mnt; None: <security_model_dir>/<inference_model_name>.",
    )
    model_store_nvme: bool = Field(
        True,
        description="The models root must sit on local NVMe (io-nvme-model-store): every disk under its filesystem "
        "is non-rotational with NVMe transport; checked before anything is installed. False: any local block "
        "device.",
    )
    model_store_mount: Annotated[str, path_rule(MODELS_ROOTS, inclusive=True, example="/data")] | None = Field(
        None,
        description="The mount point the models root must be on (e.g. /data on the NVMe drive), so that an "
        "unmounted drive never fills the system disk instead; None: whatever filesystem holds it.",
    )
    model_store_headroom: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Share of the model store's filesystem that stays free after this version and one more of "
        "the same size (the next swap keeps both on disk): below that, the deploy stops before the upload.",
    )
    engine_environment: dict[str, str] = Field(
        default_factory=dict,
        description="`Environment=` of the engine units (lab: VLLM_CPU_KVCACHE_SPACE=1): names [A-Z_][A-Z0-9_]* "
        "(not HOME, PATH, PYTHON*PATH/HOME/STARTUP, LD_*), values of printable characters, written quoted.",
    )
    service: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Overrides of /etc/ironserve/service.yaml by section (see service/service.example.yaml), "
        "validated by the service's own model; the layout keys (model_dir, engine_python, "
        "models_root, run_dir, router_dir, colour_unit, envoy_binary, model_name) belong to the "
        "role and are refused.",
    )
    prometheus: bool = Field(
        True,
        description="Install Prometheus with the SLO rules and scrape jobs for the exporter, both colours and Envoy.",
    )

    @field_validator("requirements")
    @classmethod
    def _lock_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"{path} is not a file on this machine")
        return path

    @field_validator("model_source")
    @classmethod
    def _sealed(cls, path: Path | None) -> Path | None:
        if path is None:
            return None
        missing = [name for name in (MANIFEST_NAME, RELEASE_NAME) if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{path} is not a sealed model version (missing {', '.join(missing)}; run seal)")
        # What the upload will carry is read here, on the admin's machine, before any host is touched.
        release_version(path, RELEASE_NAME)
        try:
            parse_manifest((path / MANIFEST_NAME).read_text(encoding="utf-8"))
        except (ArtifactError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path / MANIFEST_NAME}: {exc}; re-seal the model") from None
        return path

    @field_validator("model_version")
    @classmethod
    def _same_as_release(cls, version: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("model_source")
        if version is not None and source is not None:
            recorded = release_version(source, RELEASE_NAME)
            if recorded != version:
                raise ValueError(
                    f"{version} differs from {source / RELEASE_NAME} ({recorded}); accepted: the version the "
                    "source records, or no inference_model_version"
                )
        return version

    @field_validator("engine_environment")
    @classmethod
    def _environment(cls, env: dict[str, str]) -> dict[str, str]:
        return check_environment(env)

    @model_validator(mode="after")
    def _no_role_owned_overrides(self) -> InferenceSettings:
        owned = sorted(f"{s}.{k}" for s, keys in self.service.items() for k in keys if (s, k) in ROLE_OWNED)
        if owned:
            raise ValueError(f"inference_service sets {', '.join(owned)}, which the role derives from the host layout")
        return self

    @field_validator("pip_index_url", mode="before")
    @classmethod
    def _no_index_credentials(cls, value: object) -> object:
        credentials_refused(value, PIP_CREDENTIALS)
        return value

    @field_validator("pip_index_url")
    @classmethod
    def _plain_http_allowed(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            opens = "anyone on the path sees what the hosts install (pip still checks the lock's hashes)"
            plain_http_refused(value, info.data.get("allow_plain_http", ()), "inference_allow_plain_http", opens)
        return value

    @field_validator("service", mode="before")
    @classmethod
    def _no_service_credentials(cls, value: object) -> object:
        found = credential_paths(value)
        if found:
            raise ValueError(f"{', '.join(found)} carries credentials; {SERVICE_CREDENTIALS}")
        return value

    @field_validator("service", mode="before")
    @classmethod
    def _service_sections(cls, service: object) -> object:
        problems = _unknown_keys(service) + _value_problems(service)
        if problems:
            raise ValueError("\n".join(problems))
        return service

    def listeners(self) -> tuple[Listener, ...]:
        """The host's listeners in systemd mode (in kubernetes mode they are the pods'); the role reserves each of
        them in net.ipv4.ip_local_reserved_ports."""
        if self.mode != "systemd":
            return ()
        key = "inference_service"
        try:
            swap = SwapSettings.model_validate(self.service.get("swap", {}))
            exporter = ExporterSettings.model_validate(self.service.get("exporter", {}))
            quality = QualitySettings.model_validate(self.service.get("quality", {}))
        except ValidationError:  # check_deployable names the value; no plan is made of it
            return ()
        ports = [
            Listener(swap.listen_port, f"{key}.swap.listen_port", "Envoy's listener", reserved=True),
            Listener(swap.admin_port, f"{key}.swap.admin_port", "Envoy's admin interface", reserved=True),
            Listener(swap.blue_port, f"{key}.swap.blue_port", "the blue engine", reserved=True),
            Listener(swap.green_port, f"{key}.swap.green_port", "the green engine", reserved=True),
            Listener(exporter.port, f"{key}.exporter.port", "the service's exporter", reserved=True),
            # Debian's etcd-server listens on its defaults (the role writes no etcd configuration).
            Listener(ETCD_CLIENT_PORT, "inference_mode", "etcd (client)", reserved=True),
            Listener(ETCD_PEER_PORT, "inference_mode", "etcd (peer)", reserved=True),
        ]
        if quality.mirror_percent > 0:
            ports.append(Listener(quality.mirror_port, f"{key}.quality.mirror_port", "the quality sink", reserved=True))
        if self.prometheus:
            ports.append(Listener(PROMETHEUS_PORT, "inference_prometheus", "Prometheus", reserved=True))
        return tuple(ports)

    def addresses(self) -> tuple[tuple[str, str], ...]:
        return (("inference_listen_address", self.listen_address),) if self.listen_address else ()

    def version(self) -> str:
        """The version to serve: validated (YYYYMMDD-HHMMSS) at config time and again here, before any use."""
        if self.model_version:
            return check_model_version(self.model_version)
        if self.model_source is None:
            raise ValueError("inference_model_source is not set")
        return release_version(self.model_source, RELEASE_NAME)

    def model_bytes(self) -> int:
        """Bytes of the sealed version on the deploy machine (what the upload adds to the model store)."""
        if self.model_source is None:
            raise ValueError("inference_model_source is not set")
        return sum(path.stat().st_size for path in self.model_source.rglob("*") if path.is_file())

    def models_root_path(self, security_model_dir: str) -> str:
        """Where the versions live: inference_models_root, else <security_model_dir>/<model name>, checked."""
        path = self.models_root or f"{security_model_dir}/{self.model_name}"
        try:
            return check_path(path, roots=MODELS_ROOTS)
        except ValueError as exc:
            raise ValueError(f"inference_models_root {path}: {exc}") from None

    def service_settings(
        self,
        security_model_dir: str,
        service_group: str,
        service_slice: str,
        kubernetes_layout: dict[str, Any] | None = None,
        gpu_layout: dict[str, Any] | None = None,
    ) -> ServiceSettings:
        """The host's service.yaml: the role's layout plus the inventory's overrides.

        `kubernetes_layout`: the kubernetes section's derived keys (GPUs, seccomp profile, capabilities), given
        in kubernetes mode. `gpu_layout`: the gpu_health section's defaults from the hardware profile (the GPUs
        installed, the serving ones and their width), which the inventory's own gpu_health keys override."""
        models_root = Path(self.models_root_path(security_model_dir))
        venv = Path(self.venv)
        overrides = self.service
        data: dict[str, dict[str, Any]] = {
            "engine": {"served_model_name": self.model_name, **overrides.get("engine", {})},
            "swap": dict(overrides.get("swap", {})),
            **{section: dict(values) for section, values in overrides.items() if section not in {"engine", "swap"}},
        }
        # engine.model_dir names the versions' root: `swap` gives each colour's config its version's directory.
        # The version is not in this file, so a version change restarts none of the components reading it.
        data["engine"] |= {"model_dir": str(models_root), "engine_python": str(venv / "bin/python")}
        data["swap"] |= {
            "model_name": self.model_name,
            "models_root": str(models_root),
            "run_dir": str(RUN_DIR),
            "router_dir": str(ROUTER_DIR),
            "colour_unit": ENGINE_UNIT,
            "envoy_binary": str(venv / "bin/envoy"),
            # Loopback only until check_deployable has required the address.
            "listen_host": self.listen_address or "127.0.0.1",
            "api_keys_file": str(API_KEYS_PATH),
        }
        # The release gate checks the group the engines run as (security_group).
        data["release"] = {**data.get("release", {}), "service_group": service_group}
        # The load-and-chaos gate's memory pressure runs where the engines run (security_slice).
        data["chaos"] = {**data.get("chaos", {}), "slice": service_slice}
        if kubernetes_layout is not None:
            data["kubernetes"] = {**data.get("kubernetes", {}), **kubernetes_layout}
        if gpu_layout is not None:
            data["gpu_health"] = {**gpu_layout, **data.get("gpu_health", {})}
        return ServiceSettings.model_validate(data)


def check_deployable(
    settings: InferenceSettings,
    security_model_dir: str,
    service_group: str,
    service_slice: str,
    hardened_units: tuple[str, ...],
    service_dirs: tuple[str, ...] = (),
    kubernetes_layout: dict[str, Any] | None = None,
) -> None:
    """Raise ValueError naming the inventory key when the role could not run with these settings.

    `service_dirs`: the directories the service account owns (security_state_dir, security_log_dir): the models
    root, re-owned root:<group> 0750, must be apart from them. `kubernetes_layout`: see service_settings.
    """
    template = ENGINE_UNIT.format(colour="")
    on_host = settings.mode == "systemd"
    if on_host and template not in hardened_units:
        raise ValueError(
            f"security_service_units must include {template}: the engines run unprivileged, in the service slice, "
            "under the seccomp filter of roles/security's drop-in"
        )
    required: list[tuple[str, object]] = [("inference_model_source", settings.model_source)]
    if on_host:  # the engines' environment and listener are the image's and the cluster's in kubernetes mode
        required += [
            ("inference_pip_index_url", settings.pip_index_url),
            ("inference_requirements", settings.requirements),
            ("inference_listen_address", settings.listen_address),
        ]
    for key, value in required:
        if value is None:
            raise ValueError(f"{key} must be set for the inference role")
    if not on_host:
        given = settings.service.get("kubernetes", {})
        missing = [key for key in KUBERNETES_REQUIRED if given.get(key) is None]
        if missing:
            raise ValueError(
                f"inference_mode kubernetes needs inference_service.kubernetes.{', .'.join(missing)}: the engine "
                "image by digest, built from inference_requirements"
            )
    # Root runs the venv's programs and reads the models: neither may sit in a directory the service account owns
    # (it could replace them), nor hold one.
    models_root = settings.models_root_path(security_model_dir)
    for key, path in (("inference_models_root", models_root), ("inference_venv", settings.venv)):
        for owned in service_dirs:
            if is_within(path, owned) or is_within(owned, path):
                raise ValueError(
                    f"{key} {path} overlaps the service's own directory {owned}; accepted: a directory apart from "
                    "security_state_dir and security_log_dir"
                )
    mount = settings.model_store_mount
    if mount is not None and not is_within(models_root, mount):
        raise ValueError(
            f"inference_models_root {models_root} is not inside inference_model_store_mount {mount}; accepted: a "
            "models root on that mount (inference_models_root or security_model_dir)"
        )
    try:
        settings.service_settings(security_model_dir, service_group, service_slice, kubernetes_layout)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in error.errors()
        )
        raise ValueError(f"inference_service: {problems}") from None
