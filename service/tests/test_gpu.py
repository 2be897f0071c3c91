"""GPU-only checks: NVML figures and the launcher on CUDA vLLM; skipped on hosts without a GPU."""

from __future__ import annotations

import pytest

from ironserve_service import exporter

pytestmark = pytest.mark.gpu


def test_nvml_reports_absolute_bytes_per_gpu() -> None:
    readings = exporter.read_gpus(8)
    assert readings, "NVML answered nothing on a GPU host"
    for gpu in readings:
        assert 0 < gpu.used_bytes <= gpu.total_bytes and gpu.total_bytes > 10**9
        assert 0.0 <= gpu.utilization_percent <= 100.0


@pytest.mark.skip(reason="needs the CUDA vLLM venv and real Qwen2-7B weights on the GPU host (inference role)")
def test_launcher_on_cuda_vllm_with_real_model() -> None:
    """Same flow as test_engine.py with enforce_eager off and tensor_parallel_size=2."""
