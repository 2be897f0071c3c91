"""Hardware/software profiles: what a host is and the pinned software set it gets, as data.

`ironserve/profiles/<name>.yaml` holds one profile; `ironserve_profile` names it in the inventory and
`ironserve_lock` overrides parts of its lock (the lock rules then run on the result).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ironserve.lock import StackLock
from ironserve.packages import AptPackages

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "r740-a10"


class GpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    memory_gib: int = Field(gt=0)
    compute_capability: str
    board_power_w: int = Field(gt=0)


class ServerSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    pcie_gen: int = Field(ge=1, le=6)


class HardwareSpec(BaseModel):
    """What the machine must physically be before anything is installed; the profile's `hardware` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cpu_sockets: int = Field(ge=1)
    gpus_installed: int = Field(ge=0)  # NVIDIA GPUs physically present (all draw power)
    gpu_pci_name: str  # how lspci names the card, e.g. "[A10]" in "GA102GL [A10]"
    serving_gpus: int = Field(ge=0)  # full-width GPUs the service uses, lowest slots first
    serving_width: int = Field(default=16, ge=1)  # lanes a GPU needs to serve; narrower ones are excluded
    same_socket: bool = True  # serving GPUs must share one NUMA node / CPU socket
    platform_power_w: int = Field(ge=0)  # CPUs, memory, fans, disks, NICs: added to the GPUs' board power
    bios_attributes: dict[str, str] = Field(default_factory=dict)  # Redfish Bios attribute -> required value


class Profile(BaseModel):
    """A hardware/software profile: what the host is and the pinned software set it gets."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    description: str
    server: ServerSpec
    gpu: GpuSpec
    lock: StackLock
    hardware: HardwareSpec | None = None  # None: the profile states no hardware expectations
    # Host OS (`ubuntu2204`, `debian12`: /etc/os-release's ID and VERSION_ID) -> the directory of NVIDIA's CUDA
    # repository its lock is installed from. An OS not listed is one the lock is not published for.
    platforms: dict[str, str] = Field(default_factory=dict)
    packages: AptPackages | None = None  # repository directory -> the lock's exact apt versions there

    @model_validator(mode="after")
    def _platforms_have_packages(self) -> Profile:
        unpinned = sorted({d for d in self.platforms.values() if d not in (self.packages or {})})
        if unpinned:
            raise ValueError(f"platforms name repository directories with no packages section: {', '.join(unpinned)}")
        return self

    def supported(self) -> str:
        """The OS releases the lock is published for, for a message."""
        return ", ".join(f"{os_key} (from {directory})" for os_key, directory in self.platforms.items()) or "none"

    def repository_for(self, os_key: str) -> str:
        """The repository directory a host of `os_key` installs the lock from; ValueError naming the supported
        OS releases when the lock is not published for it."""
        if os_key not in self.platforms:
            raise ValueError(
                f"the OS {os_key or 'unknown'} is not one profile {self.name}'s lock is published for; "
                f"supported: {self.supported()}"
            )
        return self.platforms[os_key]


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_data(name: object, lock_overrides: object = None) -> dict[str, Any]:
    """The named profile as plain data, `lock_overrides` merged into its lock (validated by `Profile`).

    Raises ValueError naming the accepted profiles, or what is wrong with the overrides.
    """
    if not isinstance(name, str) or name not in available_profiles():
        raise ValueError(f"unknown profile {name!r} (accepted: {', '.join(available_profiles())})")
    data: dict[str, Any] = copy.deepcopy(_shipped(name))
    data["lock"] = _merged_lock(data["lock"], lock_overrides)
    return {**data, "name": name}


@functools.cache
def _shipped(name: str) -> dict[str, Any]:
    """The profile file parsed once per process: validating an inventory reads it several times for every host
    (4 ms a parse; 0.19 s of the controller's CPU for 16 hosts)."""
    data: dict[str, Any] = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    return data


def read_profile(name: str) -> Profile:
    """The named profile, validated, as shipped (no inventory overrides)."""
    return Profile.model_validate(profile_data(name))


def _merged_lock(lock: Mapping[str, Any], overrides: object) -> dict[str, Any]:
    if overrides is None:
        return dict(lock)
    if not isinstance(overrides, Mapping):
        raise ValueError("ironserve_lock: expected a mapping of lock component to value")
    merged = dict(lock)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
