"""The lab's inputs of the inference role: sealed versions of a tiny model and the CPU engine's settings.

A lab host has no GPU, so the role installs vLLM's CPU build (files/requirements-cpu.lock) and
serves a tiny Qwen2-architecture model (service/scripts/build_tiny_model.py: random weights, real
tokenizer and config) under the production model name. Two versions, sealed like real releases
(`ironserve-service seal`), let tests swap between them. Built once into the cache with the engine
venv's torch (service/scripts/setup-engine.sh).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ironserve_service.artifacts import RELEASE_NAME, seal_model_dir

from ironserve.paths import REPO_ROOT, cache_dir

REQUIREMENTS = Path(__file__).resolve().parent / "files" / "requirements-cpu.lock"
BUILD_SCRIPT = REPO_ROOT / "service" / "scripts" / "build_tiny_model.py"
VERSIONS = {"lab-v1": datetime(2026, 1, 1, tzinfo=UTC), "lab-v2": datetime(2026, 1, 2, tzinfo=UTC)}
# vLLM's CPU backend: a 1 GiB KV cache, no core pinning (lab hosts share the machine's cores).
ENGINE_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # A value as an admin may write one: spaces, double quotes, a backslash and a percent sign (systemd specifiers),
    # which must reach the engine byte for byte (the inference lab test reads it from the engine's environment).
    "IRONSERVE_LAB_NOTE": 'CPU engine on a "simulated" GPU host, 100% lab \\ no GPU',
}
SERVICE_OVERRIDES: dict[str, dict[str, Any]] = {
    "engine": {"max_model_len": 512, "max_num_seqs": 8, "tensor_parallel_size": 1, "enforce_eager": True},
    "readiness": {"startup_timeout_s": 300, "drain_timeout_s": 20},
    # The lab's balancer (tests/lab/test_inference_deploy.py) checks /health every 0.2 s: 3 s of draining notice is
    # 15 of its checks, where a site's balancer needs the default's 10 s.
    "swap": {"ready_timeout_s": 300, "poll_interval_s": 0.2, "host_drain_notice_s": 3},
    # The release gate: no GPU, and the inference lab hosts run no container runtime.
    "release": {"require_gpu": False, "runtime_storage": None, "runtime_unit": None},
    # The load-and-chaos gate runs on every swap, in phases short enough for a test; the engine, locust and stress-ng
    # share this machine's two cores, so the P99 bound only proves the gate runs (the service's hot-swap tests prove
    # a moved P99 refuses the swap). A loaded rehearsal saw 5 and 4 requests in 5 s phases (4-5 s each, the session's
    # VM beside it): 8 s phases and 3 requests keep the gate running rather than refusing for want of samples.
    "chaos": {
        "users": 4,
        "warmup_s": 2,
        "load_s": 8,
        "settle_s": 1,
        "min_requests": 3,
        "vm_workers": 1,
        "vm_bytes": "64M",
        "max_p99_increase": 20.0,
    },
}


def engine_python() -> Path:
    venv = Path(os.environ.get("IRONSERVE_ENGINE_VENV", cache_dir() / "vllm-venv"))
    return venv / "bin" / "python"


def model_versions() -> dict[str, Path]:
    """{name: sealed directory} of the lab's model versions, built on first use."""
    root = cache_dir() / "lab" / "models"
    tiny = cache_dir() / "tiny-qwen2"
    versions = {name: root / name for name in VERSIONS}
    if all((path / RELEASE_NAME).is_file() for path in versions.values()):
        return versions
    if not (tiny / "model.safetensors").is_file():
        subprocess.run([str(engine_python()), str(BUILD_SCRIPT), str(tiny)], check=True, capture_output=True)
    for name, path in versions.items():
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(tiny, path)
        seal_model_dir(path, VERSIONS[name])
    return versions


@functools.cache
def inventory_data() -> dict[str, Any]:
    """The inference role's keys for a lab host (the index URL comes with each host's wheelhouse server)."""
    if not engine_python().exists():
        return {}  # `make setup` builds the engine venv; without it the role names the missing key
    return {
        "inference_requirements": str(REQUIREMENTS),
        "inference_model_source": str(model_versions()["lab-v1"]),
        "inference_engine_environment": ENGINE_ENVIRONMENT,
        "inference_service": SERVICE_OVERRIDES,
        # A lab host's file system is a directory or a virtio disk of this machine, not NVMe.
        "inference_model_store_nvme": False,
    }
