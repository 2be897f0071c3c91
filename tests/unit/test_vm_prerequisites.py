"""VM lab hosts say exactly what is missing instead of failing somewhere inside qemu or debootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from ironserve_lab import vm, vmimage


def test_missing_qemu_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("shutil.which", lambda tool: None if tool == vm.QEMU else f"/usr/bin/{tool}")
    monkeypatch.setattr(vmimage, "cached_image", lambda: tmp_path / "base.qcow2")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert vm.missing_prerequisites() == ["qemu-system-x86_64 not found on PATH"]


def test_image_build_tools_matter_only_until_the_image_is_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("shutil.which", lambda tool: None if tool == "debootstrap" else f"/usr/bin/{tool}")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setattr(vmimage, "cached_image", lambda: tmp_path / "base.qcow2")
    assert vm.missing_prerequisites() == [
        "debootstrap not found on PATH (needed once, to build the base image)",
        "building the base image needs root (debootstrap, chroot)",
    ]
    (tmp_path / "base.qcow2").touch()
    assert vm.missing_prerequisites() == []
