"""Settings of the nvidia role: its public API, every inventory key it reads with its default.

The versions themselves are not settings: they come from the profile's `lock` and `packages`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ironserve.config import RoleSettings
from ironserve.validators import SHA256


class NvidiaSettings(RoleSettings):
    """Settings of roles/nvidia."""

    repo_url: str | None = Field(
        None,
        alias="nvidia_repo_url",
        pattern=r"^(https?|file)://\S+[^/]$",
        description="Base URL of NVIDIA's CUDA repositories or the site's mirror; the role appends "
        "`<os>/x86_64/` (flat repository: `deb [signed-by=...] URL/<os>/x86_64/ /`). Required.",
    )
    repo_key: str | None = Field(
        None,
        alias="nvidia_repo_key",
        min_length=1,
        description="Path on the deploy machine of the repository's signing key as a binary keyring "
        "(cuda-archive-keyring.gpg, or `gpg --dearmor` of an .asc); installed as "
        "/usr/share/keyrings/ironserve-nvidia.gpg. Required.",
    )
    pin_priority: int = Field(
        1001,
        alias="nvidia_pin_priority",
        ge=1001,
        le=32767,
        description="apt pin priority of the locked versions: above 1000 so apt also downgrades to them.",
    )
    cuda_home: str | None = Field(
        None,
        alias="nvidia_cuda_home",
        pattern=r"^/[\w./-]+$",
        description="CUDA_HOME in /etc/profile.d/cuda.sh and /etc/environment, and where /usr/local/cuda "
        "links; None: /usr/local/cuda-<lock's X.Y>.",
    )
    kernel_headers: bool = Field(
        True,
        alias="nvidia_kernel_headers",
        description="Install linux-headers for the running kernel and every installed kernel lacking the DKMS "
        "module; false where the module comes prebuilt (Ubuntu's linux-modules-nvidia-*) or the image has them.",
    )
    rebuild_initramfs: bool = Field(
        True,
        alias="nvidia_rebuild_initramfs",
        description="Rebuild the initramfs (update-initramfs -u -k all) when an initrd predates the nouveau blacklist.",
    )
    persistenced: bool = Field(
        True,
        alias="nvidia_persistenced",
        description="Enable and start nvidia-persistenced (keeps the driver initialised between CUDA processes).",
    )
    container_toolkit: bool = Field(
        True,
        alias="nvidia_container_toolkit",
        description="Install the profile's container_toolkit packages, pinned and held with the lock; false "
        "leaves them out.",
    )
    dkms: bool = Field(
        True,
        alias="nvidia_dkms",
        description="Verify the driver module is DKMS-built for every installed kernel and `dkms autoinstall -k` "
        "any that lacks it; false where the module comes prebuilt.",
    )
    cuda_samples_url: str | None = Field(
        None,
        alias="nvidia_cuda_samples_url",
        pattern=r"^(https?|file)://\S+\.tar\.gz$",
        description="URL of the NVIDIA/cuda-samples tarball of the lock's CUDA line (GitHub's archive of tag "
        "v11.8, or a mirror), unpacked into /opt/cuda-samples-<X.Y> for deviceQuery; None: not "
        "staged.",
    )
    cuda_samples_sha256: str | None = Field(
        None,
        alias="nvidia_cuda_samples_sha256",
        pattern=SHA256,
        description="SHA-256 of that tarball (64 lowercase hex digits); required with nvidia_cuda_samples_url.",
    )
    driver_method: Literal["apt", "runfile"] = Field(
        "apt",
        alias="nvidia_driver_method",
        description="apt: the profile's driver packages, pinned and held; runfile: NVIDIA-Linux-x86_64-<driver>.run "
        "with --silent --dkms --no-opengl-files --no-x-check, SHA-256 checked.",
    )
    runfile_base_url: str = Field(
        "https://us.download.nvidia.com",
        alias="nvidia_runfile_base_url",
        pattern=r"^(https?|file)://\S+[^/]$",
        description="Base URL of NVIDIA's driver downloads or a mirror; the role appends "
        "XFree86/Linux-x86_64/<driver>/NVIDIA-Linux-x86_64-<driver>.run.",
    )
    runfile_sha256: str | None = Field(
        None,
        alias="nvidia_runfile_sha256",
        pattern=SHA256,
        description="SHA-256 of that runfile (64 lowercase hex digits); required with nvidia_driver_method runfile.",
    )
    shim_validation_disabled: Literal["proceed", "refuse"] = Field(
        "proceed",
        alias="nvidia_shim_validation_disabled",
        description="When Secure Boot is on but shim does not validate (`mokutil --sb-state`: validation is disabled "
        "in shim): proceed (the unsigned module loads; a warning says the kernel is unprotected) or refuse.",
    )

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
