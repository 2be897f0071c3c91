"""Where the lab keeps its state: under ironserve's cache (IRONSERVE_CACHE), never in the checkout."""

from __future__ import annotations

from pathlib import Path

from ironserve.paths import cache_dir


def lab_dir() -> Path:
    path = cache_dir() / "lab"
    path.mkdir(parents=True, exist_ok=True)
    return path
