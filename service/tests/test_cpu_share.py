"""The starting colour's CPU share (issue 33): half the serving one's until its engine is ready, then equal;
through the colour's unit cgroup (systemctl's answers recorded, the cgroup a folder here) or its launcher session's
autogroup (a real session). The lab's inference deploy runs the unit path on a real systemd host."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve_service import swap
from ironserve_service.control import colour_readiness
from ironserve_service.settings import EngineSettings, ServiceSettings, SwapSettings


def service(tmp_path: Path, colour_unit: str | None = None) -> ServiceSettings:
    swap_settings = SwapSettings(router_dir=tmp_path / "envoy", run_dir=tmp_path / "run", colour_unit=colour_unit)
    return ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap_settings)


def test_a_unit_starts_at_half_the_weight_and_serves_at_the_full_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit path without systemd: systemctl's answers recorded, the unit's cgroup a folder of this test."""
    settings = service(tmp_path, "ai-service@{colour}.service")
    cgroup = tmp_path / "cgroup" / "ai.slice" / "ai-service@green.service"
    cgroup.mkdir(parents=True)
    (cgroup / "cpu.weight").write_text("100\n")
    monkeypatch.setattr(swap, "CGROUP_ROOT", tmp_path / "cgroup")
    calls: list[tuple[str, ...]] = []
    weights: list[str] = []

    def systemctl(*args: str) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        weights.append((cgroup / "cpu.weight").read_text().strip())
        if args[0] == "start":  # the engine turns ready once started
            colour_readiness(settings, "green").ready_marker.write_text(f"{os.getpid()}\n")
        answers = {
            "--property=MainPID": str(os.getpid()),
            "--property=ControlGroup": "/ai.slice/ai-service@green.service",
        }
        return subprocess.CompletedProcess(args, 0, answers.get(args[1], "") if args[0] == "show" else "", "")

    monkeypatch.setattr(swap, "systemctl", systemctl)
    swap.start_and_wait(settings, "green", tmp_path, log=lambda line: None)
    # Started at the full weight, lowered right after the start (its cgroup exists then), full again once ready.
    assert [c for c in calls if c[0] != "show"] == [("start", "ai-service@green.service")]
    assert weights[0] == "100" and str(swap.STARTING_CPU_WEIGHT) in weights  # seen by the readiness polls
    assert (cgroup / "cpu.weight").read_text().strip() == str(swap.SERVING_CPU_WEIGHT)
    assert swap.SERVING_CPU_WEIGHT == 2 * swap.STARTING_CPU_WEIGHT
    # Nothing written through systemd: no system.control drop-in for the gate to find on a hardened unit.
    assert not any(c[0] == "set-property" for c in calls)


@pytest.fixture
def session(tmp_path: Path) -> Iterator[int]:
    """A stand-in launcher in a session of its own, as swap starts one; its PID in the colour's pid file."""
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("kernel without autogroup scheduling (CONFIG_SCHED_AUTOGROUP)")
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_without_units_the_launcher_sessions_autogroup_takes_the_share(tmp_path: Path, session: int) -> None:
    settings = service(tmp_path)
    directory = settings.swap.colour_dir("green")
    directory.mkdir(parents=True)
    (directory / "launcher.pid").write_text(f"{session}\n")
    autogroup = Path(f"/proc/{session}/autogroup")
    own = Path("/proc/self/autogroup").read_text()
    swap.cpu_share(settings, "green", starting=True)
    assert autogroup.read_text().split()[-2:] == ["nice", str(swap.STARTING_AUTOGROUP_NICE)]
    assert Path("/proc/self/autogroup").read_text() == own  # only the colour's session
    swap.cpu_share(settings, "green", starting=False)
    assert autogroup.read_text().split()[-2:] == ["nice", str(swap.SERVING_AUTOGROUP_NICE)]
