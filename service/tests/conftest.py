"""Shared paths and skips: engine tests need the CPU vLLM venv, GPU tests a real NVIDIA GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SERVICE_DIR = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("IRONSERVE_CACHE", Path.home() / ".cache" / "ironserve"))
ENGINE_VENV = Path(os.environ.get("IRONSERVE_ENGINE_VENV", CACHE / "vllm-venv"))
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
TINY_MODEL_DIR = Path(os.environ.get("IRONSERVE_TINY_MODEL", CACHE / "tiny-qwen2"))


def engine_missing_reason() -> str | None:
    if not ENGINE_PYTHON.exists():
        return f"CPU vLLM engine venv absent at {ENGINE_VENV}: run service/scripts/setup-engine.sh"
    return None


def gpu_missing_reason() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this host (nvidia-smi absent)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    engine_reason, gpu_reason = engine_missing_reason(), gpu_missing_reason()
    for item in items:
        if engine_reason and item.get_closest_marker("engine"):
            item.add_marker(pytest.mark.skip(reason=engine_reason))
        if gpu_reason and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=gpu_reason))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Builds the tiny Qwen2 model once (idempotent, a few seconds) with the engine venv's torch."""
    script = SERVICE_DIR / "scripts" / "build_tiny_model.py"
    subprocess.run([str(ENGINE_PYTHON), str(script), str(TINY_MODEL_DIR)], check=True, capture_output=True)
    return TINY_MODEL_DIR


@pytest.fixture
def service_python() -> str:
    return sys.executable
