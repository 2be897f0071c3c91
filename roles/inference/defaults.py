"""Public API of the inference role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
"""

DEFAULTS: dict[str, object] = {
    # PEP 503 index the service's Python environment is installed from: the site's mirror of PyPI and the
    # PyTorch index (py-pip-official-index), or the lab's wheelhouse. Required: there is no built-in default.
    "inference_pip_index_url": None,
    # Hash-locked requirements of that environment (pip --require-hashes, every wheel pinned), a file on the
    # machine running the deploy: vLLM, torch and the service's dependencies (py-deps, py-torch-sha256).
    "inference_requirements": None,
    # The interpreter the environment is created from: the distribution's own Python, never conda or pyenv.
    "inference_python": "/usr/bin/python3",
    # Where the environment lives on the host (vLLM, the ironserve-service package, Envoy's binary).
    "inference_venv": "/opt/ironserve/venv",
    # The model's name in etcd (/models/<name>/active) and in the OpenAI API (served-model-name).
    "inference_model_name": "qwen2-7b",
    # A sealed model version on the machine running the deploy (MANIFEST.sha256 + release.json, see
    # `ironserve-service seal`), uploaded to <models root>/<version>. Required.
    "inference_model_source": None,
    # The version to serve: its directory name on the host. None: the source's release.json version.
    "inference_model_version": None,
    # Model versions on the host; None: <security_model_dir>/<inference_model_name> (root-owned, group-readable).
    "inference_models_root": None,
    # Environment of the engine units (e.g. VLLM_CPU_KVCACHE_SPACE for the CPU engine of the lab).
    "inference_engine_environment": {},
    # Overrides of /etc/ironserve/service.yaml by section (engine, readiness, exporter, quality, slo, swap),
    # validated by ironserve-service's own settings model; see service/service.example.yaml.
    "inference_service": {},
    # Install Prometheus with the SLO rules and scrape jobs for the exporter, both colours and Envoy.
    "inference_prometheus": True,
}
