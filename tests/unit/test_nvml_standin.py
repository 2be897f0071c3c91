"""The lab's stand-in libnvidia-ml.so.1 seen through the service's own NVML reader (gpu_health, exporter.read_gpus).

The library is built into tmp_path and loaded by pynvml in a child python (pynvml loads "libnvidia-ml.so.1" by name,
so LD_LIBRARY_PATH picks it), which keeps one NVML session and an XidWatcher running while the test rewrites the
state file, as a lab host's exporter would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ironserve_lab import standin_nvidia_smi, standin_nvml
from ironserve_lab.hardware import DEFAULT_PROFILE, read_hardware_profile
from ironserve_lab.standin_nvml import NvmlState, two_a10s, write_state

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc absent: the stand-in NVML is C")

# The child: one command a line on stdin, one JSON answer a line on stdout.
DRIVER = r"""
import json, sys, time
from dataclasses import asdict
import pynvml
from ironserve_service import exporter, gpu_health

watcher = gpu_health.XidWatcher(max_gpus=8, wait_ms=200)
print(json.dumps({"started": watcher.start(), "running": watcher.running}), flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "health":
        snapshot = asdict(gpu_health.read_health(None, 8))
        for gpu in snapshot["gpus"]:  # (error_type, counter) keys as "error_type/counter"
            gpu["ecc"] = None if gpu["ecc"] is None else {"/".join(k): v for k, v in gpu["ecc"].items()}
        print(json.dumps(snapshot), flush=True)
    elif command[0] == "gpus":
        readings = exporter.read_gpus(8)
        print(json.dumps(None if readings is None else [asdict(r) for r in readings]), flush=True)
    elif command[0] == "xids":  # "xids COUNT SECONDS": waits up to SECONDS for COUNT events in all
        deadline = time.monotonic() + float(command[2])
        while sum(watcher.snapshot().counts.values()) < int(command[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        state = watcher.snapshot()
        print(json.dumps({"counts": {f"{k[0]}:{k[1]}": v for k, v in state.counts.items()},
                          "supported": state.supported}), flush=True)
    elif command[0] == "functions":  # what a function the library lacks looks like to pynvml
        try:
            pynvml.nvmlDeviceGetFanSpeed(pynvml.nvmlDeviceGetHandleByIndex(0))
            print(json.dumps("answered"), flush=True)
        except pynvml.NVMLError as error:
            print(json.dumps(error.value), flush=True)
watcher.stop()
"""


class Host:
    """A lab host's view: the state file and a running NVML client."""

    def __init__(self, state_file: Path, child: subprocess.Popen[str]) -> None:
        self.state_file = state_file
        self.child = child

    def ask(self, command: str) -> Any:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(command + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        assert line, f"NVML client died: {self.child.stderr.read() if self.child.stderr else ''}"
        return json.loads(line)

    def set(self, state: NvmlState) -> None:
        write_state(state, self.state_file)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    library = standin_nvml.build(tmp_path / "lib")
    state_file = tmp_path / "nvml-state"
    write_state(two_a10s(), state_file)
    env = dict(os.environ, LD_LIBRARY_PATH=str(library.parent), **{standin_nvml.STATE_ENV: str(state_file)})
    child = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        started = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        assert started == {"started": True, "running": True}
        yield Host(state_file, child)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=10)


HEALTHY_A10 = {
    "lost": False,
    "ecc": None,  # compared separately: JSON has no tuple keys
    "retired_pages": None,  # Ampere: NOT_SUPPORTED, nvidia-smi's N/A
    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
    "power_limit_mw": 150000,
    "power_default_limit_mw": 150000,
    "temperature_c": 33,
    "pcie": {"current_generation": 1, "max_generation": 4, "current_width": 16, "max_width": 16},
}


def healthy(gpu: dict[str, Any]) -> bool:
    return all(gpu[key] == value for key, value in HEALTHY_A10.items() if key != "ecc")


def test_simulated_two_a10s_read_as_the_real_captures(host: Host) -> None:
    snapshot = host.ask("health")
    assert snapshot["available"] and snapshot["visible_count"] == 2
    first, second = snapshot["gpus"]
    # a10-nvidia-smi-q.txt and a10-second-nvidia-smi-q.txt, field by field.
    assert first["identity"] == {
        "index": 0,
        "uuid": "GPU-14705cc6-2e5b-ae28-e00a-0f87622e4299",
        "serial": "1325221009692",
        "name": "NVIDIA A10",
        "pci_bus_id": "00000000:08:00.0",
    }
    assert second["identity"]["uuid"] == "GPU-51ae0086-e1ac-4a20-f062-9caa44e4df6d"
    assert second["identity"]["pci_bus_id"] == "00000000:06:00.0"
    assert healthy(first) and healthy(second)
    assert (first["power_mw"], first["throttle_mask"]) == (15650, 0x4)  # SW Power Cap
    assert (second["power_mw"], second["throttle_mask"]) == (21300, 0x1)  # Idle
    assert first["ecc"] is not None and sorted(first["ecc"].values()) == [0, 0, 0, 0]
    assert host.ask("xids 0 0")["supported"] == {"0": True, "1": True}
    # The exporter's own reader: memory and processes.
    gpus = host.ask("gpus")
    assert [g["total_bytes"] for g in gpus] == [23028 * 2**20] * 2
    assert gpus[0]["used_bytes"] == 0 and gpus[0]["process_bytes"] == {}
    assert host.ask("functions") == 13  # NVML_ERROR_FUNCTION_NOT_FOUND: a symbol the library lacks


def test_simulated_sick_gpus_seen_on_the_next_read_and_healthy_again(host: Host) -> None:
    state = two_a10s()
    # GPU 0: an uncorrectable volatile ECC error; GPU 1: off the bus, with the XID 79 the kernel logs for it.
    sick = state.with_gpu(0, ecc_volatile_uncorrected=1, ecc_aggregate_uncorrected=1).with_gpu(1, lost=1)
    sick = sick.with_xid(1, 79)
    host.set(sick)
    snapshot = host.ask("health")
    first, second = snapshot["gpus"]
    assert snapshot["visible_count"] == 2
    assert first["ecc"] == {
        "corrected/volatile": 0,
        "corrected/aggregate": 0,
        "uncorrected/volatile": 1,
        "uncorrected/aggregate": 1,
    }
    assert healthy(first)  # the rest of GPU 0 unchanged
    assert second["lost"] is True and second["identity"] is None
    assert host.ask("xids 1 5")["counts"] == {"1:79": 1}
    assert [gpu["index"] for gpu in host.ask("gpus")] == [0]  # read_gpus skips the lost GPU, reads the other
    # Consume-once: the event is not delivered again on the next waits.
    assert host.ask("xids 2 1")["counts"] == {"1:79": 1}

    host.set(state.with_xid(1, 79))  # back to healthy; the event list keeps its IDs
    first, second = host.ask("health")["gpus"]
    assert healthy(first) and healthy(second)
    assert sorted(first["ecc"].values()) == [0, 0, 0, 0]
    assert host.ask("xids 2 1")["counts"] == {"1:79": 1}
    assert len(host.ask("gpus")) == 2


def test_simulated_state_file_round_trips(tmp_path: Path) -> None:
    state = two_a10s().with_gpu(0, processes="4242:1048576").with_xid(0, 48)
    assert standin_nvml.read_state(write_state(state, tmp_path / "state")) == state


def test_simulated_no_state_file_is_a_driver_not_loaded(tmp_path: Path) -> None:
    """Without the state a GPU host's edge writes, NVML answers as it does on a host whose kernel module is not
    loaded: every lab host with the mirror's driver package and no GPU plugged stays without NVML."""
    library = standin_nvml.build(tmp_path / "lib")
    env = dict(os.environ, LD_LIBRARY_PATH=str(library.parent), **{standin_nvml.STATE_ENV: str(tmp_path / "none")})
    code = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print(e.value)"
    answer = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert answer.stdout.strip() == "9"  # NVML_ERROR_DRIVER_NOT_LOADED


def test_simulated_profile_gpus_as_the_stand_in_nvidia_smi_prints_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = read_hardware_profile(DEFAULT_PROFILE).model_dump()
    state = standin_nvml.from_profile(profile["gpus"])
    hardware = tmp_path / "hardware.json"
    hardware.write_text(json.dumps(profile))
    monkeypatch.setattr(standin_nvidia_smi, "HARDWARE_JSON", str(hardware))
    fields = "uuid,serial,pci.bus_id,pcie.link.width.current,pcie.link.width.max,pcie.link.gen.max,power.limit"
    assert standin_nvidia_smi.main([f"--query-gpu={fields}", "--format=csv,noheader"]) == 0
    rows = [[value.strip() for value in line.split(",")] for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        [gpu.uuid, gpu.serial, gpu.pci_bus_id, str(gpu.pcie_width), str(gpu.pcie_width_max), str(gpu.pcie_gen_max),
         f"{gpu.power_limit_mw / 1000:.2f} W"]
        for gpu in state.gpus
    ]  # fmt: skip
    assert [gpu.pcie_width for gpu in state.gpus] == [16, 16, 8, 8]  # slots 3-4 train at x8 on the R740
