"""Facts of the inference role: the engine environment's packages and what is being served."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from typing import Any

from pyinfra.api.facts import FactBase

from roles.inference.render import canonical


class VenvPackages(FactBase[dict[str, str] | None]):
    """{canonical name: version} installed in a venv (`pip list`); None when the venv has no pip."""

    def command(self, venv: str) -> str:
        pip = shlex.quote(f"{venv}/bin/pip")
        return f"if [ -x {pip} ]; then {pip} list --format=json --disable-pip-version-check; fi"

    def process(self, output: Iterable[str]) -> dict[str, str] | None:
        text = "".join(output).strip()
        if not text:
            return None
        return {canonical(item["name"]): item["version"] for item in json.loads(text)}


class ServingStatus(FactBase[dict[str, Any] | None]):
    """`ironserve-service status`: the active version, its colour and whether it is ready; None before install."""

    def command(self, venv: str, config: str) -> str:
        cli, config = shlex.quote(f"{venv}/bin/ironserve-service"), shlex.quote(config)
        return f"if [ -x {cli} ] && [ -f {config} ]; then {cli} status --config {config}; fi; true"

    def process(self, output: Iterable[str]) -> dict[str, Any] | None:
        lines = [line for line in output if line.strip()]  # a line logged before it: the status is the last
        return json.loads(lines[-1]) if lines else None
