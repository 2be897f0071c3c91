"""The switch's breakdown: the control loop's timestamps, read back from its log line, and the step arithmetic."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hotswap_stack import SWITCH_STEPS, control_switches, percentile, switch_breakdown

from ironserve_service.control import Controller, SwitchTiming
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, ServiceSettings, SwapSettings


def test_the_control_loops_switch_line_gives_back_its_timestamps(tmp_path: Path) -> None:
    swap = SwapSettings(router_dir=tmp_path / "envoy", run_dir=tmp_path / "run")
    lines: list[str] = []
    controller = Controller(
        ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap),
        check=lambda colour: ProbeResult(True, "checked"),
        log=lines.append,
    )
    controller.values = {swap.active_key: "v2", swap.colour_key("green"): "v2"}
    received_at = round(time.time() - 0.001, 6)
    controller.apply(41, received_at)
    [switch] = control_switches("etcd unreachable (a line of another kind)\n" + "\n".join(lines)).values()
    assert list(control_switches("\n".join(lines))) == [41]
    assert switch.event_at == received_at
    assert switch.event_at <= switch.checked_at <= switch.written_at


def test_the_steps_add_up_to_the_switch_latency() -> None:
    control = SwitchTiming(event_at=100.0012, checked_at=100.0015, written_at=100.0031)
    steps = switch_breakdown(100.0, control, envoy_applied_at=100.005, served_at=100.0125)
    assert tuple(steps) == SWITCH_STEPS
    expected = {"etcd watch": 1.2, "readiness check": 0.3, "route file write": 1.6, "Envoy apply": 1.9,
                "first answer": 7.5}  # fmt: skip
    assert steps == pytest.approx(expected)
    assert sum(steps.values()) == pytest.approx(12.5)


def test_nearest_rank_percentiles() -> None:
    ten = [float(v) for v in (5, 1, 9, 3, 7, 2, 8, 4, 10, 6)]
    assert (percentile(ten, 50), percentile(ten, 99), percentile(ten, 0)) == (5.0, 10.0, 1.0)
    assert percentile([], 99) != percentile([], 99)  # NaN: nothing measured
