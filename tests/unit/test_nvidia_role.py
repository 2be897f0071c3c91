"""roles/nvidia pure parts: the profile's apt versions against the lock, fact parsers, generated files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from operation_harness import FakeHost, fact_key, run_operation

from ironserve.apt import preferences, unattended_blacklist
from ironserve.aptindex import upstream
from ironserve.config import ConfigError
from ironserve.facts import lines_by_file, parse_dpkg_query, parse_os_release
from ironserve.packages import distro_key, package_violations, pinned_packages
from ironserve.profiles import read_profile
from ironserve_lab import aptrepo
from roles import stack_config
from roles.nvidia import sources_line
from roles.nvidia.facts import (
    DkmsObserved,
    ModuleObserved,
    SecureBoot,
    StackObserved,
    cuda_line,
    dkms_lacking,
    driver_reboot_reason,
    parse_dkms,
    parse_loaded_module,
    parse_module_version,
    parse_runfile,
    parse_secure_boot,
    parse_stack,
    sources_naming,
    stack_problems,
)
from roles.nvidia.operations import refuse_secure_boot, runfile_options, runfile_url, secure_boot_refusal

SMI = Path(aptrepo.__file__).with_name("standin_nvidia_smi.py")
DKMS = Path(aptrepo.__file__).with_name("standin_dkms.py")


@pytest.mark.parametrize("profile", ["r740-a10", "a100-cuda117"])
def test_every_profile_pins_apt_versions_that_agree_with_its_lock(profile: str) -> None:
    loaded = read_profile(profile)
    assert package_violations(loaded.lock, loaded.packages) == []
    assert set(loaded.packages or {}) == {"debian11", "ubuntu2204"}
    assert set(loaded.platforms.values()) <= set(loaded.packages or {})


def test_primary_profile_pins_the_locked_versions() -> None:
    pins = pinned_packages(read_profile("r740-a10").packages, "debian11")
    assert pins["nvidia-driver"] == "525.85.12-1"
    assert pins["cuda-toolkit-11-8"] == "11.8.0-1"
    assert pins["libcudnn8"] == "8.6.0.163-1+cuda11.8"
    assert pins["tensorrt"] == "8.6.1.6-1+cuda11.8"
    assert "cuda-11-8" not in pins  # the metapackage that brings the bundled driver along


def test_a_cudnn_package_built_for_cuda_12_is_refused() -> None:
    lock = read_profile("r740-a10").lock
    bad = {"debian11": {"cudnn": {"libcudnn8": "8.6.0.163-1+cuda12.0"}, "gpu": {"x": "1"}}}
    messages = [v.message for v in package_violations(lock, bad)]
    assert any("libcudnn8 8.6.0.163-1+cuda12.0 is not the lock's cudnn" in m and "+cuda11.8" in m for m in messages)
    assert any("unknown component 'gpu'" in m for m in messages)


def test_lock_override_that_breaks_the_packages_is_refused_before_any_host() -> None:
    with pytest.raises(ConfigError) as error:
        stack_config("r740-01", {"ironserve_lock": {"driver": "535.129.03"}})
    assert "host r740-01: ironserve_lock: rule packages-match-lock failed" in str(error.value)
    assert "nvidia-driver 525.85.12-1 is not the lock's driver" in str(error.value)


def test_pin_priority_below_1001_is_refused() -> None:
    with pytest.raises(ConfigError, match="nvidia_pin_priority"):
        stack_config("r740-01", {"nvidia_pin_priority": 990})


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
        (["SecureBoot enabled", "SecureBoot validation is disabled in shim"], "validation-disabled"),
        (["SecureBoot disabled", "Platform is in Setup Mode"], "disabled"),
        (["efivar 1", "efivar-moksbstate"], "validation-disabled"),
        (["efivar 0"], "disabled"),
        (["This system doesn't support Secure Boot"], "unknown"),
    ],
)
def test_secure_boot_parser(lines: list[str], expected: str) -> None:
    assert parse_secure_boot(lines) == expected


@pytest.mark.parametrize(
    ("sb_state", "policy", "refused"),
    [
        ("enabled", "proceed", "the unsigned NVIDIA kernel module would not load"),
        ("validation-disabled", "proceed", None),
        ("validation-disabled", "refuse", "nvidia_shim_validation_disabled is refuse"),
        ("disabled", "refuse", None),
        ("unknown", "refuse", None),
    ],
)
def test_secure_boot_decision(sb_state: str, policy: str, refused: str | None) -> None:
    refusal = secure_boot_refusal(sb_state, policy)
    assert refusal is None if refused is None else refused in str(refusal)


def test_secure_boot_gate_warns_when_shim_does_not_validate_and_refuses_by_policy() -> None:
    host = FakeHost({fact_key(SecureBoot): "validation-disabled"})
    with patch.object(host, "log") as log:
        assert run_operation(refuse_secure_boot, host) == []  # the default policy: proceed
    message = log.call_args.args[0]
    assert "Secure Boot does not protect this host's kernel" in message and "mokutil --enable-validation" in message
    # Refused: a failing command stops this host only (the others go on).
    (refused,) = run_operation(refuse_secure_boot, host, shim_validation_disabled="refuse")
    assert "nvidia_shim_validation_disabled is refuse" in refused and refused.endswith(">&2; exit 1")
    enforcing = FakeHost({fact_key(SecureBoot): "enabled"})
    (refused,) = run_operation(refuse_secure_boot, enforcing)
    assert "mokutil --import" in refused and refused.endswith(">&2; exit 1")


def test_shim_validation_policy_is_a_checked_setting() -> None:
    assert stack_config("r740-01", {}).nvidia.shim_validation_disabled == "proceed"
    assert stack_config("r740-01", {"nvidia_shim_validation_disabled": "refuse"}).nvidia.shim_validation_disabled == (
        "refuse"
    )
    with pytest.raises(ConfigError, match="nvidia_shim_validation_disabled"):
        stack_config("r740-01", {"nvidia_shim_validation_disabled": "warn"})


STACK_OUTPUT = """== smi
525.85.12
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
        ["525.85.12"], None, "8.6.0", "11.8.0", "11.8", ["/usr/local/cuda-11.8"], "/usr/local/cuda-11.8"
    )
    assert stack_problems(observed, "525.85.12", "11.8.0", "8.6.0", "/usr/local/cuda-11.8") == []


# /usr/local/cuda-11.8/version.json of a real CUDA 11.8.0 install, joined into one line as the fact's `tr -d '\n'`
# does: its `cuda` component is date-stamped (nickeisenberg/usefull_setup_instructions, aws/nvidia_setup_cuda_11_8.md).
REAL_118_VERSION_JSON = (
    '{   "cuda" : {      "name" : "CUDA SDK",      "version" : "11.8.20220929"   },   "cuda_nvcc" : {      '
    '"name" : "CUDA NVCC",      "version" : "11.8.89"   }}'
)


def _real_118_host(package_version: str = "11.8.0-1") -> list[str]:
    cuda = STACK_OUTPUT.index("== cuda")
    lines = [*STACK_OUTPUT[: cuda + 1], REAL_118_VERSION_JSON, *STACK_OUTPUT[cuda + 2 :]]
    return [*lines, "== packages", f"cuda-toolkit-11-8\t{package_version}\tii "]


def test_a_real_cuda_118_host_matches_its_lock() -> None:
    """version.json's date-stamped 11.8.20220929 is CUDA 11.8; the package says which 11.8: 11.8.0."""
    observed = parse_stack(_real_118_host())
    assert observed.cuda_version == "11.8.20220929" and observed.toolkit_packages == {"cuda-toolkit-11-8": "11.8.0-1"}
    assert stack_problems(observed, "525.85.12", "11.8.0", "8.6.0", "/usr/local/cuda-11.8") == []


def test_cuda_drift_is_named_by_line_and_by_package() -> None:
    home = "/usr/local/cuda-11.8"
    update = parse_stack(_real_118_host("11.8.1-1"))  # another 11.8 release behind the same line
    assert stack_problems(update, "525.85.12", "11.8.0", "8.6.0", home) == [
        "dpkg has cuda-toolkit-11-8 11.8.1-1, lock CUDA 11.8.0"
    ]
    other_line = StackObserved(["525.85.12"], None, "8.6.0", "12.2.20230823", "11.8", [home], home)
    assert stack_problems(other_line, "525.85.12", "11.8.0", "8.6.0", home) == [
        f"{home}/version.json says CUDA 12.2.20230823, lock 11.8.0 (CUDA 11.8)"
    ]
    undated = StackObserved(["525.85.12"], None, "8.6.0", "12.4.1", "12.4", [], "/usr/local/cuda-12.4")
    assert stack_problems(undated, "525.85.12", "12.4.1", "8.6.0", "/usr/local/cuda-12.4") == []  # no date stamp
    assert cuda_line("11.8.20220929") == cuda_line("11.8.0") == cuda_line("11.8") == "11.8"
    assert cuda_line(None) is None and cuda_line("garbage") is None
    assert upstream("1:11.8.0-1") == "11.8.0"


def test_stack_problems_name_each_drift() -> None:
    observed = StackObserved(
        ["535.129.03"], "525.85.12", "8.9.7", "11.8.0", "11.8", ["/usr/local/cuda-11.8", "/usr/local/cuda-12.2"], None
    )
    problems = stack_problems(observed, "525.85.12", "11.8.0", "8.6.0", "/usr/local/cuda-11.8")
    text = "\n".join(problems)
    assert "nvidia-smi reports driver 535.129.03, lock 525.85.12" in text
    assert "cuDNN 8.9.7, lock 8.6.0" in text
    assert "/usr/local/cuda-12.2" in text
    assert "/usr/local/cuda resolves to None" in text
    module = StackObserved(["525.85.12"], "520.61.05", "8.6.0", "11.8.0", "11.8", ["/usr/local/cuda-11.8"], "/x")
    assert any("reboot needed" in p for p in stack_problems(module, "525.85.12", "11.8.0", "8.6.0", "/x"))


def test_generated_apt_files() -> None:
    pins = {"libcudnn8": "8.6.0.163-1+cuda11.8"}
    assert "Package: libcudnn8\nPin: version 8.6.0.163-1+cuda11.8\nPin-Priority: 1001\n" in preferences(
        pins, 1001, "roles/nvidia"
    )
    assert '"libcudnn8$";' in unattended_blacklist(["libcudnn8"], "roles/nvidia")
    keyring = "/usr/share/keyrings/ironserve-nvidia.gpg"
    line = sources_line("http://mirror.example/repos", "ubuntu2204")
    assert line == f"deb [signed-by={keyring}] http://mirror.example/repos/ubuntu2204/x86_64/ /\n"


# --- the lab's stand-ins ---------------------------------------------------------------------------------------


def test_mirror_cuda_toolkit_ships_version_json_as_nvidia_writes_it() -> None:
    """The stand-in toolkit's version.json: NVIDIA's layout and its date-stamped `cuda` version, so a lab host
    reads what a real one does, and the stack check passes on it only when it reads CUDA by its line."""
    package = aptrepo.cuda_toolkit_package("11.8.0")
    text = package.files["/usr/local/cuda-11.8/version.json"][0]
    assert text.startswith('{\n   "cuda" : {\n      "name" : "CUDA SDK",\n      "version" : "11.8.20220929"\n   },\n')
    assert (package.name, package.version) == ("cuda-toolkit-11-8", "11.8.0-1")
    cuda = STACK_OUTPUT.index("== cuda")
    lines = [*STACK_OUTPUT[: cuda + 1], text.replace("\n", ""), *STACK_OUTPUT[cuda + 2 :]]
    observed = parse_stack([*lines, "== packages", f"{package.name}\t{package.version}\tii "])
    assert stack_problems(observed, "525.85.12", "11.8.0", "8.6.0", "/usr/local/cuda-11.8") == []


def test_mirror_offers_the_pinned_set_and_newer_decoys() -> None:
    offered = {(p.name, p.version) for p in aptrepo.catalog()}
    for name, version in pinned_packages(read_profile("r740-a10").packages, "debian11").items():
        assert (name, version) in offered
    decoys = {("nvidia-driver", "535.129.03-1"), ("cuda-toolkit-12-2", "12.2.2-1")}
    decoys |= {("libcudnn8", "8.9.7.29-1+cuda12.2"), ("tensorrt", "8.6.1.6-1+cuda12.0")}
    assert decoys <= offered


def _smi(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    hardware = tmp_path / "hardware.json"
    from ironserve_lab.hardware import read_hardware_profile

    hardware.write_text(read_hardware_profile().model_dump_json())
    source = SMI.read_text().replace("/etc/ironserve-lab/hardware.json", str(hardware))
    script = tmp_path / "nvidia_smi.py"
    script.write_text(source)
    env = {**os.environ, "IRONSERVE_STANDIN_DRIVER": "525.85.12", "IRONSERVE_STANDIN_CUDA": "12.0"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)


def test_stand_in_nvidia_smi_formats(tmp_path: Path) -> None:
    csv = _smi(tmp_path, "--query-gpu=index,name,memory.total,driver_version", "--format=csv").stdout.splitlines()
    assert csv[0] == "index, name, memory.total [MiB], driver_version"
    assert csv[1] == "0, NVIDIA A10, 23028 MiB, 525.85.12"
    nounits = _smi(tmp_path, "--query-gpu=memory.total,pci.bus_id", "--format=csv,noheader,nounits").stdout
    assert nounits.splitlines()[0] == "23028, 00000000:3B:00.0"
    bad = _smi(tmp_path, "--query-gpu=bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field to query.' in bad.stderr
    full = _smi(tmp_path, "-q").stdout
    assert "Driver Version                        : 525.85.12" in full
    assert "CUDA Version                          : 12.0" in full
    topo = _smi(tmp_path, "topo", "-m").stdout.splitlines()
    assert topo[0].split("\t")[1:5] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo[1].split("\t")[1:5] == [" X ", "NODE", "SYS", "SYS"]


# --- container toolkit, DKMS, the loaded module, cuda-samples ----------------------------------------------------


def test_container_toolkit_is_pinned_with_the_lock_unless_switched_off() -> None:
    loaded = read_profile("r740-a10")
    assert loaded.lock.container_toolkit == "1.13.5"
    pins = pinned_packages(loaded.packages, "debian11")
    toolkit = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools")
    assert {pins[name] for name in (*toolkit, "libnvidia-container1")} == {"1.13.5-1"}
    assert pins["nvidia-kernel-dkms"] == "525.85.12-1"
    off = stack_config("r740-01", {"nvidia_container_toolkit": False}).nvidia.skipped_components()
    assert "nvidia-container-toolkit" not in pinned_packages(loaded.packages, "debian11", without=off)
    bad = {"debian11": {"container_toolkit": {"nvidia-container-toolkit": "1.17.8-1"}}}
    assert "is not the lock's container_toolkit" in package_violations(loaded.lock, bad)[0].message


def test_cuda_samples_settings_are_checked_before_any_host() -> None:
    with pytest.raises(ConfigError, match="nvidia_cuda_samples_sha256 is required"):
        stack_config("r740-01", {"nvidia_cuda_samples_url": "https://mirror.example/cuda-samples/v11.8.tar.gz"})
    with pytest.raises(ConfigError, match="nvidia_cuda_samples_sha256"):
        stack_config(
            "r740-01",
            {"nvidia_cuda_samples_url": "https://mirror.example/v11.8.tar.gz", "nvidia_cuda_samples_sha256": "abc"},
        )
    with pytest.raises(ConfigError, match="nvidia_cuda_samples_url"):
        stack_config("r740-01", {"nvidia_cuda_samples_url": "ftp://x/v11.zip", "nvidia_cuda_samples_sha256": "0" * 64})
    ok = stack_config(
        "r740-01",
        {"nvidia_cuda_samples_url": "https://mirror.example/v11.8.tar.gz", "nvidia_cuda_samples_sha256": "a" * 64},
    )
    assert ok.nvidia.cuda_samples_sha256 == "a" * 64


DKMS_STATUS = [
    "kernel 6.1.0-13-amd64",
    "kernel 6.1.0-18-amd64",
    "file /lib/modules/6.1.0-13-amd64/updates/dkms/nvidia-current.ko",
    "file /lib/modules/6.1.0-18-amd64/updates/dkms/nvidia-current.ko",
    "dkms-present",
    "dkms nvidia-current/525.85.12, 6.1.0-13-amd64, x86_64: installed",
    "dkms nvidia-current/535.129.03, 6.1.0-18-amd64, x86_64: installed (WARNING! Diff between built and installed)",
    "dkms nvidia, 525.85.12, 5.15.0-91-generic, x86_64: installed",
    "dkms nvidia-current/525.85.12: added",
]


def test_dkms_parser_and_the_kernels_that_lack_the_module() -> None:
    observed = parse_dkms(DKMS_STATUS)
    assert observed.kernels == ["6.1.0-13-amd64", "6.1.0-18-amd64"]
    assert observed.installed["5.15.0-91-generic"] == ["525.85.12"]  # dkms 2's comma format
    assert observed.dkms
    # 6.1.0-18 has a module, but of another driver version: it lacks 525.85.12.
    assert dkms_lacking(observed, "525.85.12") == ["6.1.0-18-amd64"]
    files_gone = DkmsObserved(["k1"], {"k1": ["525.85.12"]}, {}, True)
    assert dkms_lacking(files_gone, "525.85.12") == ["k1"]  # dkms says installed, the file is gone
    only_uvm = DkmsObserved(["k1"], {"k1": ["525.85.12"]}, {"k1": ["nvidia-current-uvm.ko"]}, True)
    assert dkms_lacking(only_uvm, "525.85.12") == ["k1"]  # the main module is what loads the driver
    xz = DkmsObserved(["k1"], {"k1": ["525.85.12"]}, {"k1": ["nvidia.ko.xz", "nvidia-uvm.ko.xz"]}, True)
    assert dkms_lacking(xz, "525.85.12") == []
    assert dkms_lacking(parse_dkms([]), "525.85.12") == []  # a container: no kernel image


@pytest.mark.parametrize(
    ("lines", "version"),
    [
        (["525.85.12"], "525.85.12"),
        (["NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.85.12  Wed Jan  4 22:01:41 UTC 2023"], "525.85.12"),
        (["NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.129.03  Release Build"], "535.129.03"),
        ([], None),
    ],
)
def test_loaded_module_version_from_sysfs_or_procfs(lines: list[str], version: str | None) -> None:
    assert parse_module_version(lines) == version


def test_driver_change_needs_a_reboot_until_the_module_matches() -> None:
    loaded = parse_loaded_module(["== nvidia", "515.86.01", "== nouveau"])
    assert loaded == ModuleObserved("515.86.01", False)
    assert "module is 515.86.01, the installed driver 525.85.12: reboot needed" in str(
        driver_reboot_reason(loaded, "525.85.12")
    )
    assert driver_reboot_reason(ModuleObserved("525.85.12"), "525.85.12") is None
    assert driver_reboot_reason(ModuleObserved(None, False), "525.85.12") is None  # no GPU, or loaded on first use
    nouveau = parse_loaded_module(["== nvidia", "== nouveau", "loaded"])
    assert "nouveau is loaded" in str(driver_reboot_reason(nouveau, "525.85.12"))


def _dkms(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IRONSERVE_STANDIN_DKMS_ROOT": str(root)}
    return subprocess.run([sys.executable, str(DKMS), *args], capture_output=True, text=True, env=env)


def test_stand_in_dkms_keeps_dkms_rules_and_status_format(tmp_path: Path) -> None:
    """The lab's stand-in: refuses a kernel without headers like dkms, and its status reads as the product expects."""
    package = aptrepo.dkms_package("525.85.12", "525.85.12-1")
    for path, (content, _) in package.files.items():
        if path.startswith("/usr/src/"):
            (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path.lstrip("/")).write_text(content)
    for kernel in ("6.1.0-lab1-amd64", "6.1.0-lab2-amd64"):
        (tmp_path / f"lib/modules/{kernel}").mkdir(parents=True)
    (tmp_path / "lib/modules/6.1.0-lab1-amd64/build").mkdir()
    assert _dkms(tmp_path, "add", "-m", "nvidia-current", "-v", "525.85.12").returncode == 0
    assert _dkms(tmp_path, "status").stdout == "nvidia-current/525.85.12: added\n"
    refused = _dkms(tmp_path, "autoinstall", "-k", "6.1.0-lab2-amd64")
    assert refused.returncode == 1 and "kernel headers for kernel 6.1.0-lab2-amd64 cannot be found" in refused.stderr
    assert _dkms(tmp_path, "autoinstall", "-k", "6.1.0-lab1-amd64").returncode == 0
    status = _dkms(tmp_path, "status").stdout.splitlines()
    assert status == ["nvidia-current/525.85.12, 6.1.0-lab1-amd64, x86_64: installed"]
    modules = sorted(p.name for p in (tmp_path / "lib/modules/6.1.0-lab1-amd64/updates/dkms").iterdir())
    assert "nvidia-current.ko" in modules
    lines = ["kernel 6.1.0-lab1-amd64", "kernel 6.1.0-lab2-amd64", "dkms-present"]
    lines += [f"file /lib/modules/6.1.0-lab1-amd64/updates/dkms/{m}" for m in modules]
    observed = parse_dkms(lines + [f"dkms {line}" for line in status])
    assert dkms_lacking(observed, "525.85.12") == ["6.1.0-lab2-amd64"]
    assert _dkms(tmp_path, "remove", "nvidia-current/525.85.12", "--all").returncode == 0
    assert not (tmp_path / "lib/modules/6.1.0-lab1-amd64/updates/dkms/nvidia-current.ko").exists()
    assert _dkms(tmp_path, "status").stdout == ""


def test_mirror_offers_the_container_toolkit_with_its_default_config() -> None:
    offered = {(p.name, p.version): p for p in aptrepo.catalog()}
    assert ("nvidia-container-toolkit", "1.17.8-1") in offered  # the decoy
    base = offered[("nvidia-container-toolkit-base", "1.13.5-1")]
    config = base.files["/etc/nvidia-container-runtime/config.toml"][0]
    assert "#no-cgroups = false" in config.splitlines()
    import tomllib

    parsed = tomllib.loads(config)
    assert "no-cgroups" not in parsed["nvidia-container-cli"] and "nvidia-container-runtime" in parsed
    assert {"/usr/bin/nvidia-ctk", "/usr/bin/nvidia-container-runtime"} <= set(base.files)


def test_mirror_cuda_samples_tarball_has_the_real_layout_and_is_reproducible() -> None:
    import io
    import tarfile

    data = aptrepo.cuda_samples_tarball("v11.8")
    assert data == aptrepo.cuda_samples_tarball("v11.8")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert "cuda-samples-11.8/Samples/1_Utilities/deviceQuery/deviceQuery.cpp" in names
    assert "cuda-samples-11.8/Samples/1_Utilities/deviceQuery/Makefile" in names
    assert aptrepo.cuda_samples_path("v11.8") == "cuda-samples/archive/refs/tags/v11.8.tar.gz"


def test_runfile_method_settings_are_checked_before_any_host() -> None:
    with pytest.raises(ConfigError, match="nvidia_runfile_sha256 is required"):
        stack_config("r740-01", {"nvidia_driver_method": "runfile"})
    with pytest.raises(ConfigError, match="nvidia_driver_method"):
        stack_config("r740-01", {"nvidia_driver_method": "source"})
    with pytest.raises(ConfigError, match="nvidia_dkms must stay true"):
        stack_config(
            "r740-01", {"nvidia_driver_method": "runfile", "nvidia_runfile_sha256": "a" * 64, "nvidia_dkms": False}
        )
    config = stack_config("r740-01", {"nvidia_driver_method": "runfile", "nvidia_runfile_sha256": "a" * 64})
    assert "driver" in config.nvidia.skipped_components()  # the apt driver packages are not installed
    pins = pinned_packages(config.profile.packages, "debian11", without=config.nvidia.skipped_components())
    assert "nvidia-driver" not in pins and "cuda-toolkit-11-8" in pins
    assert runfile_url(config.nvidia.runfile_base_url, config.lock.driver) == (
        "https://us.download.nvidia.com/XFree86/Linux-x86_64/525.85.12/NVIDIA-Linux-x86_64-525.85.12.run"
    )


def test_runfile_options_build_the_module_with_dkms() -> None:
    assert runfile_options(container=False) == ("--silent", "--dkms", "--no-opengl-files", "--no-x-check")
    assert runfile_options(container=True) == ("--silent", "--no-kernel-module", "--no-opengl-files", "--no-x-check")


def test_runfile_fact_reads_the_installer_version_and_its_log() -> None:
    lines = [
        "== version",
        "nvidia-installer:  version 525.85.12  (buildmeister@builder101)  Wed Jan  4 21:50:07 UTC 2023",
        "== log",
        "nvidia-installer log file '/var/log/nvidia-installer.log'",
        "installer version: 525.85.12",
        "",
        "nvidia-installer command line:",
        "    ./nvidia-installer",
        "    --silent",
        "    --dkms",
        "    --no-opengl-files",
        "    --no-x-check",
        "",
        "Using: nvidia-installer ncurses v6 user interface",
    ]
    observed = parse_runfile(lines)
    assert observed.version == "525.85.12"
    assert observed.options == ["--silent", "--dkms", "--no-opengl-files", "--no-x-check"]
    assert parse_runfile(["== version", "== log"]).version is None


def test_mirror_serves_a_runfile_per_profile_driver() -> None:
    script = aptrepo.runfile("525.85.12")
    assert script.startswith(b"#!/bin/sh\n") and b"\n__PAYLOAD__\n" in script
    assert aptrepo.runfile_sha256("525.85.12") == aptrepo.runfile_sha256("525.85.12")  # reproducible
    assert aptrepo.runfile_path("525.85.12") == "XFree86/Linux-x86_64/525.85.12/NVIDIA-Linux-x86_64-525.85.12.run"
    offered = {(p.name, p.version) for p in aptrepo.catalog()}
    assert ("dkms", aptrepo.DKMS_STANDIN_VERSION) in offered  # what Depends: dkms resolves to in the lab


@pytest.mark.parametrize(
    ("line", "names"),
    [
        (
            "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] https://nv.example/repos/debian12/x86_64/ /",
            True,
        ),
        ("deb [arch=amd64 signed-by=/k.gpg] https://nv.example/repos/debian12/x86_64 /", True),
        ("URIs: http://deb.debian.org/debian https://nv.example/repos/debian12/x86_64/", True),
        ("deb https://nv.example/repos/ubuntu2204/x86_64/ /", False),
        ("deb [signed-by=/k.gpg] https://nv.example/repos/debian12/x86_64/extra/ /", False),
    ],
)
def test_a_source_file_names_the_repository_by_its_uri_in_either_format(line: str, names: bool) -> None:
    files = lines_by_file([f"/etc/apt/sources.list.d/other.list:{line}"])
    expected = ["/etc/apt/sources.list.d/other.list"] if names else []
    assert sources_naming(files, "https://nv.example/repos/debian12/x86_64/") == expected
