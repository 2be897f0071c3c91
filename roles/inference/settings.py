"""Settings of the inference role: its public API, every inventory key it reads with its default.

The host's /etc/ironserve/service.yaml is validated here, on the machine running the deploy, by the
service's own settings model (ironserve_service.settings), so a bad value fails before any host is touched.
The role owns the keys that tie the service to the host layout (paths, units, the served version); the
inventory may override every other key through `inference_service`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ironserve_service.artifacts import MANIFEST_NAME, RELEASE_NAME
from ironserve_service.settings import ServiceSettings
from pydantic import Field, ValidationError, field_validator, model_validator

from ironserve.config import RoleSettings
from ironserve.validators import ABS_PATH

ENGINE_UNIT = "ai-service@{colour}.service"
CONFIG_PATH = Path("/etc/ironserve/service.yaml")
RUN_DIR = Path("/run/ironserve")
ROUTER_DIR = Path("/etc/ironserve/envoy")
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
}


class InferenceSettings(RoleSettings):
    """Settings of roles/inference."""

    pip_index_url: str | None = Field(
        None,
        alias="inference_pip_index_url",
        pattern=r"^(https?|file)://\S+$",
        description="PEP 503 index of the site's PyPI/PyTorch mirror (py-pip-official-index; the lab: its "
        "wheelhouse), masked in pyinfra's output. Required.",
    )
    requirements: Path | None = Field(
        None,
        alias="inference_requirements",
        description="Hash-locked requirements on the deploy machine (pip --require-hashes; lab: "
        "ironserve/lab/files/requirements-cpu.lock): vLLM, torch and the service's dependencies "
        "(py-deps, py-torch-sha256). Required.",
    )
    python: str = Field(
        "/usr/bin/python3",
        alias="inference_python",
        pattern=ABS_PATH,
        description="The interpreter the venv is created from: the distribution's own Python (Debian 12: "
        "3.11; Ubuntu 22.04: 3.10), never conda or pyenv.",
    )
    venv: str = Field(
        "/opt/ironserve/venv",
        alias="inference_venv",
        pattern=ABS_PATH,
        description="Where the environment lives on the host (vLLM, the ironserve-service package, Envoy's binary).",
    )
    model_name: str = Field(
        "qwen2-7b",
        alias="inference_model_name",
        pattern=r"^[A-Za-z0-9][\w.-]*$",
        description="The model's name in etcd (/models/<name>/active) and in the OpenAI API (served-model-name).",
    )
    model_source: Path | None = Field(
        None,
        alias="inference_model_source",
        description="A sealed model version directory on the deploy machine (`ironserve-service seal DIR`: "
        "MANIFEST.sha256 + release.json), uploaded to <models root>/<version>. Required.",
    )
    model_version: str | None = Field(
        None,
        alias="inference_model_version",
        pattern=r"^[\w.-]+$",
        description="The version to serve: its directory name on the host and etcd's active value. None: the "
        "source's release.json version.",
    )
    models_root: str | None = Field(
        None,
        alias="inference_models_root",
        pattern=ABS_PATH,
        description="Model versions on the host; None: <security_model_dir>/<inference_model_name>.",
    )
    engine_environment: dict[str, str] = Field(
        default_factory=dict,
        alias="inference_engine_environment",
        description="`Environment=` of the engine units (lab: VLLM_CPU_KVCACHE_SPACE=1).",
    )
    service: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        alias="inference_service",
        description="Overrides of /etc/ironserve/service.yaml by section (see service/service.example.yaml), "
        "validated by the service's own model; the layout keys (model_dir, engine_python, "
        "models_root, run_dir, router_dir, colour_unit, envoy_binary, model_name) belong to the "
        "role and are refused.",
    )
    prometheus: bool = Field(
        True,
        alias="inference_prometheus",
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
        return path

    @field_validator("engine_environment")
    @classmethod
    def _environment_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k, v in env.items() if not k.isidentifier() or "\n" in v or '"' in v]
        if bad:
            raise ValueError(f"not usable in a unit's Environment=: {', '.join(bad)}")
        return env

    @model_validator(mode="after")
    def _no_role_owned_overrides(self) -> InferenceSettings:
        owned = sorted(f"{s}.{k}" for s, keys in self.service.items() for k in keys if (s, k) in ROLE_OWNED)
        if owned:
            raise ValueError(f"inference_service sets {', '.join(owned)}, which the role derives from the host layout")
        return self

    def version(self) -> str:
        if self.model_version:
            return self.model_version
        if self.model_source is None:
            raise ValueError("inference_model_source is not set")
        return str(json.loads((self.model_source / RELEASE_NAME).read_text())["version"])

    def service_settings(self, security_model_dir: str) -> ServiceSettings:
        """The host's service.yaml: the role's layout plus the inventory's overrides."""
        models_root = Path(self.models_root or f"{security_model_dir}/{self.model_name}")
        venv = Path(self.venv)
        overrides = self.service
        data: dict[str, dict[str, Any]] = {
            "engine": {"served_model_name": self.model_name, **overrides.get("engine", {})},
            "swap": {"listen_host": "0.0.0.0", **overrides.get("swap", {})},
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
        }
        return ServiceSettings.model_validate(data)


def check_deployable(settings: InferenceSettings, security_model_dir: str, hardened_units: tuple[str, ...]) -> None:
    """Raise ValueError naming the inventory key when the role could not run with these settings."""
    template = ENGINE_UNIT.format(colour="")
    if template not in hardened_units:
        raise ValueError(
            f"security_service_units must include {template}: the engines run unprivileged, in the service slice, "
            "under the seccomp filter of roles/security's drop-in"
        )
    for key, value in (
        ("inference_pip_index_url", settings.pip_index_url),
        ("inference_requirements", settings.requirements),
        ("inference_model_source", settings.model_source),
    ):
        if value is None:
            raise ValueError(f"{key} must be set for the inference role")
    try:
        settings.service_settings(security_model_dir)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in error.errors()
        )
        raise ValueError(f"inference_service: {problems}") from None
