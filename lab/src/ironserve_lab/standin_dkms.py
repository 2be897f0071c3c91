"""Stand-in `dkms` for lab hosts, shipped only inside the lab mirror's stand-in `nvidia-kernel-dkms` package.

Why a stand-in: the real dkms compiles the module with gcc against the kernel's headers, and the lab's
stand-in driver has no module source to compile (the real nvidia.ko refuses to load without a GPU anyway).
This keeps dkms's interface and bookkeeping so that the product runs the same commands as on an R740:
`dkms status`, `dkms add`, `dkms build|install -m M -v V -k K`, `dkms autoinstall [-k K]`, `dkms remove`.

Same rules as the real tool where they matter for the role: a module is added from /usr/src/<M>-<V>/dkms.conf,
building for kernel K needs its headers (/lib/modules/K/build or source) and fails without them with dkms's
message, installing copies the built modules to /lib/modules/K/updates/dkms/ (Debian's location) and records
/var/lib/dkms/<M>/kernel-K-x86_64, `status` prints dkms 3's format (`M/V, K, x86_64: installed`). The
"built" modules are text files saying what they stand in for; depmod is not run on them.
Standard library only: it runs with the lab host's system python3.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(os.environ.get("IRONSERVE_STANDIN_DKMS_ROOT", "/"))  # "/" on a lab host; a folder in unit tests
ARCH = "x86_64"


def _tree() -> Path:
    return ROOT / "var/lib/dkms"


def _conf(module: str, version: str) -> dict[str, str]:
    text = (ROOT / f"usr/src/{module}-{version}/dkms.conf").read_text()
    return {k: v.strip("\"'") for k, v in re.findall(r"^([A-Z_]+(?:\[\d+\])?)=(.*)$", text, flags=re.M)}


def _built_names(module: str, version: str) -> list[str]:
    conf = _conf(module, version)
    return [v for k, v in sorted(conf.items()) if k.startswith("BUILT_MODULE_NAME[")]


def _added() -> list[tuple[str, str]]:
    if not _tree().is_dir():
        return []
    return sorted(
        (m.name, v.name)
        for m in _tree().iterdir()
        if m.is_dir()
        for v in m.iterdir()
        if v.is_dir() and (v / "source").is_symlink()
    )


def _kernel_dir(module: str, version: str, kernel: str) -> Path:
    return _tree() / module / version / kernel / ARCH


def _installed_link(module: str, kernel: str) -> Path:
    return _tree() / module / f"kernel-{kernel}-{ARCH}"


def add(module: str, version: str) -> int:
    source = ROOT / f"usr/src/{module}-{version}"
    if not (source / "dkms.conf").exists():
        print(f"Error! Could not find module source directory.\nDirectory: {source} does not exist.", file=sys.stderr)
        return 2
    target = _tree() / module / version
    target.mkdir(parents=True, exist_ok=True)
    if not (target / "source").is_symlink():
        (target / "source").symlink_to(f"/usr/src/{module}-{version}")
        print(f"Creating symlink /var/lib/dkms/{module}/{version}/source -> /usr/src/{module}-{version}")
    return 0


def build(module: str, version: str, kernel: str) -> int:
    if (module, version) not in _added():
        print(f"Error! The module/version combo: {module}-{version} is not located in the DKMS tree.", file=sys.stderr)
        return 3
    headers = [ROOT / f"lib/modules/{kernel}/{d}" for d in ("build", "source")]
    if not any(h.exists() for h in headers):
        print(
            f"Error! Your kernel headers for kernel {kernel} cannot be found at /lib/modules/{kernel}/build or "
            f"/lib/modules/{kernel}/source.\nPlease install the linux-headers-{kernel} package or use the "
            "--kernelsourcedir option to tell DKMS where it's located.",
            file=sys.stderr,
        )
        return 1
    out = _kernel_dir(module, version, kernel) / "module"
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"Building module:\nCleaning build area...\nmake -j1 KERNELRELEASE={kernel} modules...\nCleaning build area..."
    )
    for name in _built_names(module, version):
        (out / f"{name}.ko").write_text(
            f"ironserve lab stand-in: {name}.ko {version}, built by the stand-in dkms for kernel {kernel}\n"
        )
    return 0


def install(module: str, version: str, kernel: str) -> int:
    if not (_kernel_dir(module, version, kernel) / "module").is_dir():
        status = build(module, version, kernel)
        if status:
            return status
    dest = ROOT / f"lib/modules/{kernel}/updates/dkms"
    dest.mkdir(parents=True, exist_ok=True)
    for name in _built_names(module, version):
        shutil.copyfile(_kernel_dir(module, version, kernel) / "module" / f"{name}.ko", dest / f"{name}.ko")
        print(
            f"{name}.ko:\nRunning module version sanity check.\n - Installation\n   - Installing to {dest.as_posix()}/"
        )
    link = _installed_link(module, kernel)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(f"{version}/{kernel}/{ARCH}")
    return 0


def remove(module: str, version: str, kernels: list[str] | None) -> int:
    """`kernels` None: every kernel (--all), and the module/version leaves the tree."""
    base = _tree() / module / version
    if not base.is_dir():
        print(f"Error! The module/version combo: {module}-{version} is not located in the DKMS tree.", file=sys.stderr)
        return 3
    built = [p.name for p in base.iterdir() if p.is_dir() and (p / ARCH).is_dir()]
    for kernel in built if kernels is None else kernels:
        link = _installed_link(module, kernel)
        if link.is_symlink() and os.readlink(link).startswith(f"{version}/"):
            link.unlink()
            for name in _built_names(module, version):
                (ROOT / f"lib/modules/{kernel}/updates/dkms/{name}.ko").unlink(missing_ok=True)
        shutil.rmtree(base / kernel, ignore_errors=True)
        print(
            f"Module {module}-{version} for kernel {kernel} ({ARCH}).\nDeleting module {module}-{version} completely."
        )
    if kernels is None:
        shutil.rmtree(base)
    return 0


def status(module: str | None, version: str | None, kernel: str | None) -> int:
    for m, v in _added():
        if (module and m != module) or (version and v != version):
            continue
        kernels = sorted(p.name for p in (_tree() / m / v).iterdir() if p.is_dir() and (p / ARCH).is_dir())
        if kernel:
            kernels = [k for k in kernels if k == kernel]
        if not kernels and not kernel:
            print(f"{m}/{v}: added")
        for k in kernels:
            link = _installed_link(m, k)
            state = "installed" if link.is_symlink() and os.readlink(link).startswith(f"{v}/") else "built"
            print(f"{m}/{v}, {k}, {ARCH}: {state}")
    return 0


def autoinstall(kernel: str) -> int:
    worst = 0
    for module, version in _added():
        if _conf(module, version).get("AUTOINSTALL", "").lower() == "yes":
            worst = max(worst, install(module, version, kernel))
    return worst


def main(argv: list[str]) -> int:
    if not argv:
        print("Usage: dkms [action] [options]", file=sys.stderr)
        return 2
    action, rest = argv[0], argv[1:]
    opts: dict[str, str] = {}
    positional: list[str] = []
    every = False
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg in {"-m", "-v", "-k"} and i + 1 < len(rest):
            opts[arg] = rest[i + 1]
            i += 2
            continue
        if arg == "--all":
            every = True
        elif not arg.startswith("-"):
            positional.append(arg)
        i += 1
    if positional and "/" in positional[0]:  # M/V form
        module_name, _, module_version = positional[0].rstrip("/").rpartition("/")
        if module_name.startswith("/usr/src/"):  # dkms add /usr/src/M-V
            module_name, _, module_version = Path(positional[0]).name.rpartition("-")
        opts.setdefault("-m", module_name)
        opts.setdefault("-v", module_version)
    kernel = opts.get("-k", os.uname().release)
    module, version = opts.get("-m"), opts.get("-v")
    if action == "status":
        return status(module, version, opts.get("-k"))
    if action == "autoinstall":
        return autoinstall(kernel)
    if module is None or version is None:
        print(f"Error! Invalid number of arguments passed.\nUsage: {action} <module>/<module-version>", file=sys.stderr)
        return 2
    if action == "add":
        return add(module, version)
    if action == "build":
        return build(module, version, kernel)
    if action == "install":
        return install(module, version, kernel)
    if action == "remove":
        return remove(module, version, None if every else [kernel])
    print(f"Error! Unknown action: {action} (ironserve lab stand-in)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
