"""`ironserve coverage`: how much of the invariant catalog the project accounts for, per area.

An id counts as asserted by the acceptance gate when a test under ironserve/acceptance/ carries it in
`@pytest.mark.invariant(...)`; asserted elsewhere when another test does (unit, lab, service);
waived when a waivers file gives it a reason; otherwise it is not yet accounted for.
Tests are found by pytest's own collection, so ids from parametrised tables count too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from ironserve.invariant_collector import OUTPUT_ENV
from ironserve.paths import REPO_ROOT, spec_dir

WAIVER_FILES = (REPO_ROOT / "waivers.yaml", REPO_ROOT / "service" / "waivers.yaml")
STATUSES = ("acceptance", "elsewhere", "waived", "missing")


@dataclass(frozen=True)
class Entry:
    id: str
    area: str


def catalog(path: Path | None = None) -> list[Entry]:
    data = yaml.safe_load((path or spec_dir() / "invariants.yaml").read_text())
    return [Entry(e["id"], e["area"]) for e in data["entries"]]


def collected_ids(project: Path, targets: list[str]) -> dict[str, list[str]]:
    """Test node id -> invariant ids, as pytest collects them under `project`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "ironserve.invariant_collector",
                *targets,
            ],
            cwd=project,
            env={**os.environ, OUTPUT_ENV: output.name},
            capture_output=True,
            text=True,
        )
        if result.returncode not in (0, 5):
            raise RuntimeError(f"collecting tests in {project} failed:\n{result.stdout}{result.stderr}")
        tagged: dict[str, list[str]] = json.loads(Path(output.name).read_text() or "{}")
        return tagged


def tagged_tests() -> dict[str, list[str]]:
    """Every tagged test of the repository and the service, keyed by a path relative to the repository."""
    tagged = collected_ids(REPO_ROOT, ["tests", "ironserve/acceptance"])
    tagged |= {f"service/{node}": ids for node, ids in collected_ids(REPO_ROOT / "service", ["tests"]).items()}
    return tagged


def waivers(files: tuple[Path, ...] = WAIVER_FILES) -> dict[str, str]:
    """{id: reason}; ValueError naming the file and line when one is not a list of id/reason entries."""
    reasons: dict[str, str] = {}
    for path in files:
        if not path.exists():
            continue
        try:
            items = yaml.safe_load(path.read_text()) or []
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ValueError(
                f"{path}{where}: not YAML ({getattr(error, 'problem', error)}); quote a reason that contains ': '"
            ) from None
        for number, item in enumerate(items, 1):
            if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item.get("reason"):
                raise ValueError(f"{path}: entry {number} is not an id with a reason")
            reasons[item["id"]] = item["reason"]
    return reasons


def classify(entries: list[Entry], tagged: dict[str, list[str]]) -> dict[str, str]:
    acceptance = {i for node, ids in tagged.items() if node.startswith("ironserve/acceptance/") for i in ids}
    elsewhere = {i for node, ids in tagged.items() if not node.startswith("ironserve/acceptance/") for i in ids}
    waived = waivers()
    status = {}
    for entry in entries:
        if entry.id in acceptance:
            status[entry.id] = "acceptance"
        elif entry.id in elsewhere:
            status[entry.id] = "elsewhere"
        elif entry.id in waived:
            status[entry.id] = "waived"
        else:
            status[entry.id] = "missing"
    return status


def unknown_ids(entries: list[Entry], tagged: dict[str, list[str]]) -> set[str]:
    """Ids used in tests or waivers that the catalog does not have (typos)."""
    used = {i for ids in tagged.values() for i in ids}
    return (used | set(waivers())) - {e.id for e in entries}


def report(entries: list[Entry], status: dict[str, str], show_missing: bool) -> str:
    by_area: dict[str, Counter[str]] = {}
    for entry in entries:
        by_area.setdefault(entry.area, Counter())[status[entry.id]] += 1
    header = f"{'area':<20}{'total':>6}" + "".join(f"{s:>12}" for s in STATUSES)
    lines = [header, "-" * len(header)]
    totals: Counter[str] = Counter()
    for area, counts in by_area.items():
        totals.update(counts)
        lines.append(f"{area:<20}{sum(counts.values()):>6}" + "".join(f"{counts[s]:>12}" for s in STATUSES))
    lines.append("-" * len(header))
    lines.append(f"{'all':<20}{sum(totals.values()):>6}" + "".join(f"{totals[s]:>12}" for s in STATUSES))
    if show_missing:
        lines.append("")
        lines += [f"missing: {e.area}: {e.id}" for e in entries if status[e.id] == "missing"]
    return "\n".join(lines)
