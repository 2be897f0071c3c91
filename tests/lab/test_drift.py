"""Drift real servers get, on two converged lab container hosts: the gate names it, the deploy restores it.

Each drift is applied by SSH the way an admin, a package upgrade, a cleanup script or patch day would make it.
Drifts that do not interact share a round, and the two hosts drift differently in each round; a round is: apply
every drift, `ironserve verify` fails naming each (its gate test on that host), one `ironserve deploy` of both
hosts, each drift checked restored on the host itself (not by the gate), the next deploy changes nothing, the
gate passes. A path's content, mode and owner are compared with a copy taken before the drift.

Cost: one two-host lab (about 10 s), a first deploy (about 40 s), then about 2 minutes per round.
Simulated at the edge only: the NVIDIA packages come from the lab's signed mirror of stand-ins (lab/src/ironserve_lab).
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ironserve.owned import CLEAR_IMMUTABLE_KEY
from ironserve_lab import remote
from ironserve_lab.deploying import HOST_ROLES, DeployResult, deploy, verify
from ironserve_lab.paths import lab_dir
from ironserve_lab.state import LabHost
from roles import stack_config
from roles.nvidia import KEYRING, NOUVEAU_BLACKLIST, PREFERENCES, SOURCES_LIST, UNATTENDED_BLACKLIST
from roles.security.render import DROPIN_NAME
from tests.lab.conftest import inventory_with, lab_containers
from tests.lab.ssh import ssh_run

pytestmark = pytest.mark.lab
CONFIG = stack_config("lab", {})
SAVED = "/root/drift-saved"
DROPIN = f"/etc/systemd/system/ai-service.service.d/{DROPIN_NAME}"
TEMPLATE_DROPIN = f"/etc/systemd/system/ai-service@.service.d/{DROPIN_NAME}"
SLICE_UNIT = f"/etc/systemd/system/{CONFIG.security.slice}"
SECCOMP = f"{CONFIG.security.kubelet_seccomp_dir}/ai-service.json"
SYSCTLS = CONFIG.host_tuning.sysctl_file
POD_SYSCTLS = "/etc/sysctl.d/91-ironserve-containers.conf"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
NVIDIA_CLI = "/etc/nvidia-container-runtime/config.toml"
CUDA_HOME = "/usr/local/cuda-11.8"
CUDA_KEYRING_LIST = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"
CONTAINERD_OVERRIDE = "/etc/systemd/system/containerd.service.d/override.conf"
MODULES_LOAD = "/etc/modules-load.d/ironserve-containers.conf"
RUNNER = CONFIG.security.user
SUDO_REFUSES = f"LC_ALL=C sudo -n -l -U {RUNNER} | grep -q 'is not allowed to run sudo'"


@dataclass(frozen=True)
class Drift:
    name: str
    make: str  # shell run as root on the host
    gate: str  # the gate test (part of its name) that fails while the drift is there
    restored: str = "true"  # shell that exits 0 once the deploy restored it, besides the saved paths
    saved: tuple[str, ...] = ()  # paths whose content, mode and owner must come back as they were
    said: str = ""  # what the deploy's output must say of it (the file it names), besides restoring it


def same_as_saved(path: str) -> str:
    saved, quoted = shlex.quote(SAVED + path), shlex.quote(path)
    return (
        f"[ -f {quoted} ] && [ ! -L {quoted} ] && cmp -s {saved} {quoted} && "
        f'[ "$(stat -c %a:%U:%G {quoted})" = "$(stat -c %a:%U:%G {saved})" ]'
    )


def enabled_and_active(unit: str) -> str:
    return f"[ $(systemctl is-enabled {unit}) = enabled ] && systemctl is-active -q {unit}"


# Round -> (drifts on the first host, drifts on the second host).
ROUNDS: dict[str, tuple[tuple[Drift, ...], tuple[Drift, ...]]] = {
    "admin-and-cleanup": (
        (
            Drift(
                "pin-priority-lowered",
                f"sed -i 's/Pin-Priority: .*/Pin-Priority: 500/' {PREFERENCES}",
                "test_apt_pins_every_locked_version_above_1000",
                saved=(PREFERENCES,),
            ),
            Drift(
                "unattended-blacklist-entry-removed",
                f"sed -i '3d' {UNATTENDED_BLACKLIST}",
                "test_unattended_upgrades_leave_the_lock_alone",
                saved=(UNATTENDED_BLACKLIST,),
            ),
            Drift(
                "nouveau-blacklist-removed",
                f"rm {NOUVEAU_BLACKLIST}",
                "test_nouveau_is_blacklisted",
                saved=(NOUVEAU_BLACKLIST,),
            ),
            Drift(
                "cuda-home-changed",
                "sed -i 's|^CUDA_HOME=.*|CUDA_HOME=/usr/local/cuda-12.0|' /etc/environment",
                "test_cuda_home_is_set_system_wide",
                f"grep -qx CUDA_HOME={CUDA_HOME} /etc/environment",
            ),
            Drift(
                "cuda-link-replaced-by-a-directory",
                "rm /usr/local/cuda && mkdir /usr/local/cuda && touch /usr/local/cuda/leftover",
                "test_no_other_cuda_toolkit_and_cuda_link_is_the_lock",
                f'[ "$(readlink /usr/local/cuda)" = {CUDA_HOME} ]',
            ),
            Drift(
                "nvcc-deleted",
                f"rm {CUDA_HOME}/bin/nvcc",
                "test_cuda_toolkit_version_on_disk",
                f"[ -x {CUDA_HOME}/bin/nvcc ]",
            ),
            Drift(
                "persistenced-masked",
                "systemctl mask --now nvidia-persistenced",
                "test_persistence_daemon_enabled_and_running",
                enabled_and_active("nvidia-persistenced"),
            ),
            Drift(
                "containerd-masked",
                "systemctl mask --now containerd",
                "test_containerd_running_and_answering",
                enabled_and_active("containerd"),
            ),
            Drift(
                "containerd-cgroup-driver-edited",
                f"sed -i 's/SystemdCgroup = true/SystemdCgroup = false/' {CONTAINERD_CONFIG}",
                "test_systemd_cgroup_driver_for_every_runtime",
                saved=(CONTAINERD_CONFIG,),
            ),
            Drift(
                "nvidia-cli-config-typo",
                f"sed -i 's/^\\[nvidia-container-cli\\]/[nvidia-container-cli/' {NVIDIA_CLI}",
                "test_nvidia_container_cli_keeps_cgroups",
                f"python3 -c \"import tomllib; c = tomllib.load(open('{NVIDIA_CLI}', 'rb'));"
                " assert c['nvidia-container-cli']['no-cgroups'] is False\"",
            ),
            Drift(
                "cni-conf-dir-world-writable",
                f"chmod 0777 {CONFIG.container_runtime.cni_conf_dir}",
                "test_cni_directory_root_owned_0755",
                f"[ $(stat -c %a {CONFIG.container_runtime.cni_conf_dir}) = 755 ]",
            ),
            Drift(
                "swapfile-in-fstab",
                "echo '/swapfile none swap sw 0 0' >> /etc/fstab",
                "test_no_swap_line_in_fstab",
                "! grep -qE '^[^#]\\S*\\s+\\S+\\s+swap\\s' /etc/fstab",
            ),
            Drift(
                "containerd-unheld",
                "apt-mark unhold containerd",
                "test_containerd_package_pinned_and_held",
                "apt-mark showhold | grep -qx containerd",
            ),
            Drift(
                "containerd-pin-file-deleted",
                "rm /etc/apt/preferences.d/ironserve-containerd",
                "test_containerd_pin_file_is_the_rendered_one",
                saved=("/etc/apt/preferences.d/ironserve-containerd",),
            ),
            Drift(
                "cuda-profile-edited",
                "sed -i 's|^export CUDA_HOME=.*|export CUDA_HOME=/opt/cuda|' /etc/profile.d/cuda.sh",
                "test_cuda_home_is_set_system_wide",
                saved=("/etc/profile.d/cuda.sh",),
            ),
            Drift(
                "cni-parent-world-writable",
                "chmod o+w /etc/cni",
                "test_cni_directory_root_owned_0755",
                "[ $(stat -c %a /etc/cni) = 755 ]",
            ),
        ),
        (
            Drift(
                "sysctl-file-edited",
                f"sed -i 's/^net.core.rmem_max.*/net.core.rmem_max = 212992/' {SYSCTLS}",
                "test_sysctl_persisted",
                saved=(SYSCTLS,),
            ),
            Drift(
                "sysctl-live-value-changed",
                "sysctl -qw net.ipv4.tcp_slow_start_after_idle=1",
                "test_sysctl_live",
                "[ $(sysctl -n net.ipv4.tcp_slow_start_after_idle) = 0 ]",
            ),
            Drift(
                "timesyncd-masked",
                "systemctl mask systemd-timesyncd",
                "test_time_sync_service_enabled",
                "[ $(systemctl is-enabled systemd-timesyncd) = enabled ]",
            ),
            Drift(
                "login-shell",
                "usermod -s /bin/bash ai-runner",
                "test_service_user_is_a_system_account_without_login",
                "getent passwd ai-runner | grep -q ':/bin/false$'",
            ),
            Drift(
                "password-set",
                "usermod -p plain-text-password ai-runner",
                "test_service_user_password_is_locked",
                "[ $(passwd -S ai-runner | cut -d' ' -f2) = L ]",
            ),
            Drift(
                "added-to-sudo-and-disk",
                "usermod -aG sudo,disk ai-runner",
                "test_service_account_is_in_no_privileged_group",
                '[ "$(id -nG ai-runner)" = ai-runner ]',
            ),
            Drift(
                "state-dir-opened",
                f"chmod 0755 {CONFIG.security.state_dir}",
                "test_service_directories_least_privilege",
                f"[ $(stat -c %a {CONFIG.security.state_dir}) = 700 ]",
            ),
            Drift(
                "model-dir-given-away",
                f"chown nobody {CONFIG.security.model_dir}",
                "test_service_directories_least_privilege",
                f"[ $(stat -c %U:%G {CONFIG.security.model_dir}) = root:ai-runner ]",
            ),
            Drift(
                "drop-in-weakened",
                f"sed -i 's/^NoNewPrivileges=yes/NoNewPrivileges=no/' {DROPIN}",
                "test_unit_has_the_rendered_drop_in",
                saved=(DROPIN,),
            ),
            Drift(
                "systemctl-edit-override-user-root",
                "mkdir -p /etc/systemd/system/ai-service.service.d && printf '[Service]\\nUser=root\\n' "
                "> /etc/systemd/system/ai-service.service.d/override.conf && systemctl daemon-reload",
                "test_no_foreign_drop_in_overrides_a_managed_unit",
                "[ ! -e /etc/systemd/system/ai-service.service.d/override.conf ]",
            ),
            Drift(
                "set-property-memory-max",
                f"systemctl set-property {CONFIG.security.slice} MemoryMax=1G",
                "test_slice_in_force_has_the_rendered_settings",
                f"[ $(systemctl show -p MemoryMax --value {CONFIG.security.slice}) = 25769803776 ]",
            ),
            Drift(
                "seccomp-profile-world-writable-nobody",
                f"chown nobody:nogroup {SECCOMP} && chmod 0666 {SECCOMP}",
                "test_managed_file_is_root_only",
                saved=(SECCOMP,),
            ),
            Drift(
                "drop-in-directory-group-writable",
                "chmod 0775 /etc/systemd/system/ai-service.service.d",
                "test_unit_drop_in_is_root_only",
                "[ $(stat -c %a /etc/systemd/system/ai-service.service.d) = 755 ]",
            ),
            Drift(
                "seccomp-directory-world-writable",
                f"chmod 0777 {CONFIG.security.kubelet_seccomp_dir}",
                "test_managed_file_is_root_only",
                f"[ $(stat -c %a {CONFIG.security.kubelet_seccomp_dir}) = 755 ]",
            ),
        ),
    ),
    "patch-day-and-shapes": (
        (
            Drift(
                "keyring-and-source-deleted",
                f"rm {KEYRING} {SOURCES_LIST} && apt-get update -qq",
                "test_apt_has_fetched_the_repository",
                "apt-cache policy cuda-toolkit-11-8 | grep -qE '^ +[0-9]+ https?://'",
                saved=(KEYRING, SOURCES_LIST),
            ),
            Drift(
                "holds-removed-then-upgrade",
                "apt-mark unhold $(apt-mark showhold) >/dev/null && "
                "DEBIAN_FRONTEND=noninteractive apt-get -qq -y upgrade",
                "test_the_whole_lock_is_installed_exactly",
                "apt-mark showhold | grep -q cuda-toolkit-11-8 && apt-mark showhold | grep -qx containerd",
            ),
            Drift(
                "modules-load-file-deleted",
                "rm /etc/modules-load.d/ironserve-containers.conf",
                "test_kernel_module_persisted",
                saved=("/etc/modules-load.d/ironserve-containers.conf",),
            ),
            Drift(
                "cni-conf-dir-replaced-by-a-file",
                f"rm -rf {CONFIG.container_runtime.cni_conf_dir} && touch {CONFIG.container_runtime.cni_conf_dir}",
                "test_cni_directory_root_owned_0755",
                f"[ -d {CONFIG.container_runtime.cni_conf_dir} ]",
            ),
            Drift(
                "swap-unit-enabled",
                "printf '[Swap]\\nWhat=/swapfile\\n[Install]\\nWantedBy=swap.target\\n' > "
                "/etc/systemd/system/swapfile.swap && systemctl enable swapfile.swap",
                "test_no_swap_unit_enabled",
                '[ "$(systemctl is-enabled swapfile.swap)" != enabled ]',
            ),
            Drift(
                "hardening-baseline-ip-forward-off",
                "echo 'net.ipv4.ip_forward = 0' > /etc/sysctl.d/99-hardening.conf",
                "test_pod_networking_sysctl_wins_at_boot",
                "! grep -q '^net.ipv4.ip_forward' /etc/sysctl.d/99-hardening.conf",
            ),
        ),
        (
            Drift(
                "sysctl-file-replaced-by-a-symlink",
                f"cp {SYSCTLS} /root/sysctl-copy.conf && ln -sf /root/sysctl-copy.conf {SYSCTLS}",
                "test_sysctl_file_is_a_root_owned_regular_file",
                saved=(SYSCTLS,),
            ),
            Drift(
                "later-sysctl-file-overrides",
                "echo 'net.core.rmem_max = 4096' > /etc/sysctl.d/99-zzz.conf",
                "test_sysctl_wins_at_boot",
                "! grep -q '^net.core.rmem_max' /etc/sysctl.d/99-zzz.conf",
            ),
            Drift(
                "sysctl-conf-overrides",
                "echo 'net.ipv4.tcp_slow_start_after_idle=1' >> /etc/sysctl.conf",
                "test_sysctl_wins_at_boot",
                "! grep -q '^net.ipv4.tcp_slow_start_after_idle' /etc/sysctl.conf",
            ),
            Drift(
                "timesyncd-disabled",
                "systemctl disable systemd-timesyncd",
                "test_time_sync_service_enabled",
                "[ $(systemctl is-enabled systemd-timesyncd) = enabled ]",
            ),
            Drift(
                "template-drop-in-deleted",
                f"rm '{TEMPLATE_DROPIN}'",
                "test_unit_has_the_rendered_drop_in",
                saved=(TEMPLATE_DROPIN,),
            ),
            Drift(
                "slice-unit-edited",
                f"sed -i 's/^MemoryMax=.*/MemoryMax=infinity/' {SLICE_UNIT}",
                "test_slice_unit_is_the_rendered_one",
                saved=(SLICE_UNIT,),
            ),
            Drift(
                "seccomp-profile-edited",
                f'sed -i \'s/"SCMP_ACT_ERRNO"/"SCMP_ACT_ALLOW"/\' {SECCOMP}',
                "test_kubelet_localhost_profile",
                saved=(SECCOMP,),
            ),
            Drift(
                "drop-in-replaced-by-a-writable-symlink",
                f"cp {DROPIN} /tmp/dropin.conf && chmod 666 /tmp/dropin.conf && ln -sf /tmp/dropin.conf {DROPIN}",
                "test_unit_drop_in_is_root_only",
                saved=(DROPIN,),
            ),
            Drift(
                "set-property-runtime-cpu-weight",
                f"systemctl set-property --runtime {CONFIG.security.slice} CPUWeight=1",
                "test_slice_in_force_has_the_rendered_settings",
                f"[ $(systemctl show -p CPUWeight --value {CONFIG.security.slice}) = {CONFIG.security.cpu_weight} ]",
            ),
        ),
    ),
    "an-admins-hand": (
        (
            Drift(
                "cuda-keyring-second-source",
                # What NVIDIA's cuda-keyring package adds: the same repository, signed by another keyring file.
                f"url=$(sed -n 's/^deb \\[[^]]*\\] \\([^ ]*\\) .*/\\1/p' {SOURCES_LIST}) && [ -n \"$url\" ] && "
                f"cp {KEYRING} /usr/share/keyrings/cuda-archive-keyring.gpg && "
                f'echo "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] $url /" > {CUDA_KEYRING_LIST} && '
                "! apt-cache policy >/dev/null 2>&1",
                "test_no_other_apt_source_names_the_repository",
                f"[ ! -e {CUDA_KEYRING_LIST} ] && [ -f /var/backups/ironserve{CUDA_KEYRING_LIST} ] && "
                "apt-cache policy >/dev/null 2>&1",
                said=CUDA_KEYRING_LIST,
            ),
            Drift(
                "containerd-started-with-another-config",
                f"sed 's/SystemdCgroup = true/SystemdCgroup = false/' {CONTAINERD_CONFIG} "
                "> /etc/containerd/other.toml && "
                "mkdir -p /etc/systemd/system/containerd.service.d && "
                "printf '[Service]\\nExecStart=\\nExecStart=%s --config /etc/containerd/other.toml\\n' "
                f'"$(command -v containerd)" > {CONTAINERD_OVERRIDE} && '
                "systemctl daemon-reload && systemctl restart containerd",
                "test_running_containerd_was_started_with_the_managed_config",
                f"[ ! -e {CONTAINERD_OVERRIDE} ] && systemctl is-active -q containerd && "
                "! tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value containerd)/cmdline | grep -q other.toml",
                said=CONTAINERD_OVERRIDE,
            ),
            Drift(
                "later-profile-script-exports-another-cuda-home",
                "printf 'export CUDA_HOME=/usr/local/cuda-12.0\\nexport PATH=$CUDA_HOME/bin:$PATH\\n' "
                "> /etc/profile.d/zz-cuda12.sh",
                "test_cuda_home_is_set_system_wide",
                f"[ \"$(bash -lc 'echo $CUDA_HOME')\" = {CUDA_HOME} ] && "
                "[ -f /var/backups/ironserve/etc/profile.d/zz-cuda12.sh ]",
                said="/etc/profile.d/zz-cuda12.sh",
            ),
            Drift(
                "sudoers-d-grants-the-service-account",
                f"echo '{RUNNER} ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/90-{RUNNER} && "
                f"chmod 0440 /etc/sudoers.d/90-{RUNNER}",
                "test_service_account_has_no_sudo_rights",
                f"{SUDO_REFUSES} && [ -f /var/backups/ironserve/etc/sudoers.d/90-{RUNNER} ]",
                said=f"/etc/sudoers.d/90-{RUNNER}",
            ),
            Drift(
                "containerd-config-world-writable",
                f"chown nobody:nogroup {CONTAINERD_CONFIG} && chmod 0666 {CONTAINERD_CONFIG}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(CONTAINERD_CONFIG,),
            ),
        ),
        (
            Drift(
                "nvidia-pin-file-world-writable",
                f"chmod 0666 {PREFERENCES}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(PREFERENCES,),
            ),
            Drift(
                "nvidia-source-owned-by-nobody",
                f"chown nobody {SOURCES_LIST}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(SOURCES_LIST,),
            ),
            Drift(
                "sysctl-file-group-writable",
                f"chmod 0664 {SYSCTLS}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(SYSCTLS,),
            ),
            Drift(
                "modprobe-blocks-the-nvidia-modules",
                "printf 'blacklist nvidia\\ninstall nvidia /bin/false\\nblacklist nvidia_uvm\\n"
                "install nvidia-uvm /bin/false\\n' > /etc/modprobe.d/zz-no-gpu.conf",
                "test_no_modprobe_rule_blocks_an_nvidia_module",
                "! modprobe --showconfig | grep -qE '^(blacklist nvidia|install nvidia[-_a-z]* /bin/false)' && "
                "[ -f /var/backups/ironserve/etc/modprobe.d/zz-no-gpu.conf ]",
                said="/etc/modprobe.d/zz-no-gpu.conf",
            ),
            Drift(
                "modprobe-blocks-the-container-modules",
                "printf 'install br_netfilter /bin/false\\nblacklist overlay\\n' > /etc/modprobe.d/hardening.conf",
                "test_no_modprobe_rule_blocks_a_container_module",
                "! modprobe --showconfig | grep -qE '^(install br_netfilter|blacklist overlay)' && "
                "[ -f /var/backups/ironserve/etc/modprobe.d/hardening.conf ]",
                said="/etc/modprobe.d/hardening.conf",
            ),
            Drift(
                "sudo-user-alias-names-the-service-account",
                f"printf 'User_Alias RUNNERS = deploy, {RUNNER}\\nRUNNERS ALL=(ALL) NOPASSWD: ALL\\n' "
                "> /etc/sudoers.d/runners && chmod 0440 /etc/sudoers.d/runners",
                "test_service_account_has_no_sudo_rights",
                f"{SUDO_REFUSES} && [ -f /var/backups/ironserve/etc/sudoers.d/runners ]",
                said="/etc/sudoers.d/runners",
            ),
            Drift(
                "nvidia-cli-config-world-writable",
                f"chmod 0666 {NVIDIA_CLI}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(NVIDIA_CLI,),
            ),
            Drift(
                "containerd-folder-world-writable",
                f"chmod 0777 {posixpath.dirname(CONTAINERD_CONFIG)}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                f'[ "$(stat -c %a:%U:%G {posixpath.dirname(CONTAINERD_CONFIG)})" = 755:root:root ]',
            ),
            Drift(
                "modules-load-file-world-writable",
                f"chmod 0666 {MODULES_LOAD}",
                "test_files_deciding_what_runs_as_root_are_root_only",
                saved=(MODULES_LOAD,),
            ),
        ),
    ),
}
DRIFTS = [
    (name, index, drift) for name, pair in ROUNDS.items() for index, drifts in enumerate(pair) for drift in drifts
]


@dataclass
class RoundResult:
    gate_failures: list[str]  # FAILED lines of the gate while the drifts were there
    deployed: DeployResult
    restored: dict[str, tuple[int, str]]  # drift -> (status of its check on the host, its output)
    again: DeployResult
    gate_after: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[LabHost]]:
    with lab_containers(2) as started:
        first = deploy(started, roles=HOST_ROLES)
        assert first.returncode == 0, first.output[-6000:]
        yield started


ROUND_RESULTS: dict[str, RoundResult] = {}


def _check(host: LabHost, drift: Drift) -> tuple[int, str]:
    checks = [drift.restored, *(same_as_saved(path) for path in drift.saved)]
    rc, out, err = ssh_run(host, " && ".join(f"( {c} )" for c in checks))
    return rc, out + err


def _failed_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]


def run_round(name: str, hosts: list[LabHost]) -> RoundResult:
    """Apply the round's drifts to both hosts, gate, deploy, check each on its host, deploy again, gate (once)."""
    if name not in ROUND_RESULTS:
        for host, drifts in zip(hosts, ROUNDS[name], strict=True):
            saved = [path for drift in drifts for path in drift.saved]
            copies = "".join(f" && mkdir -p {SAVED}{posixpath.dirname(p)} && cp -a {p} {SAVED}{p}" for p in saved)
            remote.run(host, f"rm -rf {SAVED}{copies}")
            for drift in drifts:
                remote.run(host, drift.make)
        gate = verify(hosts, "-q", "-rfE", roles=HOST_ROLES)
        deployed = deploy(hosts, roles=HOST_ROLES)
        restored = {d.name: _check(h, d) for h, drifts in zip(hosts, ROUNDS[name], strict=True) for d in drifts}
        again = deploy(hosts, roles=HOST_ROLES)
        after = verify(hosts, "-q", "-rfE", roles=HOST_ROLES)
        ROUND_RESULTS[name] = RoundResult(_failed_lines(gate), deployed, restored, again, after)
    return ROUND_RESULTS[name]


@pytest.mark.parametrize(("round_name", "index", "drift"), DRIFTS, ids=[d.name for _, _, d in DRIFTS])
def test_drift_named_by_the_gate_restored_by_the_deploy(
    hosts: list[LabHost], round_name: str, index: int, drift: Drift
) -> None:
    result = run_round(round_name, hosts)
    host = hosts[index].name
    # A gate test's id names the host first, then its own parameters: [ssh://lab-c1] or [ssh://lab-c1-conf].
    on_host = re.compile(rf"\[(.+-)?ssh://{re.escape(host)}[\]-]")
    named = [line for line in result.gate_failures if drift.gate in line and on_host.search(line)]
    assert named, f"the gate did not name {drift.name} on {host} with {drift.gate}: {result.gate_failures}"
    assert result.deployed.returncode == 0, result.deployed.output[-8000:]
    assert drift.said in result.deployed.output, f"the deploy did not name {drift.said}"
    rc, output = result.restored[drift.name]
    assert rc == 0, f"{drift.name} not restored on {host}: {output}\n{result.deployed.output[-8000:]}"
    assert (result.again.returncode, result.again.changed) == (0, 0), result.again.output[-8000:]
    assert result.gate_after.returncode == 0, "\n".join(_failed_lines(result.gate_after))


def test_no_deploy_printed_a_traceback(hosts: list[LabHost]) -> None:
    for name in ROUNDS:
        result = run_round(name, hosts)
        for run in (result.deployed, result.again):
            assert "Traceback" not in run.output, run.output[-8000:]


def test_a_no_op_run_reads_each_host_in_two_round_trips(hosts: list[LabHost]) -> None:
    """The facts the operations read come in one command while the deploy is queued (hardware, distribution) and
    one when it runs (everything else, ironserve.speed.reads), not one command per fact (102 before)."""
    run = deploy(hosts, roles=HOST_ROLES, pyinfra_args=("--debug",))
    assert run.changed == 0, run.output[-8000:]
    for host in hosts:
        commands = run.output.count(f"Running command on {host.name}:")
        assert commands == 2, f"{host.name}: {commands} SSH commands in a no-op run"


def test_an_immutable_file_stops_only_its_host_naming_the_setting_then_the_setting_restores_it(
    hosts: list[LabHost], tmp_path: Path
) -> None:
    frozen, other = hosts
    remote.run(frozen, f"sed -i 's/^net.core.wmem_max.*/net.core.wmem_max = 4096/' {SYSCTLS} && chattr +i {SYSCTLS}")
    remote.run(other, f"rm {NOUVEAU_BLACKLIST}")
    try:
        refused = deploy(hosts, roles=HOST_ROLES)
        assert refused.returncode != 0
        assert f"{SYSCTLS} is immutable" in refused.output and CLEAR_IMMUTABLE_KEY in refused.output
        assert "Traceback" not in refused.output, refused.output[-8000:]
        # The other host went on: its drift is restored and the results table came out.
        assert "Grand total" in refused.output, refused.output[-8000:]
        assert remote.run(other, f"cat {NOUVEAU_BLACKLIST}").startswith("# Managed by ironserve")
        inventory = inventory_with(tmp_path, frozen, {CLEAR_IMMUTABLE_KEY: True})
        allowed = deploy([frozen], str(inventory), roles=HOST_ROLES)
        assert allowed.returncode == 0, allowed.output[-8000:]
        assert "net.core.wmem_max = 26214400" in remote.run(frozen, f"cat {SYSCTLS}")
        assert "i" in remote.run(frozen, f"lsattr {SYSCTLS}").split()[0]  # the admin's freeze is kept
    finally:
        remote.run(frozen, f"chattr -i {SYSCTLS}")
    assert deploy(hosts, roles=HOST_ROLES).changed == 0


def test_a_site_pin_above_the_lock_stops_its_host_naming_the_setting(hosts: list[LabHost]) -> None:
    """A site's apt preferences entry pins a newer driver above ironserve's pin: a deliberate choice that the
    deploy does not undo; it stops naming the file's effect and the setting that outranks it."""
    host = hosts[1]
    site_pin = "/etc/apt/preferences.d/zz-site-driver"
    remote.run(host, f"printf 'Package: nvidia-driver\\nPin: version 535.*\\nPin-Priority: 1002\\n' > {site_pin}")
    try:
        gate = verify([host], "-q", "-rfE", roles=("nvidia",))
        assert "test_apt_candidate_of_every_locked_package_is_its_pin" in gate.stdout, gate.stdout[-4000:]
        refused = deploy([host], roles=HOST_ROLES)
        assert refused.returncode != 0
        assert "apt would install nvidia-driver 535" in refused.output and "nvidia_pin_priority" in refused.output
        assert "Traceback" not in refused.output, refused.output[-8000:]
    finally:
        remote.run(host, f"rm -f {site_pin}")
    again = deploy([host], roles=HOST_ROLES)
    assert (again.returncode, again.changed) == (0, 0), again.output[-8000:]


def test_a_service_account_renumbered_outside_the_system_range_stops_its_host(hosts: list[LabHost]) -> None:
    """An admin runs `usermod -u 1500` on the service account: renumbering back is a migration (files, pods running
    as the number), so the deploy stops that host naming it rather than renumbering behind the admin's back."""
    host, user = hosts[1], CONFIG.security.user
    uid = remote.run(host, f"id -u {user}").strip()
    remote.run(host, f"usermod -u 1500 {user}")
    try:
        gate = verify([host], "-q", "-rfE", roles=("security",))
        assert "test_service_user_is_a_system_account_without_login" in gate.stdout, gate.stdout[-4000:]
        refused = deploy([host], roles=HOST_ROLES)
        assert refused.returncode != 0
        assert f"account {user} is uid 1500, outside the system range" in refused.output, refused.output[-8000:]
        assert "security_uid" in refused.output and "Traceback" not in refused.output
    finally:
        remote.run(host, f"usermod -u {uid} {user}")
    again = deploy([host], roles=HOST_ROLES)
    assert (again.returncode, again.changed) == (0, 0), again.output[-8000:]


def _idrac(host: LabHost, method: str, path: str, body: dict[str, object]) -> None:
    """A request to the host's (simulated) iDRAC as an admin's browser makes it, with the lab's credentials."""
    user, _, password = (lab_dir() / "redfish-credentials").read_text().strip().partition(":")
    request = urllib.request.Request(
        host.extra["redfish_url"] + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={
            "Content-Type": "application/json",
            "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
        },
    )
    context = ssl.create_default_context(cafile=host.extra["redfish_ca_file"])
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        assert response.status in {200, 204}


def test_a_bios_setting_changed_in_the_idrac_is_named_then_restored_by_apply(
    hosts: list[LabHost], tmp_path: Path
) -> None:
    """An admin turns 'Memory Mapped I/O above 4GB' off in the iDRAC and reboots: the GPUs' BARs go unmapped.
    The default bios_mode (check) names it and stops the host; bios_mode apply sets it back through Redfish."""
    host = hosts[0]
    system = "/redfish/v1/Systems/System.Embedded.1"
    _idrac(host, "PATCH", f"{system}/Bios/Settings", {"Attributes": {"MmioAbove4Gb": "Disabled"}})
    _idrac(
        host,
        "POST",
        "/redfish/v1/Managers/iDRAC.Embedded.1/Jobs",
        {"TargetSettingsURI": f"{system}/Bios/Settings"},
    )
    _idrac(host, "POST", f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"})
    gate = verify([host], "-q", "-rfE", roles=("preflight",))
    assert "test_every_gpu_bar_is_mapped" in gate.stdout, gate.stdout[-4000:]
    checked = deploy([host], roles=HOST_ROLES)
    assert checked.returncode != 0
    assert "MmioAbove4Gb" in checked.output and "bios_mode: apply" in checked.output, checked.output[-8000:]
    apply = inventory_with(tmp_path, host, {"bios_mode": "apply", "bios_reboot_policy": "auto"})
    applied = deploy([host], str(apply), roles=HOST_ROLES)
    assert applied.returncode == 0, applied.output[-8000:]
    assert "<unassigned>" not in remote.run(host, "lspci -vvv -D -d 10de:")
    again = deploy([host], roles=HOST_ROLES)
    assert (again.returncode, again.changed) == (0, 0), again.output[-8000:]
    assert verify([host], "-q", "-rfE", roles=("preflight",)).returncode == 0


def _orphan_apt(host: LabHost) -> None:
    """An apt-get whose SSH session dropped: it goes on holding dpkg's lock for about 40 s."""
    orphan = subprocess.Popen(
        [
            *remote.ssh_argv(host),
            "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o 'DPkg::Pre-Invoke::=sleep 40' install --reinstall "
            "containerd > /root/orphan-apt.log 2>&1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(5)
    orphan.kill()  # the admin's laptop lost the connection; the remote apt keeps running
    orphan.wait()
    assert remote.run(host, "pgrep -x apt-get || true").strip(), "the orphaned apt-get should still run"


def test_a_deploy_waits_for_the_apt_an_interrupted_run_left_and_completes(hosts: list[LabHost]) -> None:
    """The SSH session of an earlier run drops while its apt runs: that apt goes on holding dpkg's lock. The
    deploy's apt-get waits for it, and so does the hold step (apt-mark through dpkg, which does not wait itself)."""
    host = hosts[0]
    remote.run(host, f"rm {CUDA_HOME}/bin/nvcc")  # the next deploy must reinstall a package, so it needs the lock
    _orphan_apt(host)
    started = time.monotonic()
    result = deploy([host], roles=HOST_ROLES)
    assert result.returncode == 0, result.output[-8000:]
    assert time.monotonic() - started > 20  # it waited for the lock rather than failing on it
    assert remote.run(host, f"[ -x {CUDA_HOME}/bin/nvcc ] && echo ok").strip() == "ok"
    assert re.search(r"Setting up containerd", remote.run(host, "cat /root/orphan-apt.log"))
    # Only a hold is missing now: the first step that needs dpkg's lock is apt-mark hold.
    remote.run(host, "apt-mark unhold containerd")
    _orphan_apt(host)
    started = time.monotonic()
    result = deploy([host], roles=HOST_ROLES)
    assert result.returncode == 0, result.output[-8000:]
    assert time.monotonic() - started > 20
    assert "containerd" in remote.run(host, "apt-mark showhold").split()
    assert re.search(r"Setting up containerd", remote.run(host, "cat /root/orphan-apt.log"))
    assert deploy([host], roles=HOST_ROLES).changed == 0
