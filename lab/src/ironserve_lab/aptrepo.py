"""The lab's NVIDIA apt mirror: GPG-signed flat repositories of stand-in packages, served over HTTP.

It stands where NVIDIA's CUDA network repository (or a site's internal mirror of it) stands for a real host: the
same layout (`<directory>/x86_64/` with `Packages`, `Release`, `InRelease`), signed by a key the host trusts through
`signed-by`. Two directories: `debian11/`, where Debian 12 hosts take CUDA 11.x from (NVIDIA's debian12 directory
starts at CUDA 12.3), with both profiles' sets and newer decoys (driver 535.129.03, a CUDA 12 toolkit, cuDNN 8.9 for
CUDA 12, TensorRT 8.6.1.6 for CUDA 12.0 and TensorRT 10, container toolkit 1.17.8); and `debian12/`, the low end of
NVIDIA's debian12 directory (drivers 545.23.06 and 550.54.14, CUDA 12.3), so a lock pointed at it fails as it would.
Under `variants/<name>/` the same key signs copies of a directory less a package version (VARIANTS): a site's mirror
that lacks it.

Package names, versions and relations (Depends, Pre-Depends, Provides, Conflicts, Breaks) are data,
files/nvidia-repository.yaml, following captured repository metadata: the driver as Debian's
packaging of 535.261.03-1 with the version substituted (nvidia-driver, nvidia-kernel-dkms, nvidia-smi, libcuda1 and
every package they reach), TensorRT's members pinning each other with `=`, the container toolkit's `=`/`>=` shape.
apt's own resolver on a lab host therefore refuses what it refuses against NVIDIA's repository (a lone
`tensorrt=...+cuda11.8` pin, a driver version that was never released). Relations to Debian packages a lab host
lacks (X server, Mesa, ...) are dropped and listed; NVIDIA-MIRROR.md says what each directory
carries, which capture each group follows and where a neighbouring version's structure stands in.

Only the payloads are stand-ins: real-looking files where the real packages put them (`nvidia-smi` reporting the
host's hardware profile in package nvidia-smi, libcuda.so in libcuda1, `/usr/local/cuda-X.Y/version.json` and
`nvcc --version`, `cudnn_version.h`, libraries under their real names, the container toolkit's default
`config.toml`, the driver's `dkms.conf` in nvidia-kernel-dkms), plus a stand-in of Debian's `dkms`
(standin_dkms.py) at a version above Debian 12's, so that `Depends: dkms` resolves to it in the lab.
Beside the repositories the server offers what else a site mirrors: stand-in driver runfiles at NVIDIA's download
path and stand-in cuda-samples archives at GitHub's.
The same server and key also stand for pkgs.k8s.io: under `kubernetes/core:/stable:/v1.31/deb/` a flat
repository of stand-in kubeadm, kubelet, kubectl, cri-tools and kubernetes-cni (standin_kubernetes.py)
with pkgs.k8s.io's versions, control fields and systemd files, the pinned set and newer decoys.
Packages are built with `dpkg-deb` (in parallel, reproducibly), indexed with `dpkg-scanpackages` (dpkg-dev)
and signed with `gpg` (gnupg); the signing key is generated once into the cache, never committed.

`ensure_built()` builds the repository once (rebuilt when this builder or its data changes); `start(watch_pid)`
serves it on the lab bridge address (one server per lab host, stopped by `stop(pid)` at lab down, or by itself
when the host's supervisor is gone).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import fcntl
import functools
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any

import yaml

from ironserve_lab import charts, servers, standin_nvml
from ironserve_lab.paths import lab_dir

MODULE = "ironserve_lab.aptrepo"  # how servers are started, and recognised by their command line
HERE = Path(__file__).resolve().parent
NVIDIA_SMI = HERE / "standin_nvidia_smi.py"
DKMS = HERE / "standin_dkms.py"
KUBERNETES = HERE / "standin_kubernetes.py"
REPOSITORY_DATA = HERE / "files" / "nvidia-repository.yaml"  # the NVIDIA package set: names, versions, relations
# NVIDIA's repository layout, <distro>/x86_64/: debian11 (what Debian 12 hosts install CUDA 11.x from) and debian12
# (whose low end starts at CUDA 12.3 and driver 545).
DISTROS = ("debian11", "debian12")
ARCH_DIR = "x86_64"
KEY_UID = "ironserve lab NVIDIA mirror <lab-mirror@ironserve.invalid>"
LIBDIR = "/usr/lib/x86_64-linux-gnu"

Files = dict[str, tuple[str | bytes, int]]  # absolute path -> (content, mode)


@dataclass(frozen=True)
class StandinPackage:
    name: str
    version: str
    description: str
    files: Files = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)  # absolute path -> symlink target
    depends: str = ""
    postinst: str = ""
    prerm: str = ""
    section: str = "multiverse/devel"  # NVIDIA's repositories' section
    homepage: str = ""
    upstream: str = "NVIDIA's"  # whose package name and version the stand-in carries
    pre_depends: str = ""
    provides: str = ""
    conflicts: str = ""
    breaks: str = ""
    source: str = ""  # the Source: field, where the real package names its source package
    architecture: str = "amd64"


# --- what the packages contain -----------------------------------------------------------------------------

# CUDA version each driver branch reports in nvidia-smi (CUDA release notes, Table 3).
DRIVER_CUDA = {"515": "11.7", "525": "12.0", "535": "12.2", "545": "12.3", "550": "12.4"}
# nvcc build identification per toolkit, as `nvcc --version` prints it.
NVCC_BUILD = {
    "11.8": ("V11.8.89", "Wed_Sep_21_10:33:58_PDT_2022", "cuda_11.8.r11.8/compiler.31833905_0", "11.8.89"),
    "11.7": ("V11.7.99", "Wed_Jun__8_16:49:14_PDT_2022", "cuda_11.7.r11.7/compiler.31442593_0", "11.7.99"),
    "12.2": ("V12.2.140", "Tue_Aug_15_22:02:13_PDT_2023", "cuda_12.2.r12.2/compiler.33191640_0", "12.2.140"),
    "12.3": ("V12.3.107", "Wed_Nov_22_10:17:15_PST_2023", "cuda_12.3.r12.3/compiler.33567101_0", "12.3.107"),
}
# version.json's `cuda.version` ("CUDA SDK") in these toolkits is date-stamped, not the release: CUDA 11.8.0 writes
# 11.8.20220929 and 12.2.2 writes 12.2.20230823 (as real /usr/local/cuda/version.json files show; newer toolkits
# write the release, 13.0.2). 11.7.1's and 12.3.2's stamps keep the format, their dates are not taken from real files.
CUDA_SDK_VERSION = {
    "11.8.0": "11.8.20220929",
    "11.7.1": "11.7.20220802",
    "12.2.2": "12.2.20230823",
    "12.3.2": "12.3.20231122",
}


def cuda_version_json(version: str, cudart: str) -> str:
    """<cuda_home>/version.json as NVIDIA writes it: components sorted, three-space indent, `"key" : value`."""
    components = {
        "cuda": {"name": "CUDA SDK", "version": CUDA_SDK_VERSION[version]},
        "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": cudart},
        "cuda_nvcc": {"name": "CUDA NVCC", "version": cudart},
    }
    return json.dumps(components, indent=3, separators=(",", " : "), sort_keys=True) + "\n"


def _library(name: str, version: str, soname: str, build: str | None = None) -> tuple[Files, dict[str, str]]:
    """A stand-in shared library under its real file name, with the soname link ldconfig would make: a placeholder,
    or the lab's working stand-in that `build` names (LIBRARY_BUILDS)."""
    real = f"{LIBDIR}/{name}.{version}"
    content = LIBRARY_BUILDS[build]() if build else f"ironserve lab stand-in for {name} {version} (SONAME {soname})\n"
    return {real: (content, 0o644)}, {f"{LIBDIR}/{soname}": f"{name}.{version}"}


# Libraries the lab builds for real: NVML answers the inference service's GPU health reads (standin_nvml.py), and
# without the state file a GPU host's edge writes it answers "Driver Not Loaded", as NVML does without the module.
LIBRARY_BUILDS: dict[str, Callable[[], bytes]] = {"nvml": standin_nvml.library_bytes}


@dataclass(frozen=True)
class Payload:
    """What a stand-in installs: files, symlinks and maintainer scripts."""

    files: Files = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    postinst: str = ""
    prerm: str = ""


def _nvidia_smi(v: Mapping[str, str]) -> Payload:
    """The stand-in nvidia-smi (standin_nvidia_smi.py), reporting this driver and its CUDA version."""
    cuda = DRIVER_CUDA.get(v["branch"], "12.0")
    wrapper = (
        "#!/bin/sh\n"
        f"IRONSERVE_STANDIN_DRIVER={v['upstream']} IRONSERVE_STANDIN_CUDA={cuda} "
        'exec python3 /usr/lib/ironserve-lab/nvidia_smi.py "$@"\n'
    )
    files: Files = {
        "/usr/lib/ironserve-lab/nvidia_smi.py": (NVIDIA_SMI.read_text(), 0o644),
        "/usr/bin/nvidia-smi": (wrapper, 0o755),
    }
    return Payload(files)


def _driver_version_doc(v: Mapping[str, str]) -> Payload:
    return Payload({"/usr/share/doc/nvidia-driver/VERSION": (f"{v['upstream']}\n", 0o644)})


def _nvidia_persistenced(v: Mapping[str, str]) -> Payload:
    files: Files = {
        "/usr/bin/nvidia-persistenced": (
            "#!/bin/sh\n# ironserve lab stand-in: keeps the pid file nvidia-smi reads for persistence mode\n"
            "mkdir -p /run/nvidia-persistenced\necho $$ > /run/nvidia-persistenced/nvidia-persistenced.pid\n"
            "exec sleep infinity\n",
            0o755,
        ),
        "/lib/systemd/system/nvidia-persistenced.service": (
            "[Unit]\nDescription=NVIDIA Persistence Daemon\nWants=syslog.target\n\n"
            "[Service]\nType=simple\nExecStart=/usr/bin/nvidia-persistenced --verbose\n"
            "ExecStopPost=/bin/rm -rf /run/nvidia-persistenced\n\n[Install]\nWantedBy=multi-user.target\n",
            0o644,
        ),
    }
    return Payload(files, postinst="#!/bin/sh\nsystemctl daemon-reload >/dev/null 2>&1 || true\n")


DKMS_MODULE = "nvidia-current"  # Debian's name of the driver's DKMS module (Ubuntu's nvidia-dkms-<branch>: nvidia)
DKMS_BUILT = ("nvidia-current", "nvidia-current-modeset", "nvidia-current-drm", "nvidia-current-uvm")


# Above any Debian 12 dkms (3.0.10-8+deb12uN), so a lab host that asks for `dkms` gets this stand-in.
DKMS_STANDIN_VERSION = "3.0.10-99+ironservelab1"


def _dkms_standin(v: Mapping[str, str]) -> Payload:
    """Lab-only stand-in of Debian's `dkms` (standin_dkms.py): dkms's commands and bookkeeping, no
    compiler. The mirror offers it under Debian's name so that `apt-get install dkms` and `Depends: dkms` resolve
    to it in the lab as they resolve to the real dkms on an R740."""
    files: Files = {
        "/usr/lib/ironserve-lab/dkms.py": (DKMS.read_text(), 0o644),
        "/usr/sbin/dkms": ('#!/bin/sh\nexec python3 /usr/lib/ironserve-lab/dkms.py "$@"\n', 0o755),
    }
    return Payload(files)


def _dkms_conf(module: str, version: str, built: tuple[str, ...]) -> str:
    conf = [f'PACKAGE_NAME="{module}"', f'PACKAGE_VERSION="{version}"', "AUTOINSTALL=yes"]
    for index, name in enumerate(built):
        conf += [f'BUILT_MODULE_NAME[{index}]="{name}"', f'DEST_MODULE_LOCATION[{index}]="/updates/dkms"']
    return "\n".join(conf) + "\n"


def _dkms_source(v: Mapping[str, str]) -> Payload:
    """nvidia-kernel-dkms: the module source registered with DKMS, built for the running and newest kernel."""
    version = v["upstream"]
    source = f"/usr/src/{DKMS_MODULE}-{version}"
    files: Files = {
        f"{source}/dkms.conf": (_dkms_conf(DKMS_MODULE, version, DKMS_BUILT), 0o644),
        f"{source}/README.ironserve-lab": ("ironserve lab stand-in: no module source to compile.\n", 0o644),
    }
    # What Debian's dh_dkms postinst does: add the module, build it for the running kernel and the newest
    # installed one when their headers are there, and say so when they are not.
    postinst = f"""#!/bin/sh
set -e
dkms add -m {DKMS_MODULE} -v {version} >/dev/null
newest=$(ls /boot/vmlinuz-* 2>/dev/null | sed 's|^/boot/vmlinuz-||' | sort -V | tail -n 1)
for kernel in $(uname -r) $newest; do
    if [ -e /lib/modules/$kernel/build ] || [ -e /lib/modules/$kernel/source ]; then
        dkms install -m {DKMS_MODULE} -v {version} -k $kernel
    else
        echo "Module build for kernel $kernel was skipped since the kernel headers for this kernel do not \
seem to be installed."
    fi
done
"""
    prerm = f"#!/bin/sh\ndkms remove -m {DKMS_MODULE} -v {version} --all >/dev/null 2>&1 || true\n"
    return Payload(files, postinst=postinst, prerm=prerm)


# --- NVIDIA's driver runfile (NVIDIA-Linux-x86_64-<version>.run) -------------------------------------------------

RUNFILE_OPTIONS = ("--silent", "-s", "--dkms", "--no-opengl-files", "--no-x-check", "--no-kernel-module")


def runfile_path(version: str) -> str:
    """Where the mirror serves a driver runfile, relative to its base URL (NVIDIA's download server layout)."""
    return f"XFree86/Linux-x86_64/{version}/NVIDIA-Linux-x86_64-{version}.run"


def _runfile_payload(version: str) -> bytes:
    """The files the stand-in installer copies: the driver's userland, OpenGL libraries apart (under glx/)."""
    cuda = DRIVER_CUDA.get(version.split(".")[0], "12.0")
    smi = (
        f"#!/bin/sh\nIRONSERVE_STANDIN_DRIVER={version} IRONSERVE_STANDIN_CUDA={cuda} "
        'exec python3 /usr/lib/ironserve-lab/nvidia_smi.py "$@"\n'
    )
    persistenced = (  # the real daemon forks; NVIDIA's sample unit is Type=forking with this pid file
        "#!/bin/sh\nmkdir -p /run/nvidia-persistenced\nsetsid sleep infinity </dev/null >/dev/null 2>&1 &\n"
        "echo $! > /run/nvidia-persistenced/nvidia-persistenced.pid\n"
    )
    members: dict[str, tuple[str | bytes, int]] = {
        "usr/lib/ironserve-lab/nvidia_smi.py": (NVIDIA_SMI.read_text(), 0o644),
        "usr/bin/nvidia-smi": (smi, 0o755),
        "usr/bin/nvidia-persistenced": (persistenced, 0o755),
        f"usr/src/nvidia-{version}/dkms.conf": (_dkms_conf("nvidia", version, RUNFILE_DKMS_BUILT), 0o644),
    }
    libdir = LIBDIR.lstrip("/")
    members[f"{libdir}/libcuda.so.{version}"] = (f"ironserve lab stand-in for libcuda.so {version}\n", 0o644)
    members[f"{libdir}/libnvidia-ml.so.{version}"] = (standin_nvml.library_bytes(), 0o644)
    members[f"glx/{libdir}/libGLX_nvidia.so.{version}"] = ("ironserve lab stand-in (OpenGL)\n", 0o644)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (content, mode) in sorted(members.items()):
            data = content if isinstance(content, bytes) else content.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 1675209600
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


RUNFILE_DKMS_BUILT = ("nvidia", "nvidia-modeset", "nvidia-drm", "nvidia-uvm")


def runfile(version: str) -> bytes:
    """A stand-in of NVIDIA's self-extracting driver installer, run as `sh NVIDIA-Linux-x86_64-<v>.run OPTIONS`.

    Like nvidia-installer it refuses unknown options and a running X server without --no-x-check, writes
    /var/log/nvidia-installer.log with its command line, installs the OpenGL libraries unless --no-opengl-files,
    and with --dkms registers the module with dkms and builds it for the running kernel (failing without its
    headers); --no-kernel-module installs the userland only (what a container needs). It replaces a previous
    runfile install and leaves nvidia-uninstall behind.
    """
    libs = " ".join(f"{LIBDIR}/{lib}" for lib in ("libcuda.so.1", "libnvidia-ml.so.1", "libGLX_nvidia.so.0"))
    script = f"""#!/bin/sh
# ironserve lab stand-in of NVIDIA-Linux-x86_64-{version}.run (the real one is a makeself archive)
set -e
VERSION={version}
LOG=/var/log/nvidia-installer.log
dkms=0; opengl=1; xcheck=1; module=1
for option in "$@"; do
    case "$option" in
        --silent|-s) ;;
        --dkms) dkms=1 ;;
        --no-opengl-files) opengl=0 ;;
        --no-x-check) xcheck=0 ;;
        --no-kernel-module) module=0 ;;
        *) echo "ERROR: Unrecognized option: '$option'" >&2; exit 1 ;;
    esac
done
if [ $xcheck = 1 ] && pgrep -x Xorg >/dev/null 2>&1; then
    echo "ERROR: You appear to be running an X server; please exit X before installing." >&2; exit 1
fi
{{ echo "nvidia-installer log file '$LOG'"; echo "creation time: $(date)"; echo "installer version: $VERSION"
  echo; echo "nvidia-installer command line:"; echo "    ./nvidia-installer"
  for option in "$@"; do echo "    $option"; done; echo; }} > $LOG
[ -x /usr/bin/nvidia-uninstall ] && /usr/bin/nvidia-uninstall --silent >> $LOG 2>&1
work=$(mktemp -d)
sed -n '/^__PAYLOAD__$/,$p' "$0" | tail -n +2 | base64 -d | tar -xzf - -C "$work"
if [ $opengl = 1 ]; then cp -a "$work/glx/." /; fi
rm -rf "$work/glx"
if [ $module = 0 ] || [ $dkms = 0 ]; then rm -rf "$work/usr/src"; fi
( cd "$work" && find . -type f | sed 's|^\\.||' ) > /tmp/nvidia-installer-files.$$
cp -a "$work/." /
rm -rf "$work"
ln -sf libcuda.so.$VERSION {LIBDIR}/libcuda.so.1
ln -sf libnvidia-ml.so.$VERSION {LIBDIR}/libnvidia-ml.so.1
if [ $opengl = 1 ]; then ln -sf libGLX_nvidia.so.$VERSION {LIBDIR}/libGLX_nvidia.so.0; fi
mkdir -p /var/lib/nvidia
mv /tmp/nvidia-installer-files.$$ /var/lib/nvidia/installed-files
cat > /usr/bin/nvidia-uninstall <<'UNINSTALL'
#!/bin/sh
# ironserve lab stand-in of nvidia-uninstall
version=$(cat /var/lib/nvidia/version 2>/dev/null)
[ -n "$version" ] && command -v dkms >/dev/null && dkms remove -m nvidia -v "$version" --all >/dev/null 2>&1
xargs rm -f < /var/lib/nvidia/installed-files
rm -f {libs} /usr/bin/nvidia-installer /var/lib/nvidia/installed-files /var/lib/nvidia/version /usr/bin/nvidia-uninstall
rm -rf /usr/src/nvidia-$version
exit 0
UNINSTALL
chmod 755 /usr/bin/nvidia-uninstall
printf '#!/bin/sh\necho "nvidia-installer:  version %s"\n' $VERSION > /usr/bin/nvidia-installer
chmod 755 /usr/bin/nvidia-installer
echo $VERSION > /var/lib/nvidia/version
if [ $module = 1 ]; then
    if [ $dkms = 1 ]; then
        dkms add -m nvidia -v $VERSION >> $LOG
        if ! dkms install -m nvidia -v $VERSION -k "$(uname -r)" >> $LOG 2>&1; then
            echo "ERROR: Failed to install the kernel module through DKMS (see $LOG)." | tee -a $LOG >&2
            /usr/bin/nvidia-uninstall --silent >> $LOG 2>&1  # backs out, as nvidia-installer does
            exit 1
        fi
    else
        echo "ERROR: ironserve lab stand-in: only --dkms or --no-kernel-module" | tee -a $LOG >&2
        /usr/bin/nvidia-uninstall --silent >> $LOG 2>&1
        exit 1
    fi
fi
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $VERSION) is now complete." \
    | tee -a $LOG
exit 0
__PAYLOAD__
"""
    return script.encode() + base64.encodebytes(_runfile_payload(version))


def runfile_sha256(version: str) -> str:
    return hashlib.sha256(runfile(version)).hexdigest()


# nvidia-container-toolkit's default /etc/nvidia-container-runtime/config.toml as the 1.13 packages ship it
# (`nvidia-ctk config default`): commented keys are the defaults, among them `#no-cgroups = false`.
CONTAINER_TOOLKIT_CONFIG = """#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
#swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
#debug = "/var/log/nvidia-container-toolkit.log"
environment = []
#ldcache = "/etc/ld.so.cache"
ldconfig = "@/sbin/ldconfig"
load-kmods = true
#no-cgroups = false
#path = "/usr/bin/nvidia-container-cli"
#root = "/run/nvidia/driver"
#user = "root:video"

[nvidia-container-runtime]
#debug = "/var/log/nvidia-container-runtime.log"
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc"]

[nvidia-container-runtime.modes]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]

[nvidia-container-runtime.modes.csv]
mount-spec-path = "/etc/nvidia-container-runtime/host-files-for-container.d"

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false

[nvidia-ctk]
path = "nvidia-ctk"
"""


def _container_cli(v: Mapping[str, str]) -> Payload:
    version = v["upstream"]
    cli = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then printf "cli-version: {version}\\nlib-version: {version}\\n'
        'build platform: x86_64\\n"; exit 0; fi\n'
        'echo "nvidia-container-cli (ironserve lab stand-in): no GPU driver to query" >&2; exit 1\n'
    )
    return Payload({"/usr/bin/nvidia-container-cli": (cli, 0o755)})


def _container_toolkit_base(v: Mapping[str, str]) -> Payload:
    version = v["upstream"]
    ctk = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ] || [ "$1" = "-v" ]; then echo "NVIDIA Container Toolkit CLI version {version}"; '
        "exit 0; fi\n"
        'echo "nvidia-ctk (ironserve lab stand-in): only --version is implemented" >&2; exit 1\n'
    )
    # The real runtime is a runc shim that adds the NVIDIA hook to GPU containers; with no GPU it is runc.
    runtime = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then echo "NVIDIA Container Runtime version {version}"; exec runc --version; fi\n'
        'exec runc "$@"\n'
    )
    files: Files = {
        "/etc/nvidia-container-runtime/config.toml": (CONTAINER_TOOLKIT_CONFIG, 0o644),
        "/usr/bin/nvidia-ctk": (ctk, 0o755),
        "/usr/bin/nvidia-container-runtime": (runtime, 0o755),
    }
    return Payload(files)


def _container_toolkit_hook(v: Mapping[str, str]) -> Payload:
    hook = '#!/bin/sh\necho "nvidia-container-runtime-hook (ironserve lab stand-in): no GPU to inject" >&2\nexit 0\n'
    return Payload({"/usr/bin/nvidia-container-runtime-hook": (hook, 0o755)})


def _cuda_toolkit(v: Mapping[str, str]) -> Payload:
    """cuda-toolkit-X-Y: the toolkit without the driver (NVIDIA's `cuda-X-Y` metapackage adds the driver)."""
    version = v["upstream"]
    major_minor = f"{v['major']}.{v['minor']}"
    nvcc_release, built_on, build, cudart = NVCC_BUILD[major_minor]
    root = f"/usr/local/cuda-{major_minor}"
    nvcc = (
        "#!/bin/sh\ncat <<'EOF'\nnvcc: NVIDIA (R) Cuda compiler driver\n"
        f"Copyright (c) 2005-{built_on[-4:]} NVIDIA Corporation\nBuilt on {built_on}\n"
        f"Cuda compilation tools, release {major_minor}, {nvcc_release}\nBuild {build}\nEOF\n"
    )
    major, minor = int(v["major"]), int(v["minor"])
    files: Files = {
        f"{root}/version.json": (cuda_version_json(version, cudart), 0o644),
        f"{root}/bin/nvcc": (nvcc, 0o755),
        f"{root}/include/cuda_runtime_api.h": (f"#define CUDART_VERSION {major * 1000 + minor * 10}\n", 0o644),
        f"{root}/lib64/libcudart.so.{cudart}": (f"ironserve lab stand-in (SONAME libcudart.so.{major}.0)\n", 0o644),
    }
    return Payload(files, {f"{root}/lib64/libcudart.so.{major}.0": f"libcudart.so.{cudart}"})


def _cudnn_header(v: Mapping[str, str]) -> Payload:
    major, minor, patch = v["upstream"].split(".")[:3]
    header = (
        "/*\n * ironserve lab stand-in of cudnn_version.h\n */\n#ifndef CUDNN_VERSION_H_\n#define CUDNN_VERSION_H_\n\n"
        f"#define CUDNN_MAJOR {major}\n#define CUDNN_MINOR {minor}\n#define CUDNN_PATCHLEVEL {patch}\n\n"
        "#define CUDNN_VERSION (CUDNN_MAJOR * 1000 + CUDNN_MINOR * 100 + CUDNN_PATCHLEVEL)\n\n#endif\n"
    )
    return Payload({"/usr/include/cudnn_version.h": (header, 0o644)})


# The payloads the data file's `payload:` names; `library:` entries are made by _library.
PAYLOADS: dict[str, Callable[[Mapping[str, str]], Payload]] = {
    "nvidia-smi": _nvidia_smi,
    "driver-version-doc": _driver_version_doc,
    "nvidia-persistenced": _nvidia_persistenced,
    "dkms-source": _dkms_source,
    "dkms-standin": _dkms_standin,
    "cuda-toolkit": _cuda_toolkit,
    "cudnn-header": _cudnn_header,
    "container-cli": _container_cli,
    "container-toolkit-base": _container_toolkit_base,
    "container-toolkit-hook": _container_toolkit_hook,
}


# --- the package set: files/nvidia-repository.yaml ------------------------------------------------

RELATION_FIELDS = ("pre_depends", "depends")  # what apt must satisfy to install; filtered per directory (below)
OTHER_FIELDS = ("provides", "conflicts", "breaks")  # carried as the data states them
_ALTERNATIVE = re.compile(r"^([a-z0-9][a-z0-9+.\-]*)(?::[a-z0-9]+)?\s*(?:\(\s*(<<|<=|=|>=|>>)\s*([^)\s]+)\s*\))?$")


def repository_data() -> dict[str, Any]:
    """The data file: structures (package templates citing their captures) and what each directory serves."""
    return _parsed(REPOSITORY_DATA.read_text())


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return data


def placeholders(version: str) -> dict[str, str]:
    """{version}, {upstream}, {upstream3}, {branch}, {major}, {minor} of a package version (see the data file)."""
    upstream = version.split(":", 1)[-1]
    upstream = upstream.rsplit("-", 1)[0] if "-" in upstream else upstream
    parts = upstream.split(".")
    return {
        "version": version,
        "upstream": upstream,
        "upstream3": ".".join(parts[:3]),
        "branch": parts[0],
        "major": parts[0],
        "minor": parts[1] if len(parts) > 1 else "",
    }


def parse_relations(text: str) -> list[list[tuple[str, str | None, str | None]]]:
    """`a (= 1) | b, c` -> [[(a, =, 1), (b, None, None)], [(c, None, None)]] (deb-control(5) syntax)."""
    groups = []
    for group in (g.strip() for g in " ".join(text.split()).split(",")):
        if not group:
            continue
        alternatives = []
        for alternative in (a.strip() for a in group.split("|")):
            match = _ALTERNATIVE.match(alternative)
            if match is None:
                raise ValueError(f"not a package relation: {alternative!r} (in {text!r})")
            alternatives.append((match[1], match[2], match[3]))
        groups.append(alternatives)
    return groups


def format_relations(groups: list[list[tuple[str, str | None, str | None]]]) -> str:
    return ", ".join(
        " | ".join(f"{name} ({op} {version})" if op else name for name, op, version in group) for group in groups
    )


def _render(template: str, values: Mapping[str, str]) -> str:
    return " ".join(str(template).format_map(values).split())


def instantiate(structure: str, version: str, only: Iterable[str] | None = None) -> list[StandinPackage]:
    """The packages of one structure at `version`, relations as the data states them (not yet filtered)."""
    spec = repository_data()["structures"][structure]
    values = placeholders(version)
    packages = []
    for template_name, entry in spec["packages"].items():
        entry = entry or {}
        name = _render(template_name, values)
        if only is not None and name not in only:
            continue
        payload = PAYLOADS[entry["payload"]](values) if "payload" in entry else Payload()
        files, links = dict(payload.files), dict(payload.links)
        if "library" in entry:
            library = {key: _render(value, values) for key, value in entry["library"].items()}
            lib_files, lib_links = _library(
                library["file"], library["version"], library["soname"], library.get("build")
            )
            files.update(lib_files)
            links.update(lib_links)
        own_version = _render(entry.get("version", "{version}"), values)
        fields = {key: _render(entry.get(key, ""), values) for key in (*RELATION_FIELDS, *OTHER_FIELDS)}
        packages.append(
            StandinPackage(
                name,
                own_version,
                _render(entry.get("description", name), values),
                files,
                links,
                postinst=payload.postinst,
                prerm=payload.prerm,
                upstream=entry.get("upstream_label", "NVIDIA's"),
                source=spec.get("source_package", ""),
                architecture=entry.get("architecture", "amd64"),
                pre_depends=fields["pre_depends"],
                depends=fields["depends"],
                provides=fields["provides"],
                conflicts=fields["conflicts"],
                breaks=fields["breaks"],
            )
        )
    return packages


@dataclass(frozen=True)
class Dropped:
    """A relation group left out of a package, because it names only packages neither served nor on a lab host."""

    package: str
    version: str
    kind: str  # pre_depends or depends
    relation: str


def _served(packages: list[StandinPackage]) -> set[str]:
    """Every name a directory satisfies: its packages and what they provide."""
    names = {p.name for p in packages}
    for package in packages:
        names |= {alternative[0] for group in parse_relations(package.provides) for alternative in group}
    return names


def _directory(distro: str) -> tuple[list[StandinPackage], list[Dropped]]:
    data = repository_data()
    if distro not in data["repositories"]:
        raise ValueError(f"the lab mirror serves no {distro} directory (it serves {', '.join(data['repositories'])})")
    raw = [
        package
        for group in data["repositories"][distro]
        for version in group["versions"]
        for package in instantiate(group["structure"], str(version), group.get("only"))
    ]
    available = _served(raw) | set(data["host_packages"])
    dropped: list[Dropped] = []
    packages = []
    for package in raw:
        kept: dict[str, str] = {}
        for field_name in RELATION_FIELDS:
            groups = []
            for group in parse_relations(getattr(package, field_name)):
                if any(name in available for name, _, _ in group):
                    groups.append(group)
                elif group[0][0] in data["dropped"]:
                    dropped.append(Dropped(package.name, package.version, field_name, format_relations([group])))
                else:
                    raise ValueError(
                        f"{distro}: {package.name} {package.version} relation {format_relations([group])} names "
                        "nothing the directory serves or a lab host has, and is not listed under `dropped`"
                    )
            kept[field_name] = format_relations(groups)
        packages.append(dataclasses.replace(package, pre_depends=kept["pre_depends"], depends=kept["depends"]))
    seen: dict[tuple[str, str], StandinPackage] = {}
    for package in packages:
        if seen.setdefault((package.name, package.version), package) != package:
            raise ValueError(f"{distro}: {package.name} {package.version} is listed twice, differently")
    return list(seen.values()), dropped


def catalog(distro: str = "debian11") -> list[StandinPackage]:
    """Every package one directory of the mirror offers (debian11: both profiles' pinned sets and the newer
    decoys; debian12: the low end of NVIDIA's debian12 directory), in the data file's order."""
    return _directory(distro)[0]


def dropped_relations(distro: str = "debian11") -> list[Dropped]:
    """The relation groups the directory's stand-ins leave out (NVIDIA-MIRROR.md lists them)."""
    return _directory(distro)[1]


def dkms_standin_package() -> StandinPackage:
    return instantiate("dkms", DKMS_STANDIN_VERSION)[0]


def dkms_package(version: str, pkg_version: str) -> StandinPackage:
    """nvidia-kernel-dkms at `pkg_version` (its upstream `version`): the module source registered with DKMS."""
    (package,) = instantiate("debian-driver", pkg_version, only=["nvidia-kernel-dkms"])
    assert placeholders(pkg_version)["upstream"] == version, (version, pkg_version)
    return package


def cuda_toolkit_package(version: str) -> StandinPackage:
    """cuda-toolkit-X-Y at <version>-1 (NVIDIA's scheme: cuda-toolkit-11-8 11.8.0-1)."""
    return instantiate("cuda-toolkit", f"{version}-1")[0]


# NVIDIA/cuda-samples release tags the mirror serves as stand-in source tarballs, at GitHub's archive path.
CUDA_SAMPLES_TAGS = ("v11.8", "v11.7")
RUNFILE_DRIVERS = ("525.85.12", "515.86.01")  # the profiles' drivers, as NVIDIA's download server offers them


def cuda_samples_path(tag: str) -> str:
    """Where the mirror serves a cuda-samples tag, relative to its base URL (GitHub: archive/refs/tags/<tag>)."""
    return f"cuda-samples/archive/refs/tags/{tag}.tar.gz"


def cuda_samples_tarball(tag: str) -> bytes:
    """A stand-in of GitHub's archive of NVIDIA/cuda-samples at `tag`: the real top directory and sample paths,
    stand-in contents (a lab host has no GPU and no real nvcc to build them with). Byte-for-byte reproducible."""
    top = f"cuda-samples-{tag.removeprefix('v')}"
    note = f"ironserve lab stand-in of NVIDIA/cuda-samples {tag}: the layout is real, the contents are not.\n"
    refuse = "all:\n\t@echo 'ironserve lab stand-in: nothing to build (no GPU, no real nvcc)'; exit 1\n"
    members = {
        "README.md": "# CUDA Samples\n\n" + note,
        "LICENSE": note,
        "Makefile": refuse,
        "Common/helper_cuda.h": "/* " + note + " */\n",
        "Common/helper_string.h": "/* " + note + " */\n",
        "Samples/1_Utilities/deviceQuery/README.md": "# deviceQuery - Device Query\n\n" + note,
        "Samples/1_Utilities/deviceQuery/deviceQuery.cpp": "/* " + note + " */\n",
        "Samples/1_Utilities/deviceQuery/Makefile": refuse,
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directories = sorted({str(parent) for name in members for parent in Path(name).parents} - {"."})
        for entry in ["", *directories]:
            info = tarfile.TarInfo(f"{top}/{entry}".rstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1664409600  # the v11.8 tag's day
            tar.addfile(info)
        for name, text in sorted(members.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1664409600
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def cuda_samples_sha256(tag: str) -> str:
    return hashlib.sha256(cuda_samples_tarball(tag)).hexdigest()


# --- the Kubernetes repository: pkgs.k8s.io's layout and package names --------------------------------------------

# pkgs.k8s.io has one flat repository per minor release, `deb [signed-by=...] <base>/v1.31/deb/ /` with
# base https://pkgs.k8s.io/core:/stable: (colons and all); the mirror keeps that path under its own root.
KUBERNETES_BASE = "kubernetes/core:/stable:"
KUBERNETES_MINOR = "v1.31"
KUBERNETES_HOMEPAGE = "https://kubernetes.io"
KUBERNETES_UPSTREAM = "pkgs.k8s.io's"
KUBERNETES_REVISION = "1.1"  # the Debian revision pkgs.k8s.io gives every package (kubeadm 1.31.4-1.1)
# Depends of kubelet 1.31.4-1.1: kubernetes/release's kubelet.spec as debbuild renders it (iptables (>= 1.4.21),
# kubernetes-cni, iproute2, mount, util-linux, ethtool, conntrack; socat and ebtables were dropped before 1.31.4:
# upgrading kubelet 1.31.0 to 1.31.4 from pkgs.k8s.io leaves them "no longer required"), kubernetes-cni at the
# minimum its metadata.yaml sets from kubelet 1.28 on. Every one of them is a Debian 12 package.
KUBELET_DEPENDS = "iptables (>= 1.4.21), kubernetes-cni (>= 1.2.0), iproute2, mount, util-linux, ethtool, conntrack"
# kubeadm depends on cri-tools (>= 1.30.0) from 1.30 to 1.31 and on nothing from 1.32 on (krel's metadata.yaml).
KUBEADM_DEPENDS = {"1.31": "cri-tools (>= 1.30.0)"}

# The kubelet package's unit and the kubeadm package's drop-in, as pkgs.k8s.io's debs install them under
# /usr/lib/systemd/system (kubernetes/release#3392): krel's templates/latest/kubelet/kubelet.service and
# templates/latest/kubeadm/10-kubeadm.conf, whose EnvironmentFile the deb build turns into /etc/default/kubelet
# (kubernetes/release#3279, and #3625 for the kubelet package's /etc/default/kubelet itself).
KUBELET_SERVICE = """[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""
KUBEADM_DROPIN = """# Note: This dropin only works with kubeadm and kubelet v1.11+
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
# This is a file that "kubeadm init" and "kubeadm join" generates at runtime, populating the KUBELET_KUBEADM_ARGS variable dynamically
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
# This is a file that the user can use for overrides of the kubelet args as a last resort. Preferably, the user should use
# the .NodeRegistration.KubeletExtraArgs object in the configuration files instead. KUBELET_EXTRA_ARGS should be sourced from this file.
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
"""  # noqa: E501
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")  # a few of kubernetes-cni's /opt/cni/bin plugins


def kubernetes_repo_path(minor: str = KUBERNETES_MINOR) -> str:
    """Where the mirror serves a minor release's repository, relative to its base URL (pkgs.k8s.io's path)."""
    return f"{KUBERNETES_BASE}/{minor}/deb"


def _kubernetes_files(package: str, programs: dict[str, str], version: str) -> Files:
    """The stand-in (standin_kubernetes.py) in the package's own folder, and a wrapper per program path."""
    module = f"/usr/lib/ironserve-lab/{package}/kubernetes.py"
    files: Files = {module: (KUBERNETES.read_text(), 0o644)}
    for program_path, tool in programs.items():
        files[program_path] = (
            f"#!/bin/sh\n# ironserve lab stand-in of {tool} v{version} ({package} {version}-{KUBERNETES_REVISION})\n"
            f'IRONSERVE_STANDIN_KUBERNETES_VERSION={version} exec python3 {module} {tool} "$@"\n',
            0o755,
        )
    return files


def _kubernetes_package(
    name: str, version: str, summary: str, section: str, files: Files, depends: str = "", postinst: str = ""
) -> StandinPackage:
    return StandinPackage(
        name,
        f"{version}-{KUBERNETES_REVISION}",
        summary,
        files,
        depends=depends,
        postinst=postinst,
        section=section,
        homepage=KUBERNETES_HOMEPAGE,
        upstream=KUBERNETES_UPSTREAM,
    )


def kubernetes_core_packages(version: str) -> list[StandinPackage]:
    """kubeadm, kubelet and kubectl at `version`, with pkgs.k8s.io's sections and summaries."""
    minor = ".".join(version.split(".")[:2])
    kubeadm_files = _kubernetes_files("kubeadm", {"/usr/bin/kubeadm": "kubeadm"}, version)
    kubeadm_files["/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"] = (KUBEADM_DROPIN, 0o644)
    kubelet_files = _kubernetes_files("kubelet", {"/usr/bin/kubelet": "kubelet"}, version)
    kubelet_files |= {
        "/usr/lib/systemd/system/kubelet.service": (KUBELET_SERVICE, 0o644),
        "/etc/default/kubelet": ("KUBELET_EXTRA_ARGS=\n", 0o644),
        # dpkg keeps no empty folders: the real package ships these markers for them (kubelet.spec)
        "/var/lib/kubelet/.kubelet-keep": ("", 0o644),
        "/etc/kubernetes/manifests/.kubelet-keep": ("", 0o644),
    }
    return [
        _kubernetes_package(
            "kubeadm",
            version,
            "Command-line utility for administering a Kubernetes cluster",
            "admin",
            kubeadm_files,
            depends=KUBEADM_DEPENDS.get(minor, ""),
        ),
        _kubernetes_package(
            "kubelet",
            version,
            "Node agent for Kubernetes clusters",
            "net",
            kubelet_files,
            depends=KUBELET_DEPENDS,
            postinst="#!/bin/sh\nsystemctl daemon-reload >/dev/null 2>&1 || true\n",
        ),
        _kubernetes_package(
            "kubectl",
            version,
            "Command-line utility for interacting with a Kubernetes cluster",
            "admin",
            _kubernetes_files("kubectl", {"/usr/bin/kubectl": "kubectl"}, version),
        ),
    ]


def cri_tools_package(version: str) -> StandinPackage:
    summary = "Command-line utility for interacting with a container runtime"
    files = _kubernetes_files("cri-tools", {"/usr/bin/crictl": "crictl"}, version)
    return _kubernetes_package("cri-tools", version, summary, "admin", files)


def kubernetes_cni_package(version: str) -> StandinPackage:
    plugins = {f"/opt/cni/bin/{plugin}": f"cni-{plugin}" for plugin in CNI_PLUGINS}
    files = _kubernetes_files("kubernetes-cni", plugins, version)
    summary = "Binaries required to provision kubernetes container networking"
    return _kubernetes_package("kubernetes-cni", version, summary, "net", files)


def kubernetes_catalog() -> list[StandinPackage]:
    """The v1.31 repository: the pinned set and newer decoys that apt would pick without the pins."""
    return [
        *kubernetes_core_packages("1.31.4"),
        cri_tools_package("1.31.1"),
        kubernetes_cni_package("1.5.1"),
        *kubernetes_core_packages("1.31.9"),
        *kubernetes_core_packages("1.32.0"),
        cri_tools_package("1.32.0"),
        kubernetes_cni_package("1.6.0"),
    ]


def _build_kubernetes_repository(index_dir: Path) -> None:
    """pkgs.k8s.io's flat layout: the .debs in amd64/, the signed index beside them, and Release.key."""
    (index_dir / "amd64").mkdir(parents=True)
    build_debs(kubernetes_catalog(), index_dir / "amd64")
    _index_and_sign(index_dir, "ironserve lab Kubernetes mirror", "amd64")
    (index_dir / "Release.key").write_bytes(_gpg("--armor", "--export", KEY_UID))


# --- building ------------------------------------------------------------------------------------------------


def repo_dir() -> Path:
    return lab_dir() / "aptrepo"


def key_path() -> Path:
    """The mirror's public key (binary keyring), what `nvidia_repo_key` points at in the lab inventory."""
    return repo_dir() / "mirror-keyring.gpg"


def _gnupg_home() -> Path:
    return repo_dir() / "gnupg"


def _gpg(*args: str, stdin: bytes | None = None) -> bytes:
    argv = ["gpg", "--homedir", str(_gnupg_home()), "--batch", "--yes", "--pinentry-mode", "loopback"]
    argv += ["--passphrase", "", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, check=True).stdout


def _stop_gpg_agent() -> None:
    """gpg starts an agent for the home directory; stop it (ours, by its socket) so nothing stays running."""
    subprocess.run(["gpgconf", "--homedir", str(_gnupg_home()), "--kill", "all"], capture_output=True)


def _ensure_key() -> None:
    home = _gnupg_home()
    if not (home / "pubring.kbx").exists() or not _gpg("--list-secret-keys"):
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        _gpg("--quick-gen-key", KEY_UID, "ed25519", "sign", "never")
    key_path().write_bytes(_gpg("--export", KEY_UID))


# Every file's mtime in the .debs and the Release file's Date: the builder's output depends on its inputs alone.
BUILD_EPOCH = 1675209600  # 2023-02-01, when the profiles' driver 525.85.12 was current


def _control(package: StandinPackage, installed_kib: int) -> str:
    lines = [f"Package: {package.name}"]
    if package.source:
        lines.append(f"Source: {package.source}")
    lines += [
        f"Version: {package.version}",
        f"Architecture: {package.architecture}",
        "Maintainer: ironserve lab <lab-mirror@ironserve.invalid>",
        f"Installed-Size: {max(installed_kib, 1)}",
    ]
    for title, value in (
        ("Provides", package.provides),
        ("Pre-Depends", package.pre_depends),
        ("Depends", package.depends),
        ("Conflicts", package.conflicts),
        ("Breaks", package.breaks),
    ):
        if value:
            lines.append(f"{title}: {value}")
    lines += [f"Section: {package.section}", "Priority: optional"]
    if package.homepage:
        lines.append(f"Homepage: {package.homepage}")
    whose = "and a lab version" if "ironservelab" in package.version else "and version"
    note = f"ironserve lab stand-in with {package.upstream} package name {whose}."
    lines.append(f"Description: {package.description}\n {note}")
    return "\n".join(lines) + "\n"


def deb_name(package: StandinPackage) -> str:
    return f"{package.name}_{package.version.replace(':', '%3a')}_{package.architecture}.deb"


def build_deb(package: StandinPackage, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        size = 0
        for path, (content, mode) in package.files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content if isinstance(content, bytes) else content.encode()
            target.write_bytes(data)
            target.chmod(mode)
            size += len(data)
        for path, link_target in package.links.items():
            link = root / path.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(link_target)
        debian = root / "DEBIAN"
        debian.mkdir()
        (debian / "control").write_text(_control(package, size // 1024))
        conffiles = sorted(path for path in package.files if path.startswith("/etc/"))  # as debhelper marks them
        if conffiles:
            (debian / "conffiles").write_text("".join(f"{path}\n" for path in conffiles))
        for script, body in (("postinst", package.postinst), ("prerm", package.prerm)):
            if body:
                (debian / script).write_text(body)
                (debian / script).chmod(0o755)
        for entry in [root, *root.rglob("*")]:
            os.utime(entry, (BUILD_EPOCH, BUILD_EPOCH), follow_symlinks=False)
        deb = out_dir / deb_name(package)
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
            capture_output=True,
            check=True,
            env={**os.environ, "SOURCE_DATE_EPOCH": str(BUILD_EPOCH)},
        )
        return deb


def build_debs(packages: Iterable[StandinPackage], out_dir: Path) -> dict[tuple[str, str, str], Path]:
    """Build each package (one .deb per name, version and architecture) in parallel: dpkg-deb runs per package."""
    unique: dict[tuple[str, str, str], StandinPackage] = {}
    for package in packages:
        unique.setdefault((package.name, package.version, package.architecture), package)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        built = pool.map(lambda package: build_deb(package, out_dir), unique.values())
        return dict(zip(unique, built, strict=True))


def _release(index_dir: Path, label: str) -> str:
    entries = {"MD5Sum": "md5", "SHA256": "sha256"}
    lines = [
        "Origin: ironserve-lab",
        f"Label: {label}",
        "Architectures: amd64",
        f"Date: {formatdate(BUILD_EPOCH, usegmt=True)}",
    ]
    for title, algorithm in entries.items():
        lines.append(f"{title}:")
        for name in ("Packages", "Packages.gz"):
            data = (index_dir / name).read_bytes()
            lines.append(f" {hashlib.new(algorithm, data).hexdigest()} {len(data)} {name}")
    return "\n".join(lines) + "\n"


def write_index(index_dir: Path, label: str, debs: str = ".") -> None:
    """Packages (of the .debs under `debs`, relative to `index_dir`), Packages.gz and Release, unsigned."""
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", debs, "/dev/null"],
        cwd=index_dir,
        capture_output=True,
        check=True,
    ).stdout
    (index_dir / "Packages").write_bytes(packages)
    (index_dir / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    (index_dir / "Release").write_text(_release(index_dir, label))


def _sign(index_dir: Path) -> None:
    """InRelease and Release.gpg of the Release file, with the mirror's key."""
    release = (index_dir / "Release").read_bytes()
    (index_dir / "InRelease").write_bytes(_gpg("--local-user", KEY_UID, "--clearsign", stdin=release))
    (index_dir / "Release.gpg").write_bytes(_gpg("--local-user", KEY_UID, "--armor", "--detach-sign", stdin=release))


def _index_and_sign(index_dir: Path, label: str, debs: str = ".") -> None:
    write_index(index_dir, label, debs)
    _sign(index_dir)


# Variants of a directory, served under `variants/<name>/<distro>/x86_64/` with the same key: its index less some
# package versions, which is how a site's mirror that lacks them looks to a host (tests/lab/test_nvidia_repository.py).
VARIANTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "without-pinned-driver": ("debian11", (("nvidia-driver", "525.85.12-1"),)),
    "without-tensorrt-sibling": ("debian11", (("libnvinfer-bin", "8.6.1.6-1+cuda11.8"),)),
}


def build_nvidia_directories(www: Path, distros: Iterable[str] = DISTROS) -> dict[str, Path]:
    """NVIDIA's flat layout under `www`: each directory's .debs beside its index (`<distro>/x86_64/`), and the
    VARIANTS of those directories, unsigned; each .deb built once and hard-linked into every index that serves it.
    Returns each index folder by its path under `www` without `/x86_64`."""
    contents = {distro: catalog(distro) for distro in distros}
    pool = www / "pool"
    pool.mkdir(parents=True)
    built = build_debs((package for packages in contents.values() for package in packages), pool)
    layouts: dict[str, list[StandinPackage]] = dict(contents)
    for name, (distro, left_out) in VARIANTS.items():
        if distro in contents:
            offered = {(p.name, p.version) for p in contents[distro]}
            assert set(left_out) <= offered, f"variant {name}: {set(left_out) - offered} not in {distro}"
            layouts[f"variants/{name}/{distro}"] = [p for p in contents[distro] if (p.name, p.version) not in left_out]
    index_dirs = {}
    for path, packages in layouts.items():
        index_dir = www / path / ARCH_DIR
        index_dir.mkdir(parents=True)
        for package in packages:
            deb = built[(package.name, package.version, package.architecture)]
            os.link(deb, index_dir / deb.name)
        write_index(index_dir, "ironserve lab NVIDIA mirror")
        index_dirs[path] = index_dir
    shutil.rmtree(pool)
    return index_dirs


def _fingerprint() -> str:
    """What the built repository depends on: this builder, the package data, the stand-in programs it ships, the
    Helm mirror's builder and pins, the key."""
    sources = (Path(__file__), REPOSITORY_DATA, NVIDIA_SMI, DKMS, KUBERNETES, standin_nvml.SOURCE)
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources) + charts.fingerprint())
    if key_path().exists():
        digest.update(key_path().read_bytes())
    return digest.hexdigest()


def ensure_built() -> Path:
    """Build (once, under a lock, rebuilt when the builder changes) and return the repository's root."""
    root = repo_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "aptrepo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _ensure_key()
            stamp = root / "built"
            if stamp.exists() and stamp.read_text() == _fingerprint():
                return root / "www"
            staging = Path(tempfile.mkdtemp(prefix="www.", dir=root))
            for index_dir in build_nvidia_directories(staging).values():
                _sign(index_dir)
            _build_kubernetes_repository(staging / kubernetes_repo_path())
            for tag in CUDA_SAMPLES_TAGS:
                tarball = staging / cuda_samples_path(tag)
                tarball.parent.mkdir(parents=True, exist_ok=True)
                tarball.write_bytes(cuda_samples_tarball(tag))
            for driver in RUNFILE_DRIVERS:
                installer = staging / runfile_path(driver)
                installer.parent.mkdir(parents=True, exist_ok=True)
                installer.write_bytes(runfile(driver))
            charts.build_into(staging)  # Helm's release tarball and the add-ons' stand-in chart repository
            old = root / "www"
            if old.exists():
                shutil.rmtree(old)
            staging.rename(old)
            stamp.write_text(_fingerprint())
            return old
        finally:
            _stop_gpg_agent()


# --- serving ---------------------------------------------------------------------------------------------------


def start(bind: str, watch_pid: int | None, log: Path) -> tuple[int, str]:
    """Serve the repository on `bind` (the lab bridge address); return (pid, base URL)."""
    return servers.start_directory(MODULE, ensure_built(), bind, watch_pid, log, "lab apt mirror")


def running(pid: int) -> bool:
    return servers.running(pid, MODULE)


def stop(pid: int) -> None:
    """Stop a server this module started (by its recorded pid)."""
    servers.stop(pid, MODULE)


def main() -> int:
    parser = argparse.ArgumentParser(prog="aptrepo")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the repository into the cache and print its root")
    servers.add_serve_command(sub)
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_built())
        return 0
    servers.serve_directory(args.root, args.bind, args.port, args.watch_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
