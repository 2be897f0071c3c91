"""`ironserve coverage` counts ids from pytest's own collection plus waivers; every id must be in the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from ironserve.coverage import catalog, classify, collected_ids, tagged_tests, unknown_ids, waivers


@pytest.fixture(scope="module")
def tagged() -> dict[str, list[str]]:
    return tagged_tests()


def test_ids_are_collected_from_functions_parameters_and_tables(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "TABLE = [('a', ('sysctl-wmem-max',))]\n"
        '@pytest.mark.invariant("sysctl-rmem-max", "kernel-cgroup-v2")\n'
        "def test_f(): ...\n"
        "@pytest.mark.parametrize('n', [pytest.param(n, marks=pytest.mark.invariant(*ids)) for n, ids in TABLE])\n"
        "def test_p(n): ...\n"
    )
    assert collected_ids(tmp_path, ["."]) == {
        "test_x.py::test_f": ["kernel-cgroup-v2", "sysctl-rmem-max"],
        "test_x.py::test_p[a]": ["sysctl-wmem-max"],
    }


def test_every_id_used_in_tests_and_waivers_is_in_the_catalog(tagged: dict[str, list[str]]) -> None:
    assert unknown_ids(catalog(), tagged) == set()


@pytest.mark.parametrize("area", ["kernel_cgroup", "network_tuning"])
def test_host_tuning_areas_are_fully_accounted_for(tagged: dict[str, list[str]], area: str) -> None:
    entries = [e for e in catalog() if e.area == area]
    status = classify(entries, tagged)
    assert [e.id for e in entries if status[e.id] == "missing"] == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- id: a\n  reason: measured: no gain\n", "line 2: not YAML (mapping values are not allowed here); quote"),
        ("- id: a\n", "entry 1 is not an id with a reason"),
        ("- just-a-string\n", "entry 1 is not an id with a reason"),
    ],
)
def test_a_mistyped_waivers_file_is_named_with_its_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "waivers.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        waivers((path,))
    path.write_text('- id: a\n  reason: "measured: no gain"\n')
    assert waivers((path,)) == {"a": "measured: no gain"}
