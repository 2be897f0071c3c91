"""Public API of the preflight role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
What the host must be (GPU count, serving slots, BIOS attributes, power) is profile data
(`ironserve/profiles/<name>.yaml`, section `preflight`), not inventory.
"""

DEFAULTS: dict[str, object] = {
    # Named checks allowed to fail without stopping the host, e.g. ["psu-capacity"]; each is reported as overridden.
    "preflight_overrides": [],
    # Folder on the admin machine for the per-host report (<host>.txt for people, <host>.json for tools).
    "preflight_report_dir": "reports/preflight",
}
