"""The configuration model refuses bad inventory with the host, the key and the accepted values."""

from __future__ import annotations

import pytest

from ironserve.config import ConfigError
from roles import stack_config


def test_defaults_build_the_primary_profile() -> None:
    config = stack_config("h1", {})
    assert config.profile.name == "r740-a10"
    assert config.lock.driver == "525.85.02"
    assert config.host_tuning.sysctls["net.ipv4.ip_local_port_range"] == "32768\t60999"
    assert config.reboot_policy == "defer"


def test_inventory_overrides_role_defaults() -> None:
    config = stack_config(
        "h1", {"ironserve_reboot_policy": "auto", "host_tuning_sysctls": {"net.core.somaxconn": 4096}}
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
            "net.core.rmem_max: expected a non-negative integer, got 'lots'",
        ),
        (
            {"host_tuning_sysctls": {"net.core.rmem_max": -1}},
            "net.core.rmem_max: expected a non-negative integer, got -1",
        ),
        ({"host_tuning_sysctls": {"net.core.rmem_max": True}}, "a boolean is not a sysctl value"),
        ({"host_tuning_sysctls": {"net.ipv4.ip_local_port_range": "60999 32768"}}, "1024 <= LOW < HIGH <= 65535"),
        ({"ironserve_reboot_timeout_s": -5}, "ironserve_reboot_timeout_s: Input should be greater than 0"),
        ({"host_tuning_kernel_args": ["bad arg;rm"]}, "host_tuning_kernel_args[0]"),
        ({"host_tuning_sysctl_file": "/tmp/x.conf"}, "host_tuning_sysctl_file"),
        ({"host_tuning_unknown_key": 1}, "host_tuning_unknown_key: Extra inputs are not permitted"),
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
