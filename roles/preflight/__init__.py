"""Hardware preflight: refuse to build on a host that is physically wrong, and say what to change.

Reads the host (dmidecode, lscpu, lspci -vvv, sysfs NUMA, IOMMU) and what the BIOS role read from the
iDRAC (passed in the host's run state), runs the profile's checks (checks.py) and writes a report per host (text for
people, JSON for tools). A failing check stops this host before any other operation runs on it, unless
the inventory names it in preflight_overrides. A passing host gets no operation at all (zero changes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyinfra.api.command import FunctionCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.facts import FactBase
from pyinfra.api.operation import operation
from pyinfra.api.state import State
from pyinfra.context import host

from ironserve.operations import Commands
from ironserve.run import HostRun
from ironserve.speed.reads import Read, plan, read
from roles.preflight.checks import HostObservation, PreflightReport, evaluate
from roles.preflight.facts import CpuSockets, DmiString, IommuFacts, PciDevices, PciNumaNodes, PowerSupplies

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig

FACTS: dict[str, tuple[type[FactBase[Any]], dict[str, str]]] = {
    "product": (DmiString, {"keyword": "system-product-name"}),
    "bios_version": (DmiString, {"keyword": "bios-version"}),
    "cpu_sockets": (CpuSockets, {}),
    "devices": (PciDevices, {}),
    "sysfs_numa": (PciNumaNodes, {}),
    "power_supplies": (PowerSupplies, {}),
    "iommu": (IommuFacts, {}),
}


# What a fact that could not be read counts as: nothing seen, so the checks fail and say so.
EMPTY: dict[str, Any] = {"devices": [], "sysfs_numa": {}, "power_supplies": []}


def observe_facts() -> HostObservation:
    """The host's hardware through pyinfra facts (gathered while operations are prepared, in one round trip)."""
    values: dict[str, Any] = {}
    plan(Read(fact, kwargs) for fact, kwargs in FACTS.values())  # read in one round trip
    for key, (fact, kwargs) in FACTS.items():
        value = read(fact, **kwargs)
        values[key] = EMPTY[key] if value is None and key in EMPTY else value
    return HostObservation(**values)


def observe_now(pyinfra_host: Any) -> HostObservation:
    """The same facts read again now (after a BIOS change during this run), with the same parsers."""
    values = {}
    for key, (fact, kwargs) in FACTS.items():
        instance = fact()
        status, output = pyinfra_host.run_shell_command(instance.command(**kwargs))
        if not status:
            raise OperationError(f"preflight: reading {key} failed on {pyinfra_host.name}")
        values[key] = instance.process(output.stdout_lines)
    return HostObservation(**values)


def write_report(report: PreflightReport, folder: str) -> Path:
    """<folder>/<host>.json and .txt on the admin machine; a host name that is not one file name is refused."""
    if report.host in {"", ".", ".."} or Path(report.host).name != report.host:
        raise OperationError(f"host name {report.host!r} cannot name a report file in {folder}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{report.host}.json").write_text(report.to_json())
    (path / f"{report.host}.txt").write_text(report.to_text())
    return path / f"{report.host}.txt"


# pyinfra passes (state, host) to a FunctionCommand only when its parameters carry exactly those names.
def _gate(state: State, host: Any, config: StackConfig, observed: HostObservation, run: HostRun) -> bool:
    """Runs when the operation executes: judge (after any BIOS apply), write the report, stop a failed host."""
    if run.bios_changing:
        observed = observe_now(host)
    report = evaluate(host.name, config.profile, observed, run.bmc, config.preflight.overrides)
    path = write_report(report, config.preflight.report_dir)
    if not report.passed:
        lines = [
            f"{c.name}: expected {c.expected}, observed {c.observed}. What to do: {c.advice}" for c in report.failures
        ]
        raise OperationError(
            f"preflight failed, nothing else runs on this host (report: {path}):\n  " + "\n  ".join(lines)
        )
    return True


@operation()
def preflight_gate(config: StackConfig, observed: HostObservation, run: HostRun) -> Commands:
    """Stop this host unless every check passes (or is overridden), judged when the operation executes."""
    yield FunctionCommand(_gate, (config, observed, run), {})


@deploy("Hardware preflight")
def preflight(config: StackConfig, run: HostRun) -> None:
    observed = observe_facts()
    report = evaluate(host.name, config.profile, observed, run.bmc, config.preflight.overrides)
    if report.passed and not run.bios_changing:
        path = write_report(report, config.preflight.report_dir)
        overridden = [c.name for c in report.checks if c.overridden]
        host.noop(
            f"preflight passed (report {path})" + (f"; overridden: {', '.join(overridden)}" if overridden else "")
        )
        return
    preflight_gate(
        name="Hardware preflight gate",
        config=config,
        observed=observed,
        run=run,
    )
