"""One switch between ironserve's speed work and plain pyinfra (ironserve/speed/README.md).

A real pyinfra deploy (`pyinfra @local`, reading two facts of a file this test writes, changing nothing) runs the
deploy file's `speed.install` and an ironserve `reading_operation` with the switch off and on; the operation reports
from inside, as it executes, what it ran under: the functions pyinfra's modules hold, whether a fact record is kept,
which part of ironserve.speed is loaded, who called its body, and what it read.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ironserve import speed
from ironserve.cli import parser
from ironserve.paths import REPO_ROOT

# Where pyinfra 3.10 calls the three functions ironserve.speed.replacements stands in for.
REBOUND = [
    ("pyinfra.api.operation", "get_operation_order_from_stack"),
    ("pyinfra.api.arguments", "all_global_arguments"),
    ("pyinfra.api.facts", "all_global_arguments"),
    ("pyinfra.api.operation", "pop_global_arguments"),
    ("pyinfra.api.deploy", "pop_global_arguments"),
    ("pyinfra.api.facts", "pop_global_arguments"),
]

PROBE = f"""
import importlib, json, os, sys

from pyinfra.context import host, state
from pyinfra.facts.files import FileContents, Sha256File

from ironserve import speed
from ironserve.speed import reads
from ironserve.speed.reads import Read, read, reading_operation
from roles import REGISTRY  # every role's operations imported, as deploy.py does

speed.install(state)


@reading_operation(reads=lambda path, **_: [Read(FileContents, {{"path": path}}), Read(Sha256File, {{"path": path}})])
def probe(path):
    values = [read(FileContents, path=path), read(Sha256File, path=path)]
    report = {{
        "enabled": speed.enabled(),
        "rebound": {{f"{{m}}.{{n}}": getattr(importlib.import_module(m), n).__module__ for m, n in {REBOUND!r}}},
        "record": reads.fact_reads() is not None,
        "loaded": sorted(m for m in sys.modules if m.startswith("ironserve.speed")),
        "caller": sys._getframe(1).f_code.co_name,
        "values": values,
    }}
    with open(os.environ["PROBE_REPORT"], "w") as out:
        json.dump(report, out)
    yield from ()


probe(path=os.environ["PROBE_FILE"])
"""


def probed(tmp_path: Path, environ: dict[str, str]) -> dict[str, Any]:
    (tmp_path / "probe_deploy.py").write_text(PROBE)
    (tmp_path / "read-me").write_text("one\ntwo\n")
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "@local", "probe_deploy.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "PROBE_REPORT": str(report), "PROBE_FILE": str(tmp_path / "read-me")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Grand total" in run.stderr, run.stderr
    return json.loads(report.read_text())  # type: ignore[no-any-return]


def without_switch() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != speed.PLAIN_PYINFRA}


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return probed(tmp_path_factory.mktemp("fast"), without_switch())


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return probed(tmp_path_factory.mktemp("plain"), {**without_switch(), speed.PLAIN_PYINFRA: "1"})


def test_with_the_switch_off_pyinfra_runs_the_speed_work(fast: dict[str, Any]) -> None:
    assert fast["enabled"] is True
    assert set(fast["rebound"].values()) == {"ironserve.speed.replacements"}
    assert fast["record"] is True  # facts are read through the bundle
    assert "ironserve.speed.bundle" in fast["loaded"]
    assert fast["caller"] == "changing"  # the operation queued is reads' own, forgetting after each command
    assert fast["values"][0] == ["one", "two"]


def test_with_the_switch_on_pyinfra_runs_its_own_functions(plain: dict[str, Any], fast: dict[str, Any]) -> None:
    assert plain["enabled"] is False
    # Every function pyinfra calls is its own, and no module that imports a private pyinfra name is loaded.
    assert all(module.startswith("pyinfra.") for module in plain["rebound"].values()), plain["rebound"]
    assert plain["record"] is False
    assert plain["loaded"] == ["ironserve.speed", "ironserve.speed.reads"]
    assert plain["caller"] == "command_generator"  # pyinfra's own operation runs the body itself
    assert plain["values"] == fast["values"]  # what the operation read is the same either way


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("", True), ("0", True), ("1", False), ("yes", False)])
def test_the_switch_is_read_from_the_environment_each_time(
    monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool
) -> None:
    if value is None:
        monkeypatch.delenv(speed.PLAIN_PYINFRA, raising=False)
    else:
        monkeypatch.setenv(speed.PLAIN_PYINFRA, value)
    assert speed.enabled() is enabled


def test_ironserve_deploy_has_the_switch_as_a_flag() -> None:
    assert parser().parse_args(["deploy", "--plain-pyinfra", "inventory/lab.py"]).plain_pyinfra is True
    assert parser().parse_args(["deploy", "inventory/lab.py"]).plain_pyinfra is False


# The only modules allowed to use pyinfra's private names or rebind its functions.
BUNDLE = REPO_ROOT / "ironserve" / "speed" / "bundle.py"
REPLACEMENTS = REPO_ROOT / "ironserve" / "speed" / "replacements.py"


def deploy_sources() -> list[Path]:
    folders = [REPO_ROOT / "ironserve", REPO_ROOT / "roles"]
    found = [p for folder in folders for p in sorted(folder.rglob("*.py")) if "__pycache__" not in p.parts]
    return [*found, REPO_ROOT / "deploy.py"]


def test_only_ironserve_speed_reaches_into_pyinfra() -> None:
    """Outside ironserve/speed, no private pyinfra name is imported and no pyinfra module is imported by name (the
    way to rebind its functions), so the switch turns all of it off."""
    private, by_name = [], []
    for path in deploy_sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyinfra"):
                private += [f"{path}: {a.name}" for a in node.names if a.name.startswith("_") and path != BUNDLE]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("pyinfra")
                and path != REPLACEMENTS
            ):
                by_name.append(f"{path}:{node.lineno}")
    assert private == [] and by_name == []
    assert BUNDLE.is_file() and REPLACEMENTS.is_file()  # not vacuous
