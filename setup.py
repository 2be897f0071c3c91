"""Build glue: what pyproject.toml cannot say statically (setuptools runs this; nothing else does).

1. `ironserve-service` is a real dependency: the admin side validates inventories with the service's
   own settings model (roles/inference imports ironserve_service). It is not on any index and must
   never be resolved from one (a project of that name there would be someone else's): it is this
   checkout's service/, named by an absolute file URL (`ironserve-service @ file:///...`; PEP 508 has
   no relative form), which only the build knows. pip and pipx build a local directory in place, so the
   URL is the checkout's own service/ for `pip install .`, `pip install -e .` and `pipx install .`, and
   pip installs it from there in the same run (PEP 610 records the path: roles/inference/render.py
   builds the host's service wheel from it). Chosen over an in-tree PEP 517 backend because it is plain
   setuptools (`dynamic = ["dependencies"]`, nothing written into the tree), and over shipping the
   service inside this wheel because the service stays one distribution, installed once, editable in
   the dev venv.
2. The top-level `templates/` and `files/` ship as the package data `ironserve.templates` and `ironserve.files`:
   the one mapping setuptools needs for folders that sit beside the packages rather than inside one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SERVICE = HERE / "service"

if not (SERVICE / "pyproject.toml").is_file():
    raise SystemExit(
        f"ironserve: {SERVICE} is missing; build ironserve from a checkout (pip install CHECKOUT), "
        "not from an sdist: it depends on the checkout's service/ (ironserve-service)"
    )

# The roles' templates and files live at the top, beside deploy.py (pyinfra's layout for deploy projects); they ship
# as ironserve's package data, which ironserve.layout reads in a checkout and in an install alike.
DATA_FOLDERS = {"ironserve.templates": "templates", "ironserve.files": "files"}

pins: list[str] = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["ironserve"]["dependencies"]

setup(
    install_requires=[*pins, f"ironserve-service @ {SERVICE.as_uri()}"],
    packages=[*find_packages(include=["ironserve", "ironserve.*", "roles", "roles.*"]), *DATA_FOLDERS],
    package_dir=DATA_FOLDERS,
)
