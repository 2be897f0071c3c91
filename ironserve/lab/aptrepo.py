"""The lab's NVIDIA apt mirror: a GPG-signed flat repository of stand-in packages, served over HTTP.

It stands where NVIDIA's CUDA network repository (or a site's internal mirror of it) stands for a real
host: same layout (`<distro>/x86_64/` with `Packages`, `Release`, `InRelease`), same package names and
version strings, signed by a key the host trusts through `signed-by`. It carries the pinned set of every
profile AND newer decoys (driver 535, a CUDA 12 toolkit, cuDNN 8.9 for CUDA 12, TensorRT for CUDA 12,
container toolkit 1.17.8), so that a host converging to exactly the pinned set proves that the pins win.

The packages are stand-ins: real-looking files where the real ones go (`nvidia-smi` reporting the host's
hardware profile, `/usr/local/cuda-X.Y/version.json`, `nvcc --version`, `cudnn_version.h`, libraries
under their real names, the container toolkit's default `config.toml`, the driver's `dkms.conf`), plus a
stand-in of Debian's `dkms` (ironserve/lab/standin_dkms.py) at a version above Debian 12's, so that `Depends:
dkms` resolves to it in the lab. Beside the repository the server offers what else a site mirrors: stand-in
driver runfiles at NVIDIA's download path and stand-in cuda-samples archives at GitHub's.
The same server and key also stand for pkgs.k8s.io: under `kubernetes/core:/stable:/v1.31/deb/` a flat
repository of stand-in kubeadm, kubelet, kubectl, cri-tools and kubernetes-cni (ironserve/lab/standin_kubernetes.py)
with pkgs.k8s.io's versions, control fields and systemd files, the pinned set and newer decoys.
Packages are built with `dpkg-deb`, indexed with `dpkg-scanpackages` (dpkg-dev)
and signed with `gpg` (gnupg); the signing key is generated once into the cache, never committed.

`ensure_built()` builds the repository once (rebuilt when this builder changes); `start(watch_pid)` serves
it on the lab bridge address (one server per lab host, stopped by `stop(pid)` at lab down, or by itself
when the host's supervisor is gone).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

from ironserve.lab import charts, servers
from ironserve.paths import lab_dir

MODULE = "ironserve.lab.aptrepo"  # how servers are started, and recognised by their command line
HERE = Path(__file__).resolve().parent
NVIDIA_SMI = HERE / "standin_nvidia_smi.py"
DKMS = HERE / "standin_dkms.py"
KUBERNETES = HERE / "standin_kubernetes.py"
DISTROS = ("debian12",)  # the lab runs Debian 12; the layout of NVIDIA's repository: <distro>/x86_64/
ARCH_DIR = "x86_64"
KEY_UID = "ironserve lab NVIDIA mirror <lab-mirror@ironserve.invalid>"
LIBDIR = "/usr/lib/x86_64-linux-gnu"

Files = dict[str, tuple[str, int]]  # absolute path -> (content, mode)


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


# --- what the packages contain -----------------------------------------------------------------------------

# CUDA version each driver branch reports in nvidia-smi (CUDA release notes, Table 3).
DRIVER_CUDA = {"525": "12.0", "535": "12.2", "515": "11.7"}
# nvcc build identification per toolkit, as `nvcc --version` prints it.
NVCC_BUILD = {
    "11.8": ("V11.8.89", "Wed_Sep_21_10:33:58_PDT_2022", "cuda_11.8.r11.8/compiler.31833905_0", "11.8.89"),
    "11.7": ("V11.7.99", "Wed_Jun__8_16:49:14_PDT_2022", "cuda_11.7.r11.7/compiler.31442593_0", "11.7.99"),
    "12.2": ("V12.2.140", "Tue_Aug_15_22:02:13_PDT_2023", "cuda_12.2.r12.2/compiler.33191640_0", "12.2.140"),
}
# version.json's `cuda.version` ("CUDA SDK") in these toolkits is date-stamped, not the release: CUDA 11.8.0 writes
# 11.8.20220929 and 12.2.2 writes 12.2.20230823 (as real /usr/local/cuda/version.json files show; newer toolkits
# write the release, 13.0.2). 11.7.1's stamp keeps the format, its date is not taken from a real file.
CUDA_SDK_VERSION = {"11.8.0": "11.8.20220929", "11.7.1": "11.7.20220802", "12.2.2": "12.2.20230823"}


def cuda_version_json(version: str, cudart: str) -> str:
    """<cuda_home>/version.json as NVIDIA writes it: components sorted, three-space indent, `"key" : value`."""
    components = {
        "cuda": {"name": "CUDA SDK", "version": CUDA_SDK_VERSION[version]},
        "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": cudart},
        "cuda_nvcc": {"name": "CUDA NVCC", "version": cudart},
    }
    return json.dumps(components, indent=3, separators=(",", " : "), sort_keys=True) + "\n"


def _library(name: str, version: str, soname: str) -> tuple[Files, dict[str, str]]:
    """A stand-in shared library under its real file name, with the soname link ldconfig would make."""
    real = f"{LIBDIR}/{name}.{version}"
    text = f"ironserve lab stand-in for {name} {version} (SONAME {soname})\n"
    return {real: (text, 0o644)}, {f"{LIBDIR}/{soname}": f"{name}.{version}"}


def driver_packages(version: str, debian_revision: str = "1") -> list[StandinPackage]:
    branch = version.split(".")[0]
    cuda = DRIVER_CUDA.get(branch, "12.0")
    pkg_version = f"{version}-{debian_revision}"
    files: Files = {
        "/usr/lib/ironserve-lab/nvidia_smi.py": (NVIDIA_SMI.read_text(), 0o644),
        "/usr/bin/nvidia-smi": (
            "#!/bin/sh\n"
            f"IRONSERVE_STANDIN_DRIVER={version} IRONSERVE_STANDIN_CUDA={cuda} "
            'exec python3 /usr/lib/ironserve-lab/nvidia_smi.py "$@"\n',
            0o755,
        ),
        "/usr/share/doc/nvidia-driver/VERSION": (f"{version}\n", 0o644),
    }
    links: dict[str, str] = {}
    for lib, soname in (("libcuda.so", "libcuda.so.1"), ("libnvidia-ml.so", "libnvidia-ml.so.1")):
        lib_files, lib_links = _library(lib, version, soname)
        files.update(lib_files)
        links.update(lib_links)
    persistenced_files: Files = {
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
    return [
        StandinPackage("nvidia-driver", pkg_version, f"NVIDIA driver metapackage ({version})", files, links),
        dkms_package(version, pkg_version),
        StandinPackage(
            "nvidia-persistenced",
            pkg_version,
            "daemon to maintain persistent software state in the NVIDIA driver",
            persistenced_files,
            postinst="#!/bin/sh\nsystemctl daemon-reload >/dev/null 2>&1 || true\n",
        ),
    ]


DKMS_MODULE = "nvidia-current"  # Debian's name of the driver's DKMS module (Ubuntu's nvidia-dkms-<branch>: nvidia)
DKMS_BUILT = ("nvidia-current", "nvidia-current-modeset", "nvidia-current-drm", "nvidia-current-uvm")


# Above any Debian 12 dkms (3.0.10-8+deb12uN), so a lab host that asks for `dkms` gets this stand-in.
DKMS_STANDIN_VERSION = "3.0.10-99+ironservelab1"


def dkms_standin_package() -> StandinPackage:
    """Lab-only stand-in of Debian's `dkms` (ironserve/lab/standin_dkms.py): dkms's commands and bookkeeping, no
    compiler. The mirror offers it under Debian's name so that `apt-get install dkms` and `Depends: dkms` resolve
    to it in the lab as they resolve to the real dkms on an R740."""
    files: Files = {
        "/usr/lib/ironserve-lab/dkms.py": (DKMS.read_text(), 0o644),
        "/usr/sbin/dkms": ('#!/bin/sh\nexec python3 /usr/lib/ironserve-lab/dkms.py "$@"\n', 0o755),
    }
    return StandinPackage("dkms", DKMS_STANDIN_VERSION, "Dynamic Kernel Module System (DKMS), lab stand-in", files)


def _dkms_conf(module: str, version: str, built: tuple[str, ...]) -> str:
    conf = [f'PACKAGE_NAME="{module}"', f'PACKAGE_VERSION="{version}"', "AUTOINSTALL=yes"]
    for index, name in enumerate(built):
        conf += [f'BUILT_MODULE_NAME[{index}]="{name}"', f'DEST_MODULE_LOCATION[{index}]="/updates/dkms"']
    return "\n".join(conf) + "\n"


def dkms_package(version: str, pkg_version: str) -> StandinPackage:
    """nvidia-kernel-dkms: the module source registered with DKMS, built for the running and newest kernel."""
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
    return StandinPackage(
        "nvidia-kernel-dkms",
        pkg_version,
        f"NVIDIA binary kernel module DKMS source ({version})",
        files,
        depends="dkms",
        postinst=postinst,
        prerm=prerm,
    )


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
    members: dict[str, tuple[str, int]] = {
        "usr/lib/ironserve-lab/nvidia_smi.py": (NVIDIA_SMI.read_text(), 0o644),
        "usr/bin/nvidia-smi": (smi, 0o755),
        "usr/bin/nvidia-persistenced": (persistenced, 0o755),
        f"usr/src/nvidia-{version}/dkms.conf": (_dkms_conf("nvidia", version, RUNFILE_DKMS_BUILT), 0o644),
    }
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        members[f"{LIBDIR.lstrip('/')}/{lib}.{version}"] = (f"ironserve lab stand-in for {lib} {version}\n", 0o644)
    members[f"glx/{LIBDIR.lstrip('/')}/libGLX_nvidia.so.{version}"] = ("ironserve lab stand-in (OpenGL)\n", 0o644)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (text, mode) in sorted(members.items()):
            data = text.encode()
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


def container_toolkit_packages(version: str) -> list[StandinPackage]:
    """The NVIDIA container toolkit's four packages (libnvidia-container repository names), version <v>-1."""
    pkg_version = f"{version}-1"
    stub = "ironserve lab stand-in"
    lib_files, lib_links = _library("libnvidia-container.so", version, "libnvidia-container.so.1")
    cli = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then printf "cli-version: {version}\\nlib-version: {version}\\n'
        'build platform: x86_64\\n"; exit 0; fi\n'
        f'echo "nvidia-container-cli ({stub}): no GPU driver to query" >&2; exit 1\n'
    )
    ctk = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ] || [ "$1" = "-v" ]; then echo "NVIDIA Container Toolkit CLI version {version}"; '
        "exit 0; fi\n"
        f'echo "nvidia-ctk ({stub}): only --version is implemented" >&2; exit 1\n'
    )
    # The real runtime is a runc shim that adds the NVIDIA hook to GPU containers; with no GPU it is runc.
    runtime = (
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then echo "NVIDIA Container Runtime version {version}"; exec runc --version; fi\n'
        'exec runc "$@"\n'
    )
    hook = f'#!/bin/sh\necho "nvidia-container-runtime-hook ({stub}): no GPU to inject" >&2\nexit 0\n'
    return [
        StandinPackage("libnvidia-container1", pkg_version, "NVIDIA container runtime library", lib_files, lib_links),
        StandinPackage(
            "libnvidia-container-tools",
            pkg_version,
            "NVIDIA container runtime library (command-line tools)",
            {"/usr/bin/nvidia-container-cli": (cli, 0o755)},
            depends=f"libnvidia-container1 (>= {pkg_version})",
        ),
        StandinPackage(
            "nvidia-container-toolkit-base",
            pkg_version,
            "NVIDIA Container Toolkit Base",
            {
                "/etc/nvidia-container-runtime/config.toml": (CONTAINER_TOOLKIT_CONFIG, 0o644),
                "/usr/bin/nvidia-ctk": (ctk, 0o755),
                "/usr/bin/nvidia-container-runtime": (runtime, 0o755),
            },
        ),
        StandinPackage(
            "nvidia-container-toolkit",
            pkg_version,
            "NVIDIA Container toolkit",
            {"/usr/bin/nvidia-container-runtime-hook": (hook, 0o755)},
            depends=f"nvidia-container-toolkit-base (= {pkg_version}), libnvidia-container-tools (>= {pkg_version})",
        ),
    ]


def cuda_toolkit_package(version: str) -> StandinPackage:
    """cuda-toolkit-X-Y: the toolkit without the driver (NVIDIA's `cuda-X-Y` metapackage adds the driver)."""
    major_minor = ".".join(version.split(".")[:2])
    nvcc_release, built_on, build, cudart = NVCC_BUILD[major_minor]
    root = f"/usr/local/cuda-{major_minor}"
    nvcc = (
        "#!/bin/sh\ncat <<'EOF'\nnvcc: NVIDIA (R) Cuda compiler driver\n"
        f"Copyright (c) 2005-{built_on[-4:]} NVIDIA Corporation\nBuilt on {built_on}\n"
        f"Cuda compilation tools, release {major_minor}, {nvcc_release}\nBuild {build}\nEOF\n"
    )
    major, minor = (int(p) for p in major_minor.split("."))
    files: Files = {
        f"{root}/version.json": (cuda_version_json(version, cudart), 0o644),
        f"{root}/bin/nvcc": (nvcc, 0o755),
        f"{root}/include/cuda_runtime_api.h": (f"#define CUDART_VERSION {major * 1000 + minor * 10}\n", 0o644),
        f"{root}/lib64/libcudart.so.{cudart}": (f"ironserve lab stand-in (SONAME libcudart.so.{major}.0)\n", 0o644),
    }
    links = {f"{root}/lib64/libcudart.so.{major}.0": f"libcudart.so.{cudart}"}
    return StandinPackage(
        f"cuda-toolkit-{major}-{minor}", f"{version}-1", f"CUDA Toolkit {major_minor} meta-package", files, links
    )


def cudnn_packages(version: str, cuda: str) -> list[StandinPackage]:
    """libcudnn8 / libcudnn8-dev, NVIDIA's version scheme: <cudnn>.<build>-1+cuda<X.Y>."""
    major, minor, patch = version.split(".")[:3]
    build = {"8.6.0": "163", "8.9.7": "29", "8.5.0": "96"}.get(".".join((major, minor, patch)), "1")
    pkg_version = f"{major}.{minor}.{patch}.{build}-1+cuda{cuda}"
    lib_files, lib_links = _library("libcudnn.so", f"{major}.{minor}.{patch}", f"libcudnn.so.{major}")
    header = (
        "/*\n * ironserve lab stand-in of cudnn_version.h\n */\n#ifndef CUDNN_VERSION_H_\n#define CUDNN_VERSION_H_\n\n"
        f"#define CUDNN_MAJOR {major}\n#define CUDNN_MINOR {minor}\n#define CUDNN_PATCHLEVEL {patch}\n\n"
        "#define CUDNN_VERSION (CUDNN_MAJOR * 1000 + CUDNN_MINOR * 100 + CUDNN_PATCHLEVEL)\n\n#endif\n"
    )
    return [
        StandinPackage(f"libcudnn{major}", pkg_version, "cuDNN runtime libraries", lib_files, lib_links),
        StandinPackage(
            f"libcudnn{major}-dev",
            pkg_version,
            "cuDNN development libraries and headers",
            {"/usr/include/cudnn_version.h": (header, 0o644)},
            depends=f"libcudnn{major} (= {pkg_version})",
        ),
    ]


def tensorrt_packages(version: str, cuda: str) -> list[StandinPackage]:
    """tensorrt + libnvinfer8, NVIDIA's version scheme: <trt>-1+cuda<X.Y>."""
    pkg_version = f"{version}-1+cuda{cuda}"
    major = version.split(".")[0]
    lib_files, lib_links = _library("libnvinfer.so", ".".join(version.split(".")[:3]), f"libnvinfer.so.{major}")
    return [
        StandinPackage(f"libnvinfer{major}", pkg_version, "TensorRT runtime libraries", lib_files, lib_links),
        StandinPackage(
            "tensorrt", pkg_version, "Meta package for TensorRT", depends=f"libnvinfer{major} (= {pkg_version})"
        ),
    ]


def catalog() -> list[StandinPackage]:
    """Every package the mirror offers: both profiles' pinned sets and the newer decoys."""
    return [
        # r740-a10 (primary) pinned set
        *driver_packages("525.85.02"),
        cuda_toolkit_package("11.8.0"),
        *cudnn_packages("8.6.0", "11.8"),
        *tensorrt_packages("8.6.1.6", "11.8"),
        *container_toolkit_packages("1.13.5"),  # both profiles
        dkms_standin_package(),
        # a100-cuda117 pinned set
        *driver_packages("515.86.01"),
        cuda_toolkit_package("11.7.1"),
        *cudnn_packages("8.5.0", "11.7"),
        # decoys: newer than the pins, what apt would pick without them
        *driver_packages("535.129.03"),
        cuda_toolkit_package("12.2.2"),
        *cudnn_packages("8.9.7", "12.2"),
        *tensorrt_packages("8.6.1.6", "12.0"),
        *container_toolkit_packages("1.17.8"),
    ]


# NVIDIA/cuda-samples release tags the mirror serves as stand-in source tarballs, at GitHub's archive path.
CUDA_SAMPLES_TAGS = ("v11.8", "v11.7")
RUNFILE_DRIVERS = ("525.85.02", "515.86.01")  # the profiles' drivers, as NVIDIA's download server offers them


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
    for package in kubernetes_catalog():
        build_deb(package, index_dir / "amd64")
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


def _control(package: StandinPackage, installed_kib: int) -> str:
    lines = [
        f"Package: {package.name}",
        f"Version: {package.version}",
        "Architecture: amd64",
        "Maintainer: ironserve lab <lab-mirror@ironserve.invalid>",
        f"Installed-Size: {max(installed_kib, 1)}",
        f"Section: {package.section}",
        "Priority: optional",
    ]
    if package.depends:
        lines.append(f"Depends: {package.depends}")
    if package.homepage:
        lines.append(f"Homepage: {package.homepage}")
    note = f"ironserve lab stand-in with {package.upstream} package name and version."
    lines.append(f"Description: {package.description}\n {note}")
    return "\n".join(lines) + "\n"


def build_deb(package: StandinPackage, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        size = 0
        for path, (content, mode) in package.files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            target.chmod(mode)
            size += len(content.encode())
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
        deb = out_dir / f"{package.name}_{package.version.replace(':', '%3a')}_amd64.deb"
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
            capture_output=True,
            check=True,
        )
        return deb


def _release(index_dir: Path, label: str) -> str:
    entries = {"MD5Sum": "md5", "SHA256": "sha256"}
    lines = [
        "Origin: ironserve-lab",
        f"Label: {label}",
        "Architectures: amd64",
        f"Date: {formatdate(usegmt=True)}",
    ]
    for title, algorithm in entries.items():
        lines.append(f"{title}:")
        for name in ("Packages", "Packages.gz"):
            data = (index_dir / name).read_bytes()
            lines.append(f" {hashlib.new(algorithm, data).hexdigest()} {len(data)} {name}")
    return "\n".join(lines) + "\n"


def _index_and_sign(index_dir: Path, label: str, debs: str = ".") -> None:
    """Packages (of the .debs under `debs`, relative to `index_dir`), Release, InRelease and Release.gpg."""
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", debs, "/dev/null"],
        cwd=index_dir,
        capture_output=True,
        check=True,
    ).stdout
    (index_dir / "Packages").write_bytes(packages)
    (index_dir / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    release = _release(index_dir, label)
    (index_dir / "Release").write_text(release)
    (index_dir / "InRelease").write_bytes(_gpg("--local-user", KEY_UID, "--clearsign", stdin=release.encode()))
    (index_dir / "Release.gpg").write_bytes(
        _gpg("--local-user", KEY_UID, "--armor", "--detach-sign", stdin=release.encode())
    )


def _fingerprint() -> str:
    """What the built repository depends on: this builder, the stand-in programs it ships, the Helm mirror's
    builder and pins, the key."""
    sources = (Path(__file__), NVIDIA_SMI, DKMS, KUBERNETES)
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
            debs = staging / "pool"
            debs.mkdir()
            built = [build_deb(package, debs) for package in catalog()]
            for distro in DISTROS:
                index_dir = staging / distro / ARCH_DIR
                index_dir.mkdir(parents=True)
                for deb in built:  # NVIDIA's repositories are flat: the .debs sit beside the index
                    os.link(deb, index_dir / deb.name)
                _index_and_sign(index_dir, "ironserve lab NVIDIA mirror")
            shutil.rmtree(debs)
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
