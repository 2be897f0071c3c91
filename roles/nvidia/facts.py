"""Facts the nvidia role reads, each with a pure, unit-tested parser.

- `SecureBoot`: `enabled` / `validation-disabled` / `disabled` / `unknown` (mokutil, else the EFI variables).
- `StaleInitrds`: initrd images older than a file (the nouveau blacklist): they need rebuilding.
- `NvidiaStack`: what is on disk, in dpkg and what nvidia-smi reports, compared by `stack_problems` with the lock.
- `DkmsKernels`: installed kernels (an image in /boot and a /lib/modules tree) and where DKMS built the module.
- `LoadedModule`: the loaded nvidia kernel module's version (or none) and whether nouveau is loaded.
- `CudaSamples`: the SHA-256 recorded when the cuda-samples source was unpacked.
- `RunfileDriver`: the driver a runfile installed (`nvidia-installer --version`) and the options it ran with.
- `AptSourceFiles`: the active lines of every apt source file, read by `sources_naming` for a repository's URL.
- `CudaHomeAssignments`: the lines of the system-wide shell startup files that set CUDA_HOME.

The OS (`OsDistro`) and dpkg's packages (`DpkgPackages`) are shared facts in ironserve/facts.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyinfra.api.facts import FactBase

from ironserve.apt import same_repository
from ironserve.aptindex import upstream
from ironserve.facts import grep_files, lines_by_file, parse_dpkg_query, sections

SECURE_BOOT_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
# shim mirrors MokSBState (validation disabled by `mokutil --disable-validation`) into this runtime variable; the
# kernel then treats Secure Boot as off (drivers/firmware/efi/libstub/secureboot.c), so unsigned modules load.
MOK_SB_STATE_EFIVAR = "/sys/firmware/efi/efivars/MokSBStateRT-605dab50-e046-4300-abb6-3dd810dd8b23"
CUDNN_HEADERS = ("/usr/include/cudnn_version.h", "/usr/include/x86_64-linux-gnu/cudnn_version_v8.h")


class SecureBoot(FactBase[str]):
    """UEFI Secure Boot: `enabled` (enforcing), `validation-disabled` (enabled, but shim does not validate what it
    loads), `disabled`, or `unknown` (no mokutil, no EFI variables: e.g. BIOS boot)."""

    @staticmethod
    def default() -> str:
        return "unknown"

    def command(self) -> str:
        return (
            "if command -v mokutil >/dev/null 2>&1; then mokutil --sb-state 2>&1; "
            f"else od -An -tu1 {SECURE_BOOT_EFIVAR} 2>/dev/null | awk '{{print \"efivar\", $NF}}'; "
            f"[ -e {MOK_SB_STATE_EFIVAR} ] && echo efivar-moksbstate; fi; true"
        )

    def process(self, output: Iterable[str]) -> str:
        return parse_secure_boot(list(output))


def parse_secure_boot(lines: list[str]) -> str:
    """`mokutil --sb-state` (a second line `SecureBoot validation is disabled in shim` when shim does not
    validate; `Platform is in Setup Mode` after `SecureBoot disabled`), or the EFI variables without mokutil."""
    stripped = [line.strip() for line in lines]
    text = "\n".join(stripped)
    enabled = "SecureBoot enabled" in text or "efivar 1" in stripped
    if enabled and ("SecureBoot validation is disabled in shim" in text or "efivar-moksbstate" in stripped):
        return "validation-disabled"
    if enabled:
        return "enabled"
    if "SecureBoot disabled" in text or "efivar 0" in stripped:
        return "disabled"
    return "unknown"


class StaleInitrds(FactBase[list[str]]):
    """Initrd images under /boot older than `newer_than` (none in a container, which has no /boot images)."""

    @staticmethod
    def default() -> list[str]:
        return []

    def command(self, newer_than: str) -> str:
        path = shlex.quote(newer_than)
        return f'for f in /boot/initrd.img-*; do [ -e "$f" ] && [ "$f" -ot {path} ] && echo "$f"; done; true'

    def process(self, output: Iterable[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


@dataclass(frozen=True)
class StackObserved:
    driver_versions: list[str] = field(default_factory=list)  # nvidia-smi driver_version, one per distinct value
    module_version: str | None = None  # the loaded kernel module (/sys/module/nvidia/version)
    cudnn_version: str | None = None  # from cudnn_version.h
    cuda_version: str | None = None  # <cuda_home>/version.json cuda.version: 11.8.20220929 (older), 13.0.2 (newer)
    nvcc_release: str | None = None  # `nvcc --version`: "release 11.8"
    toolkits: list[str] = field(default_factory=list)  # /usr/local/cuda-* directories
    cuda_link: str | None = None  # readlink -f /usr/local/cuda
    toolkit_packages: dict[str, str] = field(default_factory=dict)  # installed cuda-toolkit-X-Y -> dpkg version


# The loaded module's version: /sys/module/nvidia/version, else the NVRM line of /proc/driver/nvidia/version.
MODULE_VERSION_COMMAND = (
    "cat /sys/module/nvidia/version 2>/dev/null || head -n 1 /proc/driver/nvidia/version 2>/dev/null"
)
NVRM = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
DPKG_FIELDS = "${Package}\\t${Version}\\t${db:Status-Abbrev}\\n"


def parse_module_version(lines: list[str]) -> str | None:
    """`525.85.12` (sysfs) or `NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.85.12  Wed Jan ...` -> version."""
    for line in lines:
        text = line.strip()
        if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", text):
            return text
        match = NVRM.search(text)
        if match:
            return match.group(1)
    return None


class NvidiaStack(FactBase[StackObserved]):
    def command(self, cuda_home: str) -> str:
        home = shlex.quote(cuda_home)
        headers = " ".join(CUDNN_HEADERS)
        return "; ".join(
            [
                "echo '== smi'",
                "nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sort -u",
                "echo '== module'",
                MODULE_VERSION_COMMAND,
                "echo '== cudnn'",
                f"grep -hE '^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' {headers} 2>/dev/null",
                "echo '== cuda'",
                f"tr -d '\\n' < {home}/version.json 2>/dev/null; echo",
                "echo '== nvcc'",
                f"{home}/bin/nvcc --version 2>/dev/null | grep -o 'release [0-9.]*'",
                "echo '== toolkits'",
                "ls -d /usr/local/cuda-* 2>/dev/null",
                "echo '== link'",
                "readlink -f /usr/local/cuda 2>/dev/null",
                "echo '== packages'",
                f"dpkg-query -W -f='{DPKG_FIELDS}' 'cuda-toolkit-[0-9]*' 2>/dev/null",
                "true",
            ]
        )

    def process(self, output: Iterable[str]) -> StackObserved:
        return parse_stack(output)


def _values(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()]


def parse_stack(lines: Iterable[str]) -> StackObserved:
    found = {name: _values(section) for name, section in sections(lines).items()}
    defines = dict(re.findall(r"#define CUDNN_(MAJOR|MINOR|PATCHLEVEL)\s+(\d+)", "\n".join(found.get("cudnn", []))))
    cudnn = None
    if {"MAJOR", "MINOR", "PATCHLEVEL"} <= defines.keys():
        cudnn = f"{defines['MAJOR']}.{defines['MINOR']}.{defines['PATCHLEVEL']}"
    cuda = None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        cuda = json.loads("".join(found.get("cuda", [])))["cuda"]["version"]
    nvcc = found.get("nvcc", [])
    link = found.get("link", [])
    packages = parse_dpkg_query(found.get("packages", []))
    return StackObserved(
        driver_versions=found.get("smi", []),
        module_version=parse_module_version(found.get("module", [])),
        cudnn_version=cudnn,
        cuda_version=cuda,
        nvcc_release=nvcc[0].removeprefix("release ") if nvcc else None,
        toolkits=found.get("toolkits", []),
        cuda_link=link[0] if link else None,
        toolkit_packages={name: entry.version for name, entry in packages.items()},
    )


def cuda_line(version: str | None) -> str | None:
    """`11.8` of a CUDA version: the lock's `11.8.0`, version.json's date-stamped `11.8.20220929`, nvcc's `11.8`."""
    parts = (version or "").split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else None


def stack_problems(observed: StackObserved, driver: str, cuda: str, cudnn: str, cuda_home: str) -> list[str]:
    """Every way the host differs from the lock, as sentences; empty when it matches.

    CUDA is compared as the lock means it: version.json and nvcc name the CUDA line (11.8: older toolkits
    date-stamp version.json's `cuda.version`, 11.8.0 writes 11.8.20220929, newer ones write the release), the
    cuda-toolkit-X-Y package names the full version (11.8.0-1). A toolkit without that package (not from apt)
    is checked by its line alone.
    """
    problems = []
    if observed.driver_versions != [driver]:
        problems.append(f"nvidia-smi reports driver {', '.join(observed.driver_versions) or 'nothing'}, lock {driver}")
    if observed.module_version is not None and observed.module_version != driver:
        problems.append(f"the loaded kernel module is {observed.module_version}, userland {driver}: reboot needed")
    line = cuda_line(cuda) or cuda
    if cuda_line(observed.cuda_version) != line:
        problems.append(f"{cuda_home}/version.json says CUDA {observed.cuda_version}, lock {cuda} (CUDA {line})")
    if observed.nvcc_release != line:
        problems.append(f"{cuda_home}/bin/nvcc reports release {observed.nvcc_release}, lock {line}")
    package = "cuda-toolkit-" + line.replace(".", "-")
    installed = observed.toolkit_packages.get(package)
    if installed is not None and upstream(installed) != cuda:
        problems.append(f"dpkg has {package} {installed}, lock CUDA {cuda}")
    if observed.cudnn_version != cudnn:
        problems.append(f"cudnn_version.h defines cuDNN {observed.cudnn_version}, lock {cudnn}")
    others = [t for t in observed.toolkits if t != cuda_home and not t.startswith("/usr/local/cuda-" + line)]
    if others:
        problems.append(f"other CUDA toolkits are installed: {', '.join(others)}")
    if observed.cuda_link != cuda_home:
        problems.append(f"/usr/local/cuda resolves to {observed.cuda_link}, not {cuda_home}")
    return problems


# --- DKMS: the module built for every installed kernel ------------------------------------------------------------

# `dkms status` lines for an installed nvidia module: dkms 3 `nvidia-current/525.85.12, 6.1.0-13-amd64, x86_64:
# installed`, dkms 2 `nvidia, 525.85.12, 5.15.0-91-generic, x86_64: installed` (a warning may follow).
DKMS_INSTALLED = re.compile(r"^(nvidia[\w-]*)(?:/|,\s*)([^,\s]+),\s*([^,\s]+),\s*[^:]+:\s*installed")


@dataclass(frozen=True)
class DkmsObserved:
    kernels: list[str] = field(default_factory=list)  # /lib/modules/<k> with /boot/vmlinuz-<k>
    installed: dict[str, list[str]] = field(default_factory=dict)  # kernel -> nvidia versions dkms installed
    modules: dict[str, list[str]] = field(default_factory=dict)  # kernel -> nvidia*.ko* in updates/dkms
    dkms: bool = False  # the dkms command exists


class DkmsKernels(FactBase[DkmsObserved]):
    """Installed kernels and, per kernel, the nvidia module versions `dkms status` reports installed and the
    module files in /lib/modules/<k>/updates/dkms (Debian's and Ubuntu's DKMS destination)."""

    @staticmethod
    def default() -> DkmsObserved:  # no output: no kernel, no module, no dkms
        return DkmsObserved()

    def command(self) -> str:
        return "; ".join(
            [
                'for d in /lib/modules/*; do k="${d##*/}"; [ -e "/boot/vmlinuz-$k" ] && echo "kernel $k"; done',
                'for f in /lib/modules/*/updates/dkms/nvidia*.ko*; do [ -e "$f" ] && echo "file $f"; done',
                "if command -v dkms >/dev/null 2>&1; then echo dkms-present; "
                "dkms status 2>/dev/null | sed 's/^/dkms /'; fi",
                "true",
            ]
        )

    def process(self, output: Iterable[str]) -> DkmsObserved:
        return parse_dkms(output)


def parse_dkms(lines: Iterable[str]) -> DkmsObserved:
    kernels: list[str] = []
    installed: dict[str, list[str]] = {}
    modules: dict[str, list[str]] = {}
    present = False
    for line in lines:
        kind, _, rest = line.strip().partition(" ")
        if kind == "kernel" and rest:
            kernels.append(rest)
        elif kind == "file":
            parts = rest.split("/")  # /lib/modules/<k>/updates/dkms/<name>
            if len(parts) > 3:
                modules.setdefault(parts[3], []).append(parts[-1])
        elif kind == "dkms-present":
            present = True
        elif kind == "dkms":
            match = DKMS_INSTALLED.match(rest)
            if match:
                installed.setdefault(match.group(3), []).append(match.group(2))
    return DkmsObserved(kernels=sorted(kernels), installed=installed, modules=modules, dkms=present)


# The driver's main module as DKMS installs it: nvidia.ko (Ubuntu, the runfile), nvidia-current.ko (Debian), maybe
# compressed; nvidia-drm/-modeset/-uvm alone do not make a working driver.
MAIN_MODULE = re.compile(r"nvidia(-current)?\.ko(\.(xz|zst|gz))?")


def dkms_lacking(observed: DkmsObserved, driver: str) -> list[str]:
    """Installed kernels without the nvidia module `driver` built and installed by DKMS (per dkms, and on disk)."""
    return [
        k
        for k in observed.kernels
        if driver not in observed.installed.get(k, [])
        or not any(MAIN_MODULE.fullmatch(name) for name in observed.modules.get(k, []))
    ]


# --- the loaded module: a driver change takes effect at the next boot -------------------------------------------


@dataclass(frozen=True)
class ModuleObserved:
    nvidia: str | None = None  # version of the loaded nvidia module, None when not loaded
    nouveau: bool = False  # nouveau loaded (it holds the GPU until a reboot without it)


class LoadedModule(FactBase[ModuleObserved]):
    def command(self) -> str:
        nouveau = "test -d /sys/module/nouveau && echo loaded"
        return f"echo '== nvidia'; {MODULE_VERSION_COMMAND}; echo '== nouveau'; {nouveau}; true"

    def process(self, output: Iterable[str]) -> ModuleObserved:
        return parse_loaded_module(list(output))


def parse_loaded_module(lines: list[str]) -> ModuleObserved:
    found = sections(lines)
    return ModuleObserved(
        nvidia=parse_module_version(found.get("nvidia", [])), nouveau="loaded" in _values(found.get("nouveau", []))
    )


def driver_reboot_reason(loaded: ModuleObserved, driver: str) -> str | None:
    """Why the installed userland driver `driver` needs a reboot to take effect, or None."""
    if loaded.nvidia is not None and loaded.nvidia != driver:
        return f"the loaded nvidia kernel module is {loaded.nvidia}, the installed driver {driver}: reboot needed"
    if loaded.nvidia is None and loaded.nouveau:
        return f"nouveau is loaded and holds the GPU; the nvidia {driver} module loads after a reboot"
    return None


class CudaSamples(FactBase[str]):
    """The SHA-256 recorded in `<dir>/.ironserve-source-sha256` when the source was unpacked, or ``""``."""

    @staticmethod
    def default() -> str:
        return ""

    def command(self, directory: str) -> str:
        return f"cat {shlex.quote(directory)}/.ironserve-source-sha256 2>/dev/null; true"

    def process(self, output: Iterable[str]) -> str:
        return "".join(line.strip() for line in output)


# --- the runfile method -------------------------------------------------------------------------------------------

INSTALLER_LOG = "/var/log/nvidia-installer.log"


@dataclass(frozen=True)
class RunfileObserved:
    version: str | None = None  # `nvidia-installer --version`; None: no runfile driver installed
    options: list[str] = field(default_factory=list)  # the installer's command line, from its log


class RunfileDriver(FactBase[RunfileObserved]):
    def command(self) -> str:
        return (
            "echo '== version'; nvidia-installer --version 2>/dev/null | head -n 3; "
            f"echo '== log'; cat {INSTALLER_LOG} 2>/dev/null; true"
        )

    def process(self, output: Iterable[str]) -> RunfileObserved:
        return parse_runfile(list(output))


def parse_runfile(lines: list[str]) -> RunfileObserved:
    """`nvidia-installer:  version 525.85.12 ...` and the log's `nvidia-installer command line:` block."""
    found = sections(lines)
    version = None
    for line in found.get("version", []):
        match = re.search(r"nvidia-installer:\s+version\s+(\d+\.\d+(?:\.\d+)?)", line)
        if match:
            version = match.group(1)
            break
    return RunfileObserved(version=version, options=_installer_options(found.get("log", [])))


def _installer_options(log: list[str]) -> list[str]:
    """The indented lines after `nvidia-installer command line:`, without the program itself (`./nvidia-installer`)."""
    if "nvidia-installer command line:" not in log:
        return []
    options: list[str] = []
    for line in log[log.index("nvidia-installer command line:") + 1 :]:
        if not line.startswith("    "):
            break
        options.append(line.strip())
    return options[1:]


# Every file apt reads sources from (sources.list(5)): the one-line format and deb822 .sources alike.
APT_SOURCE_GLOBS = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources")


class AptSourceFiles(FactBase[dict[str, list[str]]]):
    """The active lines (neither blank nor a comment) of every apt source file, by path."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def command(self) -> str:
        return grep_files(APT_SOURCE_GLOBS, "^[[:space:]]*(#|$)", invert=True)

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        return lines_by_file(output)


def sources_naming(files: dict[str, list[str]], url: str) -> list[str]:
    """The source files with a line naming the repository at `url`: a one-line `deb [options] URI suite` entry or
    a deb822 `URIs:` field (any of its URIs)."""
    wanted = same_repository(url)
    naming = []
    for path, lines in sorted(files.items()):
        for line in lines:
            fields = line.split("]", 1)[-1].split() if line.startswith(("deb ", "deb-src ")) else line.split()
            if fields and fields[0].lower() == "uris:":
                fields = fields[1:]
            if any(same_repository(field) == wanted for field in fields):
                naming.append(path)
                break
    return naming


# What a login shell sources system-wide (bash, dash and sh read /etc/profile, which runs /etc/profile.d/*.sh).
SHELL_STARTUP_GLOBS = ("/etc/profile", "/etc/bash.bashrc", "/etc/profile.d/*.sh")
CUDA_HOME_ASSIGNMENT = r"^[[:space:]]*(export[[:space:]]+)?CUDA_HOME="


class CudaHomeAssignments(FactBase[dict[str, list[str]]]):
    """The lines of the system-wide shell startup files that set CUDA_HOME, by path."""

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def command(self) -> str:
        return grep_files(SHELL_STARTUP_GLOBS, CUDA_HOME_ASSIGNMENT)

    def process(self, output: Iterable[str]) -> dict[str, list[str]]:
        return lines_by_file(output)
