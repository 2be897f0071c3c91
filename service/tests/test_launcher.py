"""Command-line builder and marker lifecycle, without an engine (the engine tests cover the real one)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from ironserve_service import health, launcher, router
from ironserve_service.settings import EngineSettings, ReadinessSettings, ServiceSettings, SloSettings


def settings(tmp_path: Path, **engine: object) -> ServiceSettings:
    return ServiceSettings(
        engine=EngineSettings(model_dir=Path("/srv/models/qwen2-7b/current"), **engine),
        readiness=ReadinessSettings(
            loading_marker=tmp_path / "model_loading",
            ready_marker=tmp_path / "model_ready",
            startup_timeout_s=1.0,
            poll_interval_s=0.05,
            drain_timeout_s=2.0,
        ),
    )


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.invariant(
    "svc-engine-vllm", "svc-max-model-len", "svc-tensor-parallel", "svc-port", "svc-no-cpu-offload",
    "svc-concurrency-control",
)  # fmt: skip
def test_command_line_from_settings(tmp_path: Path) -> None:
    command = launcher.build_command(settings(tmp_path), Path("/opt/vllm/bin/python"))
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--served-model-name") == "qwen2-7b"
    assert flag(command, "--max-model-len") == "4096"
    assert flag(command, "--tensor-parallel-size") == "2"
    assert flag(command, "--host") == "127.0.0.1" and flag(command, "--port") == "8000"
    assert flag(command, "--max-num-seqs") == "8"
    assert flag(command, "--gpu-memory-utilization") == "0.9"
    assert "--cpu-offload-gb" not in command and "--enforce-eager" not in command
    with pytest.raises(ValidationError, match="CPU offload is not allowed"):
        EngineSettings(model_dir=Path("/m"), extra_args=["--cpu-offload-gb", "4"])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--cpu-offload-gb=4"], "CPU offload is not allowed"),
        (["--cpu_offload_gb", "4"], "CPU offload is not allowed"),  # vLLM reads underscores as dashes
        (["--cpu-offload", "4"], "CPU offload is not allowed"),  # argparse takes an unambiguous prefix
        (["--kv-offloading-size=8"], "CPU offload is not allowed"),
        (["--config", "/tmp/flags.yaml"], "config file"),
        (["--port=9000"], "engine.port"),
        (["--host", "0.0.0.0"], "engine.host"),
        (["-tp", "8"], "engine.tensor_parallel_size"),
        (["--max-num-seqs 64"], "not one flag"),
    ],
)
def test_extra_args_are_read_as_vllms_command_line(args: list[str], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        EngineSettings(model_dir=Path("/m"), extra_args=args)
    assert EngineSettings(model_dir=Path("/m"), extra_args=["--enable-prefix-caching", "--swap-space", "4"])


@pytest.mark.parametrize("field", ["max_num_seqs", "port", "gpu_memory_utilization"])
def test_a_boolean_is_not_a_number(field: str) -> None:
    with pytest.raises(ValidationError, match="a boolean is not a number"):
        EngineSettings.model_validate({"model_dir": "/m", field: True})


@pytest.mark.parametrize("window", ["1 minute", "5m]", "0m", "1.5h", "5m30h", ""])
def test_slo_windows_are_prometheus_durations(window: str) -> None:
    with pytest.raises(ValidationError, match="not a Prometheus duration"):
        SloSettings(fast_window=window)
    assert SloSettings(fast_window="1h30m", slo_window="500ms").fast_window == "1h30m"


@pytest.mark.invariant("slo-p95-latency", "obs-http-metric-names")
def test_latency_buckets_have_slo_boundaries(tmp_path: Path) -> None:
    command = launcher.build_command(settings(tmp_path), Path("python"))
    buckets = json.loads(flag(command, "--custom-histogram-buckets"))
    assert 0.5 in buckets["request_latency"]  # the 003 rule: 99.9 % under 500 ms
    assert {0.4, 0.8} <= set(buckets["time_to_first_token"]) and {0.2, 0.4} <= set(buckets["inter_token_latency"])
    assert all(values == sorted(set(values)) for values in buckets.values())
    custom = launcher.latency_buckets(SloSettings(ttft_p95_s=0.35, tpot_p95_s=0.06))
    assert custom["time_to_first_token"].count(0.35) == 1 and custom["inter_token_latency"].count(0.06) == 1


@pytest.mark.invariant("pipe-cuda-graph-sizes")
def test_cuda_graph_sizes_are_batch_sizes(tmp_path: Path) -> None:
    command = launcher.build_command(settings(tmp_path, cudagraph_capture_sizes=[1, 2, 4, 8]), Path("python"))
    index = command.index("--cudagraph-capture-sizes")
    assert command[index + 1 : index + 5] == ["1", "2", "4", "8"]
    # The seed's [128, 256, 512, 1024] were input lengths; as batch sizes they exceed max_num_seqs.
    with pytest.raises(ValidationError, match="are batch sizes; 1024 exceeds max_num_seqs=8"):
        EngineSettings(model_dir=Path("/m"), cudagraph_capture_sizes=[128, 256, 512, 1024])
    with pytest.raises(ValidationError, match="no effect with enforce_eager"):
        EngineSettings(model_dir=Path("/m"), cudagraph_capture_sizes=[1], enforce_eager=True)


def test_engine_environment_is_offline() -> None:
    env = launcher.engine_environment({"PATH": "/bin"}, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["PATH"] == "/bin"


def test_the_engine_keeps_idle_connections_well_past_envoys_idle_timeout() -> None:
    """Only Envoy closes an idle upstream connection (issue 33): the engine's keep-alive, even inherited lower from
    the unit's environment, is a minute against Envoy's 4 s."""
    env = launcher.engine_environment({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "5"}, {})
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == launcher.ENGINE_KEEP_ALIVE_S == 60
    assert launcher.ENGINE_KEEP_ALIVE_S > 10 * router.UPSTREAM_IDLE_TIMEOUT_S


def fake_engine(tmp_path: Path, script: str) -> Path:
    """Stands in for the engine interpreter: a fault a real vLLM cannot be made to produce on demand."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


@pytest.mark.invariant("svc-readiness-file", "svc-probe-timeout-claim")
def test_never_ready_engine_is_stopped_without_ready_marker(tmp_path: Path) -> None:
    base = settings(tmp_path)
    config = base.model_copy(
        update={"engine": base.engine.model_copy(update={"engine_python": fake_engine(tmp_path, "exec sleep 60")})}
    )
    seen_loading = []

    def never_ready() -> health.ProbeResult:
        seen_loading.append(config.readiness.loading_marker.exists() and not config.readiness.ready_marker.exists())
        return health.ProbeResult(False, "not yet")

    code = launcher.Launcher(config, check=never_ready, log=lambda line: None).run()
    assert code != 0 and seen_loading and all(seen_loading)
    assert not config.readiness.ready_marker.exists() and not config.readiness.loading_marker.exists()


@pytest.mark.invariant("svc-readiness-file")
def test_sigterm_removes_ready_then_drains(tmp_path: Path) -> None:
    base = settings(tmp_path)
    # The fake engine exits cleanly on SIGTERM after a short drain, like vLLM finishing in-flight requests.
    engine = fake_engine(tmp_path, "trap 'sleep 0.2; exit 0' TERM; while :; do sleep 0.05; done")
    config = base.model_copy(update={"engine": base.engine.model_copy(update={"engine_python": engine})})
    observed: dict[str, bool] = {}

    def ready_then_stop() -> health.ProbeResult:
        def stop() -> None:
            observed["ready_before_stop"] = health.probe_ready(config.readiness).ok
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Timer(0.3, stop).start()
        return health.ProbeResult(True, "answers")

    code = launcher.Launcher(config, check=ready_then_stop, log=lambda line: None).run()
    assert observed == {"ready_before_stop": True}
    assert code == 0
    assert not health.probe_ready(config.readiness).ok


@pytest.mark.invariant("svc-readiness-file")
def test_probes_read_markers(tmp_path: Path) -> None:
    readiness = settings(tmp_path).readiness
    engine = EngineSettings(model_dir=Path("/m"), port=1)  # nothing listens on port 1
    assert not health.probe_ready(readiness).ok
    assert not health.probe_live(readiness, engine).ok
    launcher.write_marker(readiness.loading_marker, f"{os.getpid()}\n")
    assert health.probe_live(readiness, engine).reason.startswith("model loading")
    launcher.write_marker(readiness.ready_marker, f"{os.getpid()}\n")
    assert health.probe_ready(readiness).ok
    launcher.write_marker(readiness.ready_marker, "999999999\n")
    assert "stale" in health.probe_ready(readiness).reason
