"""The inventory-key tables of the READMEs, generated from the settings models so they cannot drift.

`python -m ironserve.docs` rewrites the part of each role's README (and of the top README, for the
`ironserve_*` keys) between the two marker lines; `python -m ironserve.docs --check` fails when a
README is stale, as the unit tests do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ironserve.config import Registry, StackBase
from ironserve.paths import REPO_ROOT
from ironserve.registry import registry

BEGIN = "<!-- inventory keys: generated from the settings model by `make docs`; edit the model, not this table -->"
END = "<!-- end of generated inventory keys -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: FieldInfo) -> str:
    if isinstance(field.json_schema_extra, dict) and "default_shown" in field.json_schema_extra:
        return str(field.json_schema_extra["default_shown"])
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "required" if "Required" in (field.description or "") else "none"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def key_table(model: type[BaseModel], prefix: str = "") -> str:
    """Markdown table of a model's inventory keys (those whose alias starts with `prefix`)."""
    rows = ["| key | default | what it does |", "|---|---|---|"]
    for field in model.model_fields.values():
        if field.alias and field.alias.startswith(prefix) and field.description:
            rows.append(f"| `{field.alias}` | {_cell(_default(field))} | {_cell(field.description)} |")
    return "\n".join(rows) + "\n"


def with_table(readme: str, table: str, where: Path) -> str:
    """`readme` with the text between the markers replaced by `table`; ValueError when a marker is missing."""
    head, begin, rest = readme.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{where}: add the marker lines {BEGIN!r} and {END!r} where the key table belongs")
    return head + begin + table + end + tail


def tables(reg: Registry[Any], root: Path = REPO_ROOT) -> dict[Path, str]:
    """README path -> its generated key table: the stack's own `ironserve_*` keys, then one per role."""
    generated = {root / "README.md": key_table(StackBase, "ironserve_")}
    for role in reg.roles:
        generated[root / "roles" / role.name / "README.md"] = key_table(role.settings)
    return generated


def stale(reg: Registry[Any], root: Path = REPO_ROOT) -> list[Path]:
    """The READMEs whose generated table differs from their settings model."""
    outdated = []
    for path, table in tables(reg, root).items():
        text = path.read_text()
        if with_table(text, table, path) != text:
            outdated.append(path)
    return outdated


def main(argv: list[str]) -> int:
    reg = registry()
    if "--check" in argv:
        outdated = stale(reg)
        for path in outdated:
            print(f"{path}: key table out of date; run `make docs`", file=sys.stderr)
        return 1 if outdated else 0
    for path, table in tables(reg).items():
        path.write_text(with_table(path.read_text(), table, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
