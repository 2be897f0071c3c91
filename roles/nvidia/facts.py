"""Facts the nvidia role reads, each with a pure, unit-tested parser.

- `OsDistro`: NVIDIA's repository directory name for the host's OS (`debian12`, `ubuntu2204`).
- `DpkgPackages`: installed packages matching names or globs -> version and hold state.
- `SecureBoot`: `enabled` / `disabled` / `unknown` (mokutil, else the EFI variable).
- `StaleInitrds`: initrd images older than a file (the nouveau blacklist): they need rebuilding.
- `NvidiaStack`: what is on disk and what nvidia-smi reports, compared by `stack_problems` with the lock.
- `DkmsKernels`: installed kernels (an image in /boot and a /lib/modules tree) and where DKMS built the module.
- `LoadedModule`: the loaded nvidia kernel module's version (or none) and whether nouveau is loaded.
- `CudaSamples`: the SHA-256 recorded when the cuda-samples source was unpacked.
- `RunfileDriver`: the driver a runfile installed (`nvidia-installer --version`) and the options it ran with.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyinfra.api.facts import FactBase

SECURE_BOOT_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
CUDNN_HEADERS = ("/usr/include/cudnn_version.h", "/usr/include/x86_64-linux-gnu/cudnn_version_v8.h")


class SecureBoot(FactBase[str]):
    """UEFI Secure Boot: `enabled`, `disabled` or `unknown` (no mokutil, no EFI variables: e.g. BIOS boot)."""

    @staticmethod
    def default() -> str:
        return "unknown"

    def command(self) -> str:
        return (
            "if command -v mokutil >/dev/null 2>&1; then mokutil --sb-state 2>&1; "
            f"else od -An -tu1 {SECURE_BOOT_EFIVAR} 2>/dev/null | awk '{{print \"efivar\", $NF}}'; fi; true"
        )

    def process(self, output: Iterable[str]) -> str:
        return parse_secure_boot(list(output))


def parse_secure_boot(lines: list[str]) -> str:
    text = " ".join(lines).strip()
    if re.search(r"SecureBoot enabled", text) or text == "efivar 1":
        return "enabled"
    if re.search(r"SecureBoot disabled", text) or text == "efivar 0":
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
    cuda_version: str | None = None  # <cuda_home>/version.json cuda.version
    nvcc_release: str | None = None  # `nvcc --version`: "release 11.8"
    toolkits: list[str] = field(default_factory=list)  # /usr/local/cuda-* directories
    cuda_link: str | None = None  # readlink -f /usr/local/cuda


# The loaded module's version: /sys/module/nvidia/version, else the NVRM line of /proc/driver/nvidia/version.
MODULE_VERSION_COMMAND = (
    "cat /sys/module/nvidia/version 2>/dev/null || head -n 1 /proc/driver/nvidia/version 2>/dev/null"
)
NVRM = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def parse_module_version(lines: list[str]) -> str | None:
    """`525.85.02` (sysfs) or `NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.85.02  Wed Jan ...` -> version."""
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
                "true",
            ]
        )

    def process(self, output: Iterable[str]) -> StackObserved:
        return parse_stack(output)


def parse_stack(lines: Iterable[str]) -> StackObserved:
    sections: dict[str, list[str]] = {}
    current = ""
    for line in lines:
        if line.startswith("== "):
            current = line[3:].strip()
            sections[current] = []
        elif line.strip() and current:
            sections[current].append(line.strip())
    defines = dict(re.findall(r"#define CUDNN_(MAJOR|MINOR|PATCHLEVEL)\s+(\d+)", "\n".join(sections.get("cudnn", []))))
    cudnn = None
    if {"MAJOR", "MINOR", "PATCHLEVEL"} <= defines.keys():
        cudnn = f"{defines['MAJOR']}.{defines['MINOR']}.{defines['PATCHLEVEL']}"
    cuda = None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        cuda = json.loads("".join(sections.get("cuda", [])))["cuda"]["version"]
    nvcc = sections.get("nvcc", [])
    link = sections.get("link", [])
    return StackObserved(
        driver_versions=sections.get("smi", []),
        module_version=parse_module_version(sections.get("module", [])),
        cudnn_version=cudnn,
        cuda_version=cuda,
        nvcc_release=nvcc[0].removeprefix("release ") if nvcc else None,
        toolkits=sections.get("toolkits", []),
        cuda_link=link[0] if link else None,
    )


def stack_problems(observed: StackObserved, driver: str, cuda: str, cudnn: str, cuda_home: str) -> list[str]:
    """Every way the host differs from the lock, as sentences; empty when it matches."""
    problems = []
    if observed.driver_versions != [driver]:
        problems.append(f"nvidia-smi reports driver {', '.join(observed.driver_versions) or 'nothing'}, lock {driver}")
    if observed.module_version is not None and observed.module_version != driver:
        problems.append(f"the loaded kernel module is {observed.module_version}, userland {driver}: reboot needed")
    if observed.cuda_version != cuda:
        problems.append(f"{cuda_home}/version.json says CUDA {observed.cuda_version}, lock {cuda}")
    cuda_line = ".".join(cuda.split(".")[:2])
    if observed.nvcc_release != cuda_line:
        problems.append(f"{cuda_home}/bin/nvcc reports release {observed.nvcc_release}, lock {cuda_line}")
    if observed.cudnn_version != cudnn:
        problems.append(f"cudnn_version.h defines cuDNN {observed.cudnn_version}, lock {cudnn}")
    others = [t for t in observed.toolkits if t != cuda_home and not t.startswith("/usr/local/cuda-" + cuda_line)]
    if others:
        problems.append(f"other CUDA toolkits are installed: {', '.join(others)}")
    if observed.cuda_link != cuda_home:
        problems.append(f"/usr/local/cuda resolves to {observed.cuda_link}, not {cuda_home}")
    return problems


# --- DKMS: the module built for every installed kernel ------------------------------------------------------------

# `dkms status` lines for an installed nvidia module: dkms 3 `nvidia-current/525.85.02, 6.1.0-13-amd64, x86_64:
# installed`, dkms 2 `nvidia, 525.85.02, 5.15.0-91-generic, x86_64: installed` (a warning may follow).
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
    split = lines.index("== nouveau") if "== nouveau" in lines else len(lines)
    nvidia = parse_module_version([line for line in lines[:split] if line != "== nvidia"])
    return ModuleObserved(nvidia=nvidia, nouveau="loaded" in (line.strip() for line in lines[split:]))


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
    """`nvidia-installer:  version 525.85.02 ...` and the log's `nvidia-installer command line:` block."""
    split = lines.index("== log") if "== log" in lines else len(lines)
    version = None
    for line in lines[:split]:
        match = re.search(r"nvidia-installer:\s+version\s+(\d+\.\d+(?:\.\d+)?)", line)
        if match:
            version = match.group(1)
            break
    options: list[str] = []
    log = lines[split + 1 :]
    if "nvidia-installer command line:" in log:
        for line in log[log.index("nvidia-installer command line:") + 1 :]:
            if not line.startswith("    "):
                break
            options.append(line.strip())
    return RunfileObserved(version=version, options=options[1:])  # [0] is ./nvidia-installer
