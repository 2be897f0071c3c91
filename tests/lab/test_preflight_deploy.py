"""Preflight and BIOS as code against real lab container hosts, one per hardware-profile variant.

Each host runs the stand-in lspci/dmidecode/lscpu and has a Redfish emulator beside it. The real
deploy (`ironserve deploy`) must pass on the default R740, stop every variant with its own failure
before anything else runs on it, fix the BIOS variant through Redfish in apply mode (and prove it),
change nothing on a second apply, and never show the iDRAC password anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ironserve_lab import container, edge, manager, remote, state
from ironserve_lab.deploying import HOST_ROLES, DeployResult, deploy
from ironserve_lab.inventory import lab_groups
from ironserve_lab.paths import lab_dir
from ironserve_lab.state import LabHost

pytestmark = pytest.mark.lab
SENTINEL = "s3ntinel-PASSWORD-lab-5e1f"
VARIANTS = {
    "pf-default": "r740-a10x4",
    "pf-above4g": "r740-a10x4-above4g-off",
    "pf-slot2": "r740-a10x4-slot2-x8",
    "pf-psu": "r740-a10x4-psu1100",
    "pf-r730": "r730-a10x4",
    "pf-stuck": "r740-a10x4-sriov-stuck",
}
SYSCTL_FILE = "/etc/sysctl.d/90-ironserve.conf"  # host_tuning's first file: proof that later roles ran


def _lab_usable() -> str | None:
    if os.geteuid() != 0:
        return "the container lab needs root"
    try:
        container.container_rootfs()
    except Exception as exc:  # the lab's own prerequisites (debootstrap, a mirror) are missing
        return f"container lab unavailable: {exc}"
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabHost]]:
    reason = _lab_usable()
    if reason:
        pytest.skip(reason)
    manager.ensure_ssh_key()
    sentinel_file = tmp_path_factory.mktemp("idrac") / "credentials"
    sentinel_file.write_text(f"root:{SENTINEL}\n")
    started: dict[str, LabHost] = {}
    try:
        for name, profile in VARIANTS.items():
            current = state.load()
            try:
                [host] = container.start([name], profile, current)
            except Exception:
                for half_started in [h for h in current.hosts if h.name == name]:
                    container.stop(half_started, current)
                raise
            started[name] = host
            edge.attach(host, sentinel_file)
        yield started
    finally:
        for host in started.values():
            edge.detach(host)
            container.stop(host, state.load())
        current = state.load()
        if not current.hosts:  # we started the lab's shared network: take it down too
            container.teardown_shared(current)
            state.save(state.LabState())


def _inventory(tmp: Path, names: list[str], **extra: Any) -> str:
    entries = {name: data for group in lab_groups() for name, data in group if name in names}
    for data in entries.values():
        data.pop("bios_credentials_file", None)  # the password comes from the environment here
        data["preflight_report_dir"] = str(tmp / "reports")
        data["ironserve_roles"] = list(HOST_ROLES)  # later roles prove the gate let the run go on
        data.update(extra)
        data.update(extra.get("per_host", {}).get(data["ssh_hostname"], {}))
        data.pop("per_host", None)
    path = tmp / "inventory.py"
    path.write_text(
        f"import json\nhosts = [tuple(e) for e in json.loads({json.dumps(json.dumps(list(entries.items())))})]\n"
    )
    return str(path)


def _deploy(tmp: Path, hosts: dict[str, LabHost], names: list[str], **extra: Any) -> DeployResult:
    env = {"IRONSERVE_REDFISH_USER": "root", "IRONSERVE_REDFISH_PASSWORD": SENTINEL}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return deploy([hosts[name] for name in names], _inventory(tmp, names, **extra))
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _report(tmp: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp / "reports" / f"{name}.json").read_text())
    return data


def _failed(report: dict[str, Any]) -> set[str]:
    return {c["name"] for c in report["checks"] if c["status"] == "fail" and not c["overridden"]}


@pytest.fixture(scope="module")
def checked(hosts: dict[str, LabHost], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DeployResult]:
    tmp = tmp_path_factory.mktemp("check")
    return tmp, _deploy(tmp, hosts, list(hosts))


@pytest.mark.invariant("hw-server-model", "hw-pcie-link-width-x16", "hw-active-gpus-two")
def test_default_r740_passes_and_the_deploy_goes_on(
    checked: tuple[Path, DeployResult], hosts: dict[str, LabHost]
) -> None:
    tmp, result = checked
    assert (tmp / "reports" / "pf-default.json").exists(), result.output
    report = _report(tmp, "pf-default")
    assert report["passed"], (tmp / "reports" / "pf-default.txt").read_text()
    assert report["serving_gpus"] == ["0000:3b:00.0", "0000:5e:00.0"]
    assert remote.run(hosts["pf-default"], f"test -f {SYSCTL_FILE} && echo yes").strip() == "yes"


@pytest.mark.parametrize(
    ("name", "failing", "phrase"),
    [
        pytest.param(
            "pf-above4g",
            {"gpu-bars-assigned", "pcie-link-width", "bios-attributes"},
            "MmioAbove4Gb=Enabled",
            marks=pytest.mark.invariant("hw-above-4g-decoding"),
        ),
        pytest.param(
            "pf-slot2",
            {"pcie-link-width"},
            "only 1 GPUs train at x16",
            marks=pytest.mark.invariant("hw-pcie-link-width-x16"),
        ),
        pytest.param(
            "pf-psu", {"psu-capacity"}, "install PSUs rated >= 1300 W", marks=pytest.mark.invariant("hw-psu-2000w")
        ),
        pytest.param(
            "pf-r730",
            {"system-model", "redfish-system-model"},
            "this host is not a PowerEdge R740",
            marks=pytest.mark.invariant("hw-server-model"),
        ),
        pytest.param(
            "pf-stuck",
            {"bios-attributes"},
            "SriovGlobalEnable=Disabled",
            marks=pytest.mark.invariant("hw-bios-sriov-disabled"),
        ),
    ],
)
def test_variant_is_stopped_with_its_failure(
    checked: tuple[Path, DeployResult], hosts: dict[str, LabHost], name: str, failing: set[str], phrase: str
) -> None:
    tmp, result = checked
    assert result.returncode != 0
    assert (tmp / "reports" / f"{name}.json").exists(), result.output
    assert _failed(_report(tmp, name)) == failing
    assert phrase in (tmp / "reports" / f"{name}.txt").read_text()
    assert phrase in result.output  # pyinfra prints the failure and what to do
    # Stopped before anything else ran on it: host_tuning never wrote its first file.
    assert remote.run(hosts[name], f"test -f {SYSCTL_FILE} && echo yes || echo no").strip() == "no"


def test_named_override_lets_a_host_through(hosts: dict[str, LabHost], tmp_path: Path) -> None:
    result = _deploy(tmp_path, hosts, ["pf-psu"], preflight_overrides=["psu-capacity"])
    assert result.returncode == 0, result.output
    report = _report(tmp_path, "pf-psu")
    assert report["passed"] and [c["name"] for c in report["checks"] if c["overridden"]] == ["psu-capacity"]


@pytest.mark.invariant("hw-above-4g-decoding", "hw-bios-sriov-disabled")
def test_apply_fixes_the_bios_and_a_second_apply_changes_nothing(hosts: dict[str, LabHost], tmp_path: Path) -> None:
    apply_mode = {"bios_mode": "apply", "bios_reboot_policy": "auto"}
    first = _deploy(tmp_path, hosts, ["pf-default", "pf-above4g", "pf-stuck"], **apply_mode)
    above = _report(tmp_path, "pf-above4g")
    assert above["passed"], (tmp_path / "reports" / "pf-above4g.txt").read_text()
    bios_row = next(c for c in above["checks"] if c["name"] == "bios-attributes")
    assert "re-read proves current == desired" in bios_row["observed"]
    # The host saw the change: every GPU BAR is mapped now.
    assert "<unassigned>" not in remote.run(hosts["pf-above4g"], "lspci -vvv -D -d 10de:")
    # A setting that stays pending after the reset is a failure, not a success.
    stuck = _report(tmp_path, "pf-stuck")
    assert _failed(stuck) == {"bios-attributes", "bios-pending"}
    assert "still pending after reset: SriovGlobalEnable=Disabled" in json.dumps(stuck)
    assert first.returncode != 0  # pf-stuck failed
    log = (lab_dir() / "pf-above4g-idrac" / "redfish.log").read_text()
    patches = log.count("PATCH /redfish/v1/Systems/System.Embedded.1/Bios/Settings")
    assert patches == 1
    second = _deploy(tmp_path, hosts, ["pf-default", "pf-above4g"], **apply_mode)
    assert second.returncode == 0, second.output
    third = _deploy(tmp_path, hosts, ["pf-default", "pf-above4g"], **apply_mode)
    assert third.returncode == 0 and third.errors == 0, third.output
    # Neither role queued an operation: BIOS and preflight are no-ops (other roles answer for themselves).
    assert "Apply BIOS attributes" not in third.output and "Hardware preflight gate" not in third.output
    log = (lab_dir() / "pf-above4g-idrac" / "redfish.log").read_text()
    assert log.count("PATCH /redfish/v1/Systems/System.Embedded.1/Bios/Settings") == 1  # no second PATCH


def test_no_credential_in_any_output_report_or_log(
    checked: tuple[Path, DeployResult], hosts: dict[str, LabHost]
) -> None:
    tmp, result = checked
    texts = [result.output]
    texts += [p.read_text() for p in (tmp / "reports").iterdir()]
    texts += [(lab_dir() / f"{name}-idrac" / "redfish.log").read_text() for name in hosts]
    texts += [(tmp / "inventory.py").read_text()]
    import base64

    encoded = base64.b64encode(f"root:{SENTINEL}".encode()).decode()
    for text in texts:
        assert SENTINEL not in text and encoded not in text
