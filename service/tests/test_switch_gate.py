"""The control loop's gate before a switch: swap's proof from the same etcd transaction stands in for the /health
request, never for the ready marker of a live launcher; a colour that is not ready is refused and keeps no traffic."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hotswap_stack import free_port

from ironserve_service import router, swap
from ironserve_service.control import PROOF_TRUSTED_S, Controller, ReadinessProof, proof_key
from ironserve_service.settings import EngineSettings, ServiceSettings, SwapSettings

# A launcher that is alive for the whole test: this process.
PID = os.getpid()


def service(tmp_path: Path) -> ServiceSettings:
    swap_settings = SwapSettings(
        router_dir=tmp_path / "envoy", run_dir=tmp_path / "run", blue_port=free_port(), green_port=free_port()
    )
    return ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=swap_settings)


def mark_ready(settings: ServiceSettings, launcher_pid: int) -> None:
    directory = settings.swap.colour_dir("green")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_ready").write_text(f"{launcher_pid}\n")


def switch_to_green(settings: ServiceSettings, proof: str | None) -> tuple[str | None, list[str]]:
    """The real Controller.apply on etcd values asking for green/v2 (blue/v1 served); the colour routed after."""
    swap_settings = settings.swap
    router.write_atomic(swap_settings.router_dir / router.RDS_FILE, router.routes(swap_settings, "blue", "v1", 3))
    lines: list[str] = []
    controller = Controller(settings, log=lines.append)
    controller.values = {swap_settings.active_key: "v2", swap_settings.colour_key("green"): "v2"}
    if proof is not None:
        controller.values[proof_key(swap_settings, "green")] = proof
    controller.apply(4)
    return router.current_route(swap_settings)[1], lines


def fresh(version: str = "v2", launcher_pid: int | None = None, age_s: float = 0.005) -> str:
    return ReadinessProof(version, launcher_pid or PID, time.time() - age_s).to_text()


@pytest.fixture
def health_200(tmp_path: Path) -> Iterator[ServiceSettings]:
    """Settings whose green engine is a stand-in answering /health 200."""
    settings = service(tmp_path)

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", settings.swap.green_port), Healthy)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield settings
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.invariant("hot-swap-health-gate")
def test_a_fresh_proof_for_the_ready_launcher_switches_without_asking_the_engine(tmp_path: Path) -> None:
    """Nothing listens on green's port: the switch happened on the ready marker and swap's proof alone."""
    settings = service(tmp_path)
    mark_ready(settings, PID)
    routed, lines = switch_to_green(settings, fresh())
    assert routed == "green", lines
    assert "checked by swap" in lines[-1] and "event_at=" in lines[-1]


@pytest.mark.invariant("hot-swap-health-gate")
def test_a_fresh_proof_never_replaces_the_ready_marker(tmp_path: Path) -> None:
    settings = service(tmp_path)
    routed, lines = switch_to_green(settings, fresh())
    assert routed == "blue" and "refusing switch to green/v2" in lines[-1] and "absent" in lines[-1], lines
    # A marker left by a launcher that is gone.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mark_ready(settings, int(gone.stdout))
    routed, lines = switch_to_green(settings, fresh(launcher_pid=int(gone.stdout)))
    assert routed == "blue" and "stale" in lines[-1], lines


@pytest.mark.invariant("hot-swap-health-gate")
@pytest.mark.parametrize(
    "proof",
    [
        pytest.param(None, id="no proof"),
        pytest.param("not json", id="malformed"),
        pytest.param(fresh(version="v1"), id="another version"),
        pytest.param(fresh(launcher_pid=PID + 1), id="another launcher"),
        pytest.param(fresh(age_s=PROOF_TRUSTED_S + 1), id="too old"),
        pytest.param(fresh(age_s=-60), id="from the future"),
    ],
)
def test_without_a_proof_that_vouches_for_the_launcher_the_engine_is_asked(
    tmp_path: Path, health_200: ServiceSettings, proof: str | None
) -> None:
    """Refused while the engine does not answer; switched once it answers /health 200."""
    settings = service(tmp_path / "silent")
    mark_ready(settings, PID)
    routed, lines = switch_to_green(settings, proof)
    assert routed == "blue" and "refusing switch to green/v2: engine unreachable" in lines[-1], lines
    mark_ready(health_200, PID)
    routed, lines = switch_to_green(health_200, proof)
    assert routed == "green" and "/health answered 200" in lines[-1], lines


def test_swap_proves_readiness_right_before_its_write_or_refuses(tmp_path: Path) -> None:
    """The proof is the full check (a completion); an engine that does not answer gives none: gate readiness."""
    settings = service(tmp_path)
    mark_ready(settings, PID)
    with pytest.raises(swap.GateFailed) as refused:
        swap.prove_ready(settings, "green", "v2")
    assert refused.value.gate == "readiness" and "just before the etcd write" in refused.value.reason
