"""What roles/inference needs besides operations: the lock's pins, the service wheel, facts and renderings.

Pure functions where possible; `service_wheel()` is the one place that builds on the machine running the
deploy (once per source change, cached outside the repository).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from ironserve_service.settings import COLOURS, ServiceSettings
from pyinfra.api.facts import FactBase

from ironserve.paths import REPO_ROOT, cache_dir

SERVICE_SOURCE = REPO_ROOT / "service"
# name==version at the start of a requirements line (continuation lines carry the hashes).
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
# Installed by venv itself, or by this role from its own wheel: not in the lock, never removed.
UNLOCKED = frozenset({"pip", "setuptools", "ironserve-service"})


def canonical(name: str) -> str:
    """PEP 503 normalised project name (PyYAML -> pyyaml, typing_extensions -> typing-extensions)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(text: str) -> dict[str, str]:
    """{canonical name: version} of a hash-locked requirements file."""
    return {canonical(m[1]): m[2] for line in text.splitlines() if (m := PIN.match(line.strip()))}


def environment_drift(pins: Mapping[str, str], installed: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(locked packages missing or at another version, installed packages the lock does not name)."""
    wrong = sorted(f"{n}=={v}" for n, v in pins.items() if installed.get(n) != v)
    extra = sorted(n for n in installed if n not in pins and n not in UNLOCKED)
    return wrong, extra


def _source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted([root / "pyproject.toml", *(root / "src").rglob("*")]):
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def service_wheel(source: Path = SERVICE_SOURCE) -> tuple[Path, str]:
    """The ironserve-service wheel for these sources, built once per change; (wheel, source digest)."""
    digest = _source_digest(source)
    target = cache_dir() / "service-wheels" / digest
    wheels = sorted(target.glob("ironserve_service-*.whl"))
    if not wheels:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(target), str(source)],
            check=True,
        )
        wheels = sorted(target.glob("ironserve_service-*.whl"))
    return wheels[-1], digest


def service_yaml(settings: ServiceSettings) -> str:
    return "# Managed by ironserve (roles/inference)\n" + yaml.safe_dump(settings.model_dump(mode="json"))


def prometheus_config(settings: ServiceSettings, rules_file: str) -> str:
    """Scrape jobs for the exporter, both colours' vLLM /metrics and Envoy; the SLO rules file."""
    swap = settings.swap
    job = settings.slo.job
    config: dict[str, Any] = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "rule_files": [rules_file],
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {"targets": [f"127.0.0.1:{settings.exporter.port}"], "labels": {"component": "exporter"}},
                    *(
                        {"targets": [f"127.0.0.1:{swap.port(c)}"], "labels": {"component": "vllm", "colour": c}}
                        for c in COLOURS
                    ),
                ],
            },
            {
                "job_name": "envoy",
                "metrics_path": "/stats/prometheus",
                "static_configs": [{"targets": [f"127.0.0.1:{swap.admin_port}"]}],
            },
        ],
    }
    return "# Managed by ironserve (roles/inference)\n" + yaml.safe_dump(config, sort_keys=False)


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
        text = "".join(output).strip()
        return json.loads(text.splitlines()[-1]) if text else None


class StaleUnits(FactBase[list[str]]):
    """Units active since before their newest input file changed (they run an older unit or config)."""

    def command(self, inputs: dict[str, list[str]]) -> str:
        return "; ".join(
            f"echo {shlex.quote(unit)} "
            f"$(systemctl show --property=ActiveEnterTimestamp --timestamp=unix --value {shlex.quote(unit)}) "
            f"$(stat -c %Y {' '.join(map(shlex.quote, paths))} 2>/dev/null | sort -n | tail -1)"
            for unit, paths in inputs.items()
        )

    def process(self, output: Iterable[str]) -> list[str]:
        stale = []
        for line in output:
            fields = line.split()  # unit, @<active since>, <newest mtime>; no @ when the unit never ran
            if len(fields) == 3 and fields[1].startswith("@") and int(fields[1][1:]) < int(fields[2]):
                stale.append(fields[0])
        return stale


class UnitsNeedingReload(FactBase[list[str]]):
    """Units whose file on disk changed since systemd loaded it (NeedDaemonReload)."""

    def command(self, units: list[str]) -> str:
        return "; ".join(
            f"echo {shlex.quote(u)} $(systemctl show --property=NeedDaemonReload --value {shlex.quote(u)})"
            for u in units
        )

    def process(self, output: Iterable[str]) -> list[str]:
        return [fields[0] for line in output if len(fields := line.split()) == 2 and fields[1] == "yes"]
