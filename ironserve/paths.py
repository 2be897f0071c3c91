"""Where ironserve's checkout is, and where it keeps state that must live outside it."""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from urllib.parse import unquote, urlparse


def installed_from(name: str) -> Path | None:
    """The local folder distribution `name` was installed from (`pip install [-e] DIR`, `pipx install DIR`),
    as its PEP 610 direct_url.json records it; None when it came from an index, a wheel or a VCS URL, or
    when that folder is gone."""
    try:
        text = distribution(name).read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    record = json.loads(text) if text else {}
    url = urlparse(record.get("url", ""))
    if url.scheme != "file" or "dir_info" not in record:
        return None
    folder = Path(unquote(url.path))
    return folder if folder.is_dir() else None


def _checkout() -> Path | None:
    # The dev venv's editable install runs the checkout's own files; `pip install .` runs a copy in
    # site-packages, and PEP 610 says which checkout it was built from.
    for root in (Path(__file__).resolve().parent.parent, installed_from("ironserve")):
        if root is not None and (root / "pyproject.toml").is_file() and (root / "deploy.py").is_file():
            return root
    return None


# The ironserve checkout this code is or was installed from (deploy.py, service/, inventory/); None for
# an install from elsewhere. REPO_ROOT falls back to the installed package's parent folder.
CHECKOUT = _checkout()
REPO_ROOT = CHECKOUT or Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Root of cached root file systems, VM images, the lab state and its keys.

    IRONSERVE_CACHE overrides the default so CI and tests can isolate themselves.
    """
    root = Path(os.environ.get("IRONSERVE_CACHE", Path.home() / ".cache" / "ironserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def spec_dir() -> Path:
    """The shared invariant catalog, beside the repository (../shared/spec)."""
    return Path(os.environ.get("IRONSERVE_SPEC", REPO_ROOT.parent / "shared" / "spec"))
