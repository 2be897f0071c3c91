"""Acceptance: roles/container_runtime (catalog area container_runtime) and its kernel prerequisites."""

from __future__ import annotations

import posixpath
import re
import shlex
import tomllib
from typing import Any

import pytest

from ironserve.acceptance.checks import admin_dropins, modprobe_blocks, not_root_only
from ironserve.apt import preferences
from ironserve.facts import parse_os_release
from ironserve.sysctl_boot import SysctlBootOrder, boot_overrides
from roles import StackConfig
from roles.container_runtime import MODULES_FILE, NVIDIA_CLI_CONFIG, PIN_FILE, PIN_PRIORITY, SYSCTL_FILE
from roles.container_runtime.facts import config_argument
from roles.container_runtime.render import CRI, DEVMAPPER, ContainerdConfigError, check_config

CONFIG = "/etc/containerd/config.toml"
# Logged at every start until the Kubernetes network add-on writes its config into the CNI conf dir.
LEVEL_ERROR = re.compile(r"level=(error|fatal|panic)\b")
CNI_NOT_YET = re.compile(r"failed to load cni during init|no network config found in")


def _config(host: Any) -> Any:
    return check_config(host.file(CONFIG).content_string)


@pytest.mark.invariant("cri-containerd")
def test_containerd_running_and_answering(host: Any, observe: Any) -> None:
    service = host.service("containerd")
    version = host.run("ctr version")
    observe(version.stdout.split("Server:")[-1].split() if version.succeeded else version.stderr.strip())
    assert service.is_enabled and service.is_running
    assert version.succeeded and "Server:" in version.stdout


def _pins(host: Any, config: StackConfig) -> dict[str, str]:
    """containerd's pinned set for this host's OS (the setting, or the OS's own default)."""
    os_key = parse_os_release(host.run(". /etc/os-release && echo $ID $VERSION_ID").stdout.split())
    return config.container_runtime.packages_for(os_key)


@pytest.mark.invariant("cri-containerd")
def test_containerd_package_pinned_and_held(host: Any, config: StackConfig, observe: Any) -> None:
    held = host.run("apt-mark showhold").stdout.split()
    pins = _pins(host, config)
    versions = {name: host.package(name).version for name in pins}
    observe({"versions": versions, "held": held})
    assert versions == pins
    assert set(pins) <= set(held)


@pytest.mark.invariant("cri-containerd")
def test_containerd_pin_file_is_the_rendered_one(host: Any, config: StackConfig, observe: Any) -> None:
    # Without the pin above 1000, the next `apt upgrade` after an unhold moves containerd off its version.
    pins = host.file(PIN_FILE)
    content = pins.content_string if pins.exists else None
    expected = preferences(_pins(host, config), PIN_PRIORITY, "roles/container_runtime")
    observe("missing" if content is None else "as rendered" if content == expected else "differs from the rendering")
    assert content == expected


@pytest.mark.invariant("cri-containerd")
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, observe: Any) -> None:
    # containerd runs as root the runtimes its config names; apt installs the pinned version; the kernel loads these;
    # the NVIDIA hook runs as root what its config names (where the toolkit is installed).
    toolkit = [NVIDIA_CLI_CONFIG] if host.file(NVIDIA_CLI_CONFIG).exists else []
    wrong = not_root_only(host, [posixpath.dirname(CONFIG), CONFIG, PIN_FILE, SYSCTL_FILE, MODULES_FILE, *toolkit])
    observe(wrong or "all root:root, writable by root alone")
    assert wrong == {}


@pytest.mark.invariant("cri-containerd", "cri-systemd-cgroup", "cri-nvidia-runtime")
def test_config_passes_ironserves_schema(host: Any, observe: Any) -> None:
    try:
        parsed = _config(host)
    except ContainerdConfigError as exc:
        observe(str(exc))
        raise
    observe(f"version {parsed.version}")


@pytest.mark.invariant("cri-systemd-cgroup")
def test_systemd_cgroup_driver_for_every_runtime(host: Any, observe: Any) -> None:
    runtimes = _config(host).plugins.cri.containerd.runtimes
    observe({name: rt.options.SystemdCgroup for name, rt in runtimes.items()})
    assert runtimes and all(rt.options.SystemdCgroup for rt in runtimes.values())


def _running_config(host: Any) -> str:
    """The config file the running containerd was started with, from its own command line (/proc/<MainPID>)."""
    pid = host.run("systemctl show -p MainPID --value containerd.service").stdout.strip()
    cmdline = host.run(f"tr '\\0' '\\n' < /proc/{pid}/cmdline") if pid.isdigit() and pid != "0" else None
    return config_argument(cmdline.stdout.splitlines() if cmdline else [], CONFIG)


def _running_dump(host: Any) -> str:
    """`containerd config dump` of the file the running daemon was started with, not of the default path."""
    return str(host.run(f"containerd --config {shlex.quote(_running_config(host))} config dump").stdout)


@pytest.mark.invariant("cri-containerd")
def test_running_containerd_was_started_with_the_managed_config(host: Any, observe: Any) -> None:
    # A `systemctl edit` drop-in can start it with another --config: config.toml is then written but not in force.
    foreign = admin_dropins(host, "containerd.service")
    running = _running_config(host)
    observe({"config": running, "admin drop-ins": foreign})
    assert running == CONFIG
    assert foreign == []


@pytest.mark.invariant("cri-systemd-cgroup")
def test_running_containerd_uses_systemd_cgroup(host: Any, observe: Any) -> None:
    # What containerd itself loaded, not only the file: every runtime's options carry SystemdCgroup = true.
    dump = _running_dump(host)
    values = re.findall(r"^\s*SystemdCgroup = (\w+)", dump, flags=re.M)
    observe(values)
    assert values and set(values) == {"true"}


@pytest.mark.invariant("cri-nvidia-runtime")
def test_nvidia_runtime_registered(host: Any, config: StackConfig, observe: Any) -> None:
    cri = _config(host).plugins.cri.containerd
    nvidia = cri.runtimes.get("nvidia")
    observe(f"default={cri.default_runtime_name} nvidia={nvidia.options.BinaryName if nvidia else None}")
    assert nvidia is not None and nvidia.options.BinaryName == config.container_runtime.nvidia_binary
    assert cri.default_runtime_name == config.container_runtime.default_runtime
    dump = _running_dump(host)
    assert f'BinaryName = "{config.container_runtime.nvidia_binary}"' in dump


@pytest.mark.invariant("cri-devmapper-snapshotter")
def test_snapshotter_as_configured(host: Any, config: StackConfig, observe: Any) -> None:
    # Correction: devmapper only with a provisioned thin-pool; overlayfs is the documented default.
    wanted = config.container_runtime.snapshotter
    plugins = host.run("ctr plugins ls").stdout
    rows = [line.split() for line in plugins.splitlines()]
    status = [row[-1] for row in rows if row[:2] == ["io.containerd.snapshotter.v1", wanted]]
    observe(f"{wanted}: {status}")
    assert _config(host).plugins.cri.containerd.snapshotter == wanted
    assert status == ["ok"]
    if wanted == "devmapper":
        assert DEVMAPPER in host.file(CONFIG).content_string


@pytest.mark.invariant("cri-runtime-journal-clean")
def test_containerd_journal_has_no_errors(host: Any, observe: Any) -> None:
    # By log level: the seed's `grep -i error` also matches containerd's info line that prints its
    # config (field names such as IgnoreRdtNotEnabledErrors).
    tail = host.run("journalctl -u containerd --no-pager -n 20 -o cat").stdout.splitlines()
    errors = [line for line in tail if LEVEL_ERROR.search(line)]
    observe(errors[:3])
    if errors and all(CNI_NOT_YET.search(line) for line in errors):
        pytest.skip("only 'no CNI network config yet': the Kubernetes network add-on installs it (CRI " + CRI + ")")
    assert errors == []


@pytest.mark.invariant("cri-nvidia-container-cli-cgroups")
def test_nvidia_container_cli_keeps_cgroups(host: Any, observe: Any) -> None:
    path = NVIDIA_CLI_CONFIG
    if not host.file(path).exists:
        pytest.skip("nvidia-container-toolkit is not installed on this host (no GPU runtime to configure)")
    section = tomllib.loads(host.file(path).content_string).get("nvidia-container-cli", {})
    observe(f"no-cgroups={section.get('no-cgroups')}")
    assert section.get("no-cgroups") is False


@pytest.mark.invariant("cri-containerd")
def test_no_modprobe_rule_blocks_a_container_module(host: Any, config: StackConfig, observe: Any) -> None:
    blocking = modprobe_blocks(host, list(config.container_runtime.kernel_modules))
    observe(blocking or "none")
    assert blocking == []


@pytest.mark.parametrize("module", ["overlay", "br_netfilter"])
def test_kernel_module_persisted(host: Any, config: StackConfig, module: str, observe: Any) -> None:
    listed = host.file("/etc/modules-load.d/ironserve-containers.conf").content_string.split()
    observe(listed)
    assert module in config.container_runtime.kernel_modules and module in listed


@pytest.mark.parametrize("module", ["overlay", "br_netfilter"])
def test_kernel_module_loaded(host: Any, module: str, container_kind: str | None, observe: Any) -> None:
    loaded = host.file(f"/sys/module/{module}").exists
    builtin = host.run(f'grep -qs "/{module}.ko" /lib/modules/$(uname -r)/modules.builtin').succeeded
    feature = {"overlay": "grep -qw overlay /proc/filesystems", "br_netfilter": "test -d /proc/sys/net/bridge"}[module]
    available = host.run(feature).succeeded
    observe(f"loaded={loaded} builtin={builtin} feature={available}")
    if container_kind and not (loaded or builtin):
        if available:
            pytest.skip(f"{container_kind} container: {module} is built into the machine's kernel (feature present)")
        pytest.skip(f"{container_kind} container: modules are the machine's; {module} is asserted on VM hosts")
    assert loaded or builtin


@pytest.mark.parametrize("key", ["net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables"])
def test_pod_networking_sysctl(host: Any, config: StackConfig, key: str, observe: Any) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    live = host.file(path).content_string.strip() if host.file(path).exists else None
    persisted = host.file("/etc/sysctl.d/91-ironserve-containers.conf").content_string
    observe(live)
    assert f"{key} = {config.container_runtime.sysctls[key]}" in persisted
    assert live == config.container_runtime.sysctls[key]


@pytest.mark.parametrize("key", ["net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables"])
def test_pod_networking_sysctl_wins_at_boot(host: Any, config: StackConfig, key: str, observe: Any) -> None:
    # A hardening baseline's later-sorting `net.ipv4.ip_forward = 0` would win at every boot.
    fact = SysctlBootOrder()
    order = fact.process(host.run(fact.command()).stdout.splitlines())
    beating = boot_overrides(order, SYSCTL_FILE, {key: config.container_runtime.sysctls[key]})
    observe([f"{a.file}: {a.line}" for a in beating])
    assert beating == []


@pytest.mark.parametrize("which", ["bin", "conf"])
@pytest.mark.invariant("cri-containerd")
def test_cni_directory_root_owned_0755(host: Any, config: StackConfig, which: str, observe: Any) -> None:
    # containerd's CRI plugin runs these binaries as root and loads these network configs: anyone who can write
    # here runs code as root or re-plumbs pod networking.
    path = {"bin": config.container_runtime.cni_bin_dir, "conf": config.container_runtime.cni_conf_dir}[which]
    directory, parent = host.file(path), host.file(path.rsplit("/", 1)[0] or "/")
    assert directory.is_directory, f"{path} is missing"
    observe(f"{directory.user}:{directory.group} {oct(directory.mode)}; parent {parent.user} {oct(parent.mode)}")
    assert (directory.user, directory.mode) == ("root", 0o755)
    assert parent.user == "root" and not parent.mode & 0o022


def _swap_off(config: StackConfig) -> None:
    if not config.container_runtime.swap_off:
        pytest.skip("container_runtime_swap_off is false")


def test_no_swap_line_in_fstab(host: Any, config: StackConfig, observe: Any) -> None:
    _swap_off(config)
    fstab = host.file("/etc/fstab")
    lines = fstab.content_string.splitlines() if fstab.exists else []
    # Field by field, as mount reads it: leading blanks and a line that stops after the type still count.
    swaps = [line.strip() for line in lines if line.split()[2:3] == ["swap"] and not line.lstrip().startswith("#")]
    observe(swaps or "none")
    assert swaps == []


def test_no_swap_unit_enabled(host: Any, config: StackConfig, observe: Any) -> None:
    # A .swap unit enabled outside fstab (systemctl enable dev-sdb2.swap) turns swap on at the next boot.
    _swap_off(config)
    listed = host.run("systemctl list-unit-files --type=swap --state=enabled --no-legend")
    enabled = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    observe(enabled or "none")
    assert listed.rc in (0, 1) and not listed.stderr.strip(), listed.stderr  # 1: it listed nothing
    assert enabled == []


def test_no_swap_active(host: Any, config: StackConfig, container_kind: str | None, observe: Any) -> None:
    _swap_off(config)
    shown = host.run("swapon --show --noheadings")
    active = shown.stdout.strip()
    observe(active or "none")
    assert shown.succeeded, shown.stderr
    if container_kind and active:
        pytest.skip(f"{container_kind} container: the machine's swap ({active.split()[0]}) is not this host's")
    assert active == ""
