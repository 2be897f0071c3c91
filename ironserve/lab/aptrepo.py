"""The lab's NVIDIA apt mirror: a GPG-signed flat repository of stand-in packages, served over HTTP.

It stands where NVIDIA's CUDA network repository (or a site's internal mirror of it) stands for a real
host: same layout (`<distro>/x86_64/` with `Packages`, `Release`, `InRelease`), same package names and
version strings, signed by a key the host trusts through `signed-by`. It carries the pinned set of every
profile AND newer decoys (driver 535, a CUDA 12 toolkit, cuDNN 8.9 for CUDA 12, TensorRT for CUDA 12),
so that a host converging to exactly the pinned set proves that the pins win over what apt would pick.

The packages are stand-ins: real-looking files where the real ones go (`nvidia-smi` reporting the host's
hardware profile, `/usr/local/cuda-X.Y/version.json`, `nvcc --version`, `cudnn_version.h`, libraries
under their real names). They are built with `dpkg-deb`, indexed with `dpkg-scanpackages` (dpkg-dev)
and signed with `gpg` (gnupg); the signing key is generated once into the cache, never committed.

`ensure_built()` builds the repository once (rebuilt when this builder changes); `start(watch_pid)` serves
it on the lab bridge address (one server per lab host, stopped by `stop(pid)` at lab down, or by itself
when the host's supervisor is gone).
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import gzip
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

from ironserve.lab import servers
from ironserve.paths import lab_dir

MODULE = "ironserve.lab.aptrepo"  # how servers are started, and recognised by their command line
HERE = Path(__file__).resolve().parent
NVIDIA_SMI = HERE / "standin_nvidia_smi.py"
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


# --- what the packages contain -----------------------------------------------------------------------------

# CUDA version each driver branch reports in nvidia-smi (CUDA release notes, Table 3).
DRIVER_CUDA = {"525": "12.0", "535": "12.2", "515": "11.7"}
# nvcc build identification per toolkit, as `nvcc --version` prints it.
NVCC_BUILD = {
    "11.8": ("V11.8.89", "Wed_Sep_21_10:33:58_PDT_2022", "cuda_11.8.r11.8/compiler.31833905_0", "11.8.89"),
    "11.7": ("V11.7.99", "Wed_Jun__8_16:49:14_PDT_2022", "cuda_11.7.r11.7/compiler.31442593_0", "11.7.99"),
    "12.2": ("V12.2.140", "Tue_Aug_15_22:02:13_PDT_2023", "cuda_12.2.r12.2/compiler.33191640_0", "12.2.140"),
}


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
        StandinPackage(
            "nvidia-persistenced",
            pkg_version,
            "daemon to maintain persistent software state in the NVIDIA driver",
            persistenced_files,
            postinst="#!/bin/sh\nsystemctl daemon-reload >/dev/null 2>&1 || true\n",
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
    version_json = {
        "cuda": {"name": "CUDA SDK", "version": version},
        "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": cudart},
        "cuda_nvcc": {"name": "CUDA NVCC", "version": cudart},
    }
    major, minor = (int(p) for p in major_minor.split("."))
    files: Files = {
        f"{root}/version.json": (json.dumps(version_json, indent=3) + "\n", 0o644),
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
        # a100-cuda117 pinned set
        *driver_packages("515.86.01"),
        cuda_toolkit_package("11.7.1"),
        *cudnn_packages("8.5.0", "11.7"),
        # decoys: newer than the pins, what apt would pick without them
        *driver_packages("535.129.03"),
        cuda_toolkit_package("12.2.2"),
        *cudnn_packages("8.9.7", "12.2"),
        *tensorrt_packages("8.6.1.6", "12.0"),
    ]


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
        "Section: multiverse/devel",
        "Priority: optional",
    ]
    if package.depends:
        lines.append(f"Depends: {package.depends}")
    lines.append(f"Description: {package.description}\n ironserve lab stand-in with NVIDIA's package name and version.")
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


def _release(index_dir: Path) -> str:
    entries = {"MD5Sum": "md5", "SHA256": "sha256"}
    lines = [
        "Origin: ironserve-lab",
        "Label: ironserve lab NVIDIA mirror",
        "Architectures: amd64",
        f"Date: {formatdate(usegmt=True)}",
    ]
    for title, algorithm in entries.items():
        lines.append(f"{title}:")
        for name in ("Packages", "Packages.gz"):
            data = (index_dir / name).read_bytes()
            lines.append(f" {hashlib.new(algorithm, data).hexdigest()} {len(data)} {name}")
    return "\n".join(lines) + "\n"


def _index_and_sign(index_dir: Path) -> None:
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", ".", "/dev/null"],
        cwd=index_dir,
        capture_output=True,
        check=True,
    ).stdout
    (index_dir / "Packages").write_bytes(packages)
    (index_dir / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    release = _release(index_dir)
    (index_dir / "Release").write_text(release)
    (index_dir / "InRelease").write_bytes(_gpg("--local-user", KEY_UID, "--clearsign", stdin=release.encode()))
    (index_dir / "Release.gpg").write_bytes(
        _gpg("--local-user", KEY_UID, "--armor", "--detach-sign", stdin=release.encode())
    )


def _fingerprint() -> str:
    """What the built repository depends on: this builder, the nvidia-smi stand-in, the key."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + NVIDIA_SMI.read_bytes())
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
                _index_and_sign(index_dir)
            shutil.rmtree(debs)
            old = root / "www"
            if old.exists():
                shutil.rmtree(old)
            staging.rename(old)
            stamp.write_text(_fingerprint())
            return old
        finally:
            _stop_gpg_agent()


# --- serving ---------------------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(root: Path, bind: str, port: int, watch_pid: int | None) -> None:
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer((bind, port), handler)
    servers.exit_with(watch_pid, lambda: os._exit(0))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server.serve_forever()


def start(bind: str, watch_pid: int | None, log: Path) -> tuple[int, str]:
    """Serve the repository on `bind` (the lab bridge address); return (pid, base URL)."""
    root = ensure_built()
    port = servers.free_port(bind)
    argv = [sys.executable, "-m", MODULE, "serve", "--root", str(root), "--bind", bind, "--port", str(port)]
    if watch_pid:
        argv += ["--watch-pid", str(watch_pid)]
    return servers.start(argv, bind, port, log, "lab apt mirror"), f"http://{bind}:{port}"


def running(pid: int) -> bool:
    return servers.running(pid, MODULE)


def stop(pid: int) -> None:
    """Stop a server this module started (by its recorded pid)."""
    servers.stop(pid, MODULE)


def main() -> int:
    parser = argparse.ArgumentParser(prog="aptrepo")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the repository into the cache and print its root")
    serve_parser = sub.add_parser("serve")
    serve_parser.add_argument("--root", type=Path, required=True)
    serve_parser.add_argument("--bind", required=True)
    serve_parser.add_argument("--port", type=int, required=True)
    serve_parser.add_argument("--watch-pid", type=int, help="exit when this process (the lab host) is gone")
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_built())
        return 0
    serve(args.root, args.bind, args.port, args.watch_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
