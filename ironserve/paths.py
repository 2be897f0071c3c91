"""Where ironserve keeps state that must live outside the repository."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Root of cached root file systems, VM images, the lab state and its keys.

    IRONSERVE_CACHE overrides the default so CI and tests can isolate themselves.
    """
    root = Path(os.environ.get("IRONSERVE_CACHE", Path.home() / ".cache" / "ironserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def lab_dir() -> Path:
    path = cache_dir() / "lab"
    path.mkdir(parents=True, exist_ok=True)
    return path


def spec_dir() -> Path:
    """The shared invariant catalog, beside the repository (../shared/spec)."""
    return Path(os.environ.get("IRONSERVE_SPEC", REPO_ROOT.parent / "shared" / "spec"))
