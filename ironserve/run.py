"""What the roles of one deploy tell each other about one host, passed to each role explicitly.

deploy.py makes one `HostRun` per host and hands it to every role in order; a role records what a
later role needs (what the host's BMC reported, whether this run changes its firmware settings), so
no role reads another's module state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ironserve.reboot import RebootCheck


@dataclass(frozen=True)
class PowerSupplyInfo:
    name: str
    capacity_w: int | None  # None when the PSU reports "Unknown" (empty bay, failed unit)
    present: bool


@dataclass(frozen=True)
class BmcObservation:
    """What the host's BMC (a Dell iDRAC) said over Redfish; `error` when unreadable, None fields when not asked."""

    address: str | None
    model: str | None = None
    bios_version: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)
    power_supplies: list[PowerSupplyInfo] = field(default_factory=list)
    error: str | None = None
    stuck: dict[str, str] = field(default_factory=dict)  # desired values still pending after a reset
    note: str | None = None  # what an apply did (patched, job, reset), for the report


@dataclass
class HostRun:
    """One host's shared state in one deploy run."""

    host: str
    # Every host's validated config, in inventory order: what a role needs to know of the others (which host
    # starts a cluster the others join).
    fleet: Mapping[str, Any] = field(default_factory=dict)
    # Set while operations are prepared and again when a BIOS apply executes (the gate reads it then).
    bmc: BmcObservation | None = None
    # This run changes the BIOS: hardware read before the change must be read again after it.
    bios_changing: bool = False
    # What needs a reboot, in deploy order; the deploy reboots once for all of them (ironserve.reboot).
    reboots: list[RebootCheck] = field(default_factory=list)
    # Verifications that fail on what a later role repairs: run after every role, before the reboot.
    checks: list[Callable[[], object]] = field(default_factory=list)
