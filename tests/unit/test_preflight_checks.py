"""Preflight checks on the stand-in tools' output for each lab hardware profile (no lab host needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ironserve.profiles import read_profile
from ironserve.run import BmcObservation
from ironserve_lab import hardware, standins
from roles import stack_config
from roles.preflight.checks import CHECK_NAMES, HostObservation, PreflightReport, evaluate
from roles.preflight.facts import (
    parse_dmidecode_power_supplies,
    parse_dmidecode_string,
    parse_lscpu_sockets,
    parse_lspci_verbose,
)

PROFILE = read_profile("r740-a10")


def observe(name: str, tmp_path: Path, bios: dict[str, str] | None = None) -> HostObservation:
    """What the preflight facts read on a lab host with hardware profile `name` (through the stand-ins)."""
    data = tmp_path / "hardware.json"
    data.write_text(json.dumps(hardware.read_hardware_profile(name).model_dump()))
    bios_file = tmp_path / "bios.json"
    if bios is not None:
        bios_file.write_text(json.dumps(bios))
    profile = standins.load(data, bios_file)
    return HostObservation(
        product=parse_dmidecode_string(standins.dmidecode(profile, ["-s", "system-product-name"]).splitlines()),
        bios_version=parse_dmidecode_string(standins.dmidecode(profile, ["-s", "bios-version"]).splitlines()),
        cpu_sockets=parse_lscpu_sockets(standins.lscpu(profile, []).splitlines()),
        devices=parse_lspci_verbose(standins.lspci(profile, ["-vvv", "-D"]).splitlines()),
        power_supplies=parse_dmidecode_power_supplies(standins.dmidecode(profile, ["-t", "39"]).splitlines()),
    )


def bios_of(name: str) -> BmcObservation:
    hw = hardware.read_hardware_profile(name)
    return BmcObservation(address="http://127.0.0.1:1", model=hw.system.model, attributes=dict(hw.bios_attributes))


def failed(report: PreflightReport) -> dict[str, str]:
    return {c.name: c.observed for c in report.failures}


def test_default_profile_passes_and_serves_two_full_width_gpus(tmp_path: Path) -> None:
    report = evaluate("lab-c1", PROFILE, observe("r740-a10x4", tmp_path), bios_of("r740-a10x4"))
    assert report.passed, report.to_text()
    assert report.serving_gpus == ["0000:3b:00.0", "0000:5e:00.0"]
    assert report.excluded_gpus == {
        "0000:af:00.0": "trained at x8, serving needs x16",
        "0000:d8:00.0": "trained at x8, serving needs x16",
    }
    assert [c.name for c in report.checks if c.status == "pass"][:3] == [
        "system-model",
        "redfish-system-model",
        "cpu-sockets",
    ]


def test_above_4g_disabled_fails_with_bios_advice(tmp_path: Path) -> None:
    report = evaluate("h", PROFILE, observe("r740-a10x4-above4g-off", tmp_path), bios_of("r740-a10x4-above4g-off"))
    assert set(failed(report)) == {"gpu-bars-assigned", "pcie-link-width", "bios-attributes"}
    by_name = {c.name: c for c in report.checks}
    assert "MmioAbove4Gb=Enabled" in by_name["gpu-bars-assigned"].advice
    assert by_name["bios-attributes"].observed == "MmioAbove4Gb=Disabled"
    assert "bios_mode: apply" in by_name["bios-attributes"].advice
    # After the BIOS change the host maps every BAR and serves again.
    fixed = evaluate("h", PROFILE, observe("r740-a10x4-above4g-off", tmp_path, {"MmioAbove4Gb": "Enabled"}), None)
    assert fixed.passed


def test_slot2_at_x8_leaves_one_full_width_gpu(tmp_path: Path) -> None:
    report = evaluate("h", PROFILE, observe("r740-a10x4-slot2-x8", tmp_path), bios_of("r740-a10x4-slot2-x8"))
    assert set(failed(report)) == {"pcie-link-width"}
    check = report.failures[0]
    assert check.observed.startswith("slot 1 (0000:3b:00.0) x16, slot 2 (0000:5e:00.0) x8 (excluded)")
    assert "only 1 GPUs train at x16" in check.advice
    assert report.serving_gpus == ["0000:3b:00.0"]


def test_1100w_psu_cannot_feed_four_a10(tmp_path: Path) -> None:
    report = evaluate("h", PROFILE, observe("r740-a10x4-psu1100", tmp_path), bios_of("r740-a10x4-psu1100"))
    assert set(failed(report)) == {"psu-capacity"}
    check = report.failures[0]
    assert check.expected == ">= 1300 W per PSU (4 x 150 W GPUs + 700 W platform)"
    assert check.observed == "2 PSUs: 1100 W, 1100 W (dmidecode)"
    overridden = evaluate("h", PROFILE, observe("r740-a10x4-psu1100", tmp_path), None, ["psu-capacity"])
    assert overridden.passed and [c.name for c in overridden.checks if c.overridden] == ["psu-capacity"]


def test_non_r740_is_refused_by_dmi_and_redfish(tmp_path: Path) -> None:
    report = evaluate("h", PROFILE, observe("r730-a10x4", tmp_path), bios_of("r730-a10x4"))
    assert failed(report) == {"system-model": "PowerEdge R730", "redfish-system-model": "PowerEdge R730"}


def test_stuck_pending_setting_is_a_failure(tmp_path: Path) -> None:
    bios = BmcObservation(
        address="http://x",
        model="PowerEdge R740",
        attributes={**hardware.read_hardware_profile("r740-a10x4-sriov-stuck").bios_attributes},
        pending={"SriovGlobalEnable": "Disabled"},
        stuck={"SriovGlobalEnable": "Disabled"},
    )
    report = evaluate("h", PROFILE, observe("r740-a10x4-sriov-stuck", tmp_path), bios)
    assert set(failed(report)) == {"bios-attributes", "bios-pending"}
    pending = {c.name: c for c in report.checks}["bios-pending"]
    assert pending.observed == "still pending after reset: SriovGlobalEnable=Disabled"
    assert "job queue" in pending.advice


def test_gpus_on_two_sockets_fail_the_same_socket_check(tmp_path: Path) -> None:
    observation = observe("r740-a10x4", tmp_path)
    report = evaluate("h", PROFILE, observation, None)
    assert {c.name: c.status for c in report.checks}["gpu-same-socket"] == "pass"
    split = HostObservation(**{**observation.__dict__, "sysfs_numa": {"0000:5e:00.0": 1}})
    report = evaluate("h", PROFILE, split, None)
    assert set(failed(report)) == {"gpu-same-socket"}


def test_acs_redirect_on_a_root_port_fails(tmp_path: Path) -> None:
    data = tmp_path / "hardware.json"
    data.write_text(json.dumps({**hardware.read_hardware_profile().model_dump(), "pcie_acs_redirect": True}))
    devices = parse_lspci_verbose(standins.lspci(standins.load(data, tmp_path / "none"), ["-vvv", "-D"]).splitlines())
    report = evaluate("h", PROFILE, HostObservation("PowerEdge R740", None, 2, devices), None)
    assert "acs-p2p-redirect" in failed(report)


def test_report_text_and_json(tmp_path: Path) -> None:
    report = evaluate("lab-c1", PROFILE, observe("r740-a10x4-psu1100", tmp_path), None)
    text = report.to_text()
    assert text.startswith("preflight lab-c1 (profile r740-a10): FAIL")
    assert "psu-capacity" in text and "install PSUs rated >= 1300 W" in text
    assert "not checked: set bios_redfish_address" in text
    data = json.loads(report.to_json())
    assert data["passed"] is False and data["serving_gpus"] == ["0000:3b:00.0", "0000:5e:00.0"]
    assert [c["name"] for c in data["checks"]] == [n for n in CHECK_NAMES if n not in {"bios-pending", "iommu"}]


def test_overrides_are_validated_by_the_config() -> None:
    from ironserve.config import ConfigError

    assert stack_config("h", {"preflight_overrides": ["psu-capacity"]}).preflight.overrides == ("psu-capacity",)
    with pytest.raises(ConfigError, match=r"host h: preflight_overrides\[0\]: unknown preflight check 'psu'"):
        stack_config("h", {"preflight_overrides": ["psu"]})


def test_standin_lspci_filters_like_lspci(tmp_path: Path) -> None:
    data = tmp_path / "hardware.json"
    data.write_text(json.dumps(hardware.read_hardware_profile().model_dump()))
    profile = standins.load(data, tmp_path / "none")
    # Without -D lspci prints domains once any device is outside domain 0: the VMD's NVMe drive is (10000:01:00.0).
    assert standins.lspci(profile, ["-d", "10de:"]).splitlines()[0] == (
        "0000:3b:00.0 3D controller: NVIDIA Corporation GA102GL [A10] (rev a1)"
    )
    assert len(standins.lspci(profile, ["-D", "-d", "10de:"]).splitlines()) == 4
    one = parse_lspci_verbose(standins.lspci(profile, ["-vv", "-D", "-s", "0000:af:00.0"]).splitlines())
    assert [d.address for d in one] == ["0000:af:00.0"]
    assert one[0].link_status is not None and one[0].link_status.width == 8
