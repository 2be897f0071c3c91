"""Every catalog id of the service's areas is asserted by a tagged test or waived with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ironserve_service.settings import ServiceSettings

SERVICE_DIR = Path(__file__).resolve().parents[1]
CATALOG = SERVICE_DIR.parent.parent / "shared" / "spec" / "invariants.yaml"
AREAS = {
    "inference_service",
    "serving_pipeline",
    "model_artifacts",
    "observability",
    "slo_alerting",
    "hot_swap",
    "routing",
    "resilience",
    "scaling",
}


class InvariantRecorder:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            for marker in item.iter_markers("invariant"):
                self.ids.update(marker.args)


def asserted_ids() -> set[str]:
    recorder = InvariantRecorder()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(SERVICE_DIR / "tests")], [recorder])
    assert code == 0
    return recorder.ids


@pytest.mark.skipif(not CATALOG.exists(), reason=f"invariant catalog absent at {CATALOG}")
def test_every_area_id_is_asserted_or_waived(capsys: pytest.CaptureFixture[str]) -> None:
    entries = yaml.safe_load(CATALOG.read_text())["entries"]
    area_ids = {e["id"] for e in entries if e["area"] in AREAS}
    waivers = yaml.safe_load((SERVICE_DIR / "waivers.yaml").read_text())
    waived = {w["id"] for w in waivers}
    assert all(w.get("reason") for w in waivers)
    asserted = asserted_ids()
    capsys.readouterr()  # the nested collection's output is noise here
    assert not asserted - {e["id"] for e in entries}, "tests tag ids the catalog does not have"
    assert not asserted & waived, "an id is both asserted and waived"
    assert not waived - area_ids, "waivers name ids outside the service areas"
    assert area_ids - asserted - waived == set()


def test_example_config_is_valid() -> None:
    ServiceSettings.model_validate(yaml.safe_load((SERVICE_DIR / "service.example.yaml").read_text()))
