"""Closed JSON Schemas of the add-ons' custom resources, and the validators `ironserve.manifests.problems` takes.

No package registry this project reaches ships the projects' CustomResourceDefinitions (cert-manager, Gateway
API, Envoy Gateway). The `@kubernetes-models/*` npm packages of `crd-schemas.lock` ship TypeScript
declarations generated from them: from the CRDs' openAPIV3Schema (cert-manager, with its enums) or from the
projects' Go API types (Gateway API, Envoy Gateway). `build` turns those declarations into one JSON Schema per
(apiVersion, kind) in which every object is closed: a field the types do not have is an error, as the API
server would drop it as unknown (pruning). What TypeScript cannot say is not checked here: patterns, ranges,
and the enums of the packages generated from Go types.

`scripts/fetch-crd-schemas.sh` fetches the packages (pinned, sha256-checked) into
$IRONSERVE_CACHE/crd-schemas/ and runs `main(["build"])` here. Without that file
(or with one built from another lock) every custom resource fails validation, saying to run the script.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from ironserve.layout import role_file
from ironserve.manifests import CustomValidator, Manifest

LOCK = role_file("cluster_addons", "crd-schemas.lock")
FETCH_SCRIPT = "scripts/fetch-crd-schemas.sh"
SCHEMAS_FILE = "schemas.json"
# Types of packages the lock does not pin (kubernetes-models' built-in types, used only by EnvoyProxy): left open.
OPEN: dict[str, Any] = {}
KEYWORD_TYPES: dict[str, dict[str, Any]] = {
    "string": {"type": "string"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "object": {"type": "object"},
    "any": OPEN,
    "unknown": OPEN,
}


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    sha256: str
    upstream: str  # what the package was generated from, e.g. "cert-manager v1.20.2"


def read_lock(path: Path = LOCK) -> tuple[Pin, ...]:
    pins = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words and not words[0].startswith("#"):
            pins.append(Pin(words[0], words[1], words[2], " ".join(words[3:])))
    return tuple(pins)


def lock_digest(path: Path = LOCK) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("IRONSERVE_CACHE", Path.home() / ".cache" / "ironserve")) / "crd-schemas"


def package_dir(root: Path, pin: Pin) -> Path:
    return root / f"{pin.package.replace('@', '').replace('/', '-')}-{pin.version}"


# --- reading the declarations ---------------------------------------------------------------------------------

TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|([A-Za-z_$][\w$]*)|(-?[0-9]+(?:\.[0-9]+)?)|(\S))')


def _tokens(text: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"^\s*//.*$", " ", text, flags=re.MULTILINE)
    return [m.group(m.lastindex or 0) for m in TOKEN.finditer(text) if m.lastindex]


@dataclass
class Module:
    """One .d.ts file: its declarations (name -> type node), imports and exported aliases."""

    path: Path
    package: str
    declarations: dict[str, Any] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (specifier, exported name)
    exports: dict[str, str] = field(default_factory=dict)  # exported name -> local name


class _Parser:
    """A reader for the declaration files kubernetes-models generates (interfaces, type aliases, imports)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.at = 0

    def peek(self, ahead: int = 0) -> str:
        index = self.at + ahead
        return self.tokens[index] if index < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, found {token!r} at token {self.at}")
        self.at += 1
        return token

    def skip_block(self) -> None:
        depth = 0
        while self.at < len(self.tokens):
            token = self.take()
            depth += token == "{"
            depth -= token == "}"
            if depth == 0 and token == "}":
                return

    def skip_statement(self) -> None:
        while self.at < len(self.tokens) and self.peek() not in {";", "{"}:
            self.take()
        if self.peek() == "{":
            self.skip_block()
        if self.peek() == ";":
            self.take()

    def module(self, module: Module) -> Module:
        while self.at < len(self.tokens):
            token = self.peek()
            if token == "import":
                self.import_(module)
            elif token == "interface" or (token == "export" and self.peek(1) == "interface"):
                self.at += 1 if token == "interface" else 2
                self.interface(module)
            elif token == "export" and self.peek(1) == "type" and self.peek(2) == "{":
                self.at += 2
                self.export_names(module)
            elif token == "export" and self.peek(1) == "type":
                self.at += 2
                name = self.take()
                self.take("=")
                module.declarations[name] = self.type_()
                module.exports.setdefault(name, name)
                if self.peek() == ";":
                    self.take()
            else:
                self.skip_statement()
        return module

    def import_(self, module: Module) -> None:
        self.take("import")
        if self.peek() == "type":
            self.take()
        if self.peek() != "{":
            self.skip_statement()
            return
        self.take("{")
        names: list[tuple[str, str]] = []
        while self.peek() != "}":
            exported = self.take()
            local = exported
            if self.peek() == "as":
                self.take()
                local = self.take()
            names.append((local, exported))
            if self.peek() == ",":
                self.take()
        self.take("}")
        self.take("from")
        specifier = json.loads(self.take())
        for local, exported in names:
            module.imports[local] = (specifier, exported)
        if self.peek() == ";":
            self.take()

    def export_names(self, module: Module) -> None:
        self.take("{")
        while self.peek() != "}":
            local = self.take()
            exported = local
            if self.peek() == "as":
                self.take()
                exported = self.take()
            module.exports[exported] = local
            if self.peek() == ",":
                self.take()
        self.take("}")
        if self.peek() == ";":
            self.take()

    def interface(self, module: Module) -> None:
        name = self.take()
        bases: list[Any] = []
        if self.peek() == "extends":
            self.take()
            bases.append(self.primary())
            while self.peek() == ",":
                self.take()
                bases.append(self.primary())
        node = self.object_()
        node["bases"] = bases
        module.declarations[name] = node
        module.exports.setdefault(name, name)

    def object_(self) -> dict[str, Any]:
        self.take("{")
        members: dict[str, tuple[Any, bool]] = {}
        index: Any = None
        while self.peek() != "}":
            if self.peek() == "readonly":
                self.take()
            if self.peek() == "[":  # an index signature: [key: string]: T
                self.take("[")
                self.take()
                self.take(":")
                self.type_()
                self.take("]")
                self.take(":")
                index = self.type_()
            else:
                token = self.take()
                name = json.loads(token) if token.startswith('"') else token
                optional = self.peek() == "?"
                if optional:
                    self.take()
                self.take(":")
                members[name] = (self.type_(), not optional)
            if self.peek() in {";", ","}:
                self.take()
        self.take("}")
        return {"kind": "object", "members": members, "index": index}

    def type_(self) -> Any:
        if self.peek() == "|":
            self.take()
        options = [self.postfix()]
        while self.peek() == "|":
            self.take()
            options.append(self.postfix())
        return options[0] if len(options) == 1 else {"kind": "union", "options": options}

    def postfix(self) -> Any:
        node = self.primary()
        while self.peek() == "[":
            self.take("[")
            if self.peek() == "]":
                self.take("]")
                node = {"kind": "array", "items": node}
            else:
                key = json.loads(self.take())
                self.take("]")
                node = {"kind": "member", "of": node, "name": key}
        return node

    def primary(self) -> Any:
        token = self.peek()
        if token == "{":
            return self.object_()
        if token == "(":
            self.take("(")
            node = self.type_()
            self.take(")")
            return node
        self.take()
        if token.startswith('"'):
            return {"kind": "literal", "value": json.loads(token)}
        if re.fullmatch(r"-?[0-9.]+", token):
            return {"kind": "literal", "value": json.loads(token)}
        if token in KEYWORD_TYPES:
            return {"kind": "keyword", "name": token}
        if token == "Array" and self.peek() == "<":
            self.take("<")
            items = self.type_()
            self.take(">")
            return {"kind": "array", "items": items}
        if self.peek() == "<":  # another generic (Model<...>): its arguments do not matter
            depth = 0
            while True:
                t = self.take()
                depth += t == "<"
                depth -= t == ">"
                if depth == 0:
                    break
        return {"kind": "ref", "name": token}


# --- turning them into JSON Schema ----------------------------------------------------------------------------


class Converter:
    """JSON Schemas of the declarations of some unpacked packages, every object closed."""

    def __init__(self, packages: Mapping[str, Path]) -> None:
        self.packages = dict(packages)
        self.modules: dict[Path, Module | None] = {}
        self.defs: dict[str, Any] = {}

    def module(self, path: Path, package: str) -> Module | None:
        if path not in self.modules:
            self.modules[path] = None
            if path.is_file():
                self.modules[path] = _Parser(_tokens(path.read_text())).module(Module(path, package))
        return self.modules[path]

    def resolve_specifier(self, module: Module, specifier: str) -> tuple[Path, str] | None:
        if specifier.startswith("."):
            target = (module.path.parent / specifier).resolve()
            return target.with_name(target.name.removesuffix(".js") + ".d.ts"), module.package
        parts = specifier.split("/")
        package = "/".join(parts[:2]) if specifier.startswith("@") else parts[0]
        rest = parts[2:] if specifier.startswith("@") else parts[1:]
        root = self.packages.get(package)
        if root is None:
            return None
        target = root.joinpath(*rest) if rest else root / "index"
        file = target.with_name(target.name + ".d.ts")
        return (file if file.is_file() else target / "index.d.ts"), package

    def lookup(self, module: Module, name: str, exported: bool = False) -> tuple[Module, str] | None:
        """The module and local name that declare `name` as seen from `module` (following imports)."""
        local = module.exports.get(name, name) if exported else name
        if local in module.declarations:
            return module, local
        if local in module.imports:
            specifier, imported = module.imports[local]
            found = self.resolve_specifier(module, specifier)
            target = self.module(*found) if found else None
            return self.lookup(target, imported, exported=True) if target else None
        return None

    def ref(self, module: Module, name: str) -> dict[str, Any]:
        found = self.lookup(module, name)
        if found is None:
            return OPEN
        owner, local = found
        key = f"{owner.package}/{owner.path.relative_to(self.packages[owner.package]).as_posix()}#{local}"
        key = re.sub(r"[^A-Za-z0-9_.#/@-]", "_", key).replace("/", ".")
        if key not in self.defs:
            self.defs[key] = OPEN  # a placeholder while a recursive type is converted
            self.defs[key] = self.schema(owner, owner.declarations[local])
        return {"$ref": f"#/$defs/{key}"}

    def members(self, module: Module, node: dict[str, Any]) -> tuple[dict[str, tuple[Module, Any, bool]], Any]:
        """An interface's own and inherited members (extends copies them: a closed object cannot be an allOf)."""
        merged: dict[str, tuple[Module, Any, bool]] = {}
        index = None
        for base in node.get("bases", []):
            found = self.lookup(module, base["name"]) if base.get("kind") == "ref" else None
            if found is not None and found[0].declarations[found[1]].get("kind") == "object":
                inherited, base_index = self.members(found[0], found[0].declarations[found[1]])
                merged.update(inherited)
                index = base_index if base_index is not None else index
        merged.update({name: (module, t, required) for name, (t, required) in node["members"].items()})
        return merged, (module, node["index"]) if node["index"] is not None else index

    def schema(self, module: Module, node: Any) -> dict[str, Any]:
        kind = node["kind"]
        if kind == "keyword":
            return KEYWORD_TYPES[node["name"]]
        if kind == "literal":
            return {"const": node["value"]}
        if kind == "array":
            return {"type": "array", "items": self.schema(module, node["items"])}
        if kind == "ref":
            return self.ref(module, node["name"])
        if kind == "union":
            options = [self.schema(module, option) for option in node["options"]]
            if all("const" in option for option in options):
                return {"enum": [option["const"] for option in options]}
            if all(set(option) == {"type"} for option in options):
                return {"type": sorted({option["type"] for option in options})}
            return {"anyOf": options}
        if kind == "member":
            found = self.lookup(module, node["of"]["name"]) if node["of"].get("kind") == "ref" else None
            if found is not None:
                members, _ = self.members(found[0], found[0].declarations[found[1]])
                if node["name"] in members:
                    owner, member, _ = members[node["name"]]
                    return self.schema(owner, member)
            return OPEN
        members, index = self.members(module, node)
        result: dict[str, Any] = {
            "type": "object",
            "properties": {name: self.schema(owner, t) for name, (owner, t, _) in members.items()},
        }
        required = sorted(name for name, (_, _, needed) in members.items() if needed)
        if required:
            result["required"] = required
        result["additionalProperties"] = self.schema(*index) if index is not None else False
        return result

    def kinds(self) -> dict[str, Any]:
        """{"apiVersion/Kind": schema} of every declared object with literal apiVersion and kind members."""
        found: dict[str, Any] = {}
        for package, root in sorted(self.packages.items()):
            for path in sorted(root.rglob("*.d.ts")):
                module = self.module(path, package)
                for name, node in (module.declarations if module else {}).items():
                    members = node.get("members", {}) if node.get("kind") == "object" else {}
                    api, kind = (members.get(key, ({}, False))[0] for key in ("apiVersion", "kind"))
                    if api.get("kind") == "literal" and kind.get("kind") == "literal" and module is not None:
                        found[f"{api['value']}/{kind['value']}"] = self.ref(module, name)
        return found


def build(root: Path | None = None, lock: Path = LOCK) -> Path:
    """Write root/schemas.json from the unpacked packages of `lock`; returns its path."""
    root = root or cache_dir()
    pins = read_lock(lock)
    packages = {pin.package: package_dir(root, pin) for pin in pins}
    missing = [f"{pin.package}@{pin.version}" for pin in pins if not package_dir(root, pin).is_dir()]
    if missing:
        raise FileNotFoundError(f"not unpacked in {root}: {', '.join(missing)}; run {FETCH_SCRIPT}")
    converter = Converter(packages)
    kinds = converter.kinds()
    document = {
        "lock": lock_digest(lock),
        "generated_from": {pin.package: f"{pin.version} ({pin.upstream})" for pin in pins},
        "$defs": converter.defs,
        "kinds": kinds,
    }
    target = root / SCHEMAS_FILE
    staged = target.with_suffix(".new")
    staged.write_text(json.dumps(document, sort_keys=True))
    staged.replace(target)
    return target


# --- validating -----------------------------------------------------------------------------------------------


class SchemasMissing(Exception):
    """The schemas file is absent or was built from another lock."""


@functools.cache
def _load(path: Path, digest: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    if document.get("lock") != digest:
        raise SchemasMissing(f"run {FETCH_SCRIPT}: {path} was built from another {LOCK.name}")
    return document


def load_schemas(root: Path | None = None, lock: Path = LOCK) -> dict[str, Any]:
    path = (root or cache_dir()) / SCHEMAS_FILE
    if not path.is_file():
        raise SchemasMissing(f"run {FETCH_SCRIPT}: no custom resource schemas in {path.parent}")
    return _load(path, lock_digest(lock))


def _where(path: Iterator[Any] | Any) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or "(top)"


def _message(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(error.schema.get("properties", {}))
        unknown = [key for key in error.instance if key not in known]
        lines = []
        for key in unknown:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else f" (accepted: {', '.join(sorted(known))})"
            lines.append(f"unknown field {key!r}, which the API server drops as unknown{hint}")
        return "; ".join(lines)
    return str(error.message)


def validator(document: Mapping[str, Any], api_version: str, kind: str) -> CustomValidator:
    """The problems of one object of (api_version, kind) against the closed schema, one line each."""
    schema = {"$defs": document["$defs"], **document["kinds"][f"{api_version}/{kind}"]}
    checker = jsonschema.Draft202012Validator(schema)

    def check(obj: Manifest) -> list[str]:
        errors = sorted(checker.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
        return [f"{_where(error.absolute_path)}: {_message(error)}" for error in errors]

    return check


def _refused(reason: str) -> CustomValidator:
    return lambda obj: [f"not validated: {reason}"]


def custom_validators(
    kinds: tuple[tuple[str, str], ...], root: Path | None = None, lock: Path = LOCK
) -> dict[tuple[str, str], CustomValidator]:
    """A validator per (apiVersion, kind); with the schemas absent, each one fails saying to run the script."""
    try:
        document = load_schemas(root, lock)
    except (SchemasMissing, OSError, ValueError) as exc:
        return {key: _refused(str(exc)) for key in kinds}
    validators: dict[tuple[str, str], CustomValidator] = {}
    for api_version, kind in kinds:
        if f"{api_version}/{kind}" in document["kinds"]:
            validators[(api_version, kind)] = validator(document, api_version, kind)
        else:
            validators[(api_version, kind)] = _refused(f"the schemas of {LOCK.name} have no {kind} in {api_version}")
    return validators


def main(argv: list[str]) -> int:
    if argv[:1] != ["build"]:
        print(f'usage: {FETCH_SCRIPT} (which calls main(["build"]))', file=sys.stderr)
        return 2
    try:
        target = build()
    except FileNotFoundError as exc:
        print(f"models_crd: {exc}", file=sys.stderr)
        return 1
    print(f"models_crd: wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
