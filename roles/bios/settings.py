"""Settings of the bios role: its public API, every inventory key it reads with its default.

The desired attributes are profile data (`hardware.bios_attributes` in `ironserve/profiles/<name>.yaml`).
Credentials are never inventory data: they come from IRONSERVE_REDFISH_USER / IRONSERVE_REDFISH_PASSWORD
or from the file named by bios_credentials_file (outside the repository, `user:password` on one line).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ironserve.config import RoleSettings


class BiosSettings(RoleSettings):
    """Settings of roles/bios."""

    redfish_address: str | None = Field(
        None,
        alias="bios_redfish_address",
        pattern=r"^https?://[\w.:\[\]-]+/?$",
        description="The iDRAC's Redfish base URL (`https://10.0.0.21`); None: the BIOS is not checked out of "
        "band (reported as skip).",
    )
    mode: Literal["check", "apply"] = Field(
        "check",
        alias="bios_mode",
        description="check: report differences and fail the preflight; apply: PATCH Bios/Settings, schedule "
        "the Dell job, re-read and prove current == desired.",
    )
    reboot_policy: Literal["auto", "never"] = Field(
        "never",
        alias="bios_reboot_policy",
        description="auto: ComputerSystem.Reset through the iDRAC to apply pending settings before the "
        "preflight judges them; never: leave them pending (the preflight fails). A firmware "
        "reset, separate from the OS reboot of ironserve_reboot_policy.",
    )
    credentials_file: str | None = Field(
        None,
        alias="bios_credentials_file",
        description="A file outside the repository holding `user:password`; None: IRONSERVE_REDFISH_USER / "
        "IRONSERVE_REDFISH_PASSWORD.",
    )
    verify_tls: bool = Field(
        True,
        alias="bios_verify_tls",
        description="Verify the iDRAC's TLS certificate (turn off only for a factory self-signed certificate "
        "you trust).",
    )
    apply_timeout_s: int = Field(
        900,
        alias="bios_apply_timeout_s",
        gt=0,
        le=7200,
        description="Seconds to wait for the Dell job and the re-read after a reset.",
    )
