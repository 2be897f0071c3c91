"""Every fact on recorded output, the way pyinfra tests its own facts (tests/facts/<Fact>/<case>.json).

A case directory is named by the fact's dotted class name. Each case gives the arguments of `command()`
(`kwargs`), optionally the exact command they make (`command`), the output, and what `process()` returns
(`fact`: dataclasses as dicts, tuples as lists), with a `source` saying where the output comes from. The output
is `output` (lines) or `output_file`: a real capture under the shared samples (../shared/samples/realworld), read
here and never copied into the repository. With `command_reads`, the fact's own command runs with the sample in
place of that path (`. /etc/os-release && ...`) and its stdout is the output. No output at all gives what pyinfra
gives then: the fact's `default()`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.facts import FactBase

import roles
from ironserve.paths import REPO_ROOT

FACTS_DIR = Path(__file__).resolve().parents[1] / "facts"
CASES = sorted(FACTS_DIR.glob("*/*.json"))
CASE_KEYS = {"source", "kwargs", "command", "command_reads", "output", "output_file", "fact"}
ROLE_FACT_FILES = sorted(Path(roles.__file__).parent.glob("*/facts.py"))
FACT_MODULES = (
    "ironserve.dropins",
    "ironserve.facts",
    "ironserve.helm",
    "ironserve.kubectl",
    "ironserve.modprobe",
    "ironserve.owned",
    "ironserve.sysctl_boot",
    *(f"roles.{path.parent.name}.facts" for path in ROLE_FACT_FILES),
)


def samples_dir() -> Path:
    """Real captured output beside the repository (../shared/samples/realworld); IRONSERVE_SAMPLES overrides it."""
    return Path(os.environ.get("IRONSERVE_SAMPLES", REPO_ROOT.parent / "shared" / "samples" / "realworld"))


def real_sample(relative: str) -> Path:
    """A file of the real samples; the calling test skips, saying where it looked, when they are not there."""
    path = samples_dir() / relative
    if not path.is_file():
        pytest.skip(f"real sample {relative} not found under {samples_dir()} (set IRONSERVE_SAMPLES to the folder)")
    return path


def output_lines(text: str) -> list[str]:
    """Lines as pyinfra hands them to `process()`: split at each newline, the newline dropped."""
    return [line.rstrip("\n") for line in io.StringIO(text)]


def plain(value: Any) -> Any:
    """A fact's value as JSON writes it: dataclasses as dicts, tuples as lists."""

    def encode(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        raise TypeError(f"{obj!r} is no JSON value")

    return json.loads(json.dumps(value, default=encode))


def fact_class(dotted: str) -> type[FactBase[Any]]:
    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert inspect.isclass(cls) and issubclass(cls, FactBase), f"{dotted} is no pyinfra fact"
    return cls


def defined_facts() -> list[str]:
    """Dotted names of every FactBase subclass the core and the roles define."""
    names = []
    for module_name in FACT_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, FactBase) and obj.__module__ == module_name:
                names.append(f"{module_name}.{name}")
    return names


def recorded_output(case: dict[str, Any], command: str) -> list[str]:
    if "output_file" not in case:
        return list(case["output"])
    path = real_sample(case["output_file"])
    if "command_reads" not in case:
        return output_lines(path.read_text())
    run = command.replace(case["command_reads"], shlex.quote(str(path)))
    return output_lines(subprocess.run(["sh", "-c", run], capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name.rsplit('.', 1)[-1]}/{p.stem}")
def test_fact_on_recorded_output(path: Path) -> None:
    case = json.loads(path.read_text())
    assert set(case) <= CASE_KEYS, f"unknown keys {set(case) - CASE_KEYS}"
    assert case.get("source"), "say where the output comes from"
    assert ("output" in case) != ("output_file" in case), "give output or output_file"
    fact = fact_class(path.parent.name)()
    command = fact.command(**case.get("kwargs", {}))
    if "command" in case:
        assert command == case["command"]
    lines = recorded_output(case, command)
    value = fact.process(lines) if lines else fact.default()
    assert plain(value) == case["fact"]


def test_every_fact_has_a_recorded_case() -> None:
    covered = {path.parent.name for path in CASES}
    assert [name for name in defined_facts() if name not in covered] == []
    assert sorted(covered - set(defined_facts())) == [], "a case folder names no fact"


def test_every_real_sample_is_used() -> None:
    """Each real capture (not its .source note) is read by a fact case or named by a unit test."""
    root = samples_dir()
    if not root.is_dir():
        pytest.skip(f"real samples not found under {root} (set IRONSERVE_SAMPLES to the folder)")
    readers = [p.read_text() for p in (*CASES, *sorted(Path(__file__).parent.glob("test_*.py")))]
    captures = sorted(str(p.relative_to(root)) for p in root.rglob("*.txt"))
    assert [c for c in captures if not any(f'"{c}"' in text for text in readers)] == []
