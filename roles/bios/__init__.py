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
from pyinfra.api.state import State
from pyinfra.context import host

from ironserve.operations import Commands
from ironserve.run import BmcObservation, HostRun
from roles.bios.client import (
    BiosState,
    RedfishClient,
    RedfishError,
    apply,
    differences,
    load_credentials,
    read_state,
)

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig
    from roles.bios.settings import BiosSettings


def _client(settings: BiosSettings) -> RedfishClient:
    assert settings.redfish_address is not None
    credentials = load_credentials(settings.credentials_file)
    return RedfishClient(settings.redfish_address, credentials, settings.ca_file, settings.tls_fingerprint)


def _observed(
    address: str, state: BiosState, note: str | None = None, stuck: dict[str, str] | None = None
) -> BmcObservation:
    return BmcObservation(
        address=address,
        model=state.model,
        bios_version=state.bios_version,
        attributes=state.attributes,
        pending=state.pending,
        power_supplies=state.power_supplies,
        stuck=stuck or {},
        note=note,
    )


# pyinfra passes (state, host) to a FunctionCommand only when its parameters carry exactly those names.
def _apply_now(state: State, host: object, settings: BiosSettings, desired: dict[str, str], run: HostRun) -> bool:
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
        run.bmc = BmcObservation(address=address, error=str(exc))
        return True
    assert result.state is not None
    run.bmc = _observed(address, result.state, result.note(), result.stuck)
    return True


@operation()
def bios_attributes(settings: BiosSettings, desired: dict[str, str], run: HostRun) -> Commands:
    """Apply `desired` through Redfish (some differ now); the preflight gate judges the result."""
    yield FunctionCommand(_apply_now, (settings, desired, run), {})


@deploy("BIOS (Redfish)")
def bios(config: StackConfig, run: HostRun) -> None:
    settings = config.bios
    spec = config.profile.hardware
    address = settings.redfish_address
    if address is None or spec is None:
        why = "no bios_redfish_address" if address is None else f"profile {config.profile_name} states no BIOS"
        host.noop(f"BIOS not checked out of band: {why}")
        return
    try:
        state = read_state(_client(settings))
    except RedfishError as exc:
        run.bmc = BmcObservation(address=address, error=str(exc))
        host.noop(f"BIOS not readable: {exc}")
        return
    run.bmc = _observed(address, state)
    differing = differences(spec.bios_attributes, state.attributes)
    if not differing:
        host.noop(f"BIOS attributes as required ({', '.join(spec.bios_attributes)})")
    elif settings.mode == "check":
        shown = ", ".join(f"{k}={state.attributes.get(k, 'absent')} (want {v})" for k, v in differing.items())
        host.noop(f"BIOS differs, bios_mode is check: {shown}")
    else:
        # Said now, while operations are prepared: the preflight decides then whether to re-read the hardware.
        run.bios_changing = True
        bios_attributes(
            name="Apply BIOS attributes through Redfish", settings=settings, desired=dict(spec.bios_attributes), run=run
        )
