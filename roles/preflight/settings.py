"""Settings of the preflight role: its public API, every inventory key it reads with its default.

What the host must be (GPU count, serving slots, BIOS attributes, power) is profile data
(`ironserve/profiles/<name>.yaml`, section `hardware`), not inventory.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from ironserve.config import RoleSettings
from roles.preflight.checks import CHECK_NAMES


def _known_check(name: str) -> str:
    if name not in CHECK_NAMES:
        raise ValueError(f"unknown preflight check {name!r}; accepted: {', '.join(CHECK_NAMES)}")
    return name


class PreflightSettings(RoleSettings):
    """Settings of roles/preflight."""

    overrides: tuple[Annotated[str, AfterValidator(_known_check)], ...] = Field(
        (),
        alias="preflight_overrides",
        description='Named checks allowed to fail (reported as FAIL*), e.g. ["psu-capacity"]; unknown names '
        "are refused.",
    )
    report_dir: str = Field(
        "reports/preflight",
        alias="preflight_report_dir",
        min_length=1,
        description="Folder on the admin machine for the per-host report (<host>.txt for people, <host>.json for "
        "tools).",
    )
