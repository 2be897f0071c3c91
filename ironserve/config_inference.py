"""Settings model of roles/inference, part of `StackConfig`.

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ABS_PATH = r"^(/[\w.@+-]+)+$"
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


class InferenceSettings(BaseModel):
    """Settings of roles/inference (keys documented in roles/inference/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pip_index_url: str | None = Field(alias="inference_pip_index_url", pattern=r"^(https?|file)://\S+$")
    requirements: Path | None = Field(alias="inference_requirements")
    python: str = Field(alias="inference_python", pattern=ABS_PATH)
    venv: str = Field(alias="inference_venv", pattern=ABS_PATH)
    model_name: str = Field(alias="inference_model_name", pattern=r"^[A-Za-z0-9][\w.-]*$")
    model_source: Path | None = Field(alias="inference_model_source")
    model_version: str | None = Field(alias="inference_model_version", pattern=r"^[\w.-]+$")
    models_root: str | None = Field(alias="inference_models_root", pattern=ABS_PATH)
    engine_environment: dict[str, str] = Field(alias="inference_engine_environment")
    service: dict[str, dict[str, Any]] = Field(alias="inference_service")
    prometheus: bool = Field(alias="inference_prometheus")

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
