"""host_tuning on a lab VM (qemu, real kernel, GRUB inside the image): the cgroup v2 argument goes
into GRUB, the `auto` policy reboots, the reboot is proven by a new boot id and the effect by cgroup2fs;
the `defer` policy leaves the reboot-required markers instead.
The VM image boots with systemd.unified_cgroup_hierarchy=0 (cgroup v1), like an older server.

The change that needs the reboot is rolled through a fleet of the VM and two container hosts by `ironserve rollout`:
the VM first and alone (the canary), its reboot inside its change phase, the gate after it, then the two containers
together in one batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve_lab import remote
from ironserve_lab.deploying import deploy, verify
from ironserve_lab.inventory import write_fleet_inventory
from ironserve_lab.state import LabHost
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.vm
# Only host_tuning: under software emulation every other role's packages cost minutes.
HOST_TUNING = ("host_tuning",)
GRUB_GATE_TEST = "test_grub_carries_cgroup_v2"
CGROUP_ARG = "systemd.unified_cgroup_hierarchy=1"


ROLLOUT: dict[str, object] = {}  # the rollout's record, for the test that reads it


@pytest.fixture(scope="module")
def rebooted_vm(vm_host: LabHost, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHost, str, str]]:
    before_boot = remote.boot_id(vm_host)
    before_fs = remote.run(vm_host, "stat -fc %T /sys/fs/cgroup").strip()
    folder = tmp_path_factory.mktemp("rollout")
    with lab_containers(2) as containers:
        inventory = write_fleet_inventory(folder / "fleet.py", [vm_host.name, *(host.name for host in containers)])
        argv = [sys.executable, "-m", "ironserve", "rollout", "--roles", "host_tuning", "--reports", str(folder)]
        argv += ["--canary", vm_host.name, "--canary-pause", "0", "--batch", "2", "--max-unavailable", "2"]
        # The lab reaches no time server, so a lab VM's clock never reports synchronised: that one check is left
        # out of the prove phase's gate (a container's is skipped: it shares this machine's clock).
        argv += [str(inventory), "-k", "not test_clock_synchronised"]
        done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
        print(done.stdout)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
        ROLLOUT.update(json.loads((folder / "rollout.json").read_text()), output=done.stdout)
    yield vm_host, before_boot, before_fs


def test_the_rollout_rebooted_the_vm_in_its_change_and_proved_it_after(
    rebooted_vm: tuple[LabHost, str, str],
) -> None:
    vm = rebooted_vm[0]
    hosts = ROLLOUT["hosts"]
    assert isinstance(hosts, dict)
    record = hosts[vm.name]
    assert (record["batch"], record["result"], record["rebooted"]) == (0, "ok", True), record
    assert record["changes"] > 0 and set(record["seconds"]) == {"drain", "change", "prove", "return"}
    assert [(h["batch"], h["result"]) for h in hosts.values()] == [(0, "ok"), (1, "ok"), (1, "ok")]
    assert ROLLOUT["status"] == "completed"
    batch = ", ".join(name for name in hosts if name != vm.name)
    assert f"batch 2/2: {batch}\n" in str(ROLLOUT["output"])


@pytest.mark.invariant("kernel-cgroup-v2")
def test_auto_policy_reboots_into_cgroup_v2(rebooted_vm: tuple[LabHost, str, str]) -> None:
    vm, before_boot, before_fs = rebooted_vm
    assert before_fs == "tmpfs"  # the image starts on cgroup v1
    assert remote.boot_id(vm) != before_boot
    assert CGROUP_ARG in remote.run(vm, "cat /proc/cmdline")
    assert remote.run(vm, "stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs"
    assert CGROUP_ARG in remote.run(vm, "grep ^GRUB_CMDLINE_LINUX= /etc/default/grub")


@pytest.mark.invariant("sysctl-rmem-max", "sysctl-wmem-max")
def test_kernel_global_sysctls_live_on_a_real_kernel(rebooted_vm: tuple[LabHost, str, str]) -> None:
    vm = rebooted_vm[0]
    assert remote.run(vm, "sysctl -n net.core.rmem_max net.core.wmem_max").split() == ["26214400", "26214400"]


def test_second_run_changes_nothing_and_does_not_reboot(rebooted_vm: tuple[LabHost, str, str]) -> None:
    vm = rebooted_vm[0]
    boot = remote.boot_id(vm)
    again = deploy([vm], roles=HOST_TUNING)
    assert (again.returncode, again.changed) == (0, 0), again.output
    assert remote.boot_id(vm) == boot


def test_grub_drift_is_restored_without_a_reboot(rebooted_vm: tuple[LabHost, str, str]) -> None:
    vm = rebooted_vm[0]
    boot = remote.boot_id(vm)
    remote.run(vm, f"sed -i 's/{CGROUP_ARG}/systemd.unified_cgroup_hierarchy=0/' /etc/default/grub && update-grub")
    restored = deploy([vm], roles=HOST_TUNING)
    assert restored.returncode == 0, restored.output
    assert restored.changed >= 1
    assert CGROUP_ARG in remote.run(vm, "grep ^GRUB_CMDLINE_LINUX= /etc/default/grub")
    assert CGROUP_ARG in remote.run(vm, "cat /boot/grub/grub.cfg")
    # The running kernel already had the argument, so the auto policy had nothing to reboot for.
    assert remote.boot_id(vm) == boot
    assert deploy([vm], roles=HOST_TUNING).changed == 0


def test_grub_drop_in_override_is_restored_without_a_reboot(rebooted_vm: tuple[LabHost, str, str]) -> None:
    vm = rebooted_vm[0]
    boot = remote.boot_id(vm)
    # Sorted before the image's ironserve-lab.cfg, which appends the serial console to whatever this one sets.
    drop_in = "/etc/default/grub.d/99-site.cfg"
    try:
        remote.run(vm, f"printf '%s\\n' 'GRUB_CMDLINE_LINUX=\"console=ttyS0\"' > {drop_in} && update-grub 2>/dev/null")
        assert CGROUP_ARG not in remote.run(vm, "cat /boot/grub/grub.cfg")
        assert GRUB_GATE_TEST in _gate_failures(vm)  # the gate reads the value update-grub computes
        restored = deploy([vm], roles=HOST_TUNING)
        assert restored.returncode == 0, restored.output
        assert restored.changed >= 1
        assert CGROUP_ARG in remote.run(vm, f"grep ^GRUB_CMDLINE_LINUX= {drop_in}")
        assert CGROUP_ARG in remote.run(vm, "cat /boot/grub/grub.cfg")
        assert "$GRUB_CMDLINE_LINUX" in remote.run(
            vm, "grep ^GRUB_CMDLINE_LINUX= /etc/default/grub.d/ironserve-lab.cfg"
        )
        assert remote.boot_id(vm) == boot  # the running kernel already had the argument
        again = deploy([vm], roles=HOST_TUNING)
        assert (again.returncode, again.changed) == (0, 0), again.output
        assert GRUB_GATE_TEST not in _gate_failures(vm)
    finally:
        remote.run(vm, f"rm -f {drop_in} && update-grub 2>/dev/null")


def _gate_failures(vm: LabHost) -> str:
    """The FAILED lines of the host_tuning gate on `vm` (other checks of a VM, e.g. its clock, may fail too)."""
    gate = verify([vm], "-q", "-rfE", roles=HOST_TUNING)
    return "\n".join(line for line in gate.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))


def test_defer_policy_leaves_a_marker_and_does_not_reboot(
    rebooted_vm: tuple[LabHost, str, str], tmp_path: Path
) -> None:
    vm = rebooted_vm[0]
    boot = remote.boot_id(vm)
    extra_arg = "ironserve.defer_test=1"
    inventory = tmp_path / "defer.py"
    inventory.write_text(
        textwrap.dedent(f"""
        from ironserve_lab.inventory import lab_groups

        _, lab_vms = lab_groups()
        lab_vms = [
            (name, {{**data, "ironserve_reboot_policy": "defer",
                     "host_tuning_kernel_args": [{CGROUP_ARG!r}, {extra_arg!r}]}})
            for name, data in lab_vms if name == {vm.name!r}
        ]
        """)
    )
    try:
        first = deploy([vm], str(inventory), roles=HOST_TUNING)
        assert first.returncode == 0, first.output
        assert extra_arg in remote.run(vm, "grep ^GRUB_CMDLINE_LINUX= /etc/default/grub")
        assert remote.boot_id(vm) == boot  # deferred: no reboot
        assert "System restart required" in remote.run(vm, "cat /run/reboot-required")
        assert extra_arg in remote.run(vm, "cat /run/ironserve/reboot-required")
        again = deploy([vm], str(inventory), roles=HOST_TUNING)
        assert (again.returncode, again.changed) == (0, 0), again.output
    finally:
        remote.run(
            vm,
            f"sed -i 's/ {extra_arg}//' /etc/default/grub && update-grub 2>/dev/null"
            " && rm -f /run/reboot-required /run/ironserve/reboot-required",
        )
