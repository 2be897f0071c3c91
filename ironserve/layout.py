"""Where a role's templates and files are: the project's top-level `templates/<role>/` and `files/<role>/`,
beside deploy.py, inventory/ and roles/ (pyinfra's layout for deploy projects).

The install ships both folders as package data, `ironserve.templates` and `ironserve.files` (setup.py maps
them), so the same call finds them in a checkout's editable install and in `pip install .`. Roles read them
through these two functions only (tests/unit/test_layout.py fails on any other way).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _role_path(kind: str, role: str, name: str) -> Path:
    path = Path(str(files(f"ironserve.{kind}"))) / role / name
    if not path.is_file():
        raise FileNotFoundError(f"{kind}/{role}/{name}: no such {kind[:-1]} of role {role}")
    return path


def role_template(role: str, name: str) -> Path:
    """templates/<role>/<name>: a jinja2 template of the role."""
    return _role_path("templates", role, name)


def role_file(role: str, name: str) -> Path:
    """files/<role>/<name>: a file the role uses as it is."""
    return _role_path("files", role, name)
