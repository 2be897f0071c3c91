"""Print how the PID replica scaler (service/src/ironserve_service/scaler.py) answers load changes on a simulated plant.

Usage: ~/.cache/ironserve/venv/bin/python benchmarks/scaler_plant.py
The catalog's gains (Kp 0.8, Ki 0.1, Kd 0.05, setpoint 70 %) and the default limits, in the real loop
(run_scaler) on the plant of service/tests/test_scaler.py: utilisation = min(100, load / serving replicas), the
metric a first-order lag of 3 s sampled every 5 s (the stack's scrape interval), new replicas serving `start`
seconds after the patch; replica_ready_s is set to the start plus 5 s, except in the row that says otherwise.
Simulated time, so it takes a few seconds. Figures only; no assertions.

- settle: the load change -> the last patch of the replica count.
- reach: the load change -> the count first at its final value (the catalog's reference, scale-performance-reference,
  is 2 -> 8 replicas in 3.2 s; it counts patches, not replicas serving).
- overshoot: replicas past the final count; reversals: direction changes of the count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
sys.path.insert(0, str(SERVICE / "tests"))

from ironserve_service.settings import ScalerSettings  # noqa: E402
from test_scaler import LOAD_CHANGE_S, ramp_load, response, simulate, step_load  # noqa: E402

Load = Callable[[float], float]


def overload_then(after: float, until_s: float) -> Load:
    return lambda t: 8 * 70 if t < LOAD_CHANGE_S else (57 * 70 if t < until_s else after)


# name, load, replicas at the start, seconds simulated, pods' start, replica_ready_s, when the measured change is.
SCENARIOS: list[tuple[str, Load, int, float, float, float, float]] = [
    ("step 4 -> 6", step_load(4 * 70, 6 * 70), 4, 200, 10, 15, LOAD_CHANGE_S),
    ("ramp 2 -> 16 in 300 s", ramp_load(2 * 70, 16 * 70, 300), 2, 500, 10, 15, LOAD_CHANGE_S),
    ("burst 2 -> 8", step_load(2 * 70, 8 * 70), 2, 200, 10, 15, LOAD_CHANGE_S),
    ("burst 2 -> 8", step_load(2 * 70, 8 * 70), 2, 400, 30, 35, LOAD_CHANGE_S),
    ("burst 2 -> 8", step_load(2 * 70, 8 * 70), 2, 600, 60, 65, LOAD_CHANGE_S),
    ("burst 2 -> 8, ready_s too short", step_load(2 * 70, 8 * 70), 2, 400, 30, 15, LOAD_CHANGE_S),
    ("burst over, 8 -> 2", lambda t: 8 * 70 if t < 150 else 2 * 70, 2, 350, 10, 15, 150),
    ("57 -> 16 replicas' load at 32", overload_then(16 * 70, 150), 8, 350, 10, 15, 150),
    ("16 replicas -> near zero", step_load(16 * 70, 20), 16, 200, 10, 15, LOAD_CHANGE_S),
]


def main() -> int:
    header = (
        f"{'scenario':<32}{'start s':>8}{'ready_s':>8}{'settle s':>10}{'reach s':>9}{'overshoot':>10}"
        f"{'reversals':>10}{'final':>7}{'util %':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, load, replicas, seconds, start_s, ready_s, since_s in SCENARIOS:
        settings = ScalerSettings(replica_ready_s=ready_s)
        model = simulate(load, replicas, seconds, settings, start_s=start_s)
        result = response(model, since_s)
        reach = min(at for at, _, _, after in model.patches if at >= since_s and after == result.final_replicas)
        print(
            f"{name:<32}{start_s:>8.0f}{ready_s:>8.0f}{result.settle_s:>10.1f}{reach - since_s:>9.1f}"
            f"{result.overshoot:>10}{result.reversals:>10}{result.final_replicas:>7}{result.final_utilisation:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
