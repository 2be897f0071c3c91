"""roles/security on a real lab container host: the boundary proven by behaviour (drift: tests/lab/test_drift.py).

A unit named like the service (ai-service.service) picks up the installed hardening drop-in; what
it reports about itself (uid, CapEff, cgroup) and what its syscall filter refuses is the proof.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest

from ironserve_lab import remote
from ironserve_lab.deploying import deploy
from ironserve_lab.state import LabHost
from roles import stack_config
from roles.security.render import DROPIN_NAME, dropin_properties, slice_cgroup, systemd_run_command
from tests.lab.conftest import lab_containers
from tests.lab.ssh import ssh_run

# Only the two roles under test: their own convergence and zero-change re-run.
SECURITY_RUNTIME = ("security", "container_runtime")
pytestmark = pytest.mark.lab
SETTINGS = stack_config("lab", {}).security
DROPIN = f"/etc/systemd/system/ai-service.service.d/{DROPIN_NAME}"
WORKLOAD = (
    "import json, ssl, hashlib, threading, sqlite3, subprocess, ctypes, os, numpy; "
    "a = numpy.random.default_rng(0).random((256, 256)); assert abs((a @ a.T).trace()) > 0; "
    "t = [threading.Thread(target=hashlib.sha256, args=(b'x',)) for _ in range(4)]; [x.start() for x in t]; "
    "[x.join() for x in t]; assert subprocess.run(['true']).returncode == 0; "
    "status = dict(line.split(':', 1) for line in open('/proc/self/status')); "
    "cgroup = open('/proc/self/cgroup').read().split('::')[-1].strip(); "
    "print('workload-ok', os.geteuid(), status['CapEff'].strip(), cgroup)"
)
# Each forbidden call with a way to tell the filter's EPERM from any other refusal.
CALLS = (
    "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
    "def show(name, rc): print(name, rc, os.strerror(ctypes.get_errno()) if rc else 'ok')\n"
    "show('mount', libc.mount(b'none', b'/mnt', b'tmpfs', 0, None))\n"
    "show('kexec_load', libc.syscall(246, 0, 0, 0, 0))\n"  # unfiltered: ENOSYS (kernel) or EPERM (no capability)
    "show('unshare', libc.unshare(0x10000000))\n"  # CLONE_NEWUSER, allowed to anyone unfiltered; last, it moves us
)


@pytest.fixture(scope="module")
def converged() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        first = deploy(hosts, roles=SECURITY_RUNTIME)
        assert first.returncode == 0, first.output
        assert first.changed > 0, first.output
        remote.run(
            hosts[0], "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-numpy"
        )
        yield hosts[0]


def test_second_deploy_reports_zero_changes(converged: LabHost) -> None:
    again = deploy([converged], roles=SECURITY_RUNTIME)
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


@pytest.mark.invariant("sec-ai-runner-user", "sec-ai-runner-group")
def test_account(converged: LabHost) -> None:
    assert remote.run(converged, "getent passwd ai-runner").strip().endswith(":/bin/false")
    assert remote.run(converged, "passwd -S ai-runner").split()[1] == "L"
    assert len(remote.run(converged, "getent group ai-runner").splitlines()) == 1
    rc, out, _ = ssh_run(converged, "su -s /bin/sh -c id ai-runner </dev/null; su -c id ai-runner </dev/null")
    assert "uid=" in out  # root may still switch with an explicit shell (how services start) ...
    assert rc != 0  # ... but the account's own shell refuses a login


@pytest.mark.invariant("sec-non-root-service", "sec-cap-sys-nice", "sec-seccomp-profile")
def test_service_unit_runs_the_workload_as_ai_runner_with_cap_sys_nice_only(converged: LabHost) -> None:
    unit = (
        "[Unit]\nDescription=stand-in for the inference service\n[Service]\nType=oneshot\n"
        f"ExecStart=/usr/bin/python3 -c {shlex.quote(WORKLOAD)}\n"
    )
    remote.run(converged, f"cat > /etc/systemd/system/ai-service.service <<'EOF'\n{unit}EOF\nsystemctl daemon-reload")
    try:
        remote.run(converged, "systemctl start ai-service.service")
        line = remote.run(converged, "journalctl -u ai-service.service -o cat --no-pager | grep workload-ok | tail -1")
        _, uid, cap_eff, cgroup = line.split()
        assert uid == remote.run(converged, "id -u ai-runner").strip() != "0"
        assert cap_eff == "0000000000800000"  # CAP_SYS_NICE, nothing else
        assert cgroup == slice_cgroup("ai-service.slice") + "/ai-service.service"
        shown = remote.run(converged, "systemctl show ai-service.slice -p MemoryMax -p DevicePolicy -p CPUWeight")
        assert {"MemoryMax=25769803776", "DevicePolicy=closed", "CPUWeight=1000"} <= set(shown.split())
    finally:
        remote.run(converged, "rm -f /etc/systemd/system/ai-service.service && systemctl daemon-reload")


def test_filter_refuses_what_unfiltered_processes_may_do(converged: LabHost) -> None:
    dropin = remote.run(converged, f"cat {DROPIN}")
    python = "python3 -c " + shlex.quote(CALLS)
    # As the service user: unshare(CLONE_NEWUSER) works without the filter, EPERM under it.
    free = remote.run(converged, f"setpriv --reuid ai-runner --regid ai-runner --clear-groups {python}")
    assert "unshare 0 ok" in free
    boxed = remote.run(converged, systemd_run_command(dropin, python))
    assert "unshare -1 Operation not permitted" in boxed
    assert "kexec_load -1 Operation not permitted" in boxed
    # As root with only the syscall filter (no capability drop): mount works unfiltered, EPERM under it.
    filter_only = "[Service]\n" + "\n".join(
        f"{k}={v}"
        for k, v in dropin_properties(dropin)
        if k.startswith("SystemCall") or k in {"RestrictNamespaces", "LockPersonality"}
    )
    root_boxed = remote.run(converged, systemd_run_command(filter_only, python))
    assert "mount -1 Operation not permitted" in root_boxed
    root_free = remote.run(converged, f"{python}; umount /mnt")
    assert "mount 0 ok" in root_free


@pytest.mark.invariant("cgroup-ai-service-devices-deny")
def test_slice_device_filter_refuses_a_non_nvidia_device(converged: LabHost) -> None:
    # A char device outside the allow-list (1:11, kmsg's numbers, opened read-only and closed at once):
    # root opens it from system.slice, but not from the service slice (DevicePolicy=closed, eBPF filter).
    remote.run(converged, "mknod -m 600 /dev/ironserve-probe c 1 11")
    try:
        code = "open('/dev/ironserve-probe', 'rb').close(); open('/dev/null', 'rb').close(); print('opened')"
        probe = f'python3 -c "{code}"'
        assert remote.run(converged, f"systemd-run --quiet --wait --pipe --collect {probe}").strip() == "opened"
        rc, _, err = ssh_run(
            converged, f"systemd-run --quiet --wait --pipe --collect -p Slice={SETTINGS.slice} {probe}"
        )
        assert rc != 0 and "PermissionError: [Errno 1] Operation not permitted: '/dev/ironserve-probe'" in err
    finally:
        remote.run(converged, "rm -f /dev/ironserve-probe")
