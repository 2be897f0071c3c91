"""The nvidia role's operations: each reads state through facts and yields commands only when it differs."""

from __future__ import annotations

import re
import shlex

from pyinfra import logger
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host, state
from pyinfra.facts.server import Command

from ironserve.apt import APT_GET, installed
from ironserve.facts import ContainerKind, DpkgPackages
from ironserve.lock import StackLock
from ironserve.operations import Commands, failing
from ironserve.owned import backed_up
from ironserve.packages import expected_version
from ironserve.speed.reads import Read, read, reading_operation
from ironserve.versions import major_minor
from roles.nvidia.facts import (
    CUDA_HOME_ASSIGNMENT,
    MAIN_MODULE,
    AptSourceFiles,
    CudaHomeAssignments,
    CudaSamples,
    DkmsKernels,
    LoadedModule,
    NvidiaStack,
    RunfileDriver,
    SecureBoot,
    StaleInitrds,
    dkms_lacking,
    driver_reboot_reason,
    sources_naming,
    stack_problems,
)

NOUVEAU_BLACKLIST = "/etc/modprobe.d/blacklist-nouveau.conf"
# Package families of the stack: an installed member that is not pinned and disagrees with the lock (another
# driver branch, a CUDA 12 toolkit, cuDNN or TensorRT for another CUDA line, the CUDA metapackages that pull a
# driver in) is removed. Members at the lock's versions are the locked packages' own dependencies and stay.
STRAY_PATTERNS = ("nvidia-driver*", "cuda-toolkit-*", "cuda-drivers*", "libcudnn*", "libnvinfer*", "tensorrt")
CUDA_LINE_PACKAGE = re.compile(r"cuda-toolkit-(\d+)-(\d+)(-.+)?")


def is_stray(name: str, version: str, lock: StackLock) -> bool:
    """Whether an installed package of the stack's families disagrees with the lock.

    cuda-toolkit-X-Y[-...] belongs to CUDA line X.Y (its own version is the component's, e.g. 11.8.89-1), and
    cuda-toolkit-config-common is shared by every line; the other families carry the lock's versions in theirs
    (nvidia-driver-bin 525.85.12-1, libnvinfer-plugin8 8.6.1.6-1+cuda11.8).
    """
    if name.startswith("cuda-drivers"):
        return True
    line = CUDA_LINE_PACKAGE.fullmatch(name)
    if line:
        return f"{line[1]}.{line[2]}" != major_minor(lock.cuda)
    if name.startswith("cuda-toolkit-"):
        return False
    component = "driver" if name.startswith("nvidia-driver") else "cudnn" if name.startswith("libcudnn") else "tensorrt"
    expected = expected_version(lock, component)
    return expected is None or not (version.startswith(expected[0]) and version.endswith(expected[1]))


MOK_STEPS = (
    "UEFI Secure Boot is enabled: the unsigned NVIDIA kernel module would not load. Either disable Secure Boot "
    "in the BIOS (iDRAC: BIOS Settings > System Security > Secure Boot), or enrol a Machine Owner Key and sign "
    "the module: (1) `openssl req -new -x509 -newkey rsa:2048 -nodes -days 36500 -subj '/CN=ironserve module "
    "signing/' -keyout /root/mok.priv -outform DER -out /root/mok.der`; (2) `mokutil --import /root/mok.der` "
    "(choose a one-time password); (3) reboot and enrol the key in the blue MOK manager screen; (4) let DKMS "
    "sign with it (/etc/dkms/framework.conf: mok_signing_key=/root/mok.priv, mok_certificate=/root/mok.der); "
    "then run the deploy again."
)


def runfile_name(driver: str) -> str:
    return f"NVIDIA-Linux-x86_64-{driver}.run"


def runfile_url(base_url: str, driver: str) -> str:
    """NVIDIA's download layout: <base>/XFree86/Linux-x86_64/<driver>/NVIDIA-Linux-x86_64-<driver>.run."""
    return f"{base_url}/XFree86/Linux-x86_64/{driver}/{runfile_name(driver)}"


def runfile_options(container: bool) -> tuple[str, ...]:
    """drv-install-runfile-flags: no OpenGL files, no X check, the module through DKMS (rebuilt for new kernels).
    In a container the kernel is the machine's: userland only (--no-kernel-module), as NVIDIA's images do."""
    module = "--no-kernel-module" if container else "--dkms"
    return ("--silent", module, "--no-opengl-files", "--no-x-check")


SHIM_VALIDATION_OFF = (
    "UEFI Secure Boot is enabled, but shim does not validate what it loads (`mokutil --sb-state`: SecureBoot "
    "validation is disabled in shim): the unsigned NVIDIA module loads, and Secure Boot does not protect this "
    "host's kernel (the kernel treats Secure Boot as off). To protect it again, have DKMS sign the module with an "
    "enrolled Machine Owner Key (`mokutil --import`), then run `mokutil --enable-validation` (choose a one-time "
    "password), reboot and confirm it in the blue MOK manager screen; an unsigned module stops loading then."
)


def secure_boot_refusal(sb_state: str, shim_validation_disabled: str) -> str | None:
    """Why the deploy must stop before touching the host, or None: an enforcing Secure Boot keeps the unsigned
    module from loading; with shim's validation off the module loads, and nvidia_shim_validation_disabled decides."""
    if sb_state == "enabled":
        return MOK_STEPS
    if sb_state == "validation-disabled" and shim_validation_disabled == "refuse":
        return f"{SHIM_VALIDATION_OFF} Refused: nvidia_shim_validation_disabled is refuse (proceed deploys anyway)."
    return None


@reading_operation(reads=lambda **_: [Read(SecureBoot)])
def refuse_secure_boot(shim_validation_disabled: str = "proceed") -> Commands:
    """Stop before touching the host when Secure Boot would keep the driver from loading (or, by policy, when
    shim's validation is off); warn when the driver loads only because shim does not validate."""
    sb_state = read(SecureBoot)
    refusal = secure_boot_refusal(sb_state, shim_validation_disabled)
    if refusal is not None:
        yield failing(refusal)
        return
    if sb_state == "validation-disabled":
        host.log(SHIM_VALIDATION_OFF, log_func=logger.warning)
    host.noop(f"Secure Boot: {sb_state}")
    yield from ()


HEADERS = "linux-headers-*"  # every installed headers package, read with the host's other facts


@reading_operation(
    reads=lambda **_: [
        Read(ContainerKind),
        Read(Command, {"command": "uname -r"}),
        Read(DkmsKernels),
        Read(DpkgPackages, {"patterns": (HEADERS,)}),
    ]
)
def kernel_headers(driver: str) -> Commands:
    """linux-headers for the running kernel and every installed kernel that lacks the DKMS-built module."""
    if read(ContainerKind):
        host.noop("container: the running kernel is the machine's; no headers to install here")
        return
    release = read(Command, command="uname -r").strip()
    kernels = [release, *(k for k in dkms_lacking(read(DkmsKernels), driver) if k != release)]
    wanted = [f"linux-headers-{k}" for k in kernels]
    have = read(DpkgPackages, patterns=(HEADERS,))
    missing = [name for name in wanted if name not in have]
    if not missing:
        host.noop("installed: " + ", ".join(wanted))
        return
    yield from installed._inner(packages=missing)


@reading_operation(reads=lambda **_: [Read(DkmsKernels)])
def dkms_every_kernel(driver: str) -> Commands:
    """`dkms autoinstall -k K` for every installed kernel without the nvidia module `driver` (a kernel installed
    while its headers were missing, or before the driver); each build is checked where DKMS installs it."""
    observed = read(DkmsKernels)
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


@reading_operation(reads=lambda also, **_: [Read(DpkgPackages, {"patterns": STRAY_PATTERNS + also})])
def remove_strays(keep: list[str], lock: StackLock, also: tuple[str, ...] = ()) -> Commands:
    """Purge packages of the stack's families installed beside the lock (e.g. a CUDA 12 toolkit), and the packages
    in `also` (the apt driver, when the runfile installs it)."""
    installed = read(DpkgPackages, patterns=STRAY_PATTERNS + also)
    strays = sorted(
        name
        for name, entry in installed.items()
        if name not in keep and (name in also or is_stray(name, entry.version, lock))
    )
    if not strays:
        host.noop("no NVIDIA packages beside the lock")
        return
    yield f"{APT_GET} --allow-change-held-packages purge " + " ".join(strays)  # a hold does not keep a stray


@reading_operation(reads=lambda **_: [Read(RunfileDriver)])
def runfile_install(path: str, driver: str, options: tuple[str, ...]) -> Commands:
    """`sh NVIDIA-Linux-x86_64-<driver>.run OPTIONS` unless that driver is installed by a run with those options."""
    observed = read(RunfileDriver)
    if observed.version == driver and set(options) <= set(observed.options):
        host.noop(f"driver {driver} installed from the runfile with {' '.join(options)}")
        return
    yield f"sh {shlex.quote(path)} {' '.join(options)}"


@reading_operation(reads=lambda **_: [Read(RunfileDriver)])
def remove_runfile_driver() -> Commands:
    """The apt method after a runfile install: `nvidia-uninstall --silent` first (its files would clash)."""
    observed = read(RunfileDriver)
    if observed.version is None:
        host.noop("no runfile driver installed")
        return
    yield "nvidia-uninstall --silent"


@reading_operation(reads=lambda **_: [Read(StaleInitrds, {"newer_than": NOUVEAU_BLACKLIST})])
def rebuild_initramfs() -> Commands:
    """`update-initramfs -u -k all` when an initrd predates the nouveau blacklist."""
    stale = read(StaleInitrds, newer_than=NOUVEAU_BLACKLIST)
    if not stale:
        host.noop("every initrd includes the nouveau blacklist (or there is none: a container)")
        return
    yield "update-initramfs -u -k all"


@reading_operation(reads=lambda directory, **_: [Read(CudaSamples, {"directory": directory})])
def stage_cuda_samples(tarball: str, directory: str, sha256: str) -> Commands:
    """Unpack the checksummed cuda-samples tarball into `directory` (recording its SHA-256) unless it is there."""
    if read(CudaSamples, directory=directory) == sha256:
        host.noop(f"{directory} holds the cuda-samples source {sha256[:12]}")
        return
    d, t = shlex.quote(directory), shlex.quote(tarball)
    yield (
        f"rm -rf {d} && mkdir -p {d} && tar -xzf {t} -C {d} --strip-components=1 && "
        f"test -f {d}/Samples/1_Utilities/deviceQuery/Makefile && echo {sha256} > {d}/.ironserve-source-sha256"
    )


def _stack_reads(cuda_home: str, dkms: bool, **_: object) -> list[Read]:
    return [Read(NvidiaStack, {"cuda_home": cuda_home}), Read(LoadedModule), *([Read(DkmsKernels)] if dkms else [])]


@reading_operation(reads=_stack_reads)
def verify_stack(driver: str, cuda: str, cudnn: str, cuda_home: str, dkms: bool) -> Commands:
    """Fail unless nvidia-smi, the toolkit, the cuDNN header and the DKMS builds match the lock.

    A module that is not yet the installed driver (an older one loaded, or nouveau holding the GPU on a first
    install) is no failure here: the deploy's one reboot brings it in. Until then a real nvidia-smi answers
    "Driver/library version mismatch" or finds no driver, so what it reports is not held against the host.
    """
    if not state.is_executing:
        host.noop("verified after the install, while the deploy runs")
        return
    observed = read(NvidiaStack, cuda_home=cuda_home)
    problems = stack_problems(observed, driver, cuda, cudnn, cuda_home)
    pending = driver_reboot_reason(read(LoadedModule), driver) is not None
    reboot = [p for p in problems if "reboot needed" in p]
    wrong = [
        p for p in problems if p not in reboot and not ((reboot or pending) and p.startswith("nvidia-smi reports"))
    ]
    if dkms:
        lacking = dkms_lacking(read(DkmsKernels), driver)
        if lacking:
            wrong.append(f"no DKMS-built nvidia {driver} module for kernel {', '.join(lacking)}")
    if wrong:
        yield failing("the NVIDIA stack does not match the lock: " + "; ".join(wrong))
        return
    if pending or reboot:
        host.noop(f"CUDA {cuda}, cuDNN {cudnn} verified; driver {driver} takes effect with the deploy's reboot")
    else:
        host.noop(f"driver {driver}, CUDA {cuda}, cuDNN {cudnn} verified")
    yield from ()


@reading_operation(reads=lambda **_: [Read(AptSourceFiles)])
def foreign_sources_disabled(url: str, own: str) -> Commands:
    """Move into BACKUP_DIR every apt source file but `own` that names the repository at `url`: NVIDIA's
    cuda-keyring package adds one with its own signed-by, and apt then refuses every command ("Conflicting values
    set for option Signed-By"). The whole file goes (cuda-keyring's holds that one line); the report names it."""
    foreign = [path for path in sources_naming(read(AptSourceFiles), url) if path != own]
    if not foreign:
        host.noop(f"no apt source but {own} names {url}")
        return
    for path in foreign:
        yield from backed_up(
            path,
            f"also names {url}, the repository ironserve configures in {own}, with its own signed-by (apt stops "
            "every command: Conflicting values set for option Signed-By)",
        )


@reading_operation(reads=lambda **_: [Read(CudaHomeAssignments)])
def foreign_cuda_home_disabled(own: str, cuda_home: str) -> Commands:
    """Comment out every CUDA_HOME assignment of the shell startup files but `own` (a copy of each file kept in
    BACKUP_DIR): a later /etc/profile.d script exporting another toolkit wins over the role's. The toolkit is the
    lock's, or nvidia_cuda_home's when a site chose another."""
    foreign = {path: lines for path, lines in read(CudaHomeAssignments).items() if path != own}
    if not foreign:
        host.noop(f"no shell startup file but {own} sets CUDA_HOME")
        return
    for path, lines in foreign.items():
        yield from backed_up(
            path,
            f"sets CUDA_HOME ({'; '.join(lines)}) over {cuda_home} (set nvidia_cuda_home instead)",
            keep_original=True,
        )
        # @ delimits: the assignment holds / (a path), never @.
        script = f"s@{CUDA_HOME_ASSIGNMENT}.*@# disabled by ironserve (nvidia_cuda_home sets it): &@"
        yield StringCommand("sed", "-i", "-E", QuoteString(script), QuoteString(path))
