"""Kubernetes objects applied from a control plane with kubectl: a fact that says whether the cluster has them as
rendered, and the operation that applies them server-side only when it does not; for a Secret, the same by the
digest of its value, which is on no command line and in no output.

Field manager `ironserve`: what the deploy applies it owns, and nothing else (a swap's selector, a scaler's replicas
belong to their own managers), so a re-run never reverts them.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import yaml
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve import manifests
from ironserve.operations import Commands
from ironserve.secrets import private_upload, refuse_escalation
from ironserve.speed.reads import Read, read, reading_operation

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


@dataclass(frozen=True)
class SecretKeyState:
    """One key of a Secret as the cluster holds it."""

    namespace_exists: bool | None  # None: the API server did not say
    digest: str | None  # SHA-256 of the key's stored value (base64, as in `data`); None: no such Secret or key


class SecretKeyDigest(FactBase[SecretKeyState | None]):
    """Whether the Secret's namespace exists, and the SHA-256 of one key's value in it, so that a deploy compares
    digests: the value stays in a shell variable on the host, never in the output; None before the cluster has an
    admin kubeconfig."""

    def command(self, namespace: str, secret: str, key: str, kubeconfig: str) -> str:
        conf = shlex.quote(kubeconfig)
        kubectl = f"kubectl --kubeconfig {conf} --request-timeout=20s"
        value_path = shlex.quote("{.data." + key.replace(".", "\\.") + "}")  # jsonpath: a dot in a key is escaped
        return (
            f"if [ -f {conf} ]; then "
            f"said=$({kubectl} get namespace {shlex.quote(namespace)} -o name 2>&1); "
            'echo "namespace $? $(printf \'%s\' "$said" | tail -n 1)"; '
            f"value=$({kubectl} -n {shlex.quote(namespace)} get secret {shlex.quote(secret)} -o jsonpath={value_path} "
            '2>/dev/null) && [ -n "$value" ] && echo "value $(printf \'%s\' "$value" | sha256sum | cut -d\' \' -f1)" '
            "|| echo 'value -'; fi"
        )

    def process(self, output: Iterable[str]) -> SecretKeyState | None:
        said = dict(line.partition(" ")[::2] for line in output if line.strip())
        if "namespace" not in said:
            return None
        status, _, words = said["namespace"].partition(" ")
        exists = True if status == "0" else False if "(NotFound)" in words else None
        value = said.get("value", "-")
        return SecretKeyState(exists, None if value == "-" else value)


def _secret_reads(secret: Mapping[str, Any], key: str, kubeconfig: str, **_: object) -> list[Read]:
    meta = secret["metadata"]
    where = {"namespace": meta["namespace"], "secret": meta["name"], "key": key, "kubeconfig": kubeconfig}
    return [Read(SecretKeyDigest, where)]


@reading_operation(reads=_secret_reads)
def secret_applied(path: str, secret: Mapping[str, Any], key: str, kubeconfig: str) -> Commands:
    """`kubectl apply --server-side` of `secret` (a Secret whose `data` holds `key`) when the cluster's value of
    `key` differs, compared by SHA-256 digests. The object reaches the host over SFTP into `path`, root:root 0600,
    which the apply's own command removes: the value is at rest there only for the apply, and on no command line.
    Nothing while the Secret's namespace is absent (the chart that creates it not installed yet): the host says so,
    and says it at the apply too when the cluster appears later in the same run (kubeadm init)."""
    meta = secret["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    found = read(SecretKeyDigest, namespace=namespace, secret=name, key=key, kubeconfig=kubeconfig)
    if found is not None and found.digest == hashlib.sha256(secret["data"][key].encode()).hexdigest():
        host.noop(f"Secret {namespace}/{name} holds the rendered {key} (compared by digest)")
        return
    waits = f"Secret {namespace}/{name}: not applied, namespace {namespace} does not exist yet"
    if found is not None and found.namespace_exists is False:
        host.noop(waits)
        return
    refuse_escalation(path)
    yield from private_upload(BytesIO(manifests.dump_all([dict(secret)]).encode()), path)
    conf, staged = shlex.quote(kubeconfig), shlex.quote(path)
    kubectl = f"kubectl --kubeconfig {conf}"
    yield StringCommand(
        f"if {kubectl} get namespace {shlex.quote(namespace)} >/dev/null 2>&1; then "
        f"{kubectl} apply --server-side --field-manager=ironserve --force-conflicts -f {staged}; status=$?; "
        f"else echo {shlex.quote(waits)}; status=0; fi; rm -f {staged}; exit $status"
    )
