"""Issue 4, the NVIDIA stack: the role's settings and the lock's exact apt versions (pure, no pyinfra).

A profile's `packages` section maps a target OS (`debian12`, `ubuntu2204`: the directory names of NVIDIA's
CUDA repositories) to lock component (driver, cuda, cudnn, tensorrt) to apt package to exact version.
`package_violations` checks that every version agrees with the lock, so a profile cannot pin a cuDNN
build for CUDA 12 under a CUDA 11.8 lock by a typo in a version string.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironserve.lock import LockViolation, StackLock

COMPONENTS = ("driver", "cuda", "cudnn", "tensorrt", "container_toolkit")
SHA256 = r"^[0-9a-f]{64}$"
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
    container_toolkit: bool = Field(alias="nvidia_container_toolkit")
    dkms: bool = Field(alias="nvidia_dkms")
    cuda_samples_url: str | None = Field(alias="nvidia_cuda_samples_url", pattern=r"^(https?|file)://\S+\.tar\.gz$")
    cuda_samples_sha256: str | None = Field(alias="nvidia_cuda_samples_sha256", pattern=SHA256)
    driver_method: Literal["apt", "runfile"] = Field(alias="nvidia_driver_method")
    runfile_base_url: str = Field(alias="nvidia_runfile_base_url", pattern=r"^(https?|file)://\S+[^/]$")
    runfile_sha256: str | None = Field(alias="nvidia_runfile_sha256", pattern=SHA256)

    @model_validator(mode="after")
    def _samples_checksum_with_url(self) -> NvidiaSettings:
        if self.cuda_samples_url is not None and self.cuda_samples_sha256 is None:
            raise ValueError(
                "nvidia_cuda_samples_sha256 is required with nvidia_cuda_samples_url "
                "(the tarball's SHA-256, 64 hex digits)"
            )
        return self

    @model_validator(mode="after")
    def _runfile_needs_checksum_and_dkms(self) -> NvidiaSettings:
        if self.driver_method == "runfile" and self.runfile_sha256 is None:
            raise ValueError(
                "nvidia_runfile_sha256 is required with nvidia_driver_method runfile "
                "(SHA-256 of NVIDIA-Linux-x86_64-<lock driver>.run, 64 hex digits)"
            )
        if self.driver_method == "runfile" and not self.dkms:
            raise ValueError("nvidia_driver_method runfile installs with --dkms: nvidia_dkms must stay true")
        return self

    def skipped_components(self) -> tuple[str, ...]:
        """Lock components the profile pins but this host does not install from apt."""
        skipped = () if self.container_toolkit else ("container_toolkit",)
        return skipped + (("driver",) if self.driver_method == "runfile" else ())


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


def pinned_packages(packages: AptPackages | None, distro: str, without: tuple[str, ...] = ()) -> dict[str, str]:
    """Package -> exact version for one target OS, every component together except those in `without`."""
    components = (packages or {}).get(distro, {})
    return {
        name: version
        for component, pins in components.items()
        if component not in without
        for name, version in pins.items()
    }
