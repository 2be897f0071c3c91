"""`ironserve rollout INVENTORY`: the deploy applied host by host in batches, each host drained, changed, proven and
returned before the next batch starts.

Phases of one host, each timed and printed:
- drain: every role of the host that carries traffic (ironserve.traffic) takes it off the host: the load
  balancer sees it not ready, in-flight work finishes within a bound. A drain that cannot finish puts the host
  back in service unchanged, and the rollout stops;
- change: `ironserve deploy INVENTORY --limit HOST` (the ordinary deploy, its reboot included); the host's
  boot id before and after says whether it rebooted;
- prove: the roles hold the host out of the load balancer but open to its own front door, then
  `ironserve verify --limit HOST` runs the whole gate on it (a completion through its Envoy, the NVIDIA checks);
- return: traffic back.
A host that fails a phase stops the rollout: it stays out of service (drained) and is named with the phase and
the reason, hosts of later batches are never contacted, and `--resume` starts again at that host. At no moment
are more hosts out of service than `max_unavailable` (the failed hosts of a resumed rollout count), and that is
always fewer than the fleet.

The rollout's state is one JSON file, `<reports>/rollout.json` beside the gate's per-host reports: the plan,
and per host the phase reached, the result, the changes, the reboot and the time per phase. It is written after
every phase, so a person, a program and `--resume` all read the same record.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ironserve.config import Registry, StackBase
from ironserve.inventory import InventoryHost
from ironserve.traffic import TrafficControl
from ironserve.verify import ssh_config

PHASES = ("drain", "change", "prove", "return")
STATE_FILE = "rollout.json"
LOG_DIR = "rollout-logs"
# pyinfra's results table ends with one row per run: operations, changed, errors, unchanged ("-" for none).
GRAND_TOTAL = re.compile(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
# A host command that hangs (an SSH connection to a host that went away) must not hang the rollout.
REMOTE_TIMEOUT_S = 900
DEPLOY_TIMEOUT_S = 4 * 3600
# After a reboot the gate is run again at this interval while the host settles (clock sync, the model's load).
SETTLE_RETRY_S = 15


class RolloutError(ValueError):
    """Input or state that stops a rollout before any host is contacted."""


# --- the plan: pure, checked before any host is contacted ----------------------------------------------------


def max_unavailable_hosts(text: str, fleet: int) -> int:
    """`N` or `P%` of the fleet (rounded down, as Kubernetes rounds maxUnavailable), at least 1 and fewer than the
    fleet: a rollout never takes every host out of service."""
    match = re.fullmatch(r"\s*(\d+)\s*(%?)\s*", text)
    if match is None:
        raise RolloutError(f"--max-unavailable {text!r}: a number of hosts (2) or a share of the fleet (25%)")
    number, percent = int(match[1]), bool(match[2])
    if percent and not 0 < number <= 100:
        raise RolloutError(f"--max-unavailable {text}: a share between 1% and 100%")
    hosts = math.floor(fleet * number / 100) if percent else number
    if hosts < 1:
        raise RolloutError(
            f"--max-unavailable {text} of {fleet} hosts is {hosts} hosts: no host could ever be changed"
            + (" (the share rounds down)" if percent else "")
        )
    if hosts >= fleet:
        raise RolloutError(
            f"--max-unavailable {text} would take all {fleet} hosts of the fleet out of service at once: at most "
            f"{fleet - 1}" + ("" if fleet > 1 else " (one host cannot be rolled without an outage: `ironserve deploy`)")
        )
    return hosts


@dataclass(frozen=True)
class Plan:
    batches: list[list[str]]
    max_unavailable: int
    canary: str | None


def make_plan(
    hosts: Sequence[str],
    batch: int | None,
    max_unavailable: str,
    canary: str | None,
    order: Sequence[str] | None,
) -> Plan:
    """The batches, in order: the canary alone first, then `order`'s hosts, then the rest in inventory order."""
    if not hosts:
        raise RolloutError("the inventory has no host")
    limit = max_unavailable_hosts(max_unavailable, len(hosts))
    size = limit if batch is None else batch
    if size < 1:
        raise RolloutError(f"--batch {size}: at least 1 host per batch")
    if size > limit:
        raise RolloutError(
            f"--batch {size} would take {size} hosts out of service at once; --max-unavailable allows {limit}"
        )
    named = list(order or [])
    for label, names in (("--order", named), ("--canary", [canary] if canary else [])):
        unknown = [name for name in names if name not in hosts]
        if unknown:
            raise RolloutError(f"{label} {', '.join(unknown)}: not in the inventory")
    if len(set(named)) != len(named):
        raise RolloutError("--order names a host twice")
    sequence = [*dict.fromkeys([*([canary] if canary else []), *named, *hosts])]
    rest = sequence[1:] if canary else sequence
    batches = [[canary]] if canary else []
    batches += [rest[start : start + size] for start in range(0, len(rest), size)]
    return Plan(batches, limit, canary)


def traffic_controls(
    registry: Registry[Any], host: str, configs: Mapping[str, StackBase], drain_timeout_s: float | None
) -> list[TrafficControl]:
    """The traffic commands of the host's roles (ironserve.traffic), in the registry's order."""
    controls = []
    for role in registry.roles:
        if role.traffic is not None and role.name in configs[host].roles:
            control = role.traffic(host, configs, drain_timeout_s)
            if control is not None:
                controls.append(control)
    return controls


def check_traffic_hosts(plan: Plan, controls: Mapping[str, Sequence[TrafficControl]]) -> None:
    """A host that runs another host's traffic commands (a control plane, for its nodes) is never changed in the
    same batch as that host: while its own change restarts it, it may not answer the drain or the return."""
    for index, batch in enumerate(plan.batches):
        for host in batch:
            for control in controls.get(host, ()):
                if control.via is not None and control.via != host and control.via in batch:
                    raise RolloutError(
                        f"batch {index + 1} changes {control.via} and {host} together, but {control.via} runs "
                        f"{host}'s {control.role} traffic commands: give {control.via} a batch of its own "
                        f"(--canary {control.via}, or --batch 1)"
                    )


# --- the record -------------------------------------------------------------------------------------------------


@dataclass
class HostRecord:
    batch: int
    phase: str | None = None  # the last phase started
    result: str = "pending"  # pending, ok, failed (out of service), returned (drain failed: serving, unchanged)
    reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    changes: int | None = None
    rebooted: bool | None = None
    serving_before: str | None = None
    serving_after: str | None = None


@dataclass
class Rollout:
    inventory: str
    started: str
    plan: Plan
    options: dict[str, Any]
    hosts: dict[str, HostRecord]
    status: str = "running"  # running, stopped, completed
    finished: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Rollout:
        document = json.loads(text)
        plan = Plan(**document.pop("plan"))
        hosts = {name: HostRecord(**record) for name, record in document.pop("hosts").items()}
        return cls(plan=plan, hosts=hosts, **document)

    def out_of_service(self) -> list[str]:
        return [name for name, record in self.hosts.items() if record.result == "failed"]

    def stopped_at(self) -> str:
        failed = [(name, r) for name, r in self.hosts.items() if r.result in ("failed", "returned")]
        return "; ".join(f"{name} in {r.phase} ({r.result}): {r.reason}" for name, r in failed) or "no host failed"


def now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def state_path(reports: Path) -> Path:
    return reports / STATE_FILE


def new_rollout(inventory: str, plan: Plan, options: dict[str, Any], reports: Path) -> Rollout:
    """A new rollout, refused while the last one of this reports folder has hosts out of service."""
    path = state_path(reports)
    if path.exists():
        previous = load(path)
        if previous.status != "completed":
            raise RolloutError(
                f"{path}: the rollout started {previous.started} {previous.status} ({previous.stopped_at()}): "
                "`ironserve rollout INVENTORY --resume` continues it; or return its hosts to service by hand and "
                "remove the file"
            )
    hosts = {name: HostRecord(batch=index) for index, names in enumerate(plan.batches) for name in names}
    return Rollout(inventory, now_text(), plan, options, hosts)


def load(path: Path) -> Rollout:
    try:
        return Rollout.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError) as error:
        raise RolloutError(f"{path} is not a rollout's record ({error})") from None


def resumable(reports: Path) -> Rollout:
    """The stopped rollout of this reports folder, read before the inventory is validated (it names the roles)."""
    path = state_path(reports)
    if not path.exists():
        raise RolloutError(f"--resume: no rollout to resume ({path} does not exist)")
    rollout = load(path)
    if rollout.status == "completed":
        raise RolloutError(f"--resume: the rollout started {rollout.started} completed on {rollout.finished}")
    return rollout


# --- the table ------------------------------------------------------------------------------------------------


def table(rollout: Rollout) -> str:
    """One row per host: batch, phase reached, result, changes, reboot, seconds per phase, reason."""
    header = ["host", "batch", "phase", "result", "changes", "reboot", *(f"{p} s" for p in PHASES), "reason"]
    rows = [header]
    for name, record in rollout.hosts.items():
        rows.append(
            [
                name,
                str(record.batch + 1),
                record.phase or "-",
                record.result,
                "-" if record.changes is None else str(record.changes),
                {None: "-", True: "yes", False: "no"}[record.rebooted],
                *(f"{record.seconds[p]:.1f}" if p in record.seconds else "-" for p in PHASES),
                record.reason or "",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]) for row in rows)


def mix(rollout: Rollout) -> str | None:
    """What the fleet serves, by host, when a role said it: a stopped rollout's mix is stated, never silent."""
    served: dict[str, list[str]] = {}
    for name, record in rollout.hosts.items():
        line = record.serving_after or record.serving_before
        if line:
            served.setdefault(line, []).append(name)
    if not served:
        return None
    unreached = [name for name, record in rollout.hosts.items() if record.phase is None]
    if unreached and rollout.status != "completed":
        served["not reached, as before the rollout"] = unreached
    return "; ".join(f"{line}: {', '.join(names)}" for line, names in served.items())


# --- running it -------------------------------------------------------------------------------------------------


class PhaseFailed(Exception):
    def __init__(self, reason: str, returned: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.returned = returned  # the host serves again, unchanged (a drain that could not finish)


def last_line(text: str) -> str:
    lines = [line.strip() for line in ANSI.sub("", text).splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


@dataclass
class Runner:
    """Runs one rollout: SSH to the hosts as the gate reaches them (ironserve.verify's config), the deploy and
    the gate as subprocesses of this interpreter."""

    rollout: Rollout
    inventory_hosts: dict[str, InventoryHost]
    controls: dict[str, list[TrafficControl]]  # per host, its roles' traffic commands (traffic_controls)
    reports: Path
    # What `ironserve deploy` and `verify` get besides the host: --roles, --deploy-file (deploy only).
    roles: str | None
    deploy_file: str | None
    gate_args: list[str]  # passed on to the gate's pytest
    settle_s: float  # how long a rebooted host may take to pass the gate
    canary_pause_s: float
    confirm: Callable[[str], bool] | None
    out: Callable[[str], None] = lambda line: print(line, flush=True)
    ssh_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ironserve-rollout-")))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        (self.ssh_dir / "ssh_config").write_text(ssh_config(list(self.inventory_hosts.values()), self.ssh_dir))
        (self.reports / LOG_DIR).mkdir(parents=True, exist_ok=True)

    # -- plumbing

    def save(self) -> None:
        with self.lock:
            path = state_path(self.reports)
            staging = path.with_name(f".{path.name}.tmp")
            staging.write_text(self.rollout.to_json(), encoding="utf-8")
            os.replace(staging, path)

    def close_connections(self) -> None:
        """Ends the SSH master connections (ControlPersist would keep them a minute) and removes their folder."""
        for host in self.rollout.hosts:
            subprocess.run(["ssh", "-F", str(self.ssh_dir / "ssh_config"), "-O", "exit", host], capture_output=True,
                           timeout=30, check=False)  # fmt: skip
        shutil.rmtree(self.ssh_dir, ignore_errors=True)

    def say(self, host: str, text: str) -> None:
        with self.lock:
            self.out(f"{host}: {text}")

    def remote(self, host: str, command: str) -> subprocess.CompletedProcess[str]:
        argv = ["ssh", "-F", str(self.ssh_dir / "ssh_config"), host, command]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=REMOTE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 255, "", f"no answer within {REMOTE_TIMEOUT_S} s")

    def local(self, host: str, what: str, argv: list[str]) -> tuple[int, str]:
        """An ironserve command of this installation, its output kept in the rollout's logs folder."""
        log = self.reports / LOG_DIR / f"{host}.{what}.log"
        with log.open("w", encoding="utf-8") as handle:
            code = subprocess.call(
                [sys.executable, "-P", "-m", "ironserve", *argv],
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=DEPLOY_TIMEOUT_S,
            )
        return code, log.read_text(encoding="utf-8", errors="replace")

    def only(self) -> list[str]:
        return ["--roles", self.roles] if self.roles else []

    def on_host(self, host: str, command: str, what: str) -> str:
        result = self.remote(host, command)
        if result.returncode != 0:
            raise PhaseFailed(f"{what}: {last_line(result.stderr or result.stdout)}")
        return last_line(result.stdout) if result.stdout.strip() else ""

    def describe(self, host: str) -> str | None:
        lines = []
        for control in self.controls[host]:
            if control.describe:
                result = self.remote(control.via or host, control.describe)
                lines.append(f"{control.role} {last_line(result.stdout) if result.returncode == 0 else 'unknown'}")
        return "; ".join(lines) or None

    # -- phases

    def drain(self, host: str) -> str:
        done = []
        for control in self.controls[host]:
            result = self.remote(control.via or host, control.drain)
            if result.returncode != 0:
                back = self.remote(control.via or host, control.restore)
                state = "serving again" if back.returncode == 0 else f"NOT serving: {last_line(back.stderr)}"
                raise PhaseFailed(
                    f"{control.role} drain: {last_line(result.stderr or result.stdout)} (unchanged, {state})",
                    returned=back.returncode == 0,
                )
            done.append(f"{control.role}: {last_line(result.stdout)}")
        return "; ".join(done) or "no role carries traffic here"

    def change(self, host: str) -> str:
        record = self.rollout.hosts[host]
        boot_before = self.on_host(host, BOOT_ID, "boot id")
        deploy_file = ["--deploy-file", self.deploy_file] if self.deploy_file else []
        code, output = self.local(
            host, "deploy", ["deploy", "--limit", host, *self.only(), *deploy_file, self.rollout.inventory]
        )
        total = GRAND_TOTAL.search(ANSI.sub("", output))
        if total:
            record.changes = 0 if total[2] == "-" else int(total[2])
        boot_after = self.on_host(host, BOOT_ID, "boot id after the deploy")
        record.rebooted = boot_after != boot_before
        if code != 0:
            log = self.reports / LOG_DIR / f"{host}.deploy.log"
            raise PhaseFailed(f"deploy exited {code}: {deploy_failure(output, host)} ({log})")
        return f"{record.changes} changes, {'rebooted' if record.rebooted else 'no reboot'}"

    def prove(self, host: str) -> str:
        """The gate, once; after a reboot again every SETTLE_RETRY_S until it passes or settle_s has passed: a host
        that has just booted syncs its clock and loads its model before it can pass."""
        for control in self.controls[host]:
            self.on_host(control.via or host, control.hold, f"{control.role} held out of service for the gate")
        # --ironserve-held: the gate expects the host out of its load balancer (a draining /health), as it is now.
        gate = ["verify", "--limit", host, "--reports", str(self.reports), *self.only(), self.rollout.inventory,
                "--ironserve-held", *self.gate_args]  # fmt: skip
        settle_until = time.monotonic() + (self.settle_s if self.rollout.hosts[host].rebooted else 0)
        while True:
            code, output = self.local(host, "verify", gate)
            if code == 0:
                return last_line(output)
            failed = gate_failures(self.reports / f"{host}.json") or last_line(output)
            if time.monotonic() + SETTLE_RETRY_S > settle_until:
                raise PhaseFailed(f"gate failed: {failed} ({self.reports / LOG_DIR}/{host}.verify.log)")
            self.say(host, f"gate not passing yet after the reboot ({failed}); again in {SETTLE_RETRY_S} s")
            time.sleep(SETTLE_RETRY_S)

    def give_back(self, host: str) -> str:
        done = [
            f"{c.role}: {self.on_host(c.via or host, c.restore, f'{c.role} back in service')}"
            for c in self.controls[host]
        ]
        return "; ".join(done) or "nothing to return"

    def host(self, host: str) -> bool:
        record = self.rollout.hosts[host]
        record.serving_before = self.describe(host)
        steps = {"drain": self.drain, "change": self.change, "prove": self.prove, "return": self.give_back}
        for phase, step in steps.items():
            record.phase = phase
            record.reason = None
            self.save()
            self.say(host, f"{phase} ...")
            started = time.monotonic()
            try:
                detail = step(host)
            except PhaseFailed as failure:
                record.seconds[phase] = round(time.monotonic() - started, 1)
                record.result, record.reason = ("returned" if failure.returned else "failed"), failure.reason
                record.serving_after = self.describe(host)
                self.save()
                self.say(host, f"{phase} FAILED after {record.seconds[phase]:.1f} s: {failure.reason}")
                return False
            record.seconds[phase] = round(time.monotonic() - started, 1)
            self.say(host, f"{phase} ok in {record.seconds[phase]:.1f} s: {detail}")
        record.result = "ok"
        record.serving_after = self.describe(host)
        self.save()
        return True

    def run(self) -> int:
        rollout = self.rollout
        batches = rollout.plan.batches
        try:
            for index, batch in enumerate(batches):
                todo = [name for name in batch if rollout.hosts[name].result != "ok"]
                if not todo:
                    continue
                out = sorted(set(rollout.out_of_service()) | set(todo))
                if len(out) > rollout.plan.max_unavailable:
                    raise RolloutError(
                        f"batch {index + 1} would have {len(out)} hosts out of service ({', '.join(out)}); "
                        f"max-unavailable is {rollout.plan.max_unavailable}"
                    )
                self.out(f"batch {index + 1}/{len(batches)}: {', '.join(todo)}")
                with ThreadPoolExecutor(max_workers=len(todo)) as pool:
                    results = list(pool.map(self.host, todo))
                if not all(results):
                    rollout.status = "stopped"
                    return 1
                if batch == [rollout.plan.canary] and index + 1 < len(batches) and not self.after_canary(batch[0]):
                    rollout.status = "stopped"
                    rollout.hosts[batch[0]].reason = "the admin stopped the rollout after the canary"
                    return 1
            rollout.status = "completed"
            return 0
        except BaseException:
            rollout.status = "stopped"
            for record in rollout.hosts.values():
                if record.phase and record.result == "pending":
                    record.result, record.reason = "failed", record.reason or "interrupted"
            raise
        finally:
            self.close_connections()
            if rollout.status != "running":
                rollout.finished = now_text()
            self.save()
            self.out("")
            self.out(table(rollout))
            served = mix(rollout)
            if served:
                self.out(f"serving: {served}")
            self.out(f"rollout {rollout.status}; record: {state_path(self.reports)}")

    def after_canary(self, canary: str) -> bool:
        if self.confirm is not None:
            return self.confirm(f"canary {canary} passed every phase; continue with the other hosts? [yes/no] ")
        if self.canary_pause_s > 0:
            self.out(f"canary {canary} passed; the next batch starts in {self.canary_pause_s:.0f} s (Ctrl-C stops)")
            time.sleep(self.canary_pause_s)
        return True


# pyinfra's count of what a failed operation ran: the reason is on the host's line before it.
EXECUTED = re.compile(r"Error: executed \d+ commands?$")


def deploy_failure(output: str, host: str) -> str:
    """What stopped the host's deploy: its last line of pyinfra's output that says an error, not the count of commands
    run nor pyinfra's closing "No hosts remaining"."""
    prefix = f"[{host}] "
    lines = [line.strip().removeprefix(prefix) for line in ANSI.sub("", output).splitlines()]
    said = [line for line in lines if re.search(r"error|fail|stop", line, re.IGNORECASE) and not EXECUTED.search(line)]
    said = [line for line in said if "No hosts remaining" not in line]
    return said[-1] if said else last_line(output)


def gate_failures(report: Path) -> str | None:
    """The failed invariants of a host's gate report, named by their tests."""
    try:
        results = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    failed = sorted({entry["test"] for entry in results.values() if entry.get("status") == "fail"})
    if not failed:
        return None
    return ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
