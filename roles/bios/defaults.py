"""Public API of the bios role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
The desired attributes are profile data (`preflight.bios_attributes` in `ironserve/profiles/<name>.yaml`).
Credentials are never inventory data: they come from IRONSERVE_REDFISH_USER / IRONSERVE_REDFISH_PASSWORD
or from the file named by bios_credentials_file (outside the repository, `user:password` on one line).
"""

DEFAULTS: dict[str, object] = {
    # The iDRAC's Redfish base URL, e.g. "https://10.0.0.21"; None skips the out-of-band BIOS check (reported).
    "bios_redfish_address": None,
    # check: report differences and fail the preflight; apply: PATCH Bios/Settings, schedule the job, prove it.
    "bios_mode": "check",
    # auto: ComputerSystem.Reset to apply pending settings; never: leave them pending (the preflight fails).
    "bios_reboot_policy": "never",
    # A file outside the repository holding `user:password`; None reads the environment variables instead.
    "bios_credentials_file": None,
    # Verify the iDRAC's TLS certificate (turn off only for a factory self-signed certificate you trust).
    "bios_verify_tls": True,
    # Seconds to wait for the BIOS to come back with the settings applied after a reset.
    "bios_apply_timeout_s": 900,
}
