"""The lock's exact-version closure and repository check on real repository metadata and real apt output.

Captures: tests/data/realworld/apt/ (this repository's, each with a .source note) and ../shared/samples/realworld/apt/
(read from there, never copied; those tests skip where that folder is absent).
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ironserve.aptindex import Index, exact_closure, repository_problems, unmet_within
from ironserve.facts import parse_simulation
from ironserve.profiles import read_profile

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "realworld" / "apt"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "samples" / "realworld"
DEBIAN_DRIVER = CAPTURES / "debian12-non-free-nvidia-graphics-drivers-535.261.03-packages.txt"
# apt's own line for an unmet relation: ` pkg : Depends: dep (= version) but ...` (the package name only on the first)
UNMET = re.compile(r"^\s*(?:(?P<package>[a-z0-9][a-z0-9+.-]*) :)?\s*Depends: (?P<dep>[a-z0-9+.-]+) \(= (?P<v>[^)]+)\)")


def shared(name: str) -> str:
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared captures lie beside the checkout in CI")
    return path.read_text()


def stanzas_from_unmet(text: str, version: str | None = None) -> str:
    """Packages stanzas holding exactly the exact-version relations apt printed as unmet: `package` at `version`
    (default: the version its first exact relation names, as NVIDIA's siblings share it) depends on each
    `dep (= v)` its lines name (the capture's relations, nothing added)."""
    depends: dict[str, list[str]] = {}
    package = None
    for line in text.splitlines():
        match = UNMET.match(line)
        if match:
            package = match["package"] or package
            assert package is not None
            depends.setdefault(package, []).append(f"{match['dep']} (= {match['v']})")
    return "\n\n".join(
        f"Package: {name}\nVersion: {version or relations[0].split('= ')[1][:-1]}\nDepends: {', '.join(relations)}"
        for name, relations in depends.items()
    )


def test_closure_of_debian_driver_packaging_follows_every_exact_relation() -> None:
    index = Index.parse(DEBIAN_DRIVER.read_text())
    closure = exact_closure({"nvidia-driver": "535.261.03-1"}, lambda wanted, required: index)
    assert closure.ok
    # nvidia-driver's own `=` Depends, and what they reach in turn (nvidia-driver-libs -> libgl1-nvidia-glvnd-glx ->
    # libglx-nvidia0 -> libnvidia-glcore -> libnvidia-glvkspirv)
    for name in ("nvidia-driver-libs", "nvidia-driver-bin", "xserver-xorg-video-nvidia", "nvidia-vdpau-driver"):
        assert closure.reached_by[name] == "nvidia-driver"
    assert closure.pins["libnvidia-glvkspirv"] == "535.261.03-1"
    assert closure.reached_by["nvidia-kernel-dkms"] == "nvidia-driver"  # `nvidia-kernel-dkms (= v) | ...`: first
    # `firmware-nvidia-gsp (= 535.261.03) | firmware-nvidia-gsp-535.261.03`: not carried, so apt takes the other
    assert "firmware-nvidia-gsp" not in closure.pins
    assert "nvidia-smi" not in closure.pins  # not reached from nvidia-driver: a compute host asks for it
    # Same build through a virtual name: nvidia-kernel-dkms depends on `nvidia-kernel-support--v1`, which
    # nvidia-kernel-support 535.261.03-1 provides; left to apt, a newer build of it would need a newer
    # nvidia-alternative (=) than the one pinned.
    assert closure.reached_by["nvidia-kernel-support"] == "nvidia-kernel-dkms"
    # Same build through a range or unversioned relation: nvidia-legacy-check (>= 495), libnvidia-ml1 (>= 319).
    assert closure.pins["nvidia-legacy-check"] == closure.pins["libnvidia-ml1"] == "535.261.03-1"


def test_a_never_published_version_is_named_with_what_the_repository_offers() -> None:
    index = Index.parse(DEBIAN_DRIVER.read_text())
    _, problems = repository_problems({"nvidia-driver": "525.85.02-1"}, index)
    assert problems == [
        "nvidia-driver 525.85.02-1 (pinned by the lock) is not in the repository; it offers nvidia-driver 535.261.03-1"
    ]


def test_a_sibling_pinned_at_another_build_clashes() -> None:
    text = shared("apt/tensorrt-8.6.1.6-cuda12.0-wsl-trt3525.txt")
    index = Index.parse(stanzas_from_unmet(text, "8.6.1.6-1+cuda12.0"))
    closure = exact_closure(
        {"tensorrt": "8.6.1.6-1+cuda12.0", "libnvinfer8": "8.6.1.6-1+cuda11.8"}, lambda wanted, required: index
    )
    assert closure.clashes == [
        "tensorrt 8.6.1.6-1+cuda12.0 needs libnvinfer8 (= 8.6.1.6-1+cuda12.0); the lock asks for 8.6.1.6-1+cuda11.8"
    ]


def test_a_required_sibling_the_repository_lacks_is_missing() -> None:
    index = Index.parse("Package: tensorrt\nVersion: 8.6.1.6-1+cuda11.8\nDepends: libnvinfer8 (= 8.6.1.6-1+cuda11.8)")
    _, problems = repository_problems({"tensorrt": "8.6.1.6-1+cuda11.8"}, index)
    assert problems == [
        "libnvinfer8 8.6.1.6-1+cuda11.8 (required by tensorrt (= 8.6.1.6-1+cuda11.8)) is not in the repository; "
        "it offers no libnvinfer8 at all"
    ]


def test_a_range_relation_the_pinned_set_breaks() -> None:
    """nvidia-container-toolkit needs libnvidia-container-tools (>= its version): pinning the tools lower breaks it."""
    index = Index.parse(
        "Package: nvidia-container-toolkit\nVersion: 1.13.5-1\n"
        "Depends: nvidia-container-toolkit-base (= 1.13.5-1), libnvidia-container-tools (>= 1.13.5-1), "
        "libnvidia-container-tools (<< 2.0.0)\n\nPackage: libnvidia-container-tools\nVersion: 1.13.4-1\n"
    )
    pins = {"nvidia-container-toolkit": "1.13.5-1", "libnvidia-container-tools": "1.13.4-1"}
    assert unmet_within(pins, index) == [
        "nvidia-container-toolkit 1.13.5-1 depends on libnvidia-container-tools (>= 1.13.5-1), but the set pins "
        "libnvidia-container-tools 1.13.4-1"
    ]


def test_apt_simulation_reasons_are_apt_s_own_lines() -> None:
    text = shared("apt/tensorrt-8.6.1.6-cuda12.0-ubuntu2004-trt3774.txt")
    simulation = parse_simulation([*text.splitlines(), "apt-get exit 100"])
    assert not simulation.ok
    assert simulation.reasons[0] == (
        "tensorrt : Depends: libnvinfer-bin (= 8.6.1.6-1+cuda12.0) but 10.0.0.6-1+cuda12.4 is to be installed"
    )
    missing = parse_simulation(["E: Version '525.85.02-1' for 'nvidia-driver' was not found", "apt-get exit 100"])
    assert missing.reasons == ["E: Version '525.85.02-1' for 'nvidia-driver' was not found"]
    assert parse_simulation(["Inst tensorrt (8.6.1.6-1+cuda11.8 repo [amd64])", "apt-get exit 0"]).ok


def test_check_repo_names_the_old_lock_s_driver_and_what_is_offered(tmp_path: Path) -> None:
    """`ironserve lock --check-repo FILE --os debian12` against real Debian metadata: the lock's debian11 driver set
    is not there (Debian's own archive carries 535), and the command says so and exits 1."""
    result = subprocess.run(
        [sys.executable, "-m", "ironserve", "lock", "--check-repo", str(DEBIAN_DRIVER), "--os", "debian12"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stderr
    assert "nvidia-driver 525.85.12-1 (pinned by the lock) is not in the repository; it offers nvidia-driver " in (
        result.stdout
    )
    unsupported = subprocess.run(
        [sys.executable, "-m", "ironserve", "lock", "--check-repo", str(DEBIAN_DRIVER), "--os", "ubuntu2004"],
        capture_output=True,
        text=True,
    )
    assert unsupported.returncode == 2  # a usage mistake, as every refused input
    assert "the OS ubuntu2004 is not one profile r740-a10's lock is published for" in unsupported.stderr
    assert "supported: ubuntu2204 (from ubuntu2204), debian12 (from debian11)" in unsupported.stderr


def test_every_profile_names_a_repository_for_every_os_it_supports() -> None:
    for name in ("r740-a10", "a100-cuda117"):
        profile = read_profile(name)
        assert profile.platforms["ubuntu2204"] == "ubuntu2204"
        # NVIDIA's debian12 directory starts at CUDA 12.3: a CUDA 11.x lock comes from debian11 there
        assert profile.platforms["debian12"] == "debian11"
        with pytest.raises(ValueError, match=r"not one profile .* is published for"):
            profile.repository_for("ubuntu2004")


# Captures of apt refusing a set whose exact-version siblings were not pinned, each with the refused package.
REFUSALS = {
    "apt/tensorrt-8.6.1.6-cuda12.0-ubuntu2004-trt3774.txt": "tensorrt",
    "apt/tensorrt-8.6.1.6-cuda12.0-wsl-trt3525.txt": "tensorrt",
    "apt/tensorrt-8.4.1-cuda11.6-full-depends-autoware2807.txt": "tensorrt",
    "apt/libnvinfer-bin-8.6.0.12-cuda11.8-ubuntu2204-trt1741.txt": "libnvinfer-bin",
    "apt/libnvinfer-dev-8.6.1.6-cuda11.8-ubuntu2004-notes.txt": "libnvinfer-dev",
    "apt/nvidia-driver-565-ubuntu-resolver-davidshare3.txt": "nvidia-driver-565",
    "apt/nvidia-driver-550-open-resolver-dataproc1342.txt": "nvidia-driver-550-open",
}


@pytest.mark.parametrize("capture", sorted(REFUSALS))
def test_every_sibling_apt_refused_is_in_the_closure(capture: str) -> None:
    """Whatever a real apt refused for want of an exact-version sibling, the closure of that package pins."""
    text = shared(capture)
    index = Index.parse(stanzas_from_unmet(text))
    root = REFUSALS[capture]
    (version,) = index.versions(root)
    closure = exact_closure({root: version}, lambda wanted, required: index)
    refused = {m["dep"]: m["v"] for m in map(UNMET.match, text.splitlines()) if m}
    assert refused and all(closure.pins[name] == wanted for name, wanted in refused.items())


def test_profiles_follow_what_the_repository_captures_show() -> None:
    """Each capture's finding, held against both profiles' pins."""
    profiles = [read_profile(name) for name in ("r740-a10", "a100-cuda117")]
    pinned = [{n: v for d in (p.packages or {}).values() for c in d.values() for n, v in c.items()} for p in profiles]
    # NVIDIA's debian12 directory's lowest nvidia-driver is 545.23.06-1: no CUDA 11.x lock is taken from it.
    debian12 = shared("apt/nvidia-driver-policy-debian12-vaapi312.txt")
    assert "545.23.06-1 500" in debian12 and "525." not in debian12
    assert all(p.platforms["debian12"] != "debian12" for p in profiles)
    # tensorrt 8.6.1.6 is published for +cuda11.8 and +cuda12.0: the pin names the CUDA 11.8 build.
    policy = shared("apt/tensorrt-policy-ubuntu2004.txt")
    assert "8.6.1.6-1+cuda11.8" in policy and pinned[0]["tensorrt"] == "8.6.1.6-1+cuda11.8"
    # cuda-11-8 pulls a driver (cuda-drivers-525, cuda-runtime-11-8): the lock takes cuda-toolkit-11-8 instead.
    assert "cuda-11-8 : Depends:" in shared("apt/cuda-11-8-pulls-cuda-drivers-525-ubuntu2004-forum238891.txt")
    assert all("cuda-11-8" not in pins and "cuda-11-7" not in pins for pins in pinned)
    # cuda-drivers-NNN depends with >= only, so it pins nothing: no profile asks for it.
    assert "(>= 535.183.01)" in shared("apt/cuda-drivers-535-stanza-dstack2355.txt")
    assert not any(name.startswith("cuda-drivers") for pins in pinned for name in pins)
    # ubuntu2204 starts at R515: the a100 profile's 515 is the oldest branch there.
    assert "No package matching 'cuda-drivers-510'" in shared("apt/cuda-drivers-510-missing-ubuntu2204-ansible65.txt")
    assert profiles[1].lock.driver.startswith("515.")
    # fabric manager (NVSwitch systems) is not in the debian11 directory and no profile needs it (PCIe cards).
    assert "cuda-drivers-fabricmanager-" in shared("apt/fabricmanager-apt-search-debian11-ubuntu2204-fm2.txt")
    assert "550.54.14-1" in shared("apt/cuda-drivers-fabricmanager-policy-ubuntu2204-fm3.txt")
    assert not any("fabricmanager" in name for pins in pinned for name in pins)
    # The container toolkit's packages move together at one version (NVIDIA/nvidia-container-toolkit#59).
    jetson = shared("apt/nvidia-container-toolkit-1.13.1-install-jetson-nct59.txt")
    assert "nvidia-container-toolkit-base=1.13.1-1" in jetson
    toolkit = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools")
    assert all(len({pins[name] for name in (*toolkit, "libnvidia-container1")}) == 1 for pins in pinned)


def test_check_repo_reads_a_repository_layout_by_url(tmp_path: Path) -> None:
    """A base URL (file:// here, as http(s):// on a site) is read at <dir>/x86_64/Packages.gz for each OS."""
    index_dir = tmp_path / "debian11" / "x86_64"
    index_dir.mkdir(parents=True)
    (index_dir / "Packages.gz").write_bytes(gzip.compress(DEBIAN_DRIVER.read_bytes()))
    result = subprocess.run(
        [sys.executable, "-m", "ironserve", "lock", "--check-repo", tmp_path.as_uri()],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stderr
    assert f"debian12 (debian11, {tmp_path.as_uri()}/debian11/x86_64/Packages.gz): 13 problem(s)" in result.stdout
    assert "ubuntu2204 (ubuntu2204, " in result.stdout and "no index could be read" in result.stdout
