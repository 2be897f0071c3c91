"""The site template a newcomer copies is itself a valid inventory (loaded without connecting), once the
site's own files exist: its hash-locked CUDA environment and its sealed model (not in this repository)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from ironserve_service.artifacts import seal_model_dir

from ironserve.inventory import load_inventory, validate_inventory
from ironserve.paths import REPO_ROOT
from ironserve.registry import registry

EXAMPLE = str(REPO_ROOT / "inventory" / "example_r740.py")


def test_example_r740_inventory_names_the_site_files_it_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    _, problems = validate_inventory(load_inventory(EXAMPLE), registry())
    assert problems and all(": inference_requirements: " in p or ": inference_model_source: " in p for p in problems)


def test_example_r740_inventory_validates(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site/requirements-cu118.lock").write_text("torch==2.1.2+cu118 --hash=sha256:" + "0" * 64 + "\n")
    model = tmp_path / "site/models/qwen2-7b/20260101-000000"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    seal_model_dir(model, datetime(2026, 1, 1, tzinfo=UTC))
    configs, problems = validate_inventory(load_inventory(EXAMPLE), registry())
    assert problems == []
    assert {c.profile.name for c in configs.values()} == {"r740-a10"}
    assert all(c.reboot_policy == "auto" for c in configs.values())
    assert {c.inference.version() for c in configs.values()} == {"20260101-000000"}
