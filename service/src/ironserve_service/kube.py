"""A minimal Kubernetes API client on the standard library: bearer token, the cluster's CA, JSON in and out.

Enough for the scaler (scaler.py): get and merge-patch a Deployment's ``scale`` subresource. No kubernetes
client package: the same two calls work against any API server since apps/v1, and nothing is pinned for it.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # settings.py imports this module
    from ironserve_service.settings import KubernetesServingSettings

# Namespaces are DNS-1123 labels; Deployment names DNS-1123 subdomains (labels joined by dots, 253 at most).
DNS_1123_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def is_dns_label(name: str) -> bool:
    return re.fullmatch(DNS_1123_LABEL, name) is not None


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= 253 and all(is_dns_label(label) for label in name.split("."))


class KubeError(Exception):
    """The API server refused (``status``: its HTTP status, ``message``: its Status message) or was unreachable
    (``status`` None). Never carries the token."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.status = status
        self.message = message


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would re-send the Authorization header to wherever a redirect points; the API server never redirects.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class KubeClient:
    def __init__(self, server: str, token_file: Path, ca_file: Path, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(server)
        if parts.scheme != "https" or not parts.netloc or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"API server {server!r} is not https://host[:port]")
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout_s = timeout_s

    @classmethod
    def from_in_cluster(cls, timeout_s: float = 5.0) -> KubeClient:
        """The API server and service account a pod is given (what client-go's in-cluster config reads)."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeError(None, "not in a cluster: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are unset")
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(f"https://{netloc}", SERVICE_ACCOUNT_DIR / "token", SERVICE_ACCOUNT_DIR / "ca.crt", timeout_s)

    def get(self, path: str) -> dict[str, Any]:
        return self._request("GET", path, None, None)

    def patch(
        self, path: str, body: dict[str, Any], content_type: str = "application/merge-patch+json"
    ) -> dict[str, Any]:
        return self._request("PATCH", path, json.dumps(body).encode(), content_type)

    def get_scale(self, namespace: str, deployment: str) -> int:
        """The Deployment's spec.replicas, read from its scale subresource."""
        return _spec_replicas(self.get(_scale_path(namespace, deployment)))

    def set_scale(self, namespace: str, deployment: str, replicas: int) -> int:
        """Merge-patch the scale subresource's spec.replicas; returns the value the API server stored."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be a non-negative integer, not {replicas!r}")
        return _spec_replicas(self.patch(_scale_path(namespace, deployment), {"spec": {"replicas": replicas}}))

    def _token(self) -> str:
        # Re-read on every request: projected service-account tokens are rotated in place by the kubelet.
        try:
            token = self.token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise KubeError(None, f"token file {self.token_file}: {error.strerror}") from None
        if not token:
            raise KubeError(None, f"token file {self.token_file} is empty")
        return token

    def _request(self, method: str, path: str, body: bytes | None, content_type: str | None) -> dict[str, Any]:
        if not path.startswith("/"):
            raise ValueError(f"API path {path!r} must start with /")
        headers = {"Authorization": f"Bearer {self._token()}", "Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.server + path, data=body, headers=headers, method=method)
        try:
            # A context per request, like the token: the CA bundle is a projected file too.
            context = ssl.create_default_context(cafile=str(self.ca_file))
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context), _NoRedirect()
            )
            with opener.open(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            raise KubeError(error.code, _status_message(error.read(), f"{method} {path}: {error.reason}")) from None
        except (OSError, ssl.SSLError) as error:
            raise KubeError(None, f"{method} {self.server}{path}: {error}") from None
        try:
            answer = json.loads(payload)
        except ValueError:
            raise KubeError(None, f"{method} {path}: the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise KubeError(None, f"{method} {path}: the answer is not a JSON object")
        return answer


def _scale_path(namespace: str, deployment: str) -> str:
    if not is_dns_label(namespace):
        raise ValueError(f"namespace {namespace!r} is not a DNS-1123 label")
    if not is_dns_subdomain(deployment):
        raise ValueError(f"deployment {deployment!r} is not a DNS-1123 subdomain")
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"


def _spec_replicas(scale: dict[str, Any]) -> int:
    spec = scale.get("spec")
    if not isinstance(spec, dict):
        raise KubeError(None, f"not a Scale: {str(scale)[:200]}")
    # autoscaling/v1 ScaleSpec omits replicas when it is 0 (omitempty).
    replicas = spec.get("replicas", 0)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise KubeError(None, f"Scale spec.replicas is {replicas!r}")
    return replicas


def _status_message(body: bytes, fallback: str) -> str:
    """The message of the API server's Status object, else the HTTP reason."""
    try:
        status = json.loads(body)
    except ValueError:
        return fallback
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) and message else fallback


def cluster_client(kubernetes: KubernetesServingSettings, timeout_s: float) -> KubeClient:
    """The client of the swap and the scaler: the settings' API server and files, else the pod's in-cluster ones."""
    if kubernetes.api_server is None:
        return KubeClient.from_in_cluster(timeout_s)
    return KubeClient(kubernetes.api_server, kubernetes.token_file, kubernetes.ca_file, timeout_s)
