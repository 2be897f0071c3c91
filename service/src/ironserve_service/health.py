"""Readiness means "the model answers": engine probes and the file-based probes for systemd/Kubernetes."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ironserve_service.settings import EngineSettings, ReadinessSettings


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str


def http_json(url: str, timeout_s: float, payload: dict[str, Any] | None = None) -> tuple[int, Any]:
    """GET (or POST when payload is given) and decode JSON; raises OSError on transport failures."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        return error.code, None
    if not body:
        return status, None
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, None


def check_engine(engine: EngineSettings, timeout_s: float) -> ProbeResult:
    """/health is 200, /v1/models lists the served name, and a one-token completion succeeds."""
    base = engine.base_url
    try:
        status, _ = http_json(f"{base}/health", timeout_s)
        if status != 200:
            return ProbeResult(False, f"/health answered {status}")
        status, models = http_json(f"{base}/v1/models", timeout_s)
        served = [m.get("id") for m in (models or {}).get("data", [])] if status == 200 else []
        if engine.served_model_name not in served:
            return ProbeResult(False, f"/v1/models lists {served}, not {engine.served_model_name!r}")
        request = {
            "model": engine.served_model_name,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
        }
        status, completion = http_json(f"{base}/v1/chat/completions", timeout_s * 15, request)
    except OSError as error:
        return ProbeResult(False, f"engine unreachable: {error}")
    usage = (completion or {}).get("usage") or {}
    if status != 200 or usage.get("completion_tokens", 0) < 1:
        return ProbeResult(False, f"one-token completion failed (HTTP {status})")
    return ProbeResult(True, "health 200, model listed, completion answered")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marker_pid(marker: Path) -> int | None:
    try:
        return int(marker.read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def probe_ready(readiness: ReadinessSettings) -> ProbeResult:
    """Ready only when the launcher wrote the ready marker and the launcher that wrote it still runs."""
    pid = marker_pid(readiness.ready_marker)
    if pid is None:
        return ProbeResult(False, f"{readiness.ready_marker} absent: model not ready")
    if not pid_alive(pid):
        return ProbeResult(False, f"{readiness.ready_marker} is stale: launcher {pid} is gone")
    return ProbeResult(True, f"model ready (launcher {pid})")


def probe_live(readiness: ReadinessSettings, engine: EngineSettings) -> ProbeResult:
    """Alive while loading (launcher running) or while the engine answers /health."""
    pid = marker_pid(readiness.loading_marker)
    if pid is not None and pid_alive(pid):
        return ProbeResult(True, f"model loading (launcher {pid})")
    try:
        status, _ = http_json(f"{engine.base_url}/health", readiness.probe_timeout_s)
    except OSError as error:
        return ProbeResult(False, f"engine unreachable and not loading: {error}")
    return ProbeResult(status == 200, f"/health answered {status}")
