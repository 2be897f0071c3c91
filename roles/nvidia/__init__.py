"""NVIDIA stack as one pinned lock: driver, CUDA toolkit, cuDNN, TensorRT from a signed apt repository.

Order (drv-install-sequence, with the apt method): Secure Boot gate, kernel headers, repository
(signed-by keyring, exact-version pins, unattended-upgrades blacklist), nouveau blacklisted and the
initramfs rebuilt, the pinned packages (driver with its DKMS source, toolkit, cuDNN, TensorRT, container
toolkit) installed (downgrading when needed) and held, the module DKMS-built for every installed kernel,
nvidia-persistenced, CUDA_HOME, the cuda-samples source for deviceQuery, then verification of what is on
disk and what nvidia-smi reports against the lock, and a driver change taken through the reboot policy.

Every step reads state through facts and changes only what differs, so a second run reports zero
changes and a drifted host (a package moved, a hold or the pin file removed) is put back.
"""

from __future__ import annotations

import functools
import re
import shlex
from io import StringIO
from typing import TYPE_CHECKING

from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host, state
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, systemd

from ironserve.config_nvidia import pinned_packages, runfile_name, runfile_options, runfile_url
from ironserve.facts import ContainerKind
from ironserve.nvidia_facts import (
    MAIN_MODULE,
    MODULE_VERSION_COMMAND,
    CudaSamples,
    DkmsKernels,
    DpkgPackages,
    LoadedModule,
    NvidiaStack,
    OsDistro,
    RunfileDriver,
    SecureBoot,
    StaleInitrds,
    dkms_lacking,
    driver_reboot_reason,
    parse_module_version,
    stack_problems,
)
from roles.host_tuning import read_on, reboot_proven
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
SAMPLES_CACHE = "/var/cache/ironserve"  # downloads: the cuda-samples tarball, the driver runfile
PERSISTENCED_UNIT = "/etc/systemd/system/nvidia-persistenced.service"
# NVIDIA's sample unit for a runfile install (nvidia-persistenced-init in the driver's samples): the daemon forks.
PERSISTENCED_RUNFILE_UNIT = """# Managed by ironserve (roles/nvidia): the runfile ships no unit (NVIDIA's sample)
[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target

[Service]
Type=forking
PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid
Restart=always
ExecStart=/usr/bin/nvidia-persistenced --verbose
ExecStopPost=/bin/rm -rf /run/nvidia-persistenced

[Install]
WantedBy=multi-user.target
"""
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
def kernel_headers(driver: str):  # type: ignore[no-untyped-def]
    """linux-headers for the running kernel and every installed kernel that lacks the DKMS-built module."""
    if host.get_fact(ContainerKind):
        host.noop("container: the running kernel is the machine's; no headers to install here")
        return
    release = host.get_fact(Command, "uname -r").strip()
    kernels = [release, *(k for k in dkms_lacking(host.get_fact(DkmsKernels), driver) if k != release)]
    yield from apt.packages._inner(packages=[f"linux-headers-{k}" for k in kernels])


@operation()
def dkms_every_kernel(driver: str):  # type: ignore[no-untyped-def]
    """`dkms autoinstall -k K` for every installed kernel without the nvidia module `driver` (a kernel installed
    while its headers were missing, or before the driver); each build is checked where DKMS installs it."""
    observed = host.get_fact(DkmsKernels)
    if not observed.kernels:
        host.noop("no kernel image in /boot: a container runs the machine's kernel")
        return
    lacking = dkms_lacking(observed, driver)
    if not lacking:
        host.noop(f"nvidia {driver} is DKMS-built for every installed kernel: {', '.join(observed.kernels)}")
        return
    for kernel in lacking:
        k = shlex.quote(kernel)
        yield f"dkms autoinstall -k {k}"
        yield f"ls /lib/modules/{k}/updates/dkms/ | grep -Eqx '{MAIN_MODULE.pattern}'"


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
def remove_strays(keep: list[str], also: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """Purge packages of the stack's families that are installed beside the lock (e.g. a CUDA 12 toolkit), and
    the packages in `also` (the apt driver, when the runfile installs it)."""
    installed = host.get_fact(DpkgPackages, patterns=STRAY_PATTERNS + also)
    strays = sorted(n for n in installed if n not in keep)
    if not strays:
        host.noop("no NVIDIA packages beside the lock")
        return
    yield f"{APT_GET} --allow-change-held-packages purge " + " ".join(strays)  # a hold does not keep a stray


@operation()
def runfile_install(path: str, driver: str, options: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """`sh NVIDIA-Linux-x86_64-<driver>.run OPTIONS` unless that driver is installed by a run with those options."""
    observed = host.get_fact(RunfileDriver)
    if observed.version == driver and set(options) <= set(observed.options):
        host.noop(f"driver {driver} installed from the runfile with {' '.join(options)}")
        return
    yield f"sh {shlex.quote(path)} {' '.join(options)}"


@operation()
def remove_runfile_driver():  # type: ignore[no-untyped-def]
    """The apt method after a runfile install: `nvidia-uninstall --silent` first (its files would clash)."""
    observed = host.get_fact(RunfileDriver)
    if observed.version is None:
        host.noop("no runfile driver installed")
        return
    yield "nvidia-uninstall --silent"


@operation()
def rebuild_initramfs():  # type: ignore[no-untyped-def]
    """`update-initramfs -u -k all` when an initrd predates the nouveau blacklist."""
    stale = host.get_fact(StaleInitrds, newer_than=NOUVEAU_BLACKLIST)
    if not stale:
        host.noop("every initrd includes the nouveau blacklist (or there is none: a container)")
        return
    yield "update-initramfs -u -k all"


@operation()
def stage_cuda_samples(tarball: str, directory: str, sha256: str):  # type: ignore[no-untyped-def]
    """Unpack the checksummed cuda-samples tarball into `directory` (recording its SHA-256) unless it is there."""
    if host.get_fact(CudaSamples, directory=directory) == sha256:
        host.noop(f"{directory} holds the cuda-samples source {sha256[:12]}")
        return
    d, t = shlex.quote(directory), shlex.quote(tarball)
    yield (
        f"rm -rf {d} && mkdir -p {d} && tar -xzf {t} -C {d} --strip-components=1 && "
        f"test -f {d}/Samples/1_Utilities/deviceQuery/Makefile && echo {sha256} > {d}/.ironserve-source-sha256"
    )


@operation()
def verify_stack(driver: str, cuda: str, cudnn: str, cuda_home: str, dkms: bool):  # type: ignore[no-untyped-def]
    """Fail unless nvidia-smi, the toolkit, the cuDNN header and the DKMS builds match the lock.

    A loaded module older than the userland is no failure here: the reboot step takes it through the policy
    (until then a real nvidia-smi answers "Driver/library version mismatch", so it is not held against it).
    """
    if not state.is_executing:
        host.noop("verified after the install, while the deploy runs")
        return
    observed = host.get_fact(NvidiaStack, cuda_home=cuda_home)
    problems = stack_problems(observed, driver, cuda, cudnn, cuda_home)
    reboot = [p for p in problems if "reboot needed" in p]
    wrong = [p for p in problems if p not in reboot and not (reboot and p.startswith("nvidia-smi reports"))]
    if dkms:
        lacking = dkms_lacking(host.get_fact(DkmsKernels), driver)
        if lacking:
            wrong.append(f"no DKMS-built nvidia {driver} module for kernel {', '.join(lacking)}")
    if wrong:
        raise OperationError("the NVIDIA stack does not match the lock: " + "; ".join(wrong))
    host.noop(f"driver {driver}, CUDA {cuda}, cuDNN {cudnn} verified")
    yield from ()


@operation()
def reboot_for_driver(driver: str, policy: str, timeout_s: int):  # type: ignore[no-untyped-def]
    """When the loaded module is not the installed driver (or nouveau holds the GPU): reboot and prove it (auto),
    leave /run/reboot-required with the reason (defer), or only report (never): host_tuning_reboot_policy."""
    reason = driver_reboot_reason(host.get_fact(LoadedModule), driver)
    if reason is None:
        host.noop(f"the loaded nvidia module is the installed driver {driver} (or none is loaded)")
        return
    if policy == "never":
        host.noop(f"{reason}, but host_tuning_reboot_policy is never")
        return
    container = host.get_fact(ContainerKind)
    if policy == "defer" or container:  # a container's kernel is the machine's: it cannot reboot it
        where = f" (container host, {container}: the machine that runs it reboots, not the role)" if container else ""
        yield from files.put._inner(src=StringIO("*** System restart required ***\n"), dest=REBOOT_MARKER)
        yield from files.put._inner(src=StringIO(reason + where + "\n"), dest=REBOOT_REASON)
        return
    yield from reboot_proven(timeout_s, functools.partial(_driver_loaded, driver=driver))


def _driver_loaded(host, driver: str) -> None:  # type: ignore[no-untyped-def]
    """After the reboot: the loaded nvidia module is the installed driver."""
    loaded = parse_module_version(read_on(host, MODULE_VERSION_COMMAND + "; true").splitlines())
    if loaded != driver:
        raise OperationError(f"rebooted, but the loaded nvidia module is {loaded or 'none'}, not the driver {driver}")


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
    pins = pinned_packages(config.profile.packages, distro, without=config.nvidia.skipped_components())
    if not pins:
        known = ", ".join(sorted(config.profile.packages or {})) or "none"
        raise OperationError(
            f"host {config.host}: profile {config.profile_name} pins no packages for {distro} (profiles have: {known})"
        )
    cuda_home = cuda_home_of(config)

    refuse_secure_boot(name="Secure Boot gate")
    if config.nvidia.kernel_headers:
        kernel_headers(name="Kernel headers for the running and installed kernels", driver=lock.driver)
    _repository(config, distro, pins)

    files.put(
        name="Blacklist nouveau",
        src=StringIO("# Managed by ironserve (roles/nvidia)\nblacklist nouveau\noptions nouveau modeset=0\n"),
        dest=NOUVEAU_BLACKLIST,
        mode="644",
    )
    if config.nvidia.rebuild_initramfs:
        rebuild_initramfs(name="Rebuild the initramfs without nouveau")

    runfile = config.nvidia.driver_method == "runfile"
    if not runfile:
        remove_runfile_driver(name="Uninstall a runfile driver (apt method)")
    pinned_install(name="Install the locked NVIDIA packages", pins=pins)
    hold(name="Hold the locked NVIDIA packages", names=list(pins))
    apt_driver = tuple(config.profile.packages.get(distro, {}).get("driver", {})) if config.profile.packages else ()
    remove_strays(name="Remove NVIDIA packages beside the lock", keep=list(pins), also=apt_driver if runfile else ())
    if runfile:
        _runfile(config)
    if config.nvidia.dkms:
        dkms_every_kernel(name="DKMS-built module for every installed kernel", driver=lock.driver)

    if runfile:
        unit = files.put(
            name="nvidia-persistenced unit (runfile method)",
            src=StringIO(PERSISTENCED_RUNFILE_UNIT),
            dest=PERSISTENCED_UNIT,
            mode="644",
        )
    else:  # the apt package ships its own unit; one left from a runfile install would override it
        unit = files.file(name="No runfile unit for nvidia-persistenced", path=PERSISTENCED_UNIT, present=False)
    systemd.daemon_reload(name="systemd reads the nvidia-persistenced unit", _if=unit.did_change)
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
    _cuda_samples(config)

    verify_stack(
        name="Verify the NVIDIA stack against the lock",
        driver=lock.driver,
        cuda=lock.cuda,
        cudnn=lock.cudnn.version,
        cuda_home=cuda_home,
        dkms=config.nvidia.dkms,
    )
    reboot_for_driver(
        name="Reboot into the installed driver (host_tuning_reboot_policy)",
        driver=lock.driver,
        policy=config.host_tuning.reboot_policy,
        timeout_s=config.host_tuning.reboot_timeout_s,
    )


def _runfile(config: StackConfig) -> None:
    """drv-install-runfile-flags: NVIDIA's runfile, SHA-256 checked, run with --silent --dkms --no-opengl-files
    --no-x-check (dkms from the OS first); replaces the apt driver, which remove_strays purged just before."""
    driver, container = config.lock.driver, bool(host.get_fact(ContainerKind))
    if not container:
        apt.packages(
            name="dkms (the runfile registers the module with it)", packages=["dkms"], update=True, cache_time=86400
        )
    _downloads()
    path = f"{SAMPLES_CACHE}/{runfile_name(driver)}"
    files.download(
        name=f"{runfile_name(driver)} (SHA-256 checked)",
        src=runfile_url(config.nvidia.runfile_base_url, driver),
        dest=path,
        sha256sum=config.nvidia.runfile_sha256,
    )
    runfile_install(
        name="Install the driver from the runfile", path=path, driver=driver, options=runfile_options(container)
    )


def _downloads() -> None:
    """curl (pyinfra's files.download runs it on the host) and the folder downloads go to."""
    apt.packages(name="curl (for downloads)", packages=["curl"], update=True, cache_time=86400)
    files.directory(name=f"{SAMPLES_CACHE} exists", path=SAMPLES_CACHE, mode="755")


def samples_dir(config: StackConfig) -> str:
    """/opt/cuda-samples-<X.Y>: where the deviceQuery acceptance test builds from (cuda-devicequery-pass)."""
    return "/opt/cuda-samples-" + ".".join(config.lock.cuda.split(".")[:2])


def _cuda_samples(config: StackConfig) -> None:
    url, sha256 = config.nvidia.cuda_samples_url, config.nvidia.cuda_samples_sha256
    if url is None or sha256 is None:
        return
    directory = samples_dir(config)
    tarball = f"{SAMPLES_CACHE}/{directory.rsplit('/', 1)[-1]}.tar.gz"
    _downloads()
    files.download(name="cuda-samples source (SHA-256 checked)", src=url, dest=tarball, sha256sum=sha256)
    stage_cuda_samples(name=f"cuda-samples source in {directory}", tarball=tarball, directory=directory, sha256=sha256)
