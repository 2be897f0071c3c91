"""The configuration model refuses bad inventory with the host, the key and the accepted values."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from ironserve_service.artifacts import seal_model_dir
from pydantic import Field, field_validator

from ironserve.config import (
    ConfigError,
    Registry,
    Role,
    RoleSettings,
    StackBase,
    accepted_keys,
    local_path_keys,
    pyinfra_keys,
    role_keys,
    stack_keys,
    validate_host,
)
from ironserve.validators import BASE_URL, SHA256
from roles import REGISTRY, stack_config


def test_defaults_build_the_primary_profile() -> None:
    config = stack_config("h1", {})
    assert config.profile.name == "r740-a10"
    assert config.lock.driver == "525.85.12"
    assert config.host_tuning.sysctls["net.ipv4.ip_local_port_range"] == "32768\t60999"
    assert config.reboot_policy == "defer"


def test_inventory_overrides_role_defaults() -> None:
    config = stack_config(
        "h1",
        {
            "ironserve_reboot_policy": "auto",
            "host_tuning_allow_sysctl_keys": ["net.core.somaxconn"],
            "host_tuning_sysctls": {"net.core.somaxconn": 4096},
        },
    )
    assert config.reboot_policy == "auto"
    assert config.host_tuning.sysctls == {"net.core.somaxconn": "4096"}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"ironserve_profile": "r750-h100"},
            "host h1: ironserve_profile: unknown profile 'r750-h100' (accepted: a100-cuda117, r740-a10)",
        ),
        (
            {"ironserve_reboot_policy": "sometimes"},
            "ironserve_reboot_policy: Input should be 'auto', 'defer' or 'never'",
        ),
        (
            {"host_tuning_sysctls": {"net.core.rmem_max": "lots"}},
            "net.core.rmem_max: expected a non-negative integer from 4608 to 2147483647",
        ),
        (
            {"host_tuning_sysctls": {"net.core.rmem_max": -1}},
            "net.core.rmem_max: expected a non-negative integer from 4608 to 2147483647 (ASCII digits, no leading "
            "zero), got -1",
        ),
        ({"host_tuning_sysctls": {"net.core.rmem_max": True}}, "a boolean is not a sysctl value"),
        ({"host_tuning_sysctls": {"net.ipv4.ip_local_port_range": "60999 32768"}}, "1024 <= LOW < HIGH <= 65535"),
        ({"ironserve_reboot_timeout_s": -5}, "ironserve_reboot_timeout_s: Input should be greater than 0"),
        ({"host_tuning_kernel_args": ["bad arg;rm"]}, "host_tuning_kernel_args[0]"),
        ({"host_tuning_sysctl_file": "/tmp/x.conf"}, "host_tuning_sysctl_file"),
        ({"host_tuning_unknown_key": 1}, "host_tuning_unknown_key: unknown key (got ***) (accepted: host_tuning_"),
        ({"host_tuning_unknown": 1}, "host_tuning_unknown: unknown key (got 1) (accepted: host_tuning_"),
        ({"ironserve_lock": {"driver": "525.x"}}, "ironserve_lock['driver']: malformed version '525.x'"),
    ],
)
def test_bad_inventory_names_host_field_and_accepted_values(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        stack_config("h1", data)
    assert expected in str(error.value)
    assert str(error.value).startswith("host h1: ")


@pytest.mark.invariant("cudnn-version", "cuda-no-12x")
def test_lock_override_with_cudnn_for_cuda12_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rule cudnn-matches-cuda failed: cudnn 8\.9\.7 is built for CUDA 12\.2"):
        stack_config("h1", {"ironserve_lock": {"cudnn": {"version": "8.9.7", "cuda": "12.2"}}})


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        stack_config("h1", {"ironserve_reboot_policy": "x", "ironserve_reboot_timeout_s": 0})
    assert len(str(error.value).splitlines()) == 2


# --- every mistake is a message (issue 12, item 5) ---------------------------------------------------------
# One mistake per row: the refusal, the words the admin needs, and what must never be in the message.
MESSAGE_RULES = [
    # What was given is shown visibly: control characters and look-alike (non-ASCII) letters escaped.
    ({"security_memory_max": "24G\r\nx"}, ["security_memory_max: ", "'24G\\r\\nx'"], ["\r", "\n"]),
    ({"ironserve_profile": "r740-\u0430" + "10"}, ["ironserve_profile: unknown profile 'r740-\\u043010'"], ["\u0430"]),
    (
        {"ironserve_profile\r": "r740-a10"},
        ["'ironserve_profile\\r': unknown key", "did you mean ironserve_profile?"],
        [],
    ),
    ({"nvidia_repo_key": "key\x00.gpg"}, ["nvidia_repo_key: contains a NUL character", "'key\\x00.gpg'"], ["\x00"]),
    # Long values are cut.
    ({"security_memory_max": "9" * 500}, ["security_memory_max: ", "(got '" + "9" * 76 + "...)"], ["9" * 400]),
    # Secrets are never echoed: URL userinfo redacted, the whole value of a secret-named key, nested too.
    (
        {"bios_redfish_address": "https://root:calvin@idrac-01"},
        ["bios_redfish_address: ", "https://***@idrac-01"],
        ["calvin"],
    ),
    (
        {"nvida_repo_url": "https://admin:s3cr3t@mirror/cuda"},
        ["https://***@mirror/cuda", "did you mean nvidia_repo_url"],
        ["s3cr3t"],
    ),
    ({"bios_credentials_file": "root:calvin"}, ["bios_credentials_file: ", "***"], ["calvin"]),
    ({"redfish_password": "calvin"}, ["redfish_password: unknown key (got ***)"], ["calvin"]),
    (
        {"site_notes": {"password": "hunter22", "url": "https://u:hunter22@h/x"}},
        ["site_notes: unknown key"],
        ["hunter22"],
    ),
    # Unknown keys, with or without a role's prefix, are refused with the closest accepted keys.
    ({"ironserve_profle": "r740-a10"}, ["ironserve_profle: unknown key", "did you mean ironserve_profile?"], []),
    ({"profile": "a100-cuda117"}, ["profile: unknown key", "did you mean ironserve_profile?"], []),
    ({"ssh_usr": "root"}, ["ssh_usr: unknown key", "did you mean ssh_user?"], []),
    ({"sudo": True}, ["sudo: unknown key", "did you mean _sudo?"], []),
    ({"host_tuning_sysctl": {}}, ["host_tuning_sysctl: unknown key", "did you mean host_tuning_sysctls?"], []),
    ({"inference_modl_source": "x"}, ["did you mean inference_model_source", "roles/inference/README.md"], []),
    ({"rack": "A3"}, ["rack: unknown key (got 'A3'); accepted: ironserve_* (README.md)", "pyinfra's host keys"], []),
    ({"ironserve_lock": {"cudaa": "11.8.0"}}, ["ironserve_lock['cudaa']: unknown key", "did you mean cuda?"], []),
    (
        {"ironserve_lock": {"cudnn": {"versoin": "8"}}},
        ["ironserve_lock['cudnn']['versoin']: unknown key", "version"],
        [],
    ),
    ({"ironserve_roles": "nvida,security"}, ["unknown role 'nvida'; did you mean nvidia?", "accepted: bios,"], []),
    ({"ironserve_profile": "r740-a1O"}, ["unknown profile 'r740-a1O'", "did you mean r740-a10?"], []),
    # Inputs that used to escape as Python exceptions.
    (
        {"ironserve_lock": {"cuda": "11"}},
        ["ironserve_lock['cuda']: expected a CUDA version major.minor", "(got '11')"],
        [],
    ),
    ({1: "x"}, ["1: an inventory key is text such as ironserve_profile (got the int 1)"], []),
    ({"ironserve_profile": ["r740-a10"]}, ["ironserve_profile: unknown profile ['r740-a10'] (accepted: "], []),
    ({"ironserve_profile": {"name": "r740-a10"}}, ["ironserve_profile: unknown profile {'name': 'r740-a10'}"], []),
    (
        {"ironserve_lock": ["driver", "525.85.12"]},
        ["ironserve_lock: expected a mapping of lock component to value"],
        [],
    ),
    ({"ironserve_lock": "cuda=11.8"}, ["ironserve_lock: expected a mapping", "(got 'cuda=11.8')"], []),
    ({"ironserve_roles": [["nvidia"]]}, ["ironserve_roles[0]: a role is named by text (got ['nvidia'])"], []),
    ({"ironserve_roles": {"nvidia": True}}, ["ironserve_roles: expected a non-empty list of roles"], []),
    ({"inference_requirements": "x" * 300}, ["inference_requirements: "], ["x" * 100 + "'"]),
    ({"host_tuning_sysctls": ["net.core.rmem_max"]}, ["host_tuning_sysctls: "], []),
]


@pytest.mark.parametrize(("data", "expected", "never"), MESSAGE_RULES, ids=[repr(r[0])[:40] for r in MESSAGE_RULES])
def test_every_mistake_is_a_message(data: dict[object, object], expected: list[str], never: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        stack_config("h1", data)
    message = str(error.value)
    for line in message.splitlines():
        assert line.startswith("host h1: ") and len(line) < 800, line
    for words in expected:
        assert words in message
    for words in never:
        assert words not in message


# --- the inventory keys are the public API (issue 32, item 6) ----------------------------------------------
# Every key each role accepts, written out as the settings models declared them one alias at a time before
# the aliases came from one prefix per role: how a model derives its keys may change, the keys may not.
PINNED_ROLE_KEYS = {
    "bios": """
        bios_apply_timeout_s bios_ca_file bios_credentials_file bios_mode bios_reboot_policy bios_redfish_address
        bios_tls_fingerprint
    """,
    "preflight": """
        preflight_overrides preflight_report_dir
    """,
    "nvidia": """
        nvidia_allow_plain_http nvidia_container_toolkit nvidia_cuda_home nvidia_cuda_samples_sha256
        nvidia_cuda_samples_url nvidia_dkms
        nvidia_driver_method nvidia_kernel_headers nvidia_persistenced nvidia_pin_priority nvidia_rebuild_initramfs
        nvidia_repo_auth_file nvidia_repo_key nvidia_repo_url nvidia_runfile_base_url nvidia_runfile_sha256
        nvidia_shim_validation_disabled
    """,
    "host_tuning": """
        host_tuning_allow_kernel_args host_tuning_allow_sysctl_keys host_tuning_kernel_args host_tuning_ntp_servers
        host_tuning_sysctl_file host_tuning_sysctls
    """,
    "security": """
        security_capabilities security_cpu_weight security_device_allow security_gid security_group
        security_kubelet_seccomp_dir security_log_dir security_memory_max security_model_dir security_service_units
        security_shell security_slice security_state_dir security_uid security_user
    """,
    "container_runtime": """
        container_runtime_allow_plain_http container_runtime_allow_sysctl_keys container_runtime_cni_bin_dir
        container_runtime_cni_conf_dir
        container_runtime_default_runtime container_runtime_devmapper_base_image_size
        container_runtime_devmapper_pool_name container_runtime_devmapper_root_path container_runtime_kernel_modules
        container_runtime_nvidia_binary container_runtime_packages container_runtime_registry_mirrors
        container_runtime_sandbox_image container_runtime_snapshotter container_runtime_swap_off
        container_runtime_sysctls
    """,
    "kubernetes": """
        kubernetes_advertise_address kubernetes_allow_insecure kubernetes_allow_local_address
        kubernetes_allow_plain_http kubernetes_api_server_port kubernetes_cluster kubernetes_cluster_name
        kubernetes_cni_version kubernetes_control_plane_endpoint kubernetes_cri_tools_version kubernetes_dns_domain
        kubernetes_drain_timeout_s kubernetes_image_repository kubernetes_kube_proxy kubernetes_kubelet
        kubernetes_node_name
        kubernetes_package_revision kubernetes_pod_subnet kubernetes_repo_key kubernetes_repo_url kubernetes_role
        kubernetes_service_subnet kubernetes_version
    """,
    "cluster_addons": """
        cluster_addons_acme_email cluster_addons_acme_server cluster_addons_acme_staging
        cluster_addons_allow_plain_http cluster_addons_cert_manager_chart_repo
        cluster_addons_cert_manager_version cluster_addons_cilium_chart_repo
        cluster_addons_cilium_native_routing_cidr cluster_addons_cilium_pod_cidr_mask_size
        cluster_addons_cilium_routing_mode cluster_addons_cilium_tunnel_protocol cluster_addons_cilium_version
        cluster_addons_cloudflare_api_token cluster_addons_cloudflare_token_env cluster_addons_coredns_forward
        cluster_addons_device_plugin_image cluster_addons_device_plugin_version cluster_addons_dns_zones
        cluster_addons_envoy_gateway_chart_repo cluster_addons_envoy_gateway_version cluster_addons_grpc_web_backend
        cluster_addons_helm_base_url cluster_addons_helm_sha256 cluster_addons_helm_version
        cluster_addons_linkerd_chart_repo cluster_addons_linkerd_chart_version cluster_addons_linkerd_trust_anchor
        cluster_addons_stream_idle_timeout_s cluster_addons_tls_dns_names
    """,
    "monitoring": """
        monitoring_alertmanager monitoring_alertmanager_urls monitoring_alertmanager_port
        monitoring_node_exporter_port monitoring_watch_hosts monitoring_webhook_urls monitoring_allow_plain_http
        monitoring_email_to monitoring_email_from monitoring_smtp_smarthost monitoring_smtp_username
        monitoring_smtp_password_env monitoring_pagerduty monitoring_pagerduty_routing_key_env monitoring_group_by
        monitoring_group_wait monitoring_group_interval monitoring_repeat_interval monitoring_grafana
        monitoring_disk_free_min_ratio
    """,
    "inference": """
        inference_allow_plain_http inference_engine_environment inference_listen_address inference_mode
        inference_model_name
        inference_model_source inference_model_store_headroom inference_model_store_mount inference_model_store_nvme
        inference_model_version inference_models_root inference_pip_index_url inference_prometheus inference_python
        inference_requirements inference_service inference_venv
    """,
}
PINNED_STACK_KEYS = """
    ironserve_clear_immutable ironserve_lock ironserve_os ironserve_profile ironserve_reboot_policy
    ironserve_reboot_timeout_s ironserve_roles
"""
PINNED_LOCAL_PATH_KEYS = """
    bios_ca_file bios_credentials_file cluster_addons_linkerd_trust_anchor inference_model_source
    inference_requirements kubernetes_repo_key nvidia_repo_auth_file nvidia_repo_key preflight_report_dir
"""


def test_every_inventory_key_stays_as_it_was() -> None:
    assert {role.name: sorted(role_keys(role)) for role in REGISTRY.roles} == {
        name: sorted(keys.split()) for name, keys in PINNED_ROLE_KEYS.items()
    }
    assert sorted(stack_keys(REGISTRY)) == sorted(PINNED_STACK_KEYS.split())
    pinned = {key for keys in PINNED_ROLE_KEYS.values() for key in keys.split()} | set(PINNED_STACK_KEYS.split())
    assert accepted_keys(REGISTRY) - pyinfra_keys() == pinned
    assert sorted(local_path_keys(REGISTRY)) == sorted(PINNED_LOCAL_PATH_KEYS.split())
    for role in REGISTRY.roles:  # each key is read into the field it names, and written back under it
        for name, field in role.settings.model_fields.items():
            assert field.validation_alias == field.serialization_alias == f"{role.name}_{name}", name


def _keys_ending(*suffixes: str) -> list[str]:
    return sorted(key for role in REGISTRY.roles for key in role_keys(role) if key.endswith(suffixes))


@pytest.mark.parametrize("key", _keys_ending("_sha256"))
def test_every_sha256_key_takes_the_shared_rule(key: str) -> None:
    assert stack_config("h1", {key: "0123456789abcdef" * 4}) is not None
    with pytest.raises(ConfigError) as error:
        stack_config("h1", {key: "0123456789ABCDEF" * 4})
    assert f"host h1: {key}: String should match pattern '{SHA256}'" in str(error.value)


@pytest.mark.parametrize("key", _keys_ending("_base_url", "_repo_url"))
def test_every_base_url_key_takes_the_shared_rule(key: str) -> None:
    assert stack_config("h1", {key: "file:///srv/mirror"}) is not None
    with pytest.raises(ConfigError) as error:
        stack_config("h1", {key: "https://mirror.example/"})
    assert f"host h1: {key}: String should match pattern '{BASE_URL}'" in str(error.value)


class DemoSettings(RoleSettings):
    value: str = Field("ok", alias="demo_value")

    @field_validator("value")
    @classmethod
    def _not_a_value_error(cls, value: str) -> str:
        if value == "keyerror":
            raise KeyError("lock")
        if value == "typeerror":
            raise TypeError("unhashable type: 'dict'")
        return value


class DemoStack(StackBase):
    demo: DemoSettings


def _demo_check(config: DemoStack) -> None:
    if config.demo.value == "hook":
        raise RuntimeError("the hook itself broke")


DEMO = Registry(stack=DemoStack, roles=(Role("demo", DemoSettings, lambda **_: None, _demo_check),))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("keyerror", "host h1: demo_value: cannot be checked: KeyError: 'lock' (got 'keyerror')"),
        ("typeerror", "host h1: demo_value: cannot be checked: TypeError: unhashable type: 'dict' (got 'typeerror')"),
        ("hook", "host h1: demo: cannot be checked: RuntimeError: the hook itself broke"),
    ],
)
def test_a_validator_raising_anything_is_still_a_message_naming_the_key(value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_host("h1", {"demo_value": value}, DEMO)
    assert str(error.value) == expected


@pytest.fixture
def site_data(tmp_path: Path) -> dict[str, object]:
    """A host's data that validates for every role, with its site files."""
    (tmp_path / "key.gpg").write_bytes(b"\x99")
    (tmp_path / "requirements.lock").write_text("torch==2.1.2+cu118 --hash=sha256:" + "0" * 64 + "\n")
    model = tmp_path / "models/20260101-000000"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    seal_model_dir(model, datetime(2026, 1, 1, tzinfo=UTC))
    return {
        "nvidia_repo_url": "https://mirror.example.internal/cuda/repos",
        "nvidia_repo_key": str(tmp_path / "key.gpg"),
        "inference_pip_index_url": "https://mirror.example.internal/pypi/simple/",
        "inference_requirements": str(tmp_path / "requirements.lock"),
        "inference_model_source": str(model),
        "inference_listen_address": "10.20.0.11",
    }


def test_every_problem_of_a_host_is_reported_with_the_missing_required_keys(site_data: dict[str, object]) -> None:
    data = {**site_data, "nvidia_repo_url": None, "ironserve_reboot_policy": "x", "security_memory_max": "lots"}
    data |= {"ironserve_profile": "r750", "ironserve_profle": "r740-a10"}
    with pytest.raises(ConfigError) as error:
        validate_host("h1", data, REGISTRY)
    lines = str(error.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "ironserve_profle",
        "ironserve_profile",
        "security_memory_max",
        "ironserve_reboot_policy",
        "nvidia_repo_url must be set for the nvidia role (NVIDIA's CUDA repository base URL or a mirror of it, and "
        "its keyring file)",
    ]


def test_a_bad_required_key_is_reported_once(site_data: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        validate_host("h1", {**site_data, "inference_requirements": str(tmp_path / "missing.lock")}, REGISTRY)
    assert str(error.value).count("inference_requirements") >= 1
    assert "must be set" not in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_pyinfra_keys_are_accepted_and_come_from_pyinfra(site_data: dict[str, object]) -> None:
    assert {"ssh_user", "ssh_port", "ssh_known_hosts_file", "_sudo", "_su_user", "_env", "docker_identifier"} <= (
        pyinfra_keys()
    )
    data = {**site_data, "ssh_user": "root", "ssh_port": 2222, "_sudo": False, "_env": {"LANG": "C"}}
    assert validate_host("h1", data, REGISTRY).host == "h1"


@pytest.mark.parametrize("host", ["r740-\u0430", "r740 01", "r740-01\x00"])
def test_host_names_are_plain_ascii(host: str) -> None:
    with pytest.raises(ConfigError, match=r"the host name is not plain ASCII without spaces"):
        stack_config(host, {})


def test_a_declared_os_outside_the_profile_is_refused_before_any_host() -> None:
    with pytest.raises(ConfigError) as error:
        stack_config("r740-01", {"ironserve_os": "ubuntu2004"})
    assert "the OS ubuntu2004 is not one profile r740-a10's lock is published for" in str(error.value)
    assert "supported: ubuntu2204 (from ubuntu2204), debian12 (from debian11)" in str(error.value)
    assert stack_config("r740-01", {"ironserve_os": "ubuntu2204"}).os == "ubuntu2204"
    with pytest.raises(ConfigError, match="ironserve_os"):
        stack_config("r740-01", {"ironserve_os": "Ubuntu 22.04; rm -rf /"})


def test_containerd_versions_are_the_host_os_s_own() -> None:
    settings = stack_config("r740-01", {}).container_runtime
    assert settings.packages_for("debian12") == {"containerd": "1.6.20~ds1-1+deb12u3", "runc": "1.1.5+ds1-1+deb12u1"}
    assert settings.packages_for("ubuntu2204")["containerd"] == "1.7.12-0ubuntu2~22.04.1"
    with pytest.raises(ValueError, match="name them in container_runtime_packages"):
        settings.packages_for("rhel9")
    pinned = stack_config("r740-01", {"container_runtime_packages": {"containerd": "1.7.0-1"}}).container_runtime
    assert pinned.packages_for("rhel9") == {"containerd": "1.7.0-1"}  # the site's own pins, whatever the OS
