"""What roles/inference renders and builds on the deploy machine: the lock's pins, the service wheel, configs.

Pure functions where possible; `service_wheel()` is the one place that builds on the machine running the
deploy (once per source change, cached outside the repository).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from ironserve_service.settings import COLOURS, ServiceSettings

from ironserve.paths import CHECKOUT, cache_dir, installed_from

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


def service_source() -> Path:
    """The ironserve-service sources the host's wheel is built from: those of the installed distribution
    (whose settings model validated the inventory), as PEP 610 records them for `pip install [-e] DIR`,
    else the checkout's service/."""
    for source in (installed_from("ironserve-service"), CHECKOUT and CHECKOUT / "service"):
        if source and (source / "pyproject.toml").is_file() and (source / "src").is_dir():
            return source
    raise FileNotFoundError(
        "no ironserve-service sources: install ironserve from its checkout (pip install CHECKOUT), "
        "which installs ./service from there"
    )


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An flock on `path`, waited for in short sleeps: the hosts of one deploy are greenlets of one thread (a blocking
    flock would stop the one holding it) and another deploy may run beside this one."""
    with path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def service_wheel(source: Path | None = None) -> tuple[Path, str]:
    """The ironserve-service wheel for these sources (default: service_source()), built once per change;
    (wheel, source digest). Built from a copy of the sources, one build at a time: setuptools writes its build/ and
    egg-info into the tree it builds, where concurrent builds (the hosts of one deploy) collide."""
    source = source or service_source()
    digest = _source_digest(source)
    target = cache_dir() / "service-wheels" / digest
    target.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{digest}.lock"):
        if not any(target.glob("ironserve_service-*.whl")):
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
                tree = Path(scratch) / "service"
                tree.mkdir()
                for name in ("pyproject.toml", "README.md"):
                    shutil.copy2(source / name, tree / name)
                shutil.copytree(
                    source / "src", tree / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
                )
                built = Path(scratch) / "wheels"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "wheel",
                        "--quiet",
                        "--no-deps",
                        "--wheel-dir",
                        str(built),
                        str(tree),
                    ],
                    check=True,
                )
                for wheel in built.glob("ironserve_service-*.whl"):
                    wheel.replace(target / wheel.name)
    return sorted(target.glob("ironserve_service-*.whl"))[-1], digest


def service_yaml(settings: ServiceSettings) -> str:
    return "# Managed by ironserve (roles/inference)\n" + yaml.safe_dump(settings.model_dump(mode="json"))


# Prometheus' extension directories: other roles (monitoring) drop rules, scrape targets, hosts to probe and
# Alertmanagers there; Prometheus re-reads the discovery files by itself and the rules at start.
PROMETHEUS_EXTENSIONS = {
    "rules": "/etc/prometheus/rules.d",
    "targets": "/etc/prometheus/targets.d",
    "probes": "/etc/prometheus/probes.d",
    "alertmanagers": "/etc/prometheus/alertmanagers.d",
}


def prometheus_config(settings: ServiceSettings, rules_file: str, host: str) -> str:
    """Scrape jobs for the exporter, both colours' vLLM /metrics and Envoy; the SLO rules file; every alert labelled
    with the host it comes from (`host`, the inventory's name); the extension directories' rules, targets, probed
    hosts (only their `up` is kept) and Alertmanagers."""
    swap = settings.swap
    job = settings.slo.job
    extensions = PROMETHEUS_EXTENSIONS

    def discovered(kind: str) -> list[dict[str, list[str]]]:
        return [{"files": [f"{extensions[kind]}/*.yml"]}]

    config: dict[str, Any] = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s", "external_labels": {"host": host}},
        "rule_files": [rules_file, f"{extensions['rules']}/*.yml"],
        "alerting": {"alertmanagers": [{"file_sd_configs": discovered("alertmanagers")}]},
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
            # A discovery file's own `job` label names its targets' job (the node exporter's: node).
            {"job_name": "targets", "file_sd_configs": discovered("targets")},
            {
                "job_name": "probes",
                "file_sd_configs": discovered("probes"),
                "metric_relabel_configs": [{"source_labels": ["__name__"], "regex": ".+", "action": "drop"}],
            },
        ],
    }
    return "# Managed by ironserve (roles/inference)\n" + yaml.safe_dump(config, sort_keys=False)
