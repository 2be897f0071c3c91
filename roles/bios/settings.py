"""Settings of the bios role: its public API, every inventory key it reads with its default.

The desired attributes are profile data (`hardware.bios_attributes` in `ironserve/profiles/<name>.yaml`).
Credentials are never inventory data: they come from IRONSERVE_REDFISH_USER / IRONSERVE_REDFISH_PASSWORD
or from the file named by bios_credentials_file (0600, outside the repository, `user:password` on one line).
The iDRAC is reached over https only, its certificate verified (bios_ca_file, bios_tls_fingerprint).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from ironserve.config import LOCAL_PATH, RoleSettings, prefixed
from ironserve.secrets import private_file
from roles.bios.client import ENV_PASSWORD, ENV_USER, https_address, normalised_fingerprint


class BiosSettings(RoleSettings):
    """Settings of roles/bios."""

    model_config = ConfigDict(alias_generator=prefixed("bios"))

    redfish_address: str | None = Field(
        None,
        description="The iDRAC's Redfish base URL, https only (`https://10.0.0.21`, `https://idrac-r740-01.example`: "
        "an ASCII name or an IP address, no credentials); None: the BIOS is not checked out of band (reported "
        "as skip).",
    )
    mode: Literal["check", "apply"] = Field(
        "check",
        description="check: report differences and fail the preflight; apply: PATCH Bios/Settings, schedule "
        "the Dell job, re-read and prove current == desired.",
    )
    reboot_policy: Literal["auto", "never"] = Field(
        "never",
        description="auto: ComputerSystem.Reset through the iDRAC to apply pending settings before the "
        "preflight judges them; never: leave them pending (the preflight fails). A firmware "
        "reset, separate from the OS reboot of ironserve_reboot_policy.",
    )
    credentials_file: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        description="A file on the admin machine holding `user:password` (mode 0600, outside the repository); "
        "None: IRONSERVE_REDFISH_USER / IRONSERVE_REDFISH_PASSWORD.",
    )
    ca_file: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        description="PEM file on the admin machine the iDRAC's certificate is verified against, instead of the "
        "system CAs: the site CA, or the iDRAC's own self-signed certificate; the certificate must name "
        "the address (else pin it). None: the system CAs.",
    )
    tls_fingerprint: str | None = Field(
        None,
        description="SHA-256 fingerprint of the iDRAC's certificate (DER; `AB:CD:...` or 64 hex digits), checked on "
        "every connection before anything is sent; alone it replaces CA and name checks (a factory "
        "self-signed certificate), with bios_ca_file both must hold.",
    )
    apply_timeout_s: int = Field(
        900,
        gt=0,
        le=7200,
        description="Seconds to wait for the Dell job and the re-read after a reset.",
    )

    @field_validator("redfish_address", mode="before")
    @classmethod
    def _https_ascii(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError("expected the iDRAC's https:// URL such as https://10.0.0.21")
        https_address(value)
        return value.rstrip("/")

    @field_validator("credentials_file")
    @classmethod
    def _private(cls, value: str | None) -> str | None:
        return None if value is None else str(private_file(value))

    @field_validator("ca_file")
    @classmethod
    def _certificates(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{path} is not a file on this machine")
        try:
            ssl.create_default_context(cafile=str(path))
        except (ssl.SSLError, OSError, ValueError):
            raise ValueError(f"{path} holds no PEM certificate") from None
        return str(path.resolve())

    @field_validator("tls_fingerprint", mode="before")
    @classmethod
    def _fingerprint(cls, value: object) -> object:
        return normalised_fingerprint(value) if isinstance(value, str) else value

    def secret_variables(self) -> dict[str, tuple[str | None, str]]:
        return {ENV_USER: (None, "the iDRAC user (bios)"), ENV_PASSWORD: (None, "the iDRAC password (bios)")}
