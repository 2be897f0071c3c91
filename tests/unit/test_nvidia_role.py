"""roles/nvidia pure parts: the profile's apt versions against the lock, fact parsers, generated files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ironserve.config import ConfigError, build_config, load_profile
from ironserve.config_nvidia import distro_key, package_violations, pinned_packages
from ironserve.lab import aptrepo
from ironserve.nvidia_facts import (
    StackObserved,
    parse_dpkg_query,
    parse_os_release,
    parse_secure_boot,
    parse_stack,
    stack_problems,
)
from roles.nvidia import preferences, sources_line, unattended_blacklist

SMI = Path(aptrepo.__file__).with_name("standin_nvidia_smi.py")


@pytest.mark.parametrize("profile", ["r740-a10", "a100-cuda117"])
def test_every_profile_pins_apt_versions_that_agree_with_its_lock(profile: str) -> None:
    loaded = load_profile(profile)
    assert package_violations(loaded.lock, loaded.packages) == []
    assert set(loaded.packages or {}) == {"debian12", "ubuntu2204"}


def test_primary_pins_are_the_seed_set() -> None:
    pins = pinned_packages(load_profile("r740-a10").packages, "debian12")
    assert pins["nvidia-driver"] == "525.85.02-1"
    assert pins["cuda-toolkit-11-8"] == "11.8.0-1"
    assert pins["libcudnn8"] == "8.6.0.163-1+cuda11.8"
    assert pins["tensorrt"] == "8.6.1.6-1+cuda11.8"
    assert "cuda-11-8" not in pins  # the metapackage that brings the bundled driver along


def test_a_cudnn_package_built_for_cuda_12_is_refused() -> None:
    lock = load_profile("r740-a10").lock
    bad = {"debian12": {"cudnn": {"libcudnn8": "8.6.0.163-1+cuda12.0"}, "gpu": {"x": "1"}}}
    messages = [v.message for v in package_violations(lock, bad)]
    assert any("libcudnn8 8.6.0.163-1+cuda12.0 is not the lock's cudnn" in m and "+cuda11.8" in m for m in messages)
    assert any("unknown component 'gpu'" in m for m in messages)


def test_lock_override_that_breaks_the_packages_is_refused_before_any_host() -> None:
    with pytest.raises(ConfigError) as error:
        build_config("r740-01", {"ironserve_lock": {"driver": "535.129.03"}})
    assert "host r740-01: ironserve_lock: rule packages-match-lock failed" in str(error.value)
    assert "nvidia-driver 525.85.02-1 is not the lock's driver" in str(error.value)


def test_pin_priority_below_1001_is_refused() -> None:
    with pytest.raises(ConfigError, match="nvidia_pin_priority"):
        build_config("r740-01", {"nvidia_pin_priority": 990})


def test_os_names_map_to_nvidia_repository_directories() -> None:
    assert distro_key("ubuntu", "22.04") == "ubuntu2204"
    assert parse_os_release(["debian 12"]) == "debian12"


def test_dpkg_query_parser_keeps_installed_and_held() -> None:
    lines = [
        "libcudnn8\t8.6.0.163-1+cuda11.8\thi ",
        "tensorrt\t8.6.1.6-1+cuda11.8\tii ",
        "nvidia-driver\t\tun ",
        "cuda-toolkit-12-2\t12.2.2-1\trc ",
    ]
    parsed = parse_dpkg_query(lines)
    assert set(parsed) == {"libcudnn8", "tensorrt"}
    assert parsed["libcudnn8"].held and not parsed["tensorrt"].held


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["SecureBoot enabled"], "enabled"),
        (["SecureBoot disabled"], "disabled"),
        (["EFI variables are not supported on this system"], "unknown"),
        (["efivar 1"], "enabled"),
        ([], "unknown"),
    ],
)
def test_secure_boot_parser(lines: list[str], expected: str) -> None:
    assert parse_secure_boot(lines) == expected


STACK_OUTPUT = """== smi
525.85.02
== module
== cudnn
#define CUDNN_MAJOR 8
#define CUDNN_MINOR 6
#define CUDNN_PATCHLEVEL 0
== cuda
{ "cuda" : { "name" : "CUDA SDK", "version" : "11.8.0" }}
== nvcc
release 11.8
== toolkits
/usr/local/cuda-11.8
== link
/usr/local/cuda-11.8
""".splitlines()


def test_stack_parser_and_a_matching_host() -> None:
    observed = parse_stack(STACK_OUTPUT)
    assert observed == StackObserved(
        ["525.85.02"], None, "8.6.0", "11.8.0", "11.8", ["/usr/local/cuda-11.8"], "/usr/local/cuda-11.8"
    )
    assert stack_problems(observed, "525.85.02", "11.8.0", "8.6.0", "/usr/local/cuda-11.8") == []


def test_stack_problems_name_each_drift() -> None:
    observed = StackObserved(
        ["535.129.03"], "525.85.02", "8.9.7", "11.8.0", "11.8", ["/usr/local/cuda-11.8", "/usr/local/cuda-12.2"], None
    )
    problems = stack_problems(observed, "525.85.02", "11.8.0", "8.6.0", "/usr/local/cuda-11.8")
    text = "\n".join(problems)
    assert "nvidia-smi reports driver 535.129.03, lock 525.85.02" in text
    assert "cuDNN 8.9.7, lock 8.6.0" in text
    assert "/usr/local/cuda-12.2" in text
    assert "/usr/local/cuda resolves to None" in text
    module = StackObserved(["525.85.02"], "520.61.05", "8.6.0", "11.8.0", "11.8", ["/usr/local/cuda-11.8"], "/x")
    assert any("reboot needed" in p for p in stack_problems(module, "525.85.02", "11.8.0", "8.6.0", "/x"))


def test_generated_apt_files() -> None:
    pins = {"libcudnn8": "8.6.0.163-1+cuda11.8"}
    assert "Package: libcudnn8\nPin: version 8.6.0.163-1+cuda11.8\nPin-Priority: 1001\n" in preferences(pins, 1001)
    assert '"libcudnn8$";' in unattended_blacklist(["libcudnn8"])
    keyring = "/usr/share/keyrings/ironserve-nvidia.gpg"
    line = sources_line("http://mirror.example/repos", "ubuntu2204")
    assert line == f"deb [signed-by={keyring}] http://mirror.example/repos/ubuntu2204/x86_64/ /\n"


# --- the lab's stand-ins ---------------------------------------------------------------------------------------


def test_mirror_offers_the_pinned_set_and_newer_decoys() -> None:
    offered = {(p.name, p.version) for p in aptrepo.catalog()}
    for name, version in pinned_packages(load_profile("r740-a10").packages, "debian12").items():
        assert (name, version) in offered
    decoys = {("nvidia-driver", "535.129.03-1"), ("cuda-toolkit-12-2", "12.2.2-1")}
    decoys |= {("libcudnn8", "8.9.7.29-1+cuda12.2"), ("tensorrt", "8.6.1.6-1+cuda12.0")}
    assert decoys <= offered


def _smi(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    hardware = tmp_path / "hardware.json"
    from ironserve.lab.hardware import load_profile as load_hardware

    hardware.write_text(load_hardware().model_dump_json())
    source = SMI.read_text().replace("/etc/ironserve-lab/hardware.json", str(hardware))
    script = tmp_path / "nvidia_smi.py"
    script.write_text(source)
    env = {**os.environ, "IRONSERVE_STANDIN_DRIVER": "525.85.02", "IRONSERVE_STANDIN_CUDA": "12.0"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)


def test_stand_in_nvidia_smi_formats(tmp_path: Path) -> None:
    csv = _smi(tmp_path, "--query-gpu=index,name,memory.total,driver_version", "--format=csv").stdout.splitlines()
    assert csv[0] == "index, name, memory.total [MiB], driver_version"
    assert csv[1] == "0, NVIDIA A10, 23028 MiB, 525.85.02"
    nounits = _smi(tmp_path, "--query-gpu=memory.total,pci.bus_id", "--format=csv,noheader,nounits").stdout
    assert nounits.splitlines()[0] == "23028, 00000000:3B:00.0"
    bad = _smi(tmp_path, "--query-gpu=bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field to query.' in bad.stderr
    full = _smi(tmp_path, "-q").stdout
    assert "Driver Version                        : 525.85.02" in full
    assert "CUDA Version                          : 12.0" in full
    topo = _smi(tmp_path, "topo", "-m").stdout.splitlines()
    assert topo[0].split("\t")[1:5] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo[1].split("\t")[1:5] == [" X ", "NODE", "SYS", "SYS"]
