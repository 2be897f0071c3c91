"""The project's layout holds: roles keep only their Python and README, read their templates and files from the
top-level templates/<role>/ and files/<role>/ through ironserve.layout, name each kind of module the same way,
and the product (ironserve/, roles/, deploy.py) never imports the lab."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve.layout import role_file, role_template
from ironserve.paths import REPO_ROOT
from roles import REGISTRY

ROLES = REPO_ROOT / "roles"
ROLE_NAMES = sorted(role.name for role in REGISTRY.roles)
# One name for each kind of module, in every role: the deploy, its inventory keys, what it reads from the host,
# what it changes there, the text it writes, typed models of what it writes, checks of what it found, and a
# client of an out-of-band API. A second module of a kind names its subject after the kind (render_corefile).
MODULE_KINDS = {"__init__", "settings", "facts", "operations", "render", "models", "checks", "client"}
# What reads a file some other way than ironserve.layout.
LAYOUT_READS = {"role_template", "role_file"}
FORBIDDEN_NAMES = {"__file__", "importlib.resources", "get_template", "FileSystemLoader", "PackageLoader"}


def _python(folder: Path) -> Iterator[Path]:
    yield from (path for path in sorted(folder.rglob("*.py")) if "__pycache__" not in path.parts)


def _names(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _layout_calls(tree: ast.AST) -> Iterator[tuple[str, list[ast.expr]]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LAYOUT_READS:
            yield node.func.id, node.args


def test_role_folders_hold_only_python_and_their_readme() -> None:
    stray = [
        str(path.relative_to(REPO_ROOT))
        for path in sorted(ROLES.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".py" and path.name != "README.md"
    ]
    assert stray == [], "templates go to templates/<role>/, other files to files/<role>/"


def test_every_role_names_its_modules_by_kind() -> None:
    for role in ROLE_NAMES:
        modules = {path.stem for path in (ROLES / role).glob("*.py")}
        unnamed = sorted(m for m in modules if m not in MODULE_KINDS and m.split("_")[0] not in MODULE_KINDS)
        assert unnamed == [], f"roles/{role}: name modules by kind ({', '.join(sorted(MODULE_KINDS))})"
        assert {"__init__", "settings"} <= modules, f"roles/{role}"


@pytest.mark.parametrize("path", list(_python(ROLES)), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_roles_read_templates_and_files_only_through_the_layout(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not FORBIDDEN_NAMES & set(_names(tree)), "read templates and files with ironserve.layout"
    role = path.relative_to(ROLES).parts[0]
    for function, args in _layout_calls(tree):
        assert args and isinstance(args[0], ast.Constant), f"{function} names its role as a literal"
        assert args[0].value == role, f"{function}({args[0].value!r}, ...) in roles/{role}: a role reads its own"


def test_template_and_file_folders_belong_to_roles_and_are_found() -> None:
    for kind, read in (("templates", role_template), ("files", role_file)):
        folders = [path for path in (REPO_ROOT / kind).iterdir() if path.is_dir() and path.name != "__pycache__"]
        assert folders, kind
        for folder in folders:
            assert folder.name in ROLE_NAMES, f"{kind}/{folder.name} names no role"
            for item in folder.iterdir():
                assert read(folder.name, item.name) == item.resolve()


def test_a_missing_template_is_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"templates/inference/nope\.j2: no such template of role inference"):
        role_template("inference", "nope.j2")


@pytest.mark.parametrize("folder", ["ironserve", "roles"])
def test_the_product_never_imports_the_lab(folder: str) -> None:
    paths = [*_python(REPO_ROOT / folder), *([REPO_ROOT / "deploy.py"] if folder == "ironserve" else [])]
    importing = [
        str(path.relative_to(REPO_ROOT))
        for path in paths
        if any(name.split(".")[0] == "ironserve_lab" for name in _names(ast.parse(path.read_text())))
    ]
    assert importing == []
