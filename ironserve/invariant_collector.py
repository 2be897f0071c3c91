"""ironserve's pytest plugin: the `invariant` and `gpu` markers; the invariant ids `ironserve coverage` collects.

Registered once, as the `pytest11` entry point of the ironserve distribution, so every pytest run where
ironserve is installed loads it: the unit and lab tests, the acceptance gate (`ironserve verify`) and
the collection that `ironserve coverage` runs (which also names it with `-p`, the same plugin).
Collecting (rather than reading source) counts every way a test can carry the marker: on the
function, on a parameter, on the module, or built from a table.
"""

from __future__ import annotations

import json
import os

import pytest

OUTPUT_ENV = "IRONSERVE_INVARIANT_IDS_FILE"


def pytest_configure(config: pytest.Config) -> None:
    # The markers of the acceptance gate, which runs from an install too (no pyproject.toml there).
    config.addinivalue_line("markers", "invariant(*ids): catalog ids this test asserts")
    config.addinivalue_line("markers", "gpu: needs a real NVIDIA GPU; skipped elsewhere")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    output = os.environ.get(OUTPUT_ENV)
    if not output:  # an ordinary test run, not `ironserve coverage`
        return
    tagged = {item.nodeid: sorted({i for m in item.iter_markers("invariant") for i in m.args}) for item in items}
    with open(output, "w") as stream:
        json.dump(tagged, stream)
