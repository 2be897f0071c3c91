"""Issue 4, the NVIDIA stack: the role's settings and the lock's exact apt versions (pure, no pyinfra).

A profile's `packages` section maps a target OS (`debian12`, `ubuntu2204`: the directory names of NVIDIA's
CUDA repositories) to lock component (driver, cuda, cudnn, tensorrt) to apt package to exact version.
`package_violations` checks that every version agrees with the lock, so a profile cannot pin a cuDNN
build for CUDA 12 under a CUDA 11.8 lock by a typo in a version string.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ironserve.lock import LockViolation, StackLock

COMPONENTS = ("driver", "cuda", "cudnn", "tensorrt")
PackageName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9+.-]+$")]
PackageVersion = Annotated[str, Field(pattern=r"^[0-9][A-Za-z0-9.+~:-]*$")]
# target OS -> lock component -> apt package -> exact version
AptPackages = dict[str, dict[str, dict[PackageName, PackageVersion]]]


class NvidiaSettings(BaseModel):
    """Settings of roles/nvidia (keys documented in roles/nvidia/defaults.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    repo_url: str | None = Field(alias="nvidia_repo_url", pattern=r"^(https?|file)://\S+[^/]$")
    repo_key: str | None = Field(alias="nvidia_repo_key", min_length=1)
    pin_priority: int = Field(alias="nvidia_pin_priority", ge=1001, le=32767)
    cuda_home: str | None = Field(alias="nvidia_cuda_home", pattern=r"^/[\w./-]+$")
    kernel_headers: bool = Field(alias="nvidia_kernel_headers")
    rebuild_initramfs: bool = Field(alias="nvidia_rebuild_initramfs")
    persistenced: bool = Field(alias="nvidia_persistenced")


def _expected(lock: StackLock, component: str) -> tuple[str, str] | None:
    """(prefix, suffix) every package version of `component` must have, or None when the lock has none."""
    if component == "driver":
        return f"{lock.driver}-", ""
    if component == "cuda":
        return f"{lock.cuda}-", ""
    if component == "cudnn":
        return f"{lock.cudnn.version}.", f"+cuda{lock.cudnn.cuda}"
    if component == "tensorrt" and lock.tensorrt is not None:
        return f"{lock.tensorrt.version}-", f"+cuda{lock.tensorrt.cuda}"
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
            expected = _expected(lock, component)
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


def pinned_packages(packages: AptPackages | None, distro: str) -> dict[str, str]:
    """Package -> exact version for one target OS, every component together."""
    return {name: version for pins in (packages or {}).get(distro, {}).values() for name, version in pins.items()}
