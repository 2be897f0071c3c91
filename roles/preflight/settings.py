"""Settings of the preflight role: its public API, every inventory key it reads with its default.

What the host must be (GPU count, serving slots, BIOS attributes, power) is profile data
(`ironserve/profiles/<name>.yaml`, section `hardware`), not inventory.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, field_validator

from ironserve.config import LOCAL_PATH, RoleSettings, prefixed
from ironserve.validators import relative_or_absolute_path
from roles.preflight.checks import CHECK_NAMES


def _known_check(name: str) -> str:
    if name not in CHECK_NAMES:
        raise ValueError(f"unknown preflight check {name!r}; accepted: {', '.join(CHECK_NAMES)}")
    return name


def _report_dir(value: str) -> str:
    return relative_or_absolute_path(value, "reports/preflight")


class PreflightSettings(RoleSettings):
    """Settings of roles/preflight."""

    model_config = ConfigDict(alias_generator=prefixed("preflight"))

    overrides: tuple[Annotated[str, AfterValidator(_known_check)], ...] = Field(
        (),
        description='Named checks allowed to fail (reported as FAIL*), e.g. ["psu-capacity"]; unknown names '
        "are refused.",
    )

    @field_validator("overrides")
    @classmethod
    def _once(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; accepted: each check once")
        return names

    report_dir: Annotated[str, AfterValidator(_report_dir)] = Field(
        "reports/preflight",
        json_schema_extra=LOCAL_PATH,
        description="Folder on the admin machine for the per-host report (<host>.txt for people, <host>.json for "
        "tools): relative or absolute, normalised (no . or .. segments), never a system directory.",
    )
