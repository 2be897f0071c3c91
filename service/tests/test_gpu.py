"""GPU-only checks: NVML figures and the launcher on CUDA vLLM; skipped on hosts without a GPU."""

from __future__ import annotations

import re
import time

import pytest
from prometheus_client import CollectorRegistry

from ironserve_service import exporter, gpu_health
from ironserve_service.settings import GpuHealthSettings

pytestmark = pytest.mark.gpu


def test_nvml_reports_absolute_bytes_per_gpu() -> None:
    readings = exporter.read_gpus(8)
    assert readings, "NVML answered nothing on a GPU host"
    for gpu in readings:
        assert 0 < gpu.used_bytes <= gpu.total_bytes and gpu.total_bytes > 10**9
        assert 0.0 <= gpu.utilization_percent <= 100.0


def test_nvml_health_fields_on_a_real_gpu() -> None:
    """Every health field through the real pynvml, in the ranges the simulated tests' captures show."""
    snapshot = gpu_health.read_health(None, 8)
    assert snapshot.available and snapshot.visible_count and len(snapshot.gpus) == min(snapshot.visible_count, 8)
    for gpu in snapshot.gpus:
        assert not gpu.lost and gpu.identity is not None, f"{gpu.device} unreadable"
        who = gpu.identity
        assert who.uuid.startswith("GPU-") and who.serial != gpu_health.UNKNOWN and who.name != gpu_health.UNKNOWN
        assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]", who.pci_bus_id, re.I), who.pci_bus_id
        if gpu.ecc is not None:  # ECC on: the four totals, never negative
            assert len(gpu.ecc) == 4 and min(gpu.ecc.values()) >= 0
        # A datacenter GPU answers one of the two memory repair mechanisms: row remapping (Ampere and newer) or
        # dynamic page retirement (before).
        assert gpu.remapped_rows is not None or gpu.retired_pages is not None
        if gpu.remapped_rows is not None:
            assert gpu.remapped_rows.correctable >= 0 and gpu.remapped_rows.uncorrectable >= 0
        assert gpu.throttle_mask is not None and gpu.throttle_mask & ~0x7FF == 0  # NVML's documented bits only
        assert gpu.power_mw is not None and gpu.power_limit_mw is not None and gpu.power_default_limit_mw
        assert 0 < gpu.power_mw < 2_000_000 and 0 < gpu.power_limit_mw <= 2_000_000  # milliwatts: below 2 kW
        assert gpu.temperature_c is not None and 0 < gpu.temperature_c < 110
        link = gpu.pcie
        assert link is not None
        generation, max_generation = link.current_generation, link.max_generation
        width, max_width = link.current_width, link.max_width
        assert generation is not None and max_generation is not None and width is not None and max_width is not None
        assert 1 <= generation <= max_generation <= 6  # an idle GPU may sit below its max: it saves power
        assert width in gpu_health.PCIE_WIDTHS and max_width in gpu_health.PCIE_WIDTHS and width <= max_width
    registry = CollectorRegistry(auto_describe=False)
    registry.register(gpu_health.GpuHealthCollector(GpuHealthSettings(expected_gpus=0), 8))
    for gpu in snapshot.gpus:
        assert registry.get_sample_value("gpu_lost", {"device": gpu.device}) == 0.0


def test_xid_watcher_registers_and_stops_on_a_real_gpu() -> None:
    watcher = gpu_health.XidWatcher(8, wait_ms=100)
    assert watcher.start()
    supported = watcher.snapshot().supported
    assert supported and all(supported.values()), f"XID events not supported: {supported}"
    started = time.monotonic()
    watcher.stop()
    assert not watcher.running and time.monotonic() - started < 2.0


@pytest.mark.skip(reason="needs the CUDA vLLM venv and real Qwen2-7B weights on the GPU host (inference role)")
def test_launcher_on_cuda_vllm_with_real_model() -> None:
    """Same flow as test_engine.py with enforce_eager off and tensor_parallel_size=2."""
