"""The site template a newcomer copies is itself a valid inventory (loaded without connecting), once the
site's own files exist beside it: its hash-locked CUDA environment, its sealed model and the repository key
(not in this repository). Its relative paths are read from the inventory's folder, from any working directory."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from ironserve_service.artifacts import seal_model_dir

from ironserve.inventory import load_inventory, validate_inventory
from ironserve.paths import REPO_ROOT
from ironserve.registry import registry

EXAMPLE = REPO_ROOT / "inventory" / "example_r740.py"


@pytest.fixture
def copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The template copied into a site folder, run from another working directory."""
    site = tmp_path / "mysite"
    site.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return Path(shutil.copy(EXAMPLE, site / "mysite.py"))


def test_example_r740_inventory_names_the_site_files_it_lacks(copied: Path) -> None:
    _, problems = validate_inventory(load_inventory(str(copied)), registry())
    assert problems
    site_files = (": nvidia_repo_key: ", ": inference_requirements: ", ": inference_model_source: ")
    assert all(any(key in p for key in site_files) for p in problems), problems
    # Named where they are looked for: beside the inventory, not in the working directory.
    assert all("/mysite/" in p for p in problems), problems


def test_example_r740_inventory_validates(copied: Path) -> None:
    site = copied.parent
    (site / "keys").mkdir()
    (site / "keys/cuda-archive-keyring.gpg").write_bytes(b"\x99")
    (site / "site").mkdir()
    (site / "site/requirements-cu118.lock").write_text("torch==2.1.2+cu118 --hash=sha256:" + "0" * 64 + "\n")
    model = site / "site/models/qwen2-7b/20260101-000000"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    seal_model_dir(model, datetime(2026, 1, 1, tzinfo=UTC))
    hosts = load_inventory(str(copied))
    configs, problems = validate_inventory(hosts, registry())
    assert problems == []
    assert {c.profile.name for c in configs.values()} == {"r740-a10"}
    assert all(c.reboot_policy == "auto" for c in configs.values())
    assert {c.inference.version() for c in configs.values()} == {"20260101-000000"}
    # pyinfra's host data (what deploy.py reads) carries the resolved paths.
    assert {h.data["nvidia_repo_key"] for h in hosts} == {str(site / "keys/cuda-archive-keyring.gpg")}
    assert {h.data["inference_model_source"] for h in hosts} == {str(model)}
