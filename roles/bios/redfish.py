"""A small Redfish client for a Dell iDRAC 9 and the BIOS workflow built on it (read, diff, apply, prove).

Runs on the admin machine. Credentials come from the environment (IRONSERVE_REDFISH_USER,
IRONSERVE_REDFISH_PASSWORD) or a private `user:password` file (0600, outside the repository); they are
sent only in the Authorization header, only over https to an iDRAC whose certificate was verified, and
never appear in a message, a repr, a log line or a report.

Trust (`https_address`, `tls_context`): the address is `https://` with an ASCII host name or an IP literal
(a look-alike Unicode name would be IDNA-encoded to someone else's domain). The certificate is verified
against the system's CAs, or only against `ca_file` (the site CA or the iDRAC's own certificate, PEM),
host name included; a pinned `fingerprint` (SHA-256 of the DER certificate) is compared right after the
handshake of every connection, before any byte of a request is sent. Verification cannot be turned off.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import ipaddress
import json
import os
import re
import ssl
import time
import unicodedata
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ironserve.run import PowerSupplyInfo
from ironserve.secrets import credentials_refused, private_file

SYSTEM = "/redfish/v1/Systems/System.Embedded.1"
BIOS = f"{SYSTEM}/Bios"
BIOS_SETTINGS = f"{BIOS}/Settings"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
JOBS = "/redfish/v1/Managers/iDRAC.Embedded.1/Jobs"
POWER = "/redfish/v1/Chassis/System.Embedded.1/Power"
ENV_USER = "IRONSERVE_REDFISH_USER"
ENV_PASSWORD = "IRONSERVE_REDFISH_PASSWORD"
CREDENTIALS_PLACE = (
    f"set {ENV_USER} and {ENV_PASSWORD}, or name a `user:password` file (0600, outside the repository) in "
    "bios_credentials_file"
)
TRUST_ADVICE = (
    "trust its certificate with bios_ca_file (the site CA or the iDRAC's own, PEM) or bios_tls_fingerprint "
    "(`openssl x509 -noout -fingerprint -sha256`)"
)
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_FINGERPRINT_PREFIX = re.compile(r"^(sha-?256( fingerprint)?[=:]\s*)", re.IGNORECASE)


class RedfishError(Exception):
    """A Redfish request failed; the message names the method, path and the service's own message only."""


def _non_ascii(text: str) -> str:
    shown = [f"{c!r} {unicodedata.name(c, f'U+{ord(c):04X}')}" for c in dict.fromkeys(text) if not c.isascii()]
    return ", ".join(shown[:3])


def https_address(url: str) -> tuple[str, int]:
    """(host, port) of a Redfish base URL `https://HOST[:PORT][/]`, or ValueError saying what is wrong.

    HOST is an IPv4 literal, a bracketed IPv6 literal or an ASCII DNS name (no IDNA A-labels `xn--`).
    """
    credentials_refused(url, CREDENTIALS_PLACE)
    if not url.isascii():
        raise ValueError(
            f"is not ASCII ({_non_ascii(url)}): a look-alike of an ASCII name is IDNA-encoded to another "
            "domain, which would receive the iDRAC credentials; write the ASCII name or the IP address"
        )
    if any(not c.isprintable() or c.isspace() or c == "\\" for c in url):
        raise ValueError("contains a space, backslash or control character; expected https://HOST[:PORT]")
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "http":
        raise ValueError(
            "is plain http: the iDRAC password would cross the network in clear text; use https:// and " + TRUST_ADVICE
        )
    if scheme != "https" or not parts.netloc:
        raise ValueError("is not an https:// URL such as https://10.0.0.21 or https://idrac-r740-01.example")
    if parts.path not in {"", "/"} or parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError("is the iDRAC's base URL only (https://HOST[:PORT]), without a path or query")
    return _host_port(parts.netloc)


def _host_port(netloc: str) -> tuple[str, int]:
    if netloc.startswith("["):
        literal, bracket, rest = netloc[1:].partition("]")
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise ValueError(f"[{literal}] is not an IPv6 address") from None
        host = literal
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError("expected [IPv6]:PORT after the scheme")
        port_text = rest[1:] if rest else ""
    else:
        host, colon, port_text = netloc.partition(":")
        if colon and not port_text:
            raise ValueError("a port number must follow the colon")
        _check_host(host)
    if port_text and not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError("the port must be a number from 1 to 65535")
    return host, int(port_text) if port_text else 443


def _check_host(host: str) -> None:
    try:
        ipaddress.IPv4Address(host)
        return
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} is neither an IP address nor a DNS name of letters, digits and hyphens")
    if labels[-1].isdigit():
        raise ValueError(f"{host!r} looks like an IPv4 address but is not one")
    if any(label.lower().startswith("xn--") for label in labels):
        raise ValueError(
            f"{host!r} is an IDNA-encoded (xn--) name, which can spell a look-alike of another; "
            "write the iDRAC's ASCII name or its IP address"
        )


def normalised_fingerprint(text: str) -> str:
    """A SHA-256 certificate fingerprint as 64 lowercase hex digits, from `AB:CD:...`, hex, or openssl's
    `sha256 Fingerprint=AB:...`; ValueError otherwise."""
    digits = _FINGERPRINT_PREFIX.sub("", text.strip()).replace(":", "").lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digits):
        raise ValueError(
            "is not a SHA-256 fingerprint: expected 64 hex digits, colons allowed "
            "(`openssl x509 -noout -fingerprint -sha256 -in idrac.pem`)"
        )
    return digits


def _colons(digest: str) -> str:
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2)).upper()


def tls_context(ca_file: str | None = None, fingerprint: str | None = None) -> ssl.SSLContext:
    """The TLS context of the iDRAC connections: the chain and host name verified against `ca_file` (only
    that file) or the system CAs; with a pinned fingerprint and no CA file, the pin alone decides (a
    self-signed factory certificate names no CA and often not the address it is reached at)."""
    context = ssl.create_default_context(cafile=ca_file)
    if fingerprint is not None and ca_file is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # replaced by the pin, checked in _Connection.connect
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class CertificateMismatch(OSError):
    """The iDRAC presented a certificate other than the pinned one; nothing was sent."""

    def __init__(self, presented: str) -> None:
        super().__init__(presented)
        self.presented = presented


class _Connection(http.client.HTTPSConnection):
    """An https connection that compares the certificate's SHA-256 with the pin right after the handshake."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, fingerprint: str | None, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.fingerprint = fingerprint

    def connect(self) -> None:
        super().connect()
        if self.fingerprint is None:
            return
        der = self.sock.getpeercert(binary_form=True) if isinstance(self.sock, ssl.SSLSocket) else None
        presented = hashlib.sha256(der).hexdigest() if der else "none"
        if presented != self.fingerprint:
            self.close()
            raise CertificateMismatch(presented)


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password=<hidden>)"

    def header(self) -> str:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return f"Basic {token}"


def load_credentials(file: str | None, environ: Mapping[str, str] | None = None) -> Credentials:
    """Credentials from `file` (`user:password`, 0600, outside the repository) or from the environment."""
    env = os.environ if environ is None else environ
    if file:
        try:
            path = private_file(file)
        except ValueError as exc:
            raise RedfishError(f"bios_credentials_file {exc}") from None
        try:
            text = path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            raise RedfishError(f"bios_credentials_file {file} cannot be read") from None
        user, sep, password = text.partition(":")
        if not sep or not user or "\n" in text:
            raise RedfishError(f"bios_credentials_file {file}: expected one line 'user:password'")
        return Credentials(user, password)
    env_user, env_password = env.get(ENV_USER), env.get(ENV_PASSWORD)
    if not env_user or env_password is None:
        raise RedfishError(f"no iDRAC credentials: {CREDENTIALS_PLACE}")
    return Credentials(env_user, env_password)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


class RedfishClient:
    """Requests to one iDRAC over verified https (see the module's docstring); redirects are not followed."""

    def __init__(
        self,
        base_url: str,
        credentials: Credentials,
        ca_file: str | None = None,
        fingerprint: str | None = None,
        timeout_s: float = 30,
    ) -> None:
        try:
            self.host, self.port = https_address(base_url)
        except ValueError as exc:
            raise RedfishError(f"bios_redfish_address {exc}") from None
        try:
            self.fingerprint = normalised_fingerprint(fingerprint) if fingerprint is not None else None
        except ValueError as exc:
            raise RedfishError(f"bios_tls_fingerprint {exc}") from None
        try:
            self._context = tls_context(ca_file, self.fingerprint)
        except (ssl.SSLError, OSError):
            raise RedfishError(f"bios_ca_file {ca_file} holds no PEM certificate") from None
        self.base_url = base_url.rstrip("/")
        self._credentials = credentials
        self.timeout_s = timeout_s
        self.requests: list[tuple[str, str]] = []  # (method, path) sent, for tests and the report

    def __repr__(self) -> str:
        return f"RedfishClient({self.base_url!r})"

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Response:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": self._credentials.header(), "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        self.requests.append((method, path))
        connection = _Connection(self.host, self.port, self._context, self.fingerprint, self.timeout_s)
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            status, reason, raw = response.status, response.reason, response.read()
            answer_headers = dict(response.getheaders())
        except CertificateMismatch as exc:
            raise RedfishError(
                f"{method} {path}: {self.base_url} presented a certificate with SHA-256 fingerprint "
                f"{_colons(exc.presented)}, not the pinned bios_tls_fingerprint; nothing was sent (if the iDRAC's "
                "certificate was replaced, compare it on the iDRAC's console before pinning it)"
            ) from None
        except ssl.SSLCertVerificationError as exc:
            raise RedfishError(
                f"{method} {path}: the certificate of {self.base_url} is not trusted ({exc.verify_message}); "
                + TRUST_ADVICE
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise RedfishError(f"{method} {path}: cannot reach {self.base_url}: {exc}") from None
        finally:
            connection.close()
        if status >= 300:
            message = _redfish_message(_json(raw)) or reason
            raise RedfishError(f"{method} {path}: HTTP {status}: {message}")
        return Response(status, answer_headers, _json(raw))

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path).body


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _redfish_message(body: Mapping[str, Any]) -> str:
    error = body.get("error") or {}
    infos = error.get("@Message.ExtendedInfo") or []
    messages = [str(i.get("Message")) for i in infos if isinstance(i, dict) and i.get("Message")]
    return "; ".join(messages) or str(error.get("message") or "")


# ---- the BIOS workflow -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BiosState:
    model: str | None
    bios_version: str | None
    power_state: str | None
    reset_types: tuple[str, ...]
    attributes: dict[str, str]
    pending: dict[str, str]
    power_supplies: list[PowerSupplyInfo]
    pcie_devices: list[dict[str, Any]]


def read_state(client: RedfishClient) -> BiosState:
    system = client.get(SYSTEM)
    bios = client.get(BIOS)
    settings = client.get(BIOS_SETTINGS)
    reset = (system.get("Actions") or {}).get("#ComputerSystem.Reset") or {}
    devices = []
    for ref in system.get("PCIeDevices") or []:
        if isinstance(ref, dict) and "@odata.id" in ref:
            devices.append(client.get(ref["@odata.id"]))
    try:
        power = client.get(POWER)
    except RedfishError:
        power = {}
    supplies = [
        PowerSupplyInfo(
            name=str(p.get("Name") or p.get("MemberId") or "PSU"),
            capacity_w=int(p["PowerCapacityWatts"]) if p.get("PowerCapacityWatts") else None,
            present=(p.get("Status") or {}).get("State", "Enabled") != "Absent",
        )
        for p in power.get("PowerSupplies") or []
    ]
    return BiosState(
        model=system.get("Model"),
        bios_version=system.get("BiosVersion"),
        power_state=system.get("PowerState"),
        reset_types=tuple(reset.get("ResetType@Redfish.AllowableValues") or ()),
        attributes={k: str(v) for k, v in (bios.get("Attributes") or {}).items()},
        pending={k: str(v) for k, v in (settings.get("Attributes") or {}).items()},
        power_supplies=supplies,
        pcie_devices=devices,
    )


def differences(desired: Mapping[str, str], current: Mapping[str, str]) -> dict[str, str]:
    """The desired attributes whose current value differs (attribute -> desired value)."""
    return {k: v for k, v in desired.items() if current.get(k) != v}


@dataclass
class ApplyResult:
    patched: dict[str, str] = field(default_factory=dict)  # what was PATCHed (empty: nothing to change)
    job: str | None = None  # the Dell configuration job scheduled
    reset: str | None = None  # the ResetType sent, None when no reset happened
    state: BiosState | None = None  # re-read after the work
    remaining: dict[str, str] = field(default_factory=dict)  # desired values still not current
    stuck: dict[str, str] = field(default_factory=dict)  # still pending after the reset

    @property
    def proven(self) -> bool:
        return self.state is not None and not self.remaining

    def note(self) -> str:
        if not self.patched and self.reset is None:
            return "nothing to apply"
        parts = [f"patched {', '.join(self.patched)}" if self.patched else "settings already pending"]
        if self.job:
            parts.append(f"job {self.job}")
        parts.append(f"reset {self.reset}" if self.reset else "no reset (bios_reboot_policy: never)")
        parts.append("re-read proves current == desired" if self.proven else "re-read: not applied")
        return "; ".join(parts)


def apply(
    client: RedfishClient,
    desired: Mapping[str, str],
    reboot: bool,
    timeout_s: float = 900,
    poll_s: float = 10,
    sleep: Callable[[float], None] = time.sleep,
) -> ApplyResult:
    """Make the BIOS carry `desired`: PATCH Bios/Settings, schedule the job, reset if allowed, re-read and prove.

    Sends nothing when the current attributes already match (idempotent).
    """
    result = ApplyResult()
    state = read_state(client)
    diffs = differences(desired, state.attributes)
    if not diffs:
        result.state = state
        return result
    unknown = [k for k in diffs if k not in state.attributes]
    if unknown:
        raise RedfishError(f"this BIOS has no attribute {', '.join(unknown)} (check the iDRAC firmware)")
    to_patch = {k: v for k, v in diffs.items() if state.pending.get(k) != v}
    if to_patch:
        response = client.request(
            "PATCH",
            BIOS_SETTINGS,
            {"Attributes": to_patch, "@Redfish.SettingsApplyTime": {"ApplyTime": "OnReset"}},
        )
        result.patched = to_patch
        result.job = _job_id(response.headers.get("Location"))
    if result.job is None:
        # Older iDRAC firmware creates no job on PATCH: schedule the BIOS configuration job ourselves.
        try:
            response = client.request("POST", JOBS, {"TargetSettingsURI": BIOS_SETTINGS})
            result.job = _job_id(response.headers.get("Location")) or "scheduled"
        except RedfishError as exc:
            # iDRAC's SYS011 "Pending configuration values are already committed": the PATCH scheduled the job
            # itself. Any other refusal (RAC0679 "A job operation is already running": someone else's) is an error.
            if "already committed" not in str(exc):
                raise
            result.job = "already scheduled"
    if reboot:
        result.reset = _reset_type(state)
        client.request("POST", RESET, {"ResetType": result.reset})
        deadline = time.monotonic() + timeout_s
        while True:
            state = read_state(client)
            remaining = differences(desired, state.attributes)
            if not remaining or _job_finished(client, result.job) or time.monotonic() >= deadline:
                break
            sleep(poll_s)
        result.stuck = {k: v for k, v in remaining.items() if state.pending.get(k) == v}
    else:
        state = read_state(client)
    result.state = state
    result.remaining = differences(desired, state.attributes)
    return result


JOB_DONE = {"Completed", "CompletedWithErrors", "Failed"}


def _job_finished(client: RedfishClient, job: str | None) -> bool:
    """Whether the Dell job ran (then a value still pending will not change any more)."""
    if not job or not job.startswith("JID_"):
        return False
    try:
        return client.get(f"{JOBS}/{job}").get("JobState") in JOB_DONE
    except RedfishError:
        return False


def _job_id(location: str | None) -> str | None:
    return location.rstrip("/").rsplit("/", 1)[-1] if location else None


def _reset_type(state: BiosState) -> str:
    if state.power_state == "Off":
        return "On"
    for choice in ("GracefulRestart", "ForceRestart"):
        if not state.reset_types or choice in state.reset_types:
            return choice
    return state.reset_types[0]
