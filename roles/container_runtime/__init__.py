"""containerd from Debian, pinned, with the systemd cgroup driver and the NVIDIA runtime registered,
plus the kernel prerequisites of containers and Kubernetes (modules, bridge sysctls, swap off).

config.toml is rendered and schema-checked by roles.container_runtime.containerd before it is shipped. Inside a
container host, kernel modules and swap belong to the machine running it: the role persists what
it can, checks what the kernel already provides, and reports the rest instead of failing.
"""

from __future__ import annotations

from io import StringIO
from typing import TYPE_CHECKING

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.files import FileContents
from pyinfra.operations import files, systemd

from ironserve.apt import held, pinned_install, preferences
from ironserve.facts import ContainerKind
from ironserve.operations import Commands, live_sysctl
from ironserve.run import HostRun
from roles.container_runtime.containerd import ContainerdConfigError, nvidia_cli_keeps_cgroups, render_config
from roles.container_runtime.facts import KernelModules, SwapState

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


@operation()
def kernel_modules(names: tuple[str, ...]) -> Commands:
    """Load each module the kernel lacks; in a container, report what the machine must provide."""
    state = host.get_fact(KernelModules, names=names)
    missing = [n for n in names if state.get(n) not in {"loaded", "builtin"}]
    if not missing:
        host.noop("kernel modules present: " + ", ".join(f"{n} ({state[n]})" for n in names))
    elif host.get_fact(ContainerKind):
        host.noop(
            f"container: cannot load {', '.join(missing)} (the kernel is the machine's); "
            f"persisted in {MODULES_FILE} for a boot on metal or a VM"
        )
    else:
        for name in missing:
            yield StringCommand("modprobe", QuoteString(name))


@operation()
def swap_off() -> Commands:
    """Turn swap off now and keep it off (fstab entries commented out); the kubelet refuses swap."""
    state = host.get_fact(SwapState)
    if host.get_fact(ContainerKind):
        note = f" (the machine has {', '.join(state['active'])})" if state["active"] else ""
        host.noop(f"container: swap belongs to the machine running it{note}; nothing to turn off here")
        return
    if not state["active"] and not state["fstab"]:
        host.noop("swap is off and not in /etc/fstab")
        return
    if state["active"]:
        yield "swapoff -a"
    if state["fstab"]:
        yield r"sed -i -E 's/^([^#]\S*\s+\S+\s+swap\s)/# ironserve: swap off for the kubelet # \1/' /etc/fstab"


@operation()
def nvidia_cli_cgroups(path: str) -> Commands:
    """cri-nvidia-container-cli-cgroups: `no-cgroups = false` under [nvidia-container-cli], so the NVIDIA hook
    puts the GPU devices in the container's cgroup; the edit is checked as TOML before it is written."""
    lines = host.get_fact(FileContents, path=path)
    if lines is None:
        host.noop(f"{path} absent: nvidia-container-toolkit is not installed (the NVIDIA role installs it)")
        return
    current = "\n".join(lines) + "\n"
    try:
        wanted = nvidia_cli_keeps_cgroups(current)
    except ContainerdConfigError as exc:
        raise OperationError(f"{path}: {exc}") from exc
    if wanted == current:
        host.noop(f"{path}: no-cgroups = false under [nvidia-container-cli]")
        return
    yield from files.put._inner(src=StringIO(wanted), dest=path, mode="644")


def _sysctl_file(settings: ContainerRuntimeSettings) -> str:
    lines = "".join(f"{k} = {v}\n" for k, v in settings.sysctls.items())
    return "# Managed by ironserve (roles/container_runtime): pod networking.\n" + lines


@deploy("Container runtime")
def container_runtime(config: StackConfig, run: HostRun) -> None:
    settings = config.container_runtime

    files.put(
        name="Kernel modules at boot",
        src=StringIO("".join(f"{m}\n" for m in settings.kernel_modules)),
        dest=MODULES_FILE,
        mode="644",
    )
    kernel_modules(name="Kernel modules loaded", names=settings.kernel_modules)
    files.put(
        name="Pod networking sysctls persisted", src=StringIO(_sysctl_file(settings)), dest=SYSCTL_FILE, mode="644"
    )
    for key, value in settings.sysctls.items():
        live_sysctl(name=f"Apply sysctl {key}", key=key, value=value)
    if settings.swap_off:
        swap_off(name="Swap off and kept off")

    files.put(
        name="Pin containerd packages",
        src=StringIO(preferences(settings.packages, PIN_PRIORITY, "roles/container_runtime")),
        dest=PIN_FILE,
        mode="644",
    )
    pinned_install(name="Install containerd (pinned)", pins=settings.packages, recommends=False)
    held(name="Hold containerd packages", names=list(settings.packages))

    nvidia_cli_cgroups(name="NVIDIA container CLI keeps cgroups", path=NVIDIA_CLI_CONFIG)
    for path in (settings.cni_bin_dir, settings.cni_conf_dir):
        files.directory(name=f"CNI directory {path}", path=path, mode="755")
    written = files.put(
        name="containerd config.toml (schema-checked)",
        src=StringIO(render_config(settings)),
        dest=CONFIG,
        mode="644",
        create_remote_dir=True,
    )
    systemd.service(
        name="Restart containerd for its new config",
        service="containerd.service",
        restarted=True,
        _if=written.did_change,
    )
    systemd.service(name="containerd enabled and running", service="containerd.service", running=True, enabled=True)
