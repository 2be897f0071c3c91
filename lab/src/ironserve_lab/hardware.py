"""Hardware profiles: the simulated machine behind a lab host.

A profile is data (YAML under `hardware_profiles/`). Only the lab's
stand-in tools (Redfish emulator, `lspci`, `dmidecode`, `nvidia-smi`) read it;
product code never does, it runs the same commands it runs on an R740.
A variant names a `base` profile and overrides parts of it (deep merge), so each
test variant states only what differs (e.g. slot 3 trained at x8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

PROFILE_DIR = Path(__file__).resolve().parent / "hardware_profiles"
DEFAULT_PROFILE = "r740-a10x4"


class PcieLink(BaseModel):
    speed_gts: float  # PCIe Gen3 = 8 GT/s; the R740 has no Gen4 slots
    width: int


class Gpu(BaseModel):
    slot: int
    model: str
    pci_address: str  # domain:bus:device.function as lspci -D prints it
    numa_node: int
    memory_mib: int
    board_power_w: int
    uuid: str
    vbios: str
    compute_cap: str
    link_capability: PcieLink
    link_status: PcieLink


class PowerSupply(BaseModel):
    name: str
    capacity_w: int


class SystemInfo(BaseModel):
    manufacturer: str
    model: str
    bios_version: str
    serial: str


class CpuInfo(BaseModel):
    sockets: int
    model: str
    cores_per_socket: int


class HardwareProfile(BaseModel):
    name: str
    description: str
    system: SystemInfo
    cpu: CpuInfo
    memory_gib: int
    bios_attributes: dict[str, str]
    # Attributes that stay pending after a reset (a BIOS that refuses a setting).
    bios_stuck_pending: list[str] = Field(default_factory=list)
    # ACS redirects peer-to-peer traffic on the GPUs' root ports (ReqRedir+ CmpltRedir+ in lspci's ACSCtl).
    pcie_acs_redirect: bool = False
    power_supplies: list[PowerSupply]
    gpus: list[Gpu]


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _raw(name: str) -> dict[str, Any]:
    path = PROFILE_DIR / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(available()) or "none"
        raise ValueError(f"unknown hardware profile {name!r}; accepted: {known}")
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    base = data.pop("base", None)
    return _deep_merge(_raw(base), data) if base else data


def read_hardware_profile(name: str = DEFAULT_PROFILE) -> HardwareProfile:
    return HardwareProfile.model_validate({**_raw(name), "name": name})


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
