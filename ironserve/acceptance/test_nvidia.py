"""Acceptance: roles/nvidia (catalog area driver_cuda; python_runtime where it is host-checkable).

Host checks read what is installed (dpkg), what is on disk (version.json, cudnn_version.h, libraries) and
what nvidia-smi reports. The `gpu` group checks the real thing (loaded module, deviceQuery, torch) and is
skipped, saying why, on a host without an NVIDIA GPU.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from ironserve.acceptance.checks import admin_dropins, modprobe_blocks, not_root_only
from ironserve.apt import metadata_lookup
from ironserve.aptindex import exact_closure
from ironserve.facts import AptCandidates, AptProviders, AptShow, RepositoryStanzas
from ironserve.lock import FORBIDDEN_DRIVERS
from ironserve.packages import distro_key, pinned_packages
from roles import StackConfig
from roles.nvidia import (
    CUDA_PROFILE,
    KEYRING,
    NVIDIA_MODULES,
    PREFERENCES,
    SOURCES_LIST,
    UNATTENDED_BLACKLIST,
    locked_set,
    sources_line,
)
from roles.nvidia.facts import AptSourceFiles, sources_naming

NOUVEAU_BLACKLIST = "/etc/modprobe.d/blacklist-nouveau.conf"
# deviceQuery is built from NVIDIA/cuda-samples tag v<X.Y> (the toolkit ships no samples since CUDA 11.6), which
# the role unpacks into /opt/cuda-samples-<X.Y>; the sample's Makefile copies the binary to bin/<arch>/<os>/release.
DEVICE_QUERY = "bin/x86_64/linux/release/deviceQuery"
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
DPKG = "dpkg-query -W -f='${Package}\\t${Version}\\t${db:Status-Abbrev}\\n' "


def _cuda_line(config: StackConfig) -> str:
    return ".".join(config.lock.cuda.split(".")[:2])


def _cuda_home(config: StackConfig) -> str:
    return config.nvidia.cuda_home or f"/usr/local/cuda-{_cuda_line(config)}"


def _distro(host: Any) -> str:
    os_id, _, version = host.run(". /etc/os-release && echo $ID $VERSION_ID").stdout.strip().partition(" ")
    return distro_key(os_id, version)


def _directory(host: Any, config: StackConfig) -> str:
    """The repository directory the profile installs this host's OS from (ValueError: an OS it does not support)."""
    return config.profile.repository_for(_distro(host))


def _pins(host: Any, config: StackConfig) -> dict[str, str]:
    """The lock's packages for this host and every package their exact-version dependencies reach, as the host's
    apt metadata states them (the deploy pins, installs and holds the same set)."""
    roots = pinned_packages(
        config.profile.packages, _directory(host, config), without=config.nvidia.skipped_components()
    )

    locked = locked_set(config, roots)

    def show(specs: tuple[str, ...]) -> list[str]:
        return AptShow().process(host.run(AptShow().command(specs)).stdout.splitlines())

    def providers(names: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
        return AptProviders().process(host.run(AptProviders().command(names)).stdout.splitlines())

    family = host.run(RepositoryStanzas().command(locked.base, locked.upstreams)).stdout.splitlines()
    return exact_closure(roots, metadata_lookup(family, show, providers)).pins


def _repository_line(host: Any, config: StackConfig) -> str:
    assert config.nvidia.repo_url is not None, "nvidia_repo_url is not set (the role refuses to deploy without it)"
    return sources_line(config.nvidia.repo_url, _directory(host, config))


def _repository_uri(host: Any, config: StackConfig) -> str:
    """The repository's URI in the source line, as apt prints it (without the trailing slash)."""
    uri = re.search(r"\]\s+(\S+)", _repository_line(host, config))
    assert uri, "the rendered source line names no URI"
    return uri[1].rstrip("/")


def _origin(line: str) -> str | None:
    """The URI of an `apt-cache policy` origin line (`   500 URI SUITE Packages`), else None."""
    fields = line.split()
    return fields[1].rstrip("/") if len(fields) > 2 and fields[0].lstrip("-").isdigit() else None


def _packet_tag(first_byte: int) -> int | None:
    """The OpenPGP packet tag of a binary packet's first byte (new or old header format); None if not binary."""
    if not first_byte & 0x80:
        return None
    return first_byte & 0x3F if first_byte & 0x40 else (first_byte >> 2) & 0x0F


def _samples_dir(config: StackConfig) -> str:
    return f"/opt/cuda-samples-{_cuda_line(config)}"


def _installed(host: Any, patterns: list[str]) -> dict[str, tuple[str, str]]:
    out = host.run(DPKG + " ".join(f"'{p}'" for p in patterns) + " 2>/dev/null").stdout
    rows = (line.split("\t") for line in out.splitlines())
    return {r[0]: (r[1], r[2].strip()) for r in rows if len(r) == 3 and r[2][1:2] == "i"}


def _smi_drivers(host: Any) -> list[str]:
    listed: str = host.run("nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u").stdout
    return listed.split()


@pytest.mark.invariant("drv-version")
def test_nvidia_smi_reports_the_locked_driver(host: Any, config: StackConfig, observe: Any) -> None:
    drivers = _smi_drivers(host)
    observe(drivers)
    assert drivers == [config.lock.driver]


@pytest.mark.invariant("drv-avoid-525-60-13")
def test_driver_is_not_a_forbidden_one(host: Any, observe: Any) -> None:
    drivers = _smi_drivers(host)
    observe(drivers)
    assert drivers and not set(drivers) & set(FORBIDDEN_DRIVERS)


@pytest.mark.invariant("drv-version", "drv-driver-cuda-compat", "cuda-version", "cudnn-version", "tensorrt-version")
def test_the_whole_lock_is_installed_exactly_and_held(host: Any, config: StackConfig, observe: Any) -> None:
    pins = _pins(host, config)
    installed = _installed(host, list(pins))
    observe({name: version for name, (version, _) in installed.items()})
    assert pins, "the profile pins no packages for this OS"
    assert {name: version for name, (version, _) in installed.items()} == pins
    assert [name for name, (_, status) in installed.items() if not status.startswith("h")] == []


@pytest.mark.invariant("drv-version", "drv-driver-cuda-compat")
def test_apt_pins_every_locked_version_above_1000(host: Any, config: StackConfig, observe: Any) -> None:
    stanzas = host.file(PREFERENCES).content_string.split("\n\n")
    pinned = {}
    for stanza in stanzas:
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith("#"))
        if "Package" in fields:
            pinned[fields["Package"]] = (fields["Pin"].removeprefix("version "), int(fields["Pin-Priority"]))
    observe(pinned)
    assert {name: version for name, (version, _) in pinned.items()} == _pins(host, config)
    assert all(priority > 1000 for _, priority in pinned.values())


@pytest.mark.invariant("drv-version")
def test_unattended_upgrades_leave_the_lock_alone(host: Any, config: StackConfig, observe: Any) -> None:
    content = host.file(UNATTENDED_BLACKLIST).content_string
    observe(content.count("$"))
    assert "Unattended-Upgrade::Package-Blacklist" in content
    for name in _pins(host, config):
        assert f'"{re.escape(name)}$";' in content


@pytest.mark.invariant("drv-version")
def test_repository_source_is_the_rendered_line(host: Any, config: StackConfig, observe: Any) -> None:
    source = host.file(SOURCES_LIST)
    content = source.content_string if source.exists else None
    observe(content.strip() if content else "missing")
    assert content == _repository_line(host, config)


@pytest.mark.invariant("drv-version")
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, observe: Any) -> None:
    # apt installs as root what its source, key and pins name; login shells source the profile script.
    wrong = not_root_only(
        host, [KEYRING, SOURCES_LIST, PREFERENCES, UNATTENDED_BLACKLIST, NOUVEAU_BLACKLIST, CUDA_PROFILE]
    )
    observe(wrong or "all root:root, writable by root alone")
    assert wrong == {}


@pytest.mark.invariant("drv-version")
def test_no_other_apt_source_names_the_repository(host: Any, config: StackConfig, observe: Any) -> None:
    # A second source of the repository with another signed-by (NVIDIA's cuda-keyring package adds one) makes apt
    # refuse every command: "Conflicting values set for option Signed-By".
    files = AptSourceFiles().process(host.run(AptSourceFiles().command()).stdout.splitlines())
    others = [path for path in sources_naming(files, _repository_uri(host, config)) if path != SOURCES_LIST]
    observe(others or "none")
    assert others == []


@pytest.mark.invariant("drv-version")
def test_repository_keyring_is_a_binary_openpgp_keyring(host: Any, observe: Any) -> None:
    source = host.file(SOURCES_LIST)
    signed_by = re.search(r"signed-by=([^\s\]]+)", source.content_string if source.exists else "")
    path = signed_by[1] if signed_by else None
    keyring = host.file(path) if path else None
    data = keyring.content if keyring is not None and keyring.is_file else b""
    observe(f"{path}: {len(data)} bytes, first byte {data[:1].hex() or 'none'}")
    assert path == KEYRING
    # apt's signed-by takes a binary keyring, which opens with a public-key packet (tag 6); armored text does not.
    assert data and _packet_tag(data[0]) == 6


@pytest.mark.invariant("drv-version")
def test_fetched_repository_index_verifies_with_the_keyring(host: Any, config: StackConfig, observe: Any) -> None:
    # A replaced key fails `apt-get update` for this repository only, and apt keeps serving the stale index.
    if not host.exists("gpgv"):
        pytest.skip("no gpgv on this host (apt verifies with another tool here)")
    packages = host.run(
        "apt-get indextargets --format '$(FILENAME)' 'Identifier: Packages' "
        f"'Repo-URI: {_repository_uri(host, config)}/'"
    ).stdout.split()
    # A flat repository's index files sit side by side in apt's lists: ..._Packages and ..._InRelease.
    in_release = packages[0].removesuffix("_Packages") + "_InRelease" if packages else None
    verified = host.run(f"gpgv --keyring {KEYRING} {in_release}") if in_release else None
    observe(verified.stderr.strip().splitlines()[-1:] if verified else "no index target for the repository")
    assert verified is not None and verified.rc == 0


@pytest.mark.invariant("drv-version")
def test_apt_has_fetched_the_repository(host: Any, config: StackConfig, observe: Any) -> None:
    # apt lists a package file only once `apt-get update` fetched it; a source restored without an update is not.
    package_files = host.run("apt-cache policy").stdout.split("Pinned packages:")[0]
    origins = [uri for uri in map(_origin, package_files.splitlines()) if uri]
    observe(origins)
    assert _repository_uri(host, config) in origins


@pytest.mark.invariant("drv-version", "cuda-version")
def test_locked_cuda_toolkit_is_offered_by_the_repository(host: Any, config: StackConfig, observe: Any) -> None:
    # Only NVIDIA's repository carries the toolkit: apt can reinstall the lock from it.
    package = "cuda-toolkit-" + _cuda_line(config).replace(".", "-")
    policy = host.run(f"apt-cache policy {package}").stdout.splitlines()
    candidate = next((line.split()[1] for line in policy if line.strip().startswith("Candidate:")), None)
    origins: dict[str, list[str]] = {}
    version = None
    for line in policy:
        if re.match(r"^ (\*\*\*|   ) \S+ -?\d+$", line):  # a version of the version table; its origins follow
            version = line.split()[-2]
            origins[version] = []
        elif version and (uri := _origin(line)):
            origins[version].append(uri)
    observe({"candidate": candidate, "from": origins.get(candidate or "", [])})
    assert candidate == _pins(host, config).get(package)
    assert _repository_uri(host, config) in origins.get(candidate or "", [])


@pytest.mark.invariant("drv-version", "cuda-version")
def test_apt_candidate_of_every_locked_package_is_its_pin(host: Any, config: StackConfig, observe: Any) -> None:
    # A site's preferences entry above ironserve's pin would move the lock at the next `apt upgrade`.
    pins = _pins(host, config)
    fact = AptCandidates()
    candidates = fact.process(host.run(fact.command(packages=tuple(pins))).stdout.splitlines())
    outranked = {name: candidates.get(name) for name, version in pins.items() if candidates.get(name) != version}
    observe(outranked or "every candidate is its pin")
    assert outranked == {}


@pytest.mark.invariant("cuda-toolkit-without-bundled-driver")
def test_cuda_toolkit_came_without_its_bundled_driver(host: Any, config: StackConfig, observe: Any) -> None:
    # cuda-X-Y and cuda-drivers* pull a driver in; the toolkit package alone does not.
    line = _cuda_line(config).replace(".", "-")
    metas = _installed(host, [f"cuda-{line}", "cuda-drivers*"])
    drivers = _smi_drivers(host)
    observe({"driver": drivers, "driver metapackages": sorted(metas)})
    assert metas == {}
    assert drivers == [config.lock.driver]


@pytest.mark.invariant("cuda-version")
def test_cuda_toolkit_version_on_disk(host: Any, config: StackConfig, observe: Any) -> None:
    home = _cuda_home(config)
    version = json.loads(host.file(f"{home}/version.json").content_string)["cuda"]["version"]
    nvcc = host.run(f"{home}/bin/nvcc --version").stdout
    package = "cuda-toolkit-" + _cuda_line(config).replace(".", "-")
    packaged = _installed(host, [package]).get(package, ("", ""))[0]
    observe(version)
    # version.json names the CUDA line (older toolkits date-stamp it: 11.8.20220929); the package the full version.
    assert version.split(".")[:2] == config.lock.cuda.split(".")[:2]
    assert packaged.split("-")[0] == config.lock.cuda
    assert f"release {_cuda_line(config)}," in nvcc


@pytest.mark.invariant("cuda-no-12x")
def test_no_other_cuda_toolkit_and_cuda_link_is_the_lock(host: Any, config: StackConfig, observe: Any) -> None:
    toolkits = host.run("ls -d /usr/local/cuda-* 2>/dev/null").stdout.split()
    link = host.run("readlink -f /usr/local/cuda").stdout.strip()
    observe({"toolkits": toolkits, "/usr/local/cuda": link})
    assert toolkits == [_cuda_home(config)]
    assert link == _cuda_home(config)


@pytest.mark.invariant("cudnn-version", "cudnn-verify-method")
def test_cudnn_header_defines_the_locked_version(host: Any, config: StackConfig, observe: Any) -> None:
    # The correction: cudnn_version.h (CUDNN_MAJOR is a header macro, not a string in the library).
    header = host.run(
        "cat $(ls /usr/include/cudnn_version.h /usr/include/x86_64-linux-gnu/cudnn_version_v8.h 2>/dev/null | head -1)"
    ).stdout
    defines = dict(
        line.split()[1:3] for line in header.splitlines() if line.startswith("#define CUDNN_") and len(line.split()) > 2
    )
    version = ".".join(defines.get(k, "?") for k in ("CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL"))
    observe(version)
    assert version == config.lock.cudnn.version
    major = config.lock.cudnn.version.split(".")[0]
    assert host.file(f"/usr/lib/x86_64-linux-gnu/libcudnn.so.{major}").exists


@pytest.mark.invariant("tensorrt-version")
def test_tensorrt_is_the_locked_cuda_build(host: Any, config: StackConfig, observe: Any) -> None:
    trt = config.lock.tensorrt
    if trt is None:
        pytest.skip(f"profile {config.profile_name} locks no TensorRT")
    major = trt.version.split(".")[0]
    installed = _installed(host, [f"libnvinfer{major}"])
    version = installed.get(f"libnvinfer{major}", ("absent", ""))[0]
    observe(version)
    # The correction: the pin is the package flavour (+cuda11.8), not a CUDA patch level.
    assert version == f"{trt.version}-1+cuda{trt.cuda}"
    assert host.file(f"/usr/lib/x86_64-linux-gnu/libnvinfer.so.{'.'.join(trt.version.split('.')[:3])}").exists


@pytest.mark.invariant("drv-no-distro-driver")
def test_only_the_pinned_driver_packages_are_installed(host: Any, config: StackConfig, observe: Any) -> None:
    pins = _pins(host, config)
    drivers = {n: v for n, (v, _) in _installed(host, ["nvidia-driver*"]).items()}
    observe(drivers)
    if config.nvidia.driver_method == "runfile":
        assert drivers == {}  # NVIDIA's runfile is the driver: no distribution driver package beside it
        return
    assert drivers
    assert all(pins.get(name) == version for name, version in drivers.items())


@pytest.mark.invariant("drv-install-runfile-flags")
def test_runfile_installed_without_opengl_files_and_x_check(
    host: Any, config: StackConfig, container_kind: str | None, observe: Any
) -> None:
    if config.nvidia.driver_method != "runfile":
        pytest.skip("nvidia_driver_method is apt: the driver comes from the pinned packages, not the runfile")
    log = host.file("/var/log/nvidia-installer.log").content_string.splitlines()
    start = log.index("nvidia-installer command line:") + 2 if "nvidia-installer command line:" in log else len(log)
    options = []
    for line in log[start:]:  # the block of indented arguments after ./nvidia-installer
        if not line.startswith("    "):
            break
        options.append(line.strip())
    version = host.run("nvidia-installer --version").stdout
    observe(options)
    assert {"--silent", "--no-opengl-files", "--no-x-check"} <= set(options)
    # --dkms rebuilds the module for new kernels; a container's kernel is the machine's (userland only).
    assert ("--no-kernel-module" if container_kind else "--dkms") in options
    assert f"version {config.lock.driver}" in version
    assert not host.file("/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0").exists


@pytest.mark.invariant("drv-update-initramfs")
def test_nouveau_is_blacklisted(host: Any, observe: Any) -> None:
    content = host.file(NOUVEAU_BLACKLIST).content_string
    observe(content.count("nouveau"))
    assert "blacklist nouveau" in content.splitlines()


@pytest.mark.invariant("drv-version")
def test_no_modprobe_rule_blocks_an_nvidia_module(host: Any, observe: Any) -> None:
    blocking = modprobe_blocks(host, list(NVIDIA_MODULES))
    observe(blocking or "none")
    assert blocking == []


@pytest.mark.invariant("drv-update-initramfs")
def test_every_initrd_was_rebuilt_after_the_blacklist(
    host: Any, config: StackConfig, container_kind: str | None, observe: Any
) -> None:
    if not config.nvidia.rebuild_initramfs:
        pytest.skip("nvidia_rebuild_initramfs is off for this host")
    initrds = host.run("ls /boot/initrd.img-* 2>/dev/null").stdout.split()
    if not initrds and container_kind:
        pytest.skip(f"no initrd in a {container_kind} container: the kernel and its initramfs are the machine's")
    stale = [f for f in initrds if host.run(f"test {f} -ot {NOUVEAU_BLACKLIST}").succeeded]
    observe({"initrds": len(initrds), "stale": stale})
    assert initrds and stale == []


@pytest.mark.invariant("drv-install-kernel-headers")
def test_kernel_headers_of_the_running_kernel(
    host: Any, config: StackConfig, container_kind: str | None, observe: Any
) -> None:
    release = host.run("uname -r").stdout.strip()
    if not config.nvidia.kernel_headers:
        pytest.skip("nvidia_kernel_headers is off for this host (prebuilt driver module, or headers in the image)")
    if container_kind:
        pytest.skip(f"a {container_kind} container runs the machine's kernel ({release}); no headers to build against")
    installed = _installed(host, [f"linux-headers-{release}"])
    observe(sorted(installed))
    assert f"linux-headers-{release}" in installed


@pytest.mark.invariant("cuda-home-env")
def test_cuda_home_is_set_system_wide(host: Any, config: StackConfig, observe: Any) -> None:
    home = _cuda_home(config)
    login = host.run("bash -lc 'echo $CUDA_HOME'").stdout.strip()
    environment = host.file("/etc/environment").content_string.splitlines()
    observe(login)
    assert f"export CUDA_HOME={home}" in host.file("/etc/profile.d/cuda.sh").content_string
    assert f"CUDA_HOME={home}" in environment
    assert login == home


def test_persistence_daemon_enabled_and_running(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.nvidia.persistenced:
        pytest.skip("nvidia_persistenced is off in the inventory")
    service = host.service("nvidia-persistenced")
    dropins = admin_dropins(host, "nvidia-persistenced.service")
    observe({"enabled": service.is_enabled, "running": service.is_running, "admin drop-ins": dropins})
    assert service.is_enabled and service.is_running
    assert dropins == []


@pytest.mark.invariant("gpu-firmware-version")
def test_every_card_reports_one_vbios_per_model(host: Any, observe: Any) -> None:
    # The correction: no FP8 firmware expectation; record the VBIOS per card and flag cards that differ.
    rows = host.run("nvidia-smi --query-gpu=index,name,vbios_version --format=csv,noheader").stdout.splitlines()
    cards = [tuple(cell.strip() for cell in row.split(",")) for row in rows if row.strip()]
    observe({index: vbios for index, _, vbios in cards})
    assert cards and all(vbios for _, _, vbios in cards)
    by_model: dict[str, set[str]] = {}
    for _, name, vbios in cards:
        by_model.setdefault(name, set()).add(vbios)
    assert all(len(versions) == 1 for versions in by_model.values()), by_model


@pytest.mark.invariant("drv-mac-not-blocking-nvidiactl")
def test_no_mandatory_access_control_denial_on_nvidia_devices(
    host: Any, container_kind: str | None, observe: Any
) -> None:
    if container_kind:
        pytest.skip(f"the kernel log belongs to the machine, not to a {container_kind} container")
    denials = host.run(
        "journalctl -k --since -1h --no-pager | grep -Eci 'avc:.*denied.*nvidia|apparmor=\"DENIED\".*nvidia'"
    ).stdout.strip()
    observe(denials)
    assert denials == "0"


@pytest.mark.invariant("cri-nvidia-runtime")
def test_container_toolkit_is_the_locked_release(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.nvidia.container_toolkit or config.lock.container_toolkit is None:
        pytest.skip("the NVIDIA container toolkit is not part of this host's lock (nvidia_container_toolkit)")
    ctk = host.run("nvidia-ctk --version").stdout
    runtime = host.file(config.container_runtime.nvidia_binary)
    observe(ctk.splitlines()[0] if ctk else None)
    assert f"version {config.lock.container_toolkit}" in ctk
    assert runtime.exists and runtime.mode & 0o111
    assert host.file(TOOLKIT_CONFIG).exists


@pytest.mark.invariant("drv-version")
def test_module_is_dkms_built_for_every_installed_kernel(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.nvidia.dkms:
        pytest.skip("nvidia_dkms is off for this host (the module comes prebuilt)")
    kernels = host.run(
        'for d in /lib/modules/*; do k="${d##*/}"; [ -e "/boot/vmlinuz-$k" ] && echo "$k"; done; true'
    ).stdout.split()
    if not kernels:
        pytest.skip("no kernel image in /boot: a container runs the machine's kernel")
    status = host.run("dkms status").stdout
    driver = re.escape(config.lock.driver)
    built = {}
    for k in kernels:  # dkms 3: `nvidia-current/525.85.12, <k>, x86_64: installed`; dkms 2: `nvidia, 525.85.12, ...`
        listed = re.search(rf"^nvidia[\w-]*(/|, ){driver}, {re.escape(k)}, [^:]+: installed", status, re.M)
        main = host.run(f"ls /lib/modules/{k}/updates/dkms/ | grep -Eqx 'nvidia(-current)?\\.ko(\\.(xz|zst|gz))?'")
        built[k] = bool(listed) and main.succeeded
    observe(built)
    assert all(built.values()), status


@pytest.mark.invariant("drv-version")
def test_loaded_module_is_the_installed_driver(host: Any, config: StackConfig, observe: Any) -> None:
    module = host.run("cat /sys/module/nvidia/version 2>/dev/null || head -n 1 /proc/driver/nvidia/version").stdout
    if not module.strip():
        pytest.skip("no nvidia kernel module loaded on this host (no GPU, or a container without one)")
    pending = host.file("/run/ironserve/reboot-required")
    observe({"module": module.strip(), "reboot pending": pending.content_string.strip() if pending.exists else None})
    assert config.lock.driver in module.split(), "reboot into the installed driver (ironserve_reboot_policy)"


def test_cuda_samples_source_is_staged(host: Any, config: StackConfig, observe: Any) -> None:
    if config.nvidia.cuda_samples_url is None:
        pytest.skip("nvidia_cuda_samples_url is not set: the cuda-samples source is not staged")
    source = _samples_dir(config)
    stamp = host.file(f"{source}/.ironserve-source-sha256")
    observe(stamp.content_string.strip() if stamp.exists else None)
    assert stamp.exists and stamp.content_string.strip() == config.nvidia.cuda_samples_sha256
    assert host.file(f"{source}/Samples/1_Utilities/deviceQuery/Makefile").exists


# --- on a real GPU only -------------------------------------------------------------------------------------


@pytest.fixture
def gpu(host: Any) -> None:
    if not host.file("/dev/nvidiactl").exists:
        pytest.skip("no NVIDIA GPU on this host (/dev/nvidiactl absent): real-hardware check")


def _torch(host: Any, code: str) -> str:
    result = host.run(f"python3 -c {json.dumps('import torch;' + code)}")
    if "No module named 'torch'" in result.stderr:
        pytest.skip("torch is not installed for the host's python3 (the inference service's venv carries it)")
    assert result.rc == 0, result.stderr
    return str(result.stdout.strip())


@pytest.mark.gpu
@pytest.mark.invariant("drv-version", "drv-update-initramfs")
def test_loaded_module_is_the_locked_driver(host: Any, gpu: None, config: StackConfig, observe: Any) -> None:
    version = host.file("/proc/driver/nvidia/version").content_string
    modules = host.run("lsmod").stdout.split()
    observe(version.splitlines()[0] if version else None)
    assert config.lock.driver in version
    assert "nvidia" in modules and "nouveau" not in modules


@pytest.mark.gpu
@pytest.mark.invariant("drv-version")
def test_real_nvidia_smi_reports_the_locked_driver_of_the_loaded_module(
    host: Any, gpu: None, config: StackConfig, observe: Any
) -> None:
    # On real hardware nvidia-smi answers through the loaded module (a stale one: "Driver/library version mismatch").
    smi = host.run("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    module = host.file("/proc/driver/nvidia/version").content_string
    observe(smi.stdout.split() or smi.stdout + smi.stderr)
    assert smi.rc == 0, smi.stdout + smi.stderr
    assert set(smi.stdout.split()) == {config.lock.driver}
    assert f"  {config.lock.driver}  " in module


@pytest.mark.gpu
@pytest.mark.invariant("cuda-devicequery-pass")
def test_device_query_passes(host: Any, gpu: None, config: StackConfig, observe: Any) -> None:
    """Build Samples/1_Utilities/deviceQuery from the staged cuda-samples source with the locked nvcc, run it."""
    source = _samples_dir(config)
    if not host.file(f"{source}/Samples/1_Utilities/deviceQuery/Makefile").exists:
        pytest.fail(f"{source} holds no cuda-samples source: set nvidia_cuda_samples_url and _sha256, then deploy")
    arch = config.profile.gpu.compute_capability.replace(".", "")
    build = host.run(f"make -C {source}/Samples/1_Utilities/deviceQuery CUDA_PATH={_cuda_home(config)} SMS={arch} 2>&1")
    assert build.rc == 0, build.stdout[-2000:]
    out = host.run(f"{source}/{DEVICE_QUERY}").stdout.strip().splitlines()
    observe(out[-1] if out else None)
    assert out and out[-1] == "Result = PASS"


@pytest.mark.gpu
@pytest.mark.invariant("py-torch-cuda-available", "drv-driver-cuda-compat")
def test_torch_sees_the_gpu(host: Any, gpu: None, config: StackConfig, observe: Any) -> None:
    out = _torch(host, "print(torch.cuda.is_available(), torch.version.cuda)")
    observe(out)
    assert out == f"True {_cuda_line(config)}"


@pytest.mark.gpu
@pytest.mark.invariant("py-torch-device-props")
def test_torch_device_properties(host: Any, gpu: None, config: StackConfig, observe: Any) -> None:
    out = _torch(host, "p=torch.cuda.get_device_properties(0);print(f'{p.major}.{p.minor}')")
    observe(out)
    assert out == config.profile.gpu.compute_capability


@pytest.mark.gpu
@pytest.mark.invariant("cuda-nccl-present")
def test_nccl_is_present(host: Any, gpu: None, observe: Any) -> None:
    out = _torch(host, "print(torch.cuda.nccl.version())")
    observe(out)
    assert out.startswith("(") or out[:1].isdigit()
