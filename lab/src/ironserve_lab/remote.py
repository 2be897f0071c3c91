"""Commands on lab hosts over real SSH: run, wait for SSH, reboot and prove the reboot happened.

A reboot is proven by a changed /proc/sys/kernel/random/boot_id, never by SSH
merely answering again: right after `reboot` the old system may still accept logins.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from ironserve_lab import state
from ironserve_lab.state import LabHost

SSH_ATTEMPT_TIMEOUT_S = 20
POLL_INTERVAL_S = 2.0
PROGRESS_INTERVAL_S = 15.0


def ssh_argv(host: LabHost) -> list[str]:
    return [
        "ssh",
        "-i",
        str(state.ssh_key_path()),
        "-o",
        f"UserKnownHostsFile={state.known_hosts_path()}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        "-p",
        str(host.ssh_port),
        f"{host.ssh_user}@{host.ssh_address}",
    ]


def run(host: LabHost, command: str, timeout: float = 120) -> str:
    """Run a shell command on `host`; return its stdout, raise with its stderr on failure."""
    result = subprocess.run(
        [*ssh_argv(host), command], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if result.returncode != 0:
        output = result.stderr.strip() or result.stdout.strip()
        raise RuntimeError(f"{host.name}: `{command}` exited {result.returncode}: {output}")
    return result.stdout


def _try_boot_id(host: LabHost) -> str | None:
    """The boot id, or None while SSH does not answer (booting, shutting down)."""
    try:
        return run(host, "cat /proc/sys/kernel/random/boot_id", timeout=SSH_ATTEMPT_TIMEOUT_S).strip()
    except (RuntimeError, subprocess.TimeoutExpired):
        return None


def boot_id(host: LabHost) -> str:
    return run(host, "cat /proc/sys/kernel/random/boot_id").strip()


def _wait(
    host: LabHost,
    timeout: float,
    what: str,
    done: Callable[[str], bool],
    still_running: Callable[[], bool] | None,
) -> str:
    started = time.monotonic()
    last_progress = started
    while True:
        current = _try_boot_id(host)
        elapsed = time.monotonic() - started
        if current is not None and done(current):
            print(f"lab: {host.name}: {what} after {elapsed:.0f} s", file=sys.stderr)
            return current
        if still_running is not None and not still_running():
            raise RuntimeError(f"{host.name}: the host stopped while waiting for {what}")
        if elapsed > timeout:
            raise TimeoutError(f"{host.name}: no {what} within {timeout:.0f} s")
        if time.monotonic() - last_progress >= PROGRESS_INTERVAL_S:
            print(f"lab: {host.name}: waiting for {what} ({elapsed:.0f} s)", file=sys.stderr)
            last_progress = time.monotonic()
        time.sleep(POLL_INTERVAL_S)


def wait_for_ssh(host: LabHost, timeout: float, still_running: Callable[[], bool] | None = None) -> str:
    """Wait until `host` accepts SSH logins; return its boot id.

    `still_running` lets the caller stop early when the host's process died.
    """
    return _wait(host, timeout, "SSH", lambda _: True, still_running)


def wait_for_reboot(
    host: LabHost, old_boot_id: str, timeout: float, still_running: Callable[[], bool] | None = None
) -> str:
    """Wait until `host` answers SSH with a boot id other than `old_boot_id`; return the new one."""
    return _wait(host, timeout, "SSH after reboot", lambda current: current != old_boot_id, still_running)


def reboot(host: LabHost, timeout: float, still_running: Callable[[], bool] | None = None) -> str:
    """Reboot `host` from inside and wait until it is back; return the new boot id."""
    old = boot_id(host)
    # The connection may drop before ssh reports the exit status; the boot id is the proof.
    subprocess.run(
        [*ssh_argv(host), "systemctl reboot"],
        capture_output=True,
        timeout=SSH_ATTEMPT_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return wait_for_reboot(host, old, timeout, still_running)
