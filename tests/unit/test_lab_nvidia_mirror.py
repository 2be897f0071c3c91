"""The lab NVIDIA mirror (ironserve_lab/aptrepo.py and its files/nvidia-repository.yaml) against real metadata.

Its package names, versions and relations follow captured apt output and control fields (../shared/samples/realworld/
apt, tests/data/realworld/apt), so apt's own resolver fails in the lab where it fails against NVIDIA's repository: a
`tensorrt` pinned without its `=`-pinned siblings, a driver version that was never released. The resolver checks
build the directories' indexes into a temporary folder and run `apt-get --simulate` in a scratch apt configuration
(its own sources, lists, status and cache; nothing of this machine's apt is read or changed).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ironserve.paths import REPO_ROOT
from ironserve_lab import aptrepo
from ironserve_lab.aptrepo import StandinPackage, format_relations, parse_relations, placeholders

CHECKOUT_APT = REPO_ROOT / "tests" / "data" / "realworld" / "apt"
DEBIAN_CAPTURE = CHECKOUT_APT / "debian12-non-free-nvidia-graphics-drivers-535.261.03-packages.txt"
DEBIAN_CAPTURED = "535.261.03-1"
MIRROR_README = Path(aptrepo.__file__).with_name("NVIDIA-MIRROR.md")
NEVER_RELEASED = "525.85.02"
TRT = "8.6.1.6"
TRT_SUFFIXES = ("+cuda11.8", "+cuda12.0")
TRT_DECOYS = ("10.0.0.6-1+cuda12.4", "8.6.1.6-1+cuda12.0")  # what apt picks over a lone +cuda11.8 pin
DRIVER_ROOTS = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1", "nvidia-persistenced")


def shared_apt() -> Path:
    """The real captures beside the checkout (../shared/samples/realworld/apt; IRONSERVE_SAMPLES overrides the
    realworld folder); the calling test skips, saying where it looked, when they are not there."""
    realworld = Path(os.environ.get("IRONSERVE_SAMPLES", REPO_ROOT.parent / "shared" / "samples" / "realworld"))
    if not (realworld / "apt").is_dir():
        pytest.skip(f"the real apt captures are not under {realworld}/apt (set IRONSERVE_SAMPLES to the folder)")
    return realworld / "apt"


def offered(distro: str = "debian11") -> dict[tuple[str, str], StandinPackage]:
    return {(p.name, p.version): p for p in aptrepo.catalog(distro)}


def exact(package: StandinPackage) -> set[tuple[str, str]]:
    """(name, version) of each `name (= version)` the package's Depends and Pre-Depends state."""
    relations = parse_relations(package.depends) + parse_relations(package.pre_depends)
    return {(name, version) for group in relations for name, op, version in group if op == "=" and version}


# --- (a) every captured `=` relation is in the mirror's data --------------------------------------------------------

UNMET = re.compile(r"^\s*(?:(?P<package>\S+) :)?\s*(?:Depends|PreDepends): (?P<dep>\S+) \(= (?P<version>[^)]+)\)")
BUT = re.compile(r"but (?P<candidate>\S+) is to be installed")


def captured_unmet(text: str) -> list[tuple[str, str, str, str | None]]:
    """apt's "unmet dependencies" lines -> (package, dependency, required version, the candidate apt named); a
    "but ..." on the next line (re-wrapped output) belongs to the line before."""
    found: list[tuple[str, str, str, str | None]] = []
    package = None
    for line in text.splitlines():
        match = UNMET.match(line)
        if match:
            package = match["package"] or package
            assert package is not None, line
            but = BUT.search(line)
            found.append((package, match["dep"], match["version"], but["candidate"] if but else None))
        elif found and line.strip().startswith("but ") and found[-1][3] is None:
            but = BUT.search(line)
            if but:
                found[-1] = (*found[-1][:3], but["candidate"])
    return found


TRT_CAPTURES = [
    "tensorrt-8.6.1.6-cuda12.0-ubuntu2004-trt3774.txt",
    "tensorrt-8.6.1.6-cuda12.0-wsl-trt3525.txt",
    "libnvinfer-dev-8.6.1.6-cuda11.8-ubuntu2004-notes.txt",
    "libnvinfer-bin-8.6.0.12-cuda11.8-ubuntu2204-trt1741.txt",  # 8.6.0.12's structure, carried to 8.6.1.6
]


@pytest.mark.parametrize("capture", TRT_CAPTURES)
def test_every_captured_tensorrt_exact_relation_is_in_the_mirror_for_both_cuda_builds(capture: str) -> None:
    relations = captured_unmet((shared_apt() / capture).read_text())
    assert relations, f"{capture}: no `Depends: X (= V)` line read"
    mirror = offered()
    for package, dependency, version, candidate in relations:
        captured_trt = version.split("-")[0]
        assert captured_trt in (TRT, "8.6.0.12"), version
        for suffix in TRT_SUFFIXES:
            ours = f"{TRT}-1{suffix}"  # the version substituted consistently: the package's and its sibling's
            assert (package, ours) in mirror, f"{package} {ours} is not offered"
            assert (dependency, ours) in exact(mirror[(package, ours)]), (
                f"{package} {ours} lacks {dependency} (= {ours})"
            )
            assert (dependency, ours) in mirror
        if candidate in TRT_DECOYS:  # the newer build apt named is offered too, so the lab's apt names it as well
            assert (dependency, candidate) in mirror, (dependency, candidate)


def test_tensorrt_depends_covers_the_complete_8_4_list_and_the_8_6_members() -> None:
    """8.4.1's complete list (autoware2807) minus nothing: 8.6 keeps those names; the members the local repo's .debs
    show for 8.6.1.6 (tests/data) are all offered at both CUDA builds."""
    complete = {
        dep
        for _, dep, _, _ in captured_unmet(
            (shared_apt() / "tensorrt-8.4.1-cuda11.6-full-depends-autoware2807.txt").read_text()
        )
    }
    assert len(complete) == 10
    mirror = offered()
    members = re.findall(
        r"dpkg -i (\S+?)_8\.6\.1\.6-1\+cuda11\.8_(?:amd64|all)\.deb",
        (CHECKOUT_APT / "tensorrt-8.6.1.6-cuda11.8-local-repo-debs-ubuntu2204-notes.txt").read_text(),
    )
    assert len(members) == 20
    for suffix in TRT_SUFFIXES:
        version = f"{TRT}-1{suffix}"
        assert complete <= {name for name, _ in exact(mirror[("tensorrt", version)])}
        assert {(member, version) for member in members} <= set(mirror)
    assert mirror[("libnvinfer-samples", f"{TRT}-1+cuda11.8")].architecture == "all"  # libnvinfer-samples_..._all.deb


def _blocks(text: str) -> list[dict[str, str]]:
    """A Packages-style file -> its stanzas, field -> value (continuation lines joined)."""
    result = []
    for block in text.strip().split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in block.splitlines():
            if line.startswith((" ", "\t")):
                fields[key] += " " + line.strip()
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        result.append(fields)
    return result


def stanzas(text: str) -> dict[str, dict[str, str]]:
    """A Packages-style file of one version per package -> package -> field -> value."""
    return {fields["Package"]: fields for fields in _blocks(text)}


def substituted(text: str, version: str) -> str:
    """The capture's relation text with its version replaced as the data file does (535.261.03-1 -> version,
    535.261.03 -> upstream, the branch in `(>= 535)` -> branch)."""
    values = placeholders(version)
    upstream = placeholders(DEBIAN_CAPTURED)["upstream"]
    text = text.replace(DEBIAN_CAPTURED, version).replace(upstream, values["upstream"])
    return text.replace("(>= 535)", f"(>= {values['branch']})")


def _driver_versions(distro: str) -> list[str]:
    return sorted({p.version for p in aptrepo.catalog(distro) if p.name == "nvidia-driver"})


@pytest.mark.parametrize("distro", aptrepo.DISTROS)
def test_debian_driver_sets_carry_the_captured_control_fields_with_the_version_substituted(distro: str) -> None:
    """Every package of each driver set has the captured Provides, Conflicts, Breaks and, less only the groups the
    data file drops (and NVIDIA-MIRROR.md lists), the captured Depends and Pre-Depends: every `=` among them."""
    captured = stanzas(DEBIAN_CAPTURE.read_text())
    mirror = offered(distro)
    dropped = {(d.package, d.version, d.kind, d.relation) for d in aptrepo.dropped_relations(distro)}
    versions = _driver_versions(distro)
    assert versions
    for version in versions:
        ours = [p for p in mirror.values() if p.source == "nvidia-graphics-drivers" and p.version == version]
        assert ours
        for package in ours:
            stanza = captured[package.name]
            for title, kind in (("Provides", "provides"), ("Conflicts", "conflicts"), ("Breaks", "breaks")):
                expected = format_relations(parse_relations(substituted(stanza.get(title, ""), version)))
                assert getattr(package, kind) == expected, (package.name, title)
            for title, kind in (("Depends", "depends"), ("Pre-Depends", "pre_depends")):
                groups = parse_relations(substituted(stanza.get(title, ""), version))
                kept = [g for g in groups if (package.name, version, kind, format_relations([g])) not in dropped]
                assert getattr(package, kind) == format_relations(kept), (package.name, title)
                left_out = [g for g in groups if g not in kept]
                assert not any(op == "=" for g in left_out for _, op, _ in g), "an exact relation was dropped"


def test_debian_driver_set_is_every_captured_package_the_roots_reach() -> None:
    """nvidia-driver, nvidia-kernel-dkms, nvidia-smi and libcuda1 and every captured package their Depends and
    Pre-Depends reach (first alternative; a virtual package through its provider), no fewer, no more."""
    captured = stanzas(DEBIAN_CAPTURE.read_text())
    providers = {
        alternative[0]: name
        for name, stanza in captured.items()
        for group in parse_relations(stanza.get("Provides", ""))
        for alternative in group
    }
    reached, todo = set(), ["nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        stanza = captured[name]
        for group in parse_relations(stanza.get("Depends", "")) + parse_relations(stanza.get("Pre-Depends", "")):
            first = group[0][0]
            target = first if first in captured else providers.get(first)
            if target:
                todo.append(target)
    for distro in aptrepo.DISTROS:
        for version in _driver_versions(distro):
            ours = {
                p.name
                for p in aptrepo.catalog(distro)
                if p.source == "nvidia-graphics-drivers" and p.version == version
            }
            assert ours == reached, (distro, version)


def test_debian11_offers_the_profiles_sets_and_newer_decoys() -> None:
    mirror = offered("debian11")
    for name in (*DRIVER_ROOTS, "nvidia-kernel-support", "libnvidia-ml1", "firmware-nvidia-gsp"):
        versions = {v for n, v in mirror if n == name}
        wanted = {"525.85.12", "515.86.01", "535.129.03"}
        assert {placeholders(v)["upstream"] for v in versions} == wanted, name
    for pin in [
        ("cuda-toolkit-11-8", "11.8.0-1"),
        ("cuda-toolkit-11-7", "11.7.1-1"),
        ("cuda-toolkit-12-2", "12.2.2-1"),
        ("libcudnn8", "8.6.0.163-1+cuda11.8"),
        ("libcudnn8-dev", "8.5.0.96-1+cuda11.7"),
        ("libcudnn8", "8.9.7.29-1+cuda12.2"),
        ("tensorrt", "10.0.0.6-1+cuda12.4"),
        ("libnvinfer10", "10.0.0.6-1+cuda12.4"),
        ("nvidia-container-toolkit", "1.13.5-1"),
        ("libnvidia-container1", "1.17.8-1"),
        ("dkms", aptrepo.DKMS_STANDIN_VERSION),
    ]:
        assert pin in mirror, pin
    assert ("libcudnn8", f"{TRT}-1+cuda11.8") not in mirror
    dev = mirror[("libcudnn8-dev", "8.6.0.163-1+cuda11.8")]
    assert exact(dev) == {("libcudnn8", "8.6.0.163-1+cuda11.8")}
    toolkit = mirror[("nvidia-container-toolkit", "1.13.5-1")]
    assert toolkit.depends == "nvidia-container-toolkit-base (= 1.13.5-1), libnvidia-container-tools (>= 1.13.5-1)"


def test_debian12_holds_only_what_nvidias_debian12_directory_starts_with() -> None:
    """NVIDIA's debian12 directory starts at driver 545.23.06-1 (vaapi312) and CUDA 12.3: no R525/R515, no CUDA 11,
    no cuDNN or TensorRT for CUDA 11.8."""
    policy = (shared_apt() / "nvidia-driver-policy-debian12-vaapi312.txt").read_text()
    nvidia_builds = re.findall(r"^\s+(?:\*\*\* )?(\d+\.\d+\.\d+-1) ", policy, re.M)
    mirror = offered("debian12")
    drivers = _driver_versions("debian12")
    assert min(drivers, key=lambda v: [int(p) for p in placeholders(v)["upstream"].split(".")]) == "545.23.06-1"
    assert set(drivers) <= set(nvidia_builds)
    names = {name for name, _ in mirror}
    assert not {"cuda-toolkit-11-8", "cuda-toolkit-11-7", "libcudnn8", "tensorrt", "libnvinfer8"} & names
    assert ("cuda-toolkit-12-3", "12.3.2-1") in mirror


# --- (b) the never-released driver is nowhere -------------------------------------------------------------------------


def test_the_never_released_driver_is_nowhere_in_the_mirror() -> None:
    assert NEVER_RELEASED not in aptrepo.REPOSITORY_DATA.read_text()
    assert NEVER_RELEASED not in " ".join(aptrepo.RUNFILE_DRIVERS)
    for distro in aptrepo.DISTROS:
        for package in aptrepo.catalog(distro):
            text = repr(package)  # name, version, relations, file contents, links
            assert NEVER_RELEASED not in text, (distro, package.name, package.version)


# --- payloads: what the role and the acceptance tests read stays where it was ----------------------------------------


def test_payloads_the_role_and_gate_read_are_in_the_packages_that_hold_them_for_real() -> None:
    mirror = offered("debian11")
    driver = "525.85.12-1"
    assert "/usr/bin/nvidia-smi" in mirror[("nvidia-smi", driver)].files
    assert "IRONSERVE_STANDIN_DRIVER=525.85.12 " in mirror[("nvidia-smi", driver)].files["/usr/bin/nvidia-smi"][0]
    assert mirror[("libcuda1", driver)].links == {f"{aptrepo.LIBDIR}/libcuda.so.1": "libcuda.so.525.85.12"}
    assert mirror[("libnvidia-ml1", driver)].links == {
        f"{aptrepo.LIBDIR}/libnvidia-ml.so.1": "libnvidia-ml.so.525.85.12"
    }
    # The working stand-in NVML (standin_nvml.py), not a placeholder: a host with the driver has an NVML to ask.
    library = mirror[("libnvidia-ml1", driver)].files[f"{aptrepo.LIBDIR}/libnvidia-ml.so.525.85.12"][0]
    assert isinstance(library, bytes) and library.startswith(b"\x7fELF")
    persistenced = mirror[("nvidia-persistenced", driver)].files
    assert {"/usr/bin/nvidia-persistenced", "/lib/systemd/system/nvidia-persistenced.service"} <= set(persistenced)
    assert mirror[("nvidia-driver", driver)].files["/usr/share/doc/nvidia-driver/VERSION"][0] == "525.85.12\n"
    dkms = mirror[("nvidia-kernel-dkms", driver)]
    assert "/usr/src/nvidia-current-525.85.12/dkms.conf" in dkms.files and "dkms add" in dkms.postinst
    assert "dkms (>= 3.0.3-4~)" in dkms.depends
    assert f"{aptrepo.LIBDIR}/libnvinfer.so.8" in mirror[("libnvinfer8", f"{TRT}-1+cuda11.8")].links
    assert f"{aptrepo.LIBDIR}/libnvinfer.so.10" in mirror[("libnvinfer10", "10.0.0.6-1+cuda12.4")].links
    header = mirror[("libcudnn8-dev", "8.6.0.163-1+cuda11.8")].files["/usr/include/cudnn_version.h"][0]
    assert "#define CUDNN_MINOR 6" in header
    assert "/usr/local/cuda-11.8/version.json" in mirror[("cuda-toolkit-11-8", "11.8.0-1")].files


@pytest.mark.parametrize("distro", aptrepo.DISTROS)
def test_no_path_is_shipped_by_two_packages(distro: str) -> None:
    """dpkg refuses to unpack a file another installed package owns: each path has one owner (by name)."""
    owners: dict[str, str] = {}
    for package in aptrepo.catalog(distro):
        for path in [*package.files, *package.links]:
            assert owners.setdefault(path, package.name) == package.name, (path, owners[path], package.name)


def test_dropped_relations_are_all_listed_in_the_mirror_readme() -> None:
    readme = MIRROR_README.read_text().replace("\\|", "|")  # a table cell writes the relation's `|` as `\|`
    for distro in aptrepo.DISTROS:
        for dropped in aptrepo.dropped_relations(distro):
            assert f"`{dropped.relation}`" in readme, dropped
            assert re.search(rf"\| {re.escape(dropped.package)} \|.*`{re.escape(dropped.relation)}`", readme), dropped


def test_every_cited_capture_exists() -> None:
    data = yaml.safe_load(aptrepo.REPOSITORY_DATA.read_text())
    cited = " ".join(str(s.get("source", "")) + " " + str(s.get("note", "")) for s in data["structures"].values())
    local = set(re.findall(r"tests/data/realworld/apt/[\w.+-]+\.txt", cited))
    assert local and all((REPO_ROOT / path).is_file() for path in local), local
    beside = set(re.findall(r"shared/samples/realworld/apt/[\w.+-]+\.txt", cited))
    assert beside
    folder = shared_apt()
    for path in beside:
        assert (folder / Path(path).name).is_file(), path


def test_debs_are_byte_for_byte_reproducible(tmp_path: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed")
    package = offered()[("nvidia-kernel-dkms", "525.85.12-1")]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = aptrepo.build_deb(package, tmp_path / "a"), aptrepo.build_deb(package, tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()


# --- (c) apt's own resolver against the built indexes -----------------------------------------------------------------

# A lab host's Debian packages the driver set's kept relations name (the data file's host_packages).
HOST_STATUS = {
    "libc6": "2.36-9+deb12u10",
    "libgcc-s1": "12.2.0-14",
    "libssl3": "3.0.16-1~deb12u1",
    "dpkg": "1.21.22",
    "debconf": "1.5.82",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both directories built as the lab builds them (.debs, dpkg-scanpackages, Release; unsigned)."""
    missing = [tool for tool in ("dpkg-deb", "dpkg-scanpackages", "apt-get") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (dpkg-dev and apt build and read the index)")
    www = tmp_path_factory.mktemp("mirror") / "www"
    aptrepo.build_nvidia_directories(www)
    return www


def scratch_apt(root: Path, index_dir: Path) -> dict[str, str]:
    """An apt configuration of its own under `root`: one `[trusted=yes]` file: source, its own lists, cache and a
    status file holding only a lab host's relevant Debian packages. Returns the environment that selects it."""
    for folder in ("parts", "sources.d", "preferences.d", "lists/partial", "cache/archives/partial", "log"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "sources.list").write_text(f"deb [trusted=yes] file:{index_dir}/ /\n")
    (root / "status").write_text(
        "".join(
            f"Package: {name}\nStatus: install ok installed\nVersion: {version}\n"
            f"Architecture: {'all' if name == 'debconf' else 'amd64'}\n\n"
            for name, version in HOST_STATUS.items()
        )
    )
    options = {
        "Dir::Etc::main": "/dev/null",
        "Dir::Etc::parts": f"{root}/parts",
        "Dir::Etc::sourcelist": f"{root}/sources.list",
        "Dir::Etc::sourceparts": f"{root}/sources.d",
        "Dir::Etc::preferences": f"{root}/preferences",
        "Dir::Etc::preferencesparts": f"{root}/preferences.d",
        "Dir::State": f"{root}/state",
        "Dir::State::lists": f"{root}/lists",
        "Dir::State::status": f"{root}/status",
        "Dir::Cache": f"{root}/cache",
        "Dir::Log": f"{root}/log",
        "Debug::NoLocking": "true",
        "APT::Sandbox::User": getpass.getuser(),
        "Acquire::Languages": "none",
        "APT::Architecture": "amd64",
    }
    config = root / "apt.conf"
    config.write_text(
        "".join(f'{key} "{value}";\n' for key, value in options.items()) + 'APT::Architectures { "amd64"; };\n'
    )
    env = {"APT_CONFIG": str(config), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    update = subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=120)
    assert update.returncode == 0, update.stdout + update.stderr
    return env


@pytest.fixture(scope="module")
def apt(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, str]]]:
    yield {
        distro: scratch_apt(tmp_path_factory.mktemp(f"apt-{distro}"), built / distro / aptrepo.ARCH_DIR)
        for distro in aptrepo.DISTROS
    }


def simulate(env: dict[str, str], *wanted: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["apt-get", "install", "--simulate", *wanted], env=env, capture_output=True, text=True, timeout=120
    )


def exact_closure(roots: dict[str, str], distro: str = "debian11") -> dict[str, str]:
    """`roots` and every package their `=` relations reach (first alternative; in the mirror's data)."""
    mirror = offered(distro)
    pins, todo = dict(roots), list(roots.items())
    while todo:
        package = mirror.get(todo.pop())
        if package is None:
            continue
        for group in parse_relations(package.depends) + parse_relations(package.pre_depends):
            name, op, version = group[0]
            if op == "=" and version and (name, version) in mirror and name not in pins:
                pins[name] = version
                todo.append((name, version))
    return pins


def installs(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(re.findall(r"^Inst (\S+) \((\S+) ", result.stdout, re.M))


def test_apt_refuses_tensorrt_pinned_alone_as_nvidias_repository_does(apt: dict[str, dict[str, str]]) -> None:
    alone = simulate(apt["debian11"], f"tensorrt={TRT}-1+cuda11.8")
    assert alone.returncode != 0
    out = alone.stdout + alone.stderr
    wanted = f"{TRT}-1+cuda11.8"
    assert f"tensorrt : Depends: libnvinfer8 (= {wanted}) but {TRT}-1+cuda12.0 is to be installed" in out
    assert f"Depends: libnvinfer-bin (= {wanted}) but 10.0.0.6-1+cuda12.4 is to be installed" in out  # as trt3774
    assert f"Depends: libnvinfer-lean-dev (= {wanted}) but 10.0.0.6-1+cuda12.4 is to be installed" in out


def test_apt_installs_tensorrt_with_every_exact_sibling_pinned(apt: dict[str, dict[str, str]]) -> None:
    pins = exact_closure({"tensorrt": f"{TRT}-1+cuda11.8"})
    assert {"libnvinfer-lean8", "libnvinfer-dispatch8", "libnvinfer-vc-plugin8", "libnvinfer-headers-dev"} <= set(pins)
    resolved = simulate(apt["debian11"], *(f"{name}={version}" for name, version in pins.items()))
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    assert installs(resolved) == pins


def test_apt_does_not_find_the_never_released_driver(apt: dict[str, dict[str, str]]) -> None:
    result = simulate(apt["debian11"], f"nvidia-driver={NEVER_RELEASED}-1")
    assert result.returncode != 0
    assert f"Version '{NEVER_RELEASED}-1' for 'nvidia-driver' was not found" in result.stderr


def test_apt_installs_the_r740_debian11_set_with_its_exact_closure_and_nvidia_kernel_support(
    apt: dict[str, dict[str, str]],
) -> None:
    """The profile's roots, every package their `=` relations reach, and nvidia-kernel-support, which nvidia-kernel-dkms
    reaches through the virtual nvidia-kernel-support--v1 (apt takes the candidate provider, the 535 decoy, whose
    `nvidia-alternative (= 535...)` breaks the set): as with Debian's packaging against a repository of many drivers."""
    driver = "525.85.12-1"
    roots = {name: driver for name in DRIVER_ROOTS}
    roots |= {"cuda-toolkit-11-8": "11.8.0-1", "libcudnn8": "8.6.0.163-1+cuda11.8"}
    roots |= {"libcudnn8-dev": "8.6.0.163-1+cuda11.8", "tensorrt": f"{TRT}-1+cuda11.8"}
    toolkit = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools")
    roots |= {name: "1.13.5-1" for name in (*toolkit, "libnvidia-container1")}
    pins = exact_closure(roots)
    assert pins["firmware-nvidia-gsp"] == "525.85.12" and "nvidia-kernel-support" not in pins
    without = simulate(apt["debian11"], *(f"{name}={version}" for name, version in pins.items()))
    assert without.returncode != 0
    assert (
        "nvidia-kernel-support : Depends: nvidia-alternative (= 535.129.03-1) but 525.85.12-1 is to be installed"
        in (without.stdout + without.stderr)
    )
    pins["nvidia-kernel-support"] = driver
    resolved = simulate(apt["debian11"], *(f"{name}={version}" for name, version in pins.items()))
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    installed = installs(resolved)
    assert {name: installed[name] for name in pins} == pins
    assert installed["dkms"] == aptrepo.DKMS_STANDIN_VERSION
    # what the set leaves unpinned moves to the newest build, as on a real host
    assert installed["nvidia-modprobe"] == installed["nvidia-legacy-check"] == "535.129.03-1"


def test_apt_moves_an_unpinned_container_toolkit_sibling_to_the_newest(apt: dict[str, dict[str, str]]) -> None:
    result = simulate(apt["debian11"], "nvidia-container-toolkit=1.13.5-1", "nvidia-container-toolkit-base=1.13.5-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert installs(result)["libnvidia-container-tools"] == "1.17.8-1"  # `>=`: why the maintainer pins all four


def test_apt_on_the_debian12_directory_fails_the_cuda_11_8_lock(apt: dict[str, dict[str, str]]) -> None:
    driver = simulate(apt["debian12"], "nvidia-driver=525.85.12-1")
    assert "Version '525.85.12-1' for 'nvidia-driver' was not found" in driver.stderr
    toolkit = simulate(apt["debian12"], "cuda-toolkit-11-8=11.8.0-1")
    assert toolkit.returncode != 0 and "Unable to locate package cuda-toolkit-11-8" in toolkit.stderr
    pins = exact_closure({name: "545.23.06-1" for name in DRIVER_ROOTS}, "debian12")
    pins["nvidia-kernel-support"] = "545.23.06-1"
    resolved = simulate(apt["debian12"], *(f"{n}={v}" for n, v in pins.items()), "cuda-toolkit-12-3=12.3.2-1")
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr


@pytest.mark.parametrize("variant", sorted(aptrepo.VARIANTS))
def test_a_variant_is_its_directory_less_the_versions_it_names(built: Path, variant: str) -> None:
    distro, left_out = aptrepo.VARIANTS[variant]
    index = (built / "variants" / variant / distro / aptrepo.ARCH_DIR / "Packages").read_text()
    listed = {(block["Package"], block["Version"]) for block in _blocks(index)}
    assert listed == set(offered(distro)) - set(left_out)
