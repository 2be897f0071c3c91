"""Kubernetes objects applied from a control plane with kubectl: a fact that says whether the cluster has them as
rendered, and the operation that applies them server-side only when it does not.

Field manager `ironserve`: what the deploy applies it owns, and nothing else (a swap's selector, a scaler's replicas
belong to their own managers), so a re-run never reverts them.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve.operations import Commands
from ironserve.reads import Read, read, reading_operation

ADMIN_KUBECONFIG = "/etc/kubernetes/admin.conf"  # kubeadm's, on every control plane


@dataclass(frozen=True)
class ObjectsDiff:
    """`kubectl diff --server-side` of a file against the cluster: 0 no difference, 1 a difference, >1 an error."""

    status: int
    stderr: str  # its last lines: what an error said


class KubectlDiff(FactBase[ObjectsDiff | None]):
    """The server-side diff of `objects` (YAML, the content the deploy writes: the file may be older until the
    deploy runs) as the field manager `ironserve`; None before the cluster has an admin kubeconfig. The diff
    itself goes nowhere: it may be long, and it is not what decides."""

    def command(self, objects: str, kubeconfig: str) -> str:
        conf = shlex.quote(kubeconfig)
        diff = f"kubectl --kubeconfig {conf} diff --server-side --field-manager=ironserve --force-conflicts -f -"
        return (
            f"if [ -f {conf} ]; then err=$(printf '%s' {shlex.quote(objects)} | {diff} 2>&1 >/dev/null); "
            'echo "status=$?"; printf \'%s\\n\' "$err" | tail -n 5; fi'
        )

    def process(self, output: Iterable[str]) -> ObjectsDiff | None:
        lines = list(output)
        if not lines or not lines[0].startswith("status="):
            return None
        return ObjectsDiff(int(lines[0].removeprefix("status=")), "\n".join(line for line in lines[1:] if line.strip()))


class ServedKinds(FactBase[dict[str, list[str] | None] | None]):
    """{api version: the kinds the cluster serves in it ([] when it serves no such group or version; None when the
    API server did not say)}, from its discovery documents; None before the cluster has an admin kubeconfig."""

    def command(self, api_versions: list[str], kubeconfig: str) -> str:
        conf = shlex.quote(kubeconfig)
        get = f"kubectl --kubeconfig {conf} --request-timeout=20s get --raw"
        reads = "; ".join(
            f"out=$({get} {shlex.quote(_discovery_path(gv))} 2>&1); "
            f"echo {shlex.quote(gv)} $? \"$(printf '%s' \"$out\" | tr -d '\\n')\""
            for gv in api_versions
        )
        return f"if [ -f {conf} ]; then {reads}; fi"

    def process(self, output: Iterable[str]) -> dict[str, list[str] | None] | None:
        served: dict[str, list[str] | None] = {}
        for line in output:
            api_version, status, body = [*line.split(" ", 2), "", ""][:3]
            if not api_version:
                continue
            if status == "0":
                resources = json.loads(body)["resources"]
                served[api_version] = sorted({r["kind"] for r in resources if "/" not in r["name"]})
            else:  # kubectl's words for a 404: the group or version is not served; anything else says nothing
                served[api_version] = [] if "(NotFound)" in body else None
        return served or None


def _discovery_path(api_version: str) -> str:
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def kinds_of(objects: str) -> dict[str, list[str]]:
    """{api version: kinds} of a YAML stream of objects, in order of first appearance."""
    found: dict[str, list[str]] = {}
    for obj in yaml.safe_load_all(objects):
        if obj:
            kinds = found.setdefault(obj["apiVersion"], [])
            if obj["kind"] not in kinds:
                kinds.append(obj["kind"])
    return found


def _apply_reads(objects: str, kubeconfig: str, **_: object) -> list[Read]:
    versions = list(kinds_of(objects))
    return [
        Read(ServedKinds, {"api_versions": versions, "kubeconfig": kubeconfig}),
        Read(KubectlDiff, {"objects": objects, "kubeconfig": kubeconfig}),
    ]


@reading_operation(reads=_apply_reads)
def objects_applied(path: str, objects: str, kubeconfig: str) -> Commands:
    """`kubectl apply --server-side` of the file at `path` (which the deploy writes with `objects`) when the cluster
    differs from `objects`, or cannot say (before kubeadm init in this run, a namespace the objects create): the
    apply then reports what a diff could not. Nothing while the cluster does not serve one of their kinds (a custom
    resource whose CRD comes with a chart not installed yet): the host says which."""
    wanted = kinds_of(objects)
    served = read(ServedKinds, api_versions=list(wanted), kubeconfig=kubeconfig)
    known = {version: kinds for version, kinds in (served or {}).items() if kinds is not None}
    missing = [f"{v} {kind}" for v, kinds in wanted.items() if v in known for kind in kinds if kind not in known[v]]
    if missing:
        host.noop(f"{path}: not applied, the cluster does not serve {', '.join(missing)} yet")
        return
    diff = read(KubectlDiff, objects=objects, kubeconfig=kubeconfig)
    if diff is not None and diff.status == 0:
        host.noop(f"the cluster has {path} as applied")
        return
    yield StringCommand(
        "kubectl", "--kubeconfig", QuoteString(kubeconfig), "apply", "--server-side", "--field-manager=ironserve",
        "--force-conflicts", "-f", QuoteString(path),
    )  # fmt: skip
