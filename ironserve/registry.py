"""The role registry this checkout deploys: the one place the core learns which roles exist.

Imported late (inside the function) so `ironserve.config` and the roles can import each other's
modules without a cycle; every entry point (the CLI, deploy.py, the gate) gets the registry here.
"""

from __future__ import annotations

from typing import Any

from ironserve.config import Registry


def registry() -> Registry[Any]:
    from roles import REGISTRY

    return REGISTRY
