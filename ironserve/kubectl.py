"""Kubernetes objects applied from a control plane with kubectl: a fact that says whether the cluster has them as
rendered, and the operation that applies them server-side only when it does not.

Field manager `ironserve`: what the deploy applies it owns, and nothing else (a swap's selector, a scaler's replicas
belong to their own managers), so a re-run never reverts them.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass

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


def _diff_reads(objects: str, kubeconfig: str, **_: object) -> list[Read]:
    return [Read(KubectlDiff, {"objects": objects, "kubeconfig": kubeconfig})]


@reading_operation(reads=_diff_reads)
def objects_applied(path: str, objects: str, kubeconfig: str) -> Commands:
    """`kubectl apply --server-side` of the file at `path` (which the deploy writes with `objects`) when the cluster
    differs from `objects`, or cannot say (before kubeadm init in this run, a namespace the objects create): the
    apply then reports what a diff could not."""
    diff = read(KubectlDiff, objects=objects, kubeconfig=kubeconfig)
    if diff is not None and diff.status == 0:
        host.noop(f"the cluster has {path} as applied")
        return
    yield StringCommand(
        "kubectl", "--kubeconfig", QuoteString(kubeconfig), "apply", "--server-side", "--field-manager=ironserve",
        "--force-conflicts", "-f", QuoteString(path),
    )  # fmt: skip
