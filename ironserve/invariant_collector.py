"""pytest plugin used by `ironserve coverage`: after collection, write each test's invariant ids as JSON.

Collecting (rather than reading source) counts every way a test can carry the marker: on the
function, on a parameter, on the module, or built from a table.
"""

from __future__ import annotations

import json
import os

import pytest

OUTPUT_ENV = "IRONSERVE_INVARIANT_IDS_FILE"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "invariant(*ids): catalog ids this test asserts")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tagged = {item.nodeid: sorted({i for m in item.iter_markers("invariant") for i in m.args}) for item in items}
    with open(os.environ[OUTPUT_ENV], "w") as output:
        json.dump(tagged, output)
