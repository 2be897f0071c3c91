"""BIOS as code through the iDRAC's Redfish API, from the admin machine (never from the host itself).

check (default): read Systems/System.Embedded.1, Bios, Bios/Settings, PCIe devices and power supplies,
and hand what differs to the preflight, which fails the host. apply: PATCH Bios/Settings, schedule the
Dell configuration job, reset through ComputerSystem.Reset when bios_reboot_policy allows, re-read
and prove current == desired (a value still pending is a failure). Nothing differs: nothing is sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyinfra.api.command import FunctionCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.operation import operation
from pyinfra.context import host

from ironserve.preflight import BiosObservation
from ironserve.redfish import (
    BiosState,
    RedfishClient,
    RedfishError,
    apply,
    differences,
    load_credentials,
    read_state,
)
from roles.bios.defaults import DEFAULTS

if TYPE_CHECKING:  # the config model imports this package's defaults
    from ironserve.config import BiosSettings, StackConfig

# What the iDRAC said about each host in this run (host name -> observation); the preflight gate reads it.
OBSERVATIONS: dict[str, BiosObservation] = {}
# Hosts whose BIOS this run changes: the preflight re-reads their hardware after the apply.
APPLYING: set[str] = set()


def observation(host_name: str) -> BiosObservation | None:
    return OBSERVATIONS.get(host_name)


def _client(settings: BiosSettings) -> RedfishClient:
    assert settings.redfish_address is not None
    return RedfishClient(settings.redfish_address, load_credentials(settings.credentials_file), settings.verify_tls)


def _observed(
    address: str, state: BiosState, note: str | None = None, stuck: dict[str, str] | None = None
) -> BiosObservation:
    return BiosObservation(
        address=address,
        model=state.model,
        bios_version=state.bios_version,
        attributes=state.attributes,
        pending=state.pending,
        power_supplies=state.power_supplies,
        stuck=stuck or {},
        note=note,
    )


def _apply_now(state, host, settings: BiosSettings, desired: dict[str, str]) -> bool:  # type: ignore[no-untyped-def]
    """Runs on the admin machine when the operation executes: apply, re-read, record for the gate."""
    address = settings.redfish_address
    assert address is not None
    try:
        result = apply(
            _client(settings),
            desired,
            reboot=settings.reboot_policy == "auto",
            timeout_s=settings.apply_timeout_s,
        )
    except RedfishError as exc:
        OBSERVATIONS[host.name] = BiosObservation(address=address, error=str(exc))
        return True
    assert result.state is not None
    OBSERVATIONS[host.name] = _observed(address, result.state, result.note(), result.stuck)
    return True


@operation()
def bios_attributes(settings: BiosSettings, desired: dict[str, str], differing: dict[str, str]):  # type: ignore[no-untyped-def]
    """Apply `differing` (the desired attributes the BIOS lacks) through Redfish; the gate judges the result."""
    APPLYING.add(host.name)
    yield FunctionCommand(_apply_now, (settings, desired), {})


@deploy("BIOS (Redfish)", data_defaults=DEFAULTS)
def bios(config: StackConfig) -> None:
    settings = config.bios
    spec = config.profile.preflight
    address = settings.redfish_address
    OBSERVATIONS.pop(host.name, None)
    APPLYING.discard(host.name)
    if address is None or spec is None:
        why = "no bios_redfish_address" if address is None else f"profile {config.profile_name} states no BIOS"
        host.noop(f"BIOS not checked out of band: {why}")
        return
    try:
        state = read_state(_client(settings))
    except RedfishError as exc:
        OBSERVATIONS[host.name] = BiosObservation(address=address, error=str(exc))
        host.noop(f"BIOS not readable: {exc}")
        return
    OBSERVATIONS[host.name] = _observed(address, state)
    differing = differences(spec.bios_attributes, state.attributes)
    if not differing:
        host.noop(f"BIOS attributes as required ({', '.join(spec.bios_attributes)})")
    elif settings.mode == "check":
        shown = ", ".join(f"{k}={state.attributes.get(k, 'absent')} (want {v})" for k, v in differing.items())
        host.noop(f"BIOS differs, bios_mode is check: {shown}")
    else:
        bios_attributes(
            name="Apply BIOS attributes through Redfish",
            settings=settings,
            desired=dict(spec.bios_attributes),
            differing=differing,
        )
