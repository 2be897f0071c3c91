"""Kubernetes objects rendered by roles: strictly validated before any host is contacted, written as YAML.

Built-in kinds are checked by kubernetes-validate's strict schemas (generated from the Kubernetes OpenAPI
of the pinned minor: an unknown field, a wrong type or a missing required field fails). A kind it has no
schema for fails too, unless the caller passes a validator for it (a custom resource checked against its
project's CRD schema): nothing reaches a cluster unchecked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kubernetes_validate
import yaml

Manifest = dict[str, Any]
# (apiVersion, kind) -> the problems of one object of that kind (empty: valid).
CustomValidator = Callable[[Manifest], list[str]]


def identity(obj: Mapping[str, Any]) -> str:
    """`Kind namespace/name` (or `Kind name`) for messages."""
    metadata = obj.get("metadata") or {}
    name = metadata.get("name", "<no name>")
    namespace = metadata.get("namespace")
    return f"{obj.get('kind', '<no kind>')} {namespace + '/' if namespace else ''}{name}"


def _location(path: Iterable[object]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".") or "(top)"


def problems(
    objects: Iterable[Manifest],
    kubernetes_version: str,
    custom: Mapping[tuple[str, str], CustomValidator] | None = None,
) -> list[str]:
    """Every problem of `objects` at `kubernetes_version` (MAJOR.MINOR.PATCH), one line each."""
    found: list[str] = []
    for obj in objects:
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        validator = (custom or {}).get(key)
        if validator is not None:
            found += [f"{identity(obj)}: {problem}" for problem in validator(obj)]
            continue
        try:
            kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            found.append(f"{identity(obj)}: {_location(error.absolute_path)}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError:
            found.append(
                f"{identity(obj)}: Kubernetes {kubernetes_version} has no kind {key[1]} in {key[0]}, and no "
                "custom resource schema was given for it"
            )
    return found


def dump_all(objects: Iterable[Manifest]) -> str:
    """One multi-document YAML file (`kubectl apply -f` reads it), keys in the order rendered."""
    return yaml.safe_dump_all(list(objects), sort_keys=False, default_flow_style=False)
