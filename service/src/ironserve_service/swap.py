"""`swap MODEL VERSION`: the blue/green protocol, each step a named gate.

verify -> etcd (read state) -> start (idle colour, through the launcher) -> readiness -> release-check
(the 12-item checklist of release.py on the new colour) -> load-chaos (chaos.py: the P99 under stress-ng
within 15 % of the baseline's) -> compare-and-swap
(the only write) -> route-switch (observed through Envoy) -> drain (old colour idle 10 s in Envoy's
stats) -> stop (SIGTERM to the old launcher: its own drain path). A failure before the write leaves
the key untouched and stops the new instance; traffic never moved. Rollback (`rollback MODEL`) is a swap
to the version that was active before (etcd's `previous` key); with `swap.keep_previous` the drained colour
keeps running that version, so the rollback starts nothing and skips the load-and-chaos gate that version
already passed.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ironserve_service import artifacts, chaos, release, router
from ironserve_service.control import (
    EnvoyAdmin,
    Etcd,
    EtcdError,
    ReadinessProof,
    check_colour,
    colour_readiness,
    desired,
    proof_key,
    traffic_reason,
    traffic_state,
)
from ironserve_service.health import marker_pid, pid_alive
from ironserve_service.settings import COLOURS, Colour, ServiceSettings

# The route-switch gate's pause between two questions to Envoy: a few questions for the milliseconds a switch
# takes, and the switch it reports lags the real one by half of this on average.
SWITCH_POLL_S = 0.001
# The starting colour's CPU share, half the serving one's where both want the host's CPUs: loading (imports,
# weights, warm-up) at an equal share starved the serving engine's API server (issue 33); a fifth made a start at
# 50 streaming clients on 2 cores outlast a 240 s ready timeout. A unit's cgroup cpu.weight (cgroup v2; systemd's
# CPUWeight= default 100), else the launcher session's autogroup nice (sched(7)); nice 3 is CFS weight 526 against
# nice 0's 1024 (the kernel's sched_prio_to_weight table).
STARTING_CPU_WEIGHT, SERVING_CPU_WEIGHT = 50, 100
CGROUP_ROOT = Path("/sys/fs/cgroup")
STARTING_AUTOGROUP_NICE, SERVING_AUTOGROUP_NICE = 3, 0


class GateFailed(Exception):
    def __init__(self, gate: str, reason: str) -> None:
        super().__init__(f"{gate}: {reason}")
        self.gate = gate
        self.reason = reason


@dataclass
class SwapResult:
    ok: bool
    gate: str
    detail: str
    colour: Colour | None = None
    previous_colour: Colour | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Wall clock of the etcd write (time.time()), to line the switch up with other processes' clocks.
    written_at: float | None = None


def other(colour: Colour) -> Colour:
    return "green" if colour == "blue" else "blue"


def colour_settings(settings: ServiceSettings, colour: Colour, model_dir: Path) -> ServiceSettings:
    """The launcher config of one colour: its port, its markers, the version's model directory."""
    return settings.model_copy(
        update={
            "engine": settings.engine.model_copy(update={"model_dir": model_dir, "port": settings.swap.port(colour)}),
            "readiness": colour_readiness(settings, colour),
        }
    )


def systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False)


def launcher_pid(settings: ServiceSettings, colour: Colour) -> int | None:
    """PID of the colour's running launcher: the unit's main process, or the pid file written at start."""
    unit = settings.swap.unit(colour)
    if unit is not None:
        main_pid = systemctl("show", "--property=MainPID", "--value", unit).stdout.strip()
        return int(main_pid) if main_pid.isdigit() and int(main_pid) > 0 else None
    pid = marker_pid(settings.swap.colour_dir(colour) / "launcher.pid")
    if pid is not None:
        _reap(pid)
    return pid if pid is not None and pid_alive(pid) else None


def start_colour(settings: ServiceSettings, colour: Colour, model_dir: Path) -> None:
    """Writes the colour's launcher config (run_dir/<colour>/service.yaml) and starts `ironserve-service
    launch` with it: through the colour's systemd unit, or detached (own session) with logs beside the config."""
    directory = settings.swap.colour_dir(colour)
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "service.yaml"
    config.write_text(yaml.safe_dump(colour_settings(settings, colour, model_dir).model_dump(mode="json")))
    unit = settings.swap.unit(colour)
    if unit is not None:
        started = systemctl("start", unit)
        if started.returncode != 0:
            raise GateFailed("start", f"systemctl start {unit}: {started.stderr.strip()}")
        cpu_share(settings, colour, starting=True)  # its cgroup exists once started; the load comes after
        return
    with (directory / "launcher.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ironserve_service", "launch", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    (directory / "launcher.pid").write_text(f"{process.pid}\n")
    cpu_share(settings, colour, starting=True)


def cpu_share(settings: ServiceSettings, colour: Colour, starting: bool) -> None:
    """The colour's CPU share against the other colour's: STARTING_* until its engine is ready, SERVING_* after.

    A unit is a cgroup of its own: its cpu.weight is written directly, not through `systemctl set-property`, whose
    drop-in (system.control) the security role and the gate rightly treat as a foreign override of a hardened unit;
    systemd puts its own CPUWeight= back on a reload, the serving share. Without units, the launcher's session (the
    engine runs in it) is the group the kernel shares CPUs between under autogroup scheduling, which applies to
    tasks outside any cgroup with a CPU controller; its nice is /proc/<pid>/autogroup (sched(7)). Best effort: a
    cgroup without the CPU controller, a kernel without autogroups, or a launcher already gone, leaves the share as
    it was."""
    unit = settings.swap.unit(colour)
    if unit is not None:
        group = systemctl("show", "--property=ControlGroup", "--value", unit).stdout.strip()
        if group.startswith("/"):
            with contextlib.suppress(OSError):
                (CGROUP_ROOT / group.lstrip("/") / "cpu.weight").write_text(
                    f"{STARTING_CPU_WEIGHT if starting else SERVING_CPU_WEIGHT}\n"
                )
        return
    pid = launcher_pid(settings, colour)
    if pid is not None:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/autogroup").write_text(
                f"{STARTING_AUTOGROUP_NICE if starting else SERVING_AUTOGROUP_NICE}\n"
            )


def launcher_log_tail(settings: ServiceSettings, colour: Colour) -> str:
    unit = settings.swap.unit(colour)
    if unit is not None:
        return subprocess.run(["journalctl", "--unit", unit, "--lines", "15", "--no-pager", "--output", "cat"],
                              capture_output=True, text=True, check=False).stdout  # fmt: skip
    log = settings.swap.colour_dir(colour) / "launcher.log"
    return log.read_text(errors="replace")[-600:] if log.exists() else ""


def _reap(pid: int) -> None:
    # Our own child (started by this process) must be reaped or it stays a zombie that looks alive.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop_colour(settings: ServiceSettings, colour: Colour) -> float:
    """SIGTERM to the launcher (ready marker removed, vLLM drains, killed after drain_timeout_s); returns seconds.

    A unit is stopped by systemd (KillMode=mixed: SIGTERM to the launcher, SIGKILL for what is left after
    TimeoutStopSec), which also keeps Restart= from bringing a deliberately stopped colour back."""
    started = time.monotonic()
    unit = settings.swap.unit(colour)
    if unit is not None:
        systemctl("stop", unit)
        return time.monotonic() - started
    pid = launcher_pid(settings, colour)
    if pid is None:
        return 0.0
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = started + settings.readiness.drain_timeout_s + 30
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    (settings.swap.colour_dir(colour) / "launcher.pid").unlink(missing_ok=True)
    return time.monotonic() - started


@dataclass(frozen=True)
class Answer:
    """The /health question through Envoy's listener that the new colour answered: when it was asked and answered
    (time.monotonic())."""

    asked_at: float
    answered_at: float


def first_answer_from(settings: ServiceSettings, colour: Colour, timeout_s: float) -> Answer | None:
    """The first /health answer through Envoy from `colour`, or None after timeout_s.

    One question at a time on one kept-alive connection (Envoy routes each request by the route in force when it
    arrives, also on an open connection): no connection set up per question for `swap`, Envoy and the engine to
    pay while the switch competes for the host's CPU. A connection that Envoy closes, or that fails, is closed
    here and http.client opens a new one for the next question."""
    listener = urllib.parse.urlsplit(settings.swap.listener_url)
    connection = http.client.HTTPConnection(listener.hostname or "127.0.0.1", listener.port or 80, timeout=2)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            asked_at = time.monotonic()
            try:
                # The probe header: on a drained host Envoy answers the plain /health itself (router.PROBE_HEADER).
                connection.request("GET", router.HEALTH_PATH, headers={router.PROBE_HEADER: "swap"})
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
            else:
                if response.headers.get(router.COLOUR_HEADER) == colour:
                    return Answer(asked_at, time.monotonic())
            time.sleep(SWITCH_POLL_S)
        return None
    finally:
        connection.close()


def wait_idle(admin: EnvoyAdmin, cluster: str, idle_s: float, max_s: float, interval_s: float) -> float:
    """Waits until the cluster has had zero active requests for idle_s; returns the seconds waited."""
    started = time.monotonic()
    idle_since: float | None = None
    while time.monotonic() - started < max_s:
        try:
            active = admin.active_requests(cluster)
        except OSError:
            active = 1  # Envoy unreadable: not proven idle.
        now = time.monotonic()
        if active == 0:
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= idle_s:
                return now - started
        else:
            idle_since = None
        time.sleep(interval_s)
    raise GateFailed("drain", f"cluster {cluster} still had active requests after {max_s}s")


def serving_status(settings: ServiceSettings) -> dict[str, object]:
    """What this host serves now: etcd's active version and colour, whether that colour is ready, and the host's
    traffic state (control.traffic_state; None when etcd is unreachable) with why it left serving
    (control.traffic_reason: the GPU guard's reason; None while it serves or when no reason was given).

    `ready` is the fast check (ready marker of a live launcher, /health 200), as the control loop uses it; it does
    not depend on the traffic state. The inference role reads this to decide whether a swap is due (a version
    change, or a colour that died).
    """
    swap_settings = settings.swap
    status: dict[str, object] = {
        "model": swap_settings.model_name,
        "active": None,
        "colour": None,
        "ready": False,
        "traffic": None,
        "traffic_reason": None,
    }
    try:
        snapshot = Etcd(swap_settings.etcd_url, swap_settings.etcd_timeout_s).get_prefix(swap_settings.key_prefix)
    except EtcdError as error:
        return {**status, "reason": f"etcd: {error}"}
    colour, version = desired(swap_settings, snapshot.values)
    status.update(active=version, colour=colour, traffic=traffic_state(swap_settings, snapshot.values),
                  traffic_reason=traffic_reason(swap_settings, snapshot.values))  # fmt: skip
    if colour is None:
        return {**status, "reason": "no colour runs the active version" if version else "nothing active"}
    result = check_colour(settings, colour, full=False)
    return {**status, "ready": result.ok, "reason": result.reason}


def swap(settings: ServiceSettings, model_name: str, version: str, log: Callable[[str], None] = print) -> SwapResult:
    swap_settings = settings.swap
    timings: dict[str, float] = {}
    started = time.monotonic()
    if model_name != swap_settings.model_name:
        return SwapResult(False, "config", f"this host serves {swap_settings.model_name!r}, not {model_name!r}")
    model_dir = swap_settings.models_root / version

    report = artifacts.verify_model_dir(
        model_dir, model_dir / artifacts.MANIFEST_NAME, require_release=swap_settings.verify_release
    )
    if not report.ok:
        failed = "; ".join(f"{f.check} {f.subject}: {f.detail}" for f in report.findings if not f.ok)
        return SwapResult(False, "verify", f"{model_dir}: {failed}")
    log(f"OK verify {model_dir}")

    etcd = Etcd(swap_settings.etcd_url, swap_settings.etcd_timeout_s)
    try:
        snapshot = etcd.get_prefix(swap_settings.key_prefix)
    except EtcdError as error:
        return SwapResult(False, "etcd", str(error))
    previous = snapshot.values.get(swap_settings.active_key)
    old_colour, _ = desired(swap_settings, snapshot.values)
    recovering = old_colour is not None and launcher_pid(settings, old_colour) is None
    if recovering:
        # The active instance died (e.g. SIGKILL): nothing to drain; this swap is the recovery.
        log(f"active colour {old_colour} has no running launcher: recovering onto the other colour")
    elif previous == version and old_colour is not None:
        return SwapResult(True, "noop", f"{version} already active on {old_colour}", old_colour, old_colour)
    new_colour: Colour = other(old_colour) if old_colour else COLOURS[0]

    # A colour kept warm (swap.keep_previous) on this very version and still ready (the control loop's fast check:
    # marker, launcher alive, /health) is reused; anything else on the idle colour is not serving (the route
    # points at old_colour): replace it.
    warm = (
        swap_settings.keep_previous
        and snapshot.values.get(swap_settings.colour_key(new_colour)) == version
        and check_colour(settings, new_colour, full=False).ok
    )
    if warm:
        log(f"{new_colour} still runs {version} (kept warm): no start")
    else:
        stop_colour(settings, new_colour)
    try:
        if not warm:
            start_and_wait(settings, new_colour, model_dir, log)
        result = check_colour(settings, new_colour)
        if not result.ok:
            raise GateFailed("readiness", f"{new_colour}: {result.reason}")
        timings["ready_s"] = time.monotonic() - started
        log(f"OK readiness {new_colour}: {result.reason}")
        old_pid = launcher_pid(settings, old_colour) if old_colour is not None else None
        candidate = release.Candidate(settings, new_colour, release.process_tree(old_pid) if old_pid else frozenset())
        checks = release.run_checks(candidate)
        if release.failed(checks):
            raise GateFailed("release-check", release.summary(checks))
        timings["release_check_s"] = time.monotonic() - started - timings["ready_s"]
        skipped = [c.name for c in checks if c.skipped]
        log(
            f"OK release-check {new_colour}: {len(checks) - len(skipped)} passed"
            + (f", skipped by settings: {', '.join(skipped)}" if skipped else "")
        )
        if warm:
            log(f"load-chaos skipped: {new_colour} passed it when {version} was swapped in")
        elif settings.chaos.enabled:
            gated = time.monotonic()
            outcome = chaos.gate(settings.chaos, candidate.base_url, settings.engine.served_model_name, log)
            if not outcome.ok:
                raise GateFailed("load-chaos", outcome.detail)
            timings["load_chaos_s"] = time.monotonic() - gated
            log(f"OK load-chaos {new_colour}: {outcome.detail}")
        proof = prove_ready(settings, new_colour, version)
        puts = {
            swap_settings.active_key: version,
            swap_settings.colour_key(new_colour): version,
            proof_key(swap_settings, new_colour): proof.to_text(),
        }
        if previous is not None and previous != version:
            puts[swap_settings.previous_key] = previous
        if old_colour is not None and (recovering or not swap_settings.keep_previous):
            # The old colour stops after the drain, or is dead: it no longer names a version the route may follow
            # (kept, a dead colour would name the same version as the new one, and blue would win the route).
            puts[swap_settings.colour_key(old_colour)] = ""
        try:
            succeeded, revision = etcd.compare_and_swap(swap_settings.active_key, previous, puts)
        except EtcdError as error:
            raise GateFailed("compare-and-swap", str(error)) from error
        if not succeeded:
            raise GateFailed("compare-and-swap", f"{swap_settings.active_key} is no longer {previous!r}")
    except GateFailed as failure:
        stop_colour(settings, new_colour)
        return SwapResult(False, failure.gate, failure.reason + "; key untouched, new instance stopped", new_colour,
                          old_colour, timings)  # fmt: skip
    written, written_at = time.monotonic(), time.time()
    log(f"OK compare-and-swap {swap_settings.active_key}: {previous} -> {version} (revision {revision})")

    # After the write the key is the truth; failures from here on are reported, never rolled back silently.
    answer = first_answer_from(settings, new_colour, swap_settings.switch_timeout_s)
    if answer is None:
        reason = f"Envoy still not serving {new_colour} {swap_settings.switch_timeout_s}s after the write"
        return SwapResult(False, "route-switch", reason, new_colour, old_colour, timings, written_at)
    timings["switch_asked_s"] = answer.asked_at - written
    timings["switch_s"] = answer.answered_at - written
    log(f"OK route-switch to {new_colour} in {timings['switch_s'] * 1000:.0f} ms")

    if old_colour is not None and launcher_pid(settings, old_colour) is not None:
        admin = EnvoyAdmin(swap_settings.admin_port)
        try:
            timings["drain_s"] = wait_idle(admin, old_colour, swap_settings.drain_idle_s, swap_settings.drain_max_s,
                                           swap_settings.poll_interval_s)  # fmt: skip
        except GateFailed as failure:
            return SwapResult(False, failure.gate, failure.reason + "; old instance left running", new_colour,
                              old_colour, timings, written_at)  # fmt: skip
        drained = f"OK drain {old_colour}: idle {swap_settings.drain_idle_s}s after {timings['drain_s']:.1f}s, "
        if swap_settings.keep_previous:
            log(drained + f"kept warm on {previous} for a rollback")
        else:
            timings["stop_s"] = stop_colour(settings, old_colour)
            log(drained + f"stopped in {timings['stop_s']:.1f}s")
    return SwapResult(True, "done", f"{version} active on {new_colour}", new_colour, old_colour, timings, written_at)


def start_and_wait(settings: ServiceSettings, colour: Colour, model_dir: Path, log: Callable[[str], None]) -> None:
    """Starts the colour's launcher on model_dir and waits for its ready marker (gate readiness)."""
    start_colour(settings, colour, model_dir)
    log(f"started {colour} ({model_dir.name}) on port {settings.swap.port(colour)}")
    deadline = time.monotonic() + settings.swap.ready_timeout_s
    while True:
        pid = launcher_pid(settings, colour)
        if pid is None or not pid_alive(pid):
            tail = launcher_log_tail(settings, colour).strip()
            raise GateFailed("readiness", f"{colour} launcher exited before ready: ...{tail}")
        if colour_readiness(settings, colour).ready_marker.exists():
            # Its full share before the gates that measure it (release-check, load-chaos) and before it serves.
            cpu_share(settings, colour, starting=False)
            return
        if time.monotonic() > deadline:
            raise GateFailed("readiness", f"{colour} not ready after {settings.swap.ready_timeout_s}s")
        time.sleep(settings.swap.poll_interval_s)


def prove_ready(settings: ServiceSettings, colour: Colour, version: str) -> ReadinessProof:
    """The full readiness check once more, right before the etcd write: the proof that the write carries, so
    that the control loop can switch without asking the engine again (gate readiness)."""
    launcher = marker_pid(colour_readiness(settings, colour).ready_marker)
    result = check_colour(settings, colour)
    if not result.ok or launcher is None:
        raise GateFailed("readiness", f"{colour} just before the etcd write: {result.reason}")
    return ReadinessProof(version, launcher, time.time())


def rollback(settings: ServiceSettings, model_name: str, log: Callable[[str], None] = print) -> SwapResult:
    """A swap back to the version that was active before the last swap (etcd's `previous` key)."""
    swap_settings = settings.swap
    try:
        values = Etcd(swap_settings.etcd_url, swap_settings.etcd_timeout_s).get_prefix(swap_settings.key_prefix).values
    except EtcdError as error:
        return SwapResult(False, "etcd", str(error))
    previous = values.get(swap_settings.previous_key)
    if not previous:
        return SwapResult(False, "rollback", f"no previous version recorded under {swap_settings.previous_key}")
    log(f"rollback: {values.get(swap_settings.active_key)} -> {previous}")
    return swap(settings, model_name, previous, log)
