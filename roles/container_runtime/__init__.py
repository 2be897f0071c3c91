"""containerd from Debian, pinned, with the systemd cgroup driver and the NVIDIA runtime registered,
plus the kernel prerequisites of containers and Kubernetes (modules, bridge sysctls, swap off).

config.toml is rendered and schema-checked by roles.container_runtime.render before it is shipped. Inside a
container host, kernel modules and swap belong to the machine running it: the role persists what
it can, checks what the kernel already provides, and reports the rest instead of failing.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.facts.files import FileContents
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from ironserve.apt import held, pinned_install, pins_in_force, preferences
from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.facts import ContainerKind, OsDistro
from ironserve.modprobe import modules_not_blocked
from ironserve.operations import Commands, live_sysctl, service_state, stop_host
from ironserve.owned import OwnedPath, backed_up, backup_path, owned_directory, owned_file, unmasked
from ironserve.run import HostRun
from ironserve.speed.reads import Read, read, reading_operation
from ironserve.sysctl_boot import boot_sysctls_win
from roles.container_runtime.facts import (
    FSTAB_SWAP_LINE,
    KernelModules,
    SwapState,
)
from roles.container_runtime.render import (
    ContainerdConfigError,
    hosts_toml,
    nvidia_cli_keeps_cgroups,
    render_config,
)
from roles.container_runtime.settings import REGISTRY_CONFIG_PATH

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig
    from roles.container_runtime.settings import ContainerRuntimeSettings

CONFIG = "/etc/containerd/config.toml"
MODULES_FILE = "/etc/modules-load.d/ironserve-containers.conf"
SYSCTL_FILE = "/etc/sysctl.d/91-ironserve-containers.conf"
PIN_FILE = "/etc/apt/preferences.d/ironserve-containerd"
# Above 1000: apt installs the pinned version even when it is a downgrade (apt_preferences(5)).
PIN_PRIORITY = 1001
NVIDIA_CLI_CONFIG = "/etc/nvidia-container-runtime/config.toml"
NVIDIA_CLI_MINIMAL = """# Rewritten by ironserve (roles/container_runtime): not valid TOML before (kept as {backup}).
# The toolkit uses its defaults for every key not set here.
[nvidia-container-cli]
no-cgroups = false
"""


@reading_operation(reads=lambda names, **_: [Read(KernelModules, {"names": names}), Read(ContainerKind)])
def kernel_modules(names: tuple[str, ...]) -> Commands:
    """Load each module the kernel lacks; in a container, report what the machine must provide."""
    state = read(KernelModules, names=names)
    missing = [n for n in names if state.get(n) not in {"loaded", "builtin"}]
    if not missing:
        host.noop("kernel modules present: " + ", ".join(f"{n} ({state[n]})" for n in names))
    elif read(ContainerKind):
        host.noop(
            f"container: cannot load {', '.join(missing)} (the kernel is the machine's); "
            f"persisted in {MODULES_FILE} for a boot on metal or a VM"
        )
    else:
        for name in missing:
            yield StringCommand("modprobe", QuoteString(name))


@reading_operation(reads=lambda **_: [Read(SwapState), Read(ContainerKind)])
def swap_off() -> Commands:
    """Turn swap off now and keep it off at boot (fstab entries commented out, .swap units disabled); the
    kubelet refuses swap. In a container the active swap is the machine's, but the boot files are the host's."""
    state = read(SwapState)
    container = read(ContainerKind)
    live = [] if container else state["active"]
    if not live and not state["fstab"] and not state["unit"]:
        note = f" (the machine running this container has {', '.join(state['active'])})" if state["active"] else ""
        host.noop(f"swap is off, not in /etc/fstab, no .swap unit enabled{note}")
        return
    if live:
        yield "swapoff -a"
    if state["fstab"]:
        entry = FSTAB_SWAP_LINE.removeprefix("^")
        yield f"sed -i --follow-symlinks -E 's/^({entry})/# ironserve: swap off for the kubelet # \\1/' /etc/fstab"
    for unit in state["unit"]:
        yield StringCommand("systemctl", "disable", "--now", QuoteString(unit))


@reading_operation(reads=lambda path, **_: [Read(FileContents, {"path": path}), Read(OwnedPath, {"path": path})])
def nvidia_cli_cgroups(path: str, clear_immutable: bool = False) -> Commands:
    """cri-nvidia-container-cli-cgroups: `no-cgroups = false` under [nvidia-container-cli], so the NVIDIA hook
    puts the GPU devices in the container's cgroup; the edit is checked as TOML before it is written. The file is
    root's alone (0644 root:root): the hook runs as root what it names (ldconfig, the CLI's path)."""
    lines = read(FileContents, path=path)
    if lines is None:
        host.noop(f"{path} absent: nvidia-container-toolkit is not installed (the NVIDIA role installs it)")
        return
    current = "\n".join(lines) + "\n"
    try:
        wanted = nvidia_cli_keeps_cgroups(current)
    except ContainerdConfigError as exc:
        # Not TOML (a typo): the toolkit reads defaults for every key a file leaves out, so only the one
        # setting ironserve owns is written; the broken file is kept for the admin.
        wanted = NVIDIA_CLI_MINIMAL.format(backup=backup_path(path))
        yield from backed_up(path, f"is not TOML ({exc}), rewritten", keep_original=True)
    yield from owned_file._inner(path=path, content=wanted, clear_immutable=clear_immutable)


def _sysctl_file(settings: ContainerRuntimeSettings) -> str:
    lines = "".join(f"{k} = {v}\n" for k, v in settings.sysctls.items())
    return "# Managed by ironserve (roles/container_runtime): pod networking.\n" + lines


@deploy("Container runtime")
def container_runtime(config: StackConfig, run: HostRun) -> None:
    settings = config.container_runtime

    frozen = config.clear_immutable
    owned_file(
        name="Kernel modules at boot",
        path=MODULES_FILE,
        content="".join(f"{m}\n" for m in settings.kernel_modules),
        clear_immutable=frozen,
    )
    modules_not_blocked(name="No modprobe.d rule blocks a container module", modules=settings.kernel_modules)
    kernel_modules(name="Kernel modules loaded", names=settings.kernel_modules)
    owned_file(
        name="Pod networking sysctls persisted",
        path=SYSCTL_FILE,
        content=_sysctl_file(settings),
        clear_immutable=frozen,
    )
    boot_sysctls_win(name="Pod networking sysctls win at boot", own_file=SYSCTL_FILE, sysctls=settings.sysctls)
    for key, value in settings.sysctls.items():
        live_sysctl(name=f"Apply sysctl {key}", key=key, value=value)
    if settings.swap_off:
        swap_off(name="Swap off and kept off")

    try:
        packages = settings.packages_for(read(OsDistro))
    except ValueError as unknown:
        stop_host(name="containerd's versions are known for this OS", reason=f"host {config.host}: {unknown}")
        return
    owned_file(
        name="Pin containerd packages",
        path=PIN_FILE,
        content=preferences(packages, PIN_PRIORITY, "roles/container_runtime"),
        clear_immutable=frozen,
    )
    pins_in_force(name="apt's candidates are containerd's pins", pins=packages, own_file=PIN_FILE)
    pinned_install(name="Install containerd (pinned)", pins=packages, recommends=False)
    held(name="Hold containerd packages", names=list(packages))

    nvidia_cli_cgroups(name="NVIDIA container CLI keeps cgroups", path=NVIDIA_CLI_CONFIG, clear_immutable=frozen)
    # containerd runs CNI binaries as root and loads their configs: root-only down from the folder above them.
    for path in dict.fromkeys(
        p for d in (settings.cni_bin_dir, settings.cni_conf_dir) for p in (posixpath.dirname(d), d)
    ):
        owned_directory(name=f"CNI directory {path}", path=path, clear_immutable=frozen)
    # containerd reads hosts.toml at each pull (CRI config_path): a mirror takes effect without a restart.
    owned_directory(name="Registry mirror folder", path=REGISTRY_CONFIG_PATH, clear_immutable=frozen)
    for registry, mirror in settings.registry_mirrors.items():
        owned_directory(
            name=f"Registry {registry} folder", path=f"{REGISTRY_CONFIG_PATH}/{registry}", clear_immutable=frozen
        )
        owned_file(
            name=f"Registry {registry} pulls through {mirror}",
            path=f"{REGISTRY_CONFIG_PATH}/{registry}/hosts.toml",
            content=hosts_toml(registry, mirror),
            clear_immutable=frozen,
        )
    # Whoever may write the folder may replace the config in it.
    owned_directory(name="containerd's folder", path=posixpath.dirname(CONFIG), clear_immutable=frozen)
    written = owned_file(
        name="containerd config.toml (schema-checked)",
        path=CONFIG,
        content=render_config(settings),
        clear_immutable=frozen,
    )
    unmasked(name="containerd not masked", unit="containerd.service")
    # A `systemctl edit` drop-in can start containerd with another --config: the file written would not be in force.
    dropins = foreign_dropins_moved_aside(
        name="No foreign drop-in on containerd",
        units=["containerd.service"],
        own=[],
        why=f"overrides containerd's unit (it must run with {CONFIG}; set it through container_runtime_*)",
    )
    systemd.daemon_reload(name="systemd drops the foreign containerd drop-in", _if=dropins.did_change)
    systemd.service(
        name="Restart containerd for its new config",
        service="containerd.service",
        restarted=True,
        _if=any_changed(written, dropins),
    )
    service_state(name="containerd enabled and running", unit="containerd.service", running=True, enabled=True)
