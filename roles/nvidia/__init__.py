"""NVIDIA stack as one pinned lock: driver, CUDA toolkit, cuDNN, TensorRT from a signed apt repository.

Order (drv-install-sequence, with the apt method): Secure Boot gate, kernel headers, repository
(signed-by keyring, exact-version pins, unattended-upgrades blacklist), nouveau blacklisted and the
initramfs rebuilt, the pinned packages installed (downgrading when needed) and held, nvidia-persistenced,
CUDA_HOME, then verification of what is on disk and what nvidia-smi reports against the lock.

Every step reads state through facts and changes only what differs, so a second run reports zero
changes and a drifted host (a package moved, a hold or the pin file removed) is put back.
"""

from __future__ import annotations

import re
from io import StringIO
from typing import TYPE_CHECKING

from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host, state
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, systemd

from ironserve.config_nvidia import pinned_packages
from ironserve.facts import ContainerKind
from ironserve.nvidia_facts import DpkgPackages, NvidiaStack, OsDistro, SecureBoot, StaleInitrds, stack_problems
from roles.nvidia.defaults import DEFAULTS

if TYPE_CHECKING:  # the config model imports this package's defaults
    from ironserve.config import StackConfig

KEYRING = "/usr/share/keyrings/ironserve-nvidia.gpg"
SOURCES_LIST = "/etc/apt/sources.list.d/ironserve-nvidia.list"
PREFERENCES = "/etc/apt/preferences.d/ironserve-nvidia.pref"
UNATTENDED_BLACKLIST = "/etc/apt/apt.conf.d/51ironserve-nvidia-blacklist"
NOUVEAU_BLACKLIST = "/etc/modprobe.d/blacklist-nouveau.conf"
CUDA_PROFILE = "/etc/profile.d/cuda.sh"
REBOOT_MARKER = "/run/reboot-required"
REBOOT_REASON = "/run/ironserve/reboot-required-nvidia"
# Packages of the stack's families that must not sit beside the lock (another driver branch, a CUDA 12
# toolkit, the CUDA metapackages that pull a driver in): removed when installed and not pinned.
STRAY_PATTERNS = ("nvidia-driver*", "cuda-toolkit-*", "cuda-drivers*", "libcudnn*", "libnvinfer*", "tensorrt")
APT_GET = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
)
MOK_STEPS = (
    "UEFI Secure Boot is enabled: the unsigned NVIDIA kernel module would not load. Either disable Secure Boot "
    "in the BIOS (iDRAC: BIOS Settings > System Security > Secure Boot), or enrol a Machine Owner Key and sign "
    "the module: (1) `openssl req -new -x509 -newkey rsa:2048 -nodes -days 36500 -subj '/CN=ironserve module "
    "signing/' -keyout /root/mok.priv -outform DER -out /root/mok.der`; (2) `mokutil --import /root/mok.der` "
    "(choose a one-time password); (3) reboot and enrol the key in the blue MOK manager screen; (4) let DKMS "
    "sign with it (/etc/dkms/framework.conf: mok_signing_key=/root/mok.priv, mok_certificate=/root/mok.der); "
    "then run the deploy again."
)


def preferences(pins: dict[str, str], priority: int) -> str:
    """apt preferences pinning each package to its exact version; above 1000 apt also downgrades."""
    stanzas = [f"Package: {name}\nPin: version {version}\nPin-Priority: {priority}\n" for name, version in pins.items()]
    head = "# Managed by ironserve (roles/nvidia): the profile's lock, exact versions.\n\n"
    return head + "\n".join(stanzas)


def unattended_blacklist(names: list[str]) -> str:
    """unattended-upgrades never touches the locked packages (entries are regular expressions)."""
    entries = "".join(f'    "{re.escape(name)}$";\n' for name in names)
    head = "// Managed by ironserve (roles/nvidia): unattended-upgrades never moves the locked NVIDIA set.\n"
    return head + "Unattended-Upgrade::Package-Blacklist {\n" + entries + "};\n"


def sources_line(repo_url: str, distro: str) -> str:
    return f"deb [signed-by={KEYRING}] {repo_url}/{distro}/x86_64/ /\n"


def cuda_home_of(config: StackConfig) -> str:
    return config.nvidia.cuda_home or "/usr/local/cuda-" + ".".join(config.lock.cuda.split(".")[:2])


@operation()
def refuse_secure_boot():  # type: ignore[no-untyped-def]
    """Stop before touching the host when Secure Boot would keep the driver from loading."""
    sb_state = host.get_fact(SecureBoot)
    if sb_state == "enabled":
        raise OperationError(MOK_STEPS)
    host.noop(f"Secure Boot: {sb_state}")
    yield from ()


@operation()
def kernel_headers():  # type: ignore[no-untyped-def]
    """linux-headers for the running kernel (DKMS builds the module against them)."""
    if host.get_fact(ContainerKind):
        host.noop("container: the running kernel is the machine's; no headers to install here")
        return
    release = host.get_fact(Command, "uname -r").strip()
    yield from apt.packages._inner(packages=[f"linux-headers-{release}"])


@operation()
def pinned_install(pins: dict[str, str]):  # type: ignore[no-untyped-def]
    """Install exactly `pins` (package -> version), downgrading or replacing held packages when they drifted."""
    installed = host.get_fact(DpkgPackages, patterns=tuple(pins))
    wrong = {n: v for n, v in pins.items() if n not in installed or installed[n].version != v}
    if not wrong:
        host.noop("the locked packages are installed at their pinned versions")
        return
    yield "apt-get update -q"
    # The whole set at once: dependent packages (libcudnn8-dev = libcudnn8) move together.
    wanted = " ".join(f"{name}={version}" for name, version in pins.items())
    yield f"{APT_GET} --allow-downgrades --allow-change-held-packages install {wanted}"


@operation()
def hold(names: list[str]):  # type: ignore[no-untyped-def]
    """`apt-mark hold` every locked package that is not held."""
    installed = host.get_fact(DpkgPackages, patterns=tuple(names))
    loose = [n for n in names if n in installed and not installed[n].held]
    if not loose:
        host.noop("the locked packages are held")
        return
    yield "apt-mark hold " + " ".join(loose)


@operation()
def remove_strays(keep: list[str]):  # type: ignore[no-untyped-def]
    """Purge packages of the stack's families that are installed beside the lock (e.g. a CUDA 12 toolkit)."""
    installed = host.get_fact(DpkgPackages, patterns=STRAY_PATTERNS)
    strays = sorted(n for n in installed if n not in keep)
    if not strays:
        host.noop("no NVIDIA packages beside the lock")
        return
    yield f"{APT_GET} purge " + " ".join(strays)


@operation()
def rebuild_initramfs():  # type: ignore[no-untyped-def]
    """`update-initramfs -u -k all` when an initrd predates the nouveau blacklist."""
    stale = host.get_fact(StaleInitrds, newer_than=NOUVEAU_BLACKLIST)
    if not stale:
        host.noop("every initrd includes the nouveau blacklist (or there is none: a container)")
        return
    yield "update-initramfs -u -k all"


@operation()
def verify_stack(driver: str, cuda: str, cudnn: str, cuda_home: str):  # type: ignore[no-untyped-def]
    """Fail unless nvidia-smi, the toolkit and the cuDNN header match the lock; a module change asks for a reboot."""
    if not state.is_executing:
        host.noop("verified after the install, while the deploy runs")
        return
    observed = host.get_fact(NvidiaStack, cuda_home=cuda_home)
    problems = stack_problems(observed, driver, cuda, cudnn, cuda_home)
    reboot = [p for p in problems if "reboot needed" in p]
    wrong = [p for p in problems if p not in reboot]
    if wrong:
        raise OperationError("the NVIDIA stack does not match the lock: " + "; ".join(wrong))
    if reboot:  # the new userland is in place; the old module stays loaded until the next boot
        yield from files.put._inner(src=StringIO("*** System restart required ***\n"), dest=REBOOT_MARKER)
        yield from files.put._inner(src=StringIO(reboot[0] + "\n"), dest=REBOOT_REASON)
        return
    host.noop(f"driver {driver}, CUDA {cuda}, cuDNN {cudnn} verified")


def _repository(config: StackConfig, distro: str, pins: dict[str, str]) -> None:
    settings = config.nvidia
    if settings.repo_url is None or settings.repo_key is None:
        raise OperationError(
            f"host {config.host}: nvidia_repo_url and nvidia_repo_key must be set (NVIDIA's CUDA repository "
            "base URL or a mirror of it, and its keyring file)"
        )
    files.put(name="NVIDIA repository key", src=settings.repo_key, dest=KEYRING, mode="644")
    files.put(
        name="NVIDIA repository (signed-by)",
        src=StringIO(sources_line(settings.repo_url, distro)),
        dest=SOURCES_LIST,
        mode="644",
    )
    files.put(
        name="Pin the locked versions",
        src=StringIO(preferences(pins, settings.pin_priority)),
        dest=PREFERENCES,
        mode="644",
    )
    files.put(
        name="Keep unattended-upgrades off the lock",
        src=StringIO(unattended_blacklist(list(pins))),
        dest=UNATTENDED_BLACKLIST,
        mode="644",
    )


@deploy("NVIDIA stack", data_defaults=DEFAULTS)
def nvidia(config: StackConfig) -> None:
    lock = config.lock
    distro = host.get_fact(OsDistro)
    pins = pinned_packages(config.profile.packages, distro)
    if not pins:
        known = ", ".join(sorted(config.profile.packages or {})) or "none"
        raise OperationError(
            f"host {config.host}: profile {config.profile_name} pins no packages for {distro} (profiles have: {known})"
        )
    cuda_home = cuda_home_of(config)

    refuse_secure_boot(name="Secure Boot gate")
    if config.nvidia.kernel_headers:
        kernel_headers(name="Kernel headers for the running kernel")
    _repository(config, distro, pins)

    files.put(
        name="Blacklist nouveau",
        src=StringIO("# Managed by ironserve (roles/nvidia)\nblacklist nouveau\noptions nouveau modeset=0\n"),
        dest=NOUVEAU_BLACKLIST,
        mode="644",
    )
    if config.nvidia.rebuild_initramfs:
        rebuild_initramfs(name="Rebuild the initramfs without nouveau")

    pinned_install(name="Install the locked NVIDIA packages", pins=pins)
    hold(name="Hold the locked NVIDIA packages", names=list(pins))
    remove_strays(name="Remove NVIDIA packages beside the lock", keep=list(pins))

    if config.nvidia.persistenced:
        systemd.service(
            name="Enable nvidia-persistenced",
            service="nvidia-persistenced.service",
            enabled=True,
            running=True,
        )

    files.put(
        name="CUDA_HOME for login shells",
        src=StringIO(
            f"# Managed by ironserve (roles/nvidia)\nexport CUDA_HOME={cuda_home}\n"
            'case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) export PATH="$CUDA_HOME/bin:$PATH" ;; esac\n'
        ),
        dest=CUDA_PROFILE,
        mode="644",
    )
    files.line(
        name="CUDA_HOME for every process (/etc/environment)",
        path="/etc/environment",
        line="^CUDA_HOME=.*",
        replace=f"CUDA_HOME={cuda_home}",
    )
    files.link(name="/usr/local/cuda is the locked toolkit", path="/usr/local/cuda", target=cuda_home)

    verify_stack(
        name="Verify the NVIDIA stack against the lock",
        driver=lock.driver,
        cuda=lock.cuda,
        cudnn=lock.cudnn.version,
        cuda_home=cuda_home,
    )
