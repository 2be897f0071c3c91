"""Helm on a control plane: the pinned client from its release tarball, and releases installed or upgraded only
when the cluster's differ from what is rendered (chart, version, status, values).

A release is compared by what `helm list` and `helm get values` say, so a value changed by hand, a failed upgrade
or an uninstalled release is put back by the next deploy, and a release as rendered costs one read and no change.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase
from pyinfra.context import host

from ironserve.operations import Commands
from ironserve.speed.reads import Read, read, reading_operation

HELM = "/usr/local/bin/helm"  # where Helm's install guide puts the binary of its release tarball
TARBALL_MEMBER = "linux-amd64/helm"  # the binary's path inside helm-v<version>-linux-amd64.tar.gz
VERSION_QUERY = "version --template '{{.Version}}'"  # prints the client's version alone: v3.17.3


def tarball_name(version: str) -> str:
    """The name of Helm's release tarball for Linux on x86-64 (helm.sh/docs/intro/install, binary releases)."""
    return f"helm-v{version}-linux-amd64.tar.gz"


class HelmClientVersion(FactBase[str | None]):
    """The version the Helm client at `path` reports (`v3.17.3`), or None where there is none."""

    def command(self, path: str = HELM) -> str:
        binary = shlex.quote(path)
        return f"if [ -x {binary} ]; then {binary} {VERSION_QUERY}; echo; fi"

    def process(self, output: Iterable[str]) -> str | None:
        lines = [line.strip() for line in output if line.strip()]
        return lines[0] if lines else None


@reading_operation(reads=lambda path=HELM, **_: [Read(HelmClientVersion, {"path": path})])
def helm_installed(tarball: str, version: str, path: str = HELM) -> Commands:
    """The Helm client at `path` is `version`: unpacked from `tarball` (Helm's release tarball, already checked
    by its SHA-256) when it reports another version or is absent; a tarball holding another version fails."""
    wanted = f"v{version}"
    if read(HelmClientVersion, path=path) == wanted:
        host.noop(f"{path} is Helm {wanted}")
        return
    binary, archive = shlex.quote(path), shlex.quote(tarball)
    said = f"$({binary} {VERSION_QUERY})"
    wrong = shlex.quote(f"{tarball} holds Helm ") + f'"{said}"' + shlex.quote(f", not {wanted}")
    yield StringCommand(
        f'd=$(mktemp -d) && tar -xzf {archive} -C "$d" {TARBALL_MEMBER} && '
        f'install -m 0755 "$d/{TARBALL_MEMBER}" {binary}; status=$?; rm -rf "$d"; '
        f'[ $status -eq 0 ] || exit $status; [ "{said}" = {wanted} ] || {{ echo {wrong} >&2; exit 1; }}'
    )


@dataclass(frozen=True)
class Release:
    """One Helm release as the cluster holds it."""

    chart: str | None  # `<chart>-<version>`, as `helm list` shows it; None: no such release (or `error`)
    status: str | None  # deployed, failed, pending-upgrade, ...
    values: dict[str, Any] | None  # the values given to it (`helm get values`), {} for none
    error: str = ""  # what helm said when it could not list the releases (the API server down, no helm yet)


class HelmRelease(FactBase[Release | None]):
    """Release `release` in `namespace`: its chart, status and given values; None before the cluster has an admin
    kubeconfig. printf, not echo: dash's echo would turn the `\\n` of a JSON string into a line break."""

    def command(self, release: str, namespace: str, kubeconfig: str, helm: str = HELM) -> str:
        conf = shlex.quote(kubeconfig)
        client = f"{shlex.quote(helm)} --kubeconfig {conf} --namespace {shlex.quote(namespace)}"
        only = shlex.quote(f"^{re.escape(release)}$")
        return (
            f"if [ -f {conf} ]; then "
            f"out=$({client} list --all --filter {only} -o json 2>&1); "
            "printf 'list %s %s\\n' $? \"$(printf '%s' \"$out\" | tr -d '\\n')\"; "
            f"out=$({client} get values {shlex.quote(release)} -o json 2>/dev/null) && "
            "printf 'values %s\\n' \"$(printf '%s' \"$out\" | tr -d '\\n')\"; true; fi"
        )

    def process(self, output: Iterable[str]) -> Release | None:
        said = dict(line.partition(" ")[::2] for line in output if line.strip())
        if "list" not in said:
            return None
        status, _, body = said["list"].partition(" ")
        if status != "0":
            return Release(None, None, None, body.strip() or f"helm list exited with status {status}")
        listed = json.loads(body)
        if not listed:
            return Release(None, None, None)
        values = json.loads(said["values"]) if "values" in said else None
        return Release(listed[0]["chart"], listed[0]["status"], values or {})


def chart_reference(chart: str, repo: str, version: str) -> list[str]:
    """The chart arguments of `helm upgrade --install` for a repository URL: an OCI registry names the chart by
    reference, an HTTP(S) chart repository by `--repo`, and a `file://` folder holds `helm package`'s
    `<chart>-<version>.tgz`."""
    if repo.startswith("oci://"):
        return [f"{repo}/{chart}", "--version", version]
    if repo.startswith("file://"):
        return [f"{repo.removeprefix('file://')}/{chart}-{version}.tgz"]
    return [chart, "--repo", repo, "--version", version]


def _release_reads(release: str, namespace: str, kubeconfig: str, **_: object) -> list[Read]:
    return [Read(HelmRelease, {"release": release, "namespace": namespace, "kubeconfig": kubeconfig})]


@reading_operation(reads=_release_reads)
def helm_released(
    release: str,
    namespace: str,
    chart: str,
    repo: str,
    version: str,
    values: Mapping[str, Any],
    values_path: str,
    kubeconfig: str,
) -> Commands:
    """`helm upgrade --install` of `chart` at `version` from `repo` as `release` in `namespace` (created if
    absent), its values from the file at `values_path` (which the deploy writes with `values`), when the release
    differs: another chart or version, a status other than deployed, other given values, or none at all."""
    found = read(HelmRelease, release=release, namespace=namespace, kubeconfig=kubeconfig)
    wanted = json.loads(json.dumps(values))  # as helm gives them back: JSON types, tuples as lists
    pinned = f"{chart}-{version}"
    if found is not None and (found.chart, found.status, found.values) == (pinned, "deployed", wanted):
        host.noop(f"Helm release {namespace}/{release} is {pinned}, deployed with the rendered values")
        return
    yield StringCommand(
        QuoteString(HELM), "--kubeconfig", QuoteString(kubeconfig), "upgrade", "--install", QuoteString(release),
        *(QuoteString(word) for word in chart_reference(chart, repo, version)),
        "--namespace", QuoteString(namespace), "--create-namespace", "--values", QuoteString(values_path),
    )  # fmt: skip
