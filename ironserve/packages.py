"""The lock's exact apt versions per target OS, as a profile's `packages` section states them.

A profile maps a target OS (`debian12`, `ubuntu2204`: the directory names of NVIDIA's CUDA repositories)
to lock component (driver, cuda, cudnn, tensorrt, container_toolkit) to apt package to exact version.
`package_violations` checks that every version agrees with the lock, so a profile cannot pin a cuDNN
build for CUDA 12 under a CUDA 11.8 lock by a typo in a version string.
"""

from __future__ import annotations

import re

from ironserve.lock import LockViolation, StackLock
from ironserve.validators import PackageName, PackageVersion

COMPONENTS = ("driver", "cuda", "cudnn", "tensorrt", "container_toolkit")
# target OS -> lock component -> apt package -> exact version
AptPackages = dict[str, dict[str, dict[PackageName, PackageVersion]]]


def expected_version(lock: StackLock, component: str) -> tuple[str, str] | None:
    """(prefix, suffix) every package version of `component` must have, or None when the lock has none."""
    if component == "driver":
        return f"{lock.driver}-", ""
    if component == "cuda":
        return f"{lock.cuda}-", ""
    if component == "cudnn":
        return f"{lock.cudnn.version}.", f"+cuda{lock.cudnn.cuda}"
    if component == "tensorrt" and lock.tensorrt is not None:
        return f"{lock.tensorrt.version}-", f"+cuda{lock.tensorrt.cuda}"
    if component == "container_toolkit" and lock.container_toolkit is not None:
        return f"{lock.container_toolkit}-", ""
    return None


def package_violations(lock: StackLock, packages: AptPackages | None) -> list[LockViolation]:
    """Every package version in `packages` that disagrees with the lock, naming the version that would."""
    violations: list[LockViolation] = []
    for distro, components in (packages or {}).items():
        for component, pins in components.items():
            if component not in COMPONENTS:
                violations.append(
                    LockViolation(
                        "packages-known-component",
                        f"packages[{distro}]: unknown component {component!r}; accepted: {', '.join(COMPONENTS)}",
                    )
                )
                continue
            expected = expected_version(lock, component)
            for name, version in pins.items():
                if expected is None:
                    violations.append(
                        LockViolation(
                            "packages-match-lock",
                            f"packages[{distro}][{component}]: {name} {version} is pinned, "
                            f"but the lock has no {component}",
                        )
                    )
                elif not (version.startswith(expected[0]) and version.endswith(expected[1])):
                    violations.append(
                        LockViolation(
                            "packages-match-lock",
                            f"packages[{distro}][{component}]: {name} {version} is not the lock's {component}; "
                            f"expected a version {expected[0]}...{expected[1]}",
                        )
                    )
    return violations


def distro_key(os_id: str, version_id: str) -> str:
    """`debian` + `12` -> `debian12`, `ubuntu` + `22.04` -> `ubuntu2204` (NVIDIA's repository directory names)."""
    return re.sub(r"[^a-z0-9]", "", f"{os_id.lower()}{version_id}")


def pinned_packages(packages: AptPackages | None, distro: str, without: tuple[str, ...] = ()) -> dict[str, str]:
    """Package -> exact version for one target OS, every component together except those in `without`."""
    components = (packages or {}).get(distro, {})
    return {
        name: version
        for component, pins in components.items()
        if component not in without
        for name, version in pins.items()
    }
