"""The iDRAC 9 Redfish client on sushy, and the BIOS workflow built on it (read, diff, apply, prove).

Runs on the admin machine. sushy, OpenStack's Redfish library (Ironic drives iDRACs with it), reads and changes
the resources: the system, its Bios and the pending Bios/Settings that Bios links, `Bios.set_attributes` with
apply time OnReset, `System.reset_system` among the reset types the system lists, the chassis' Power. Dell's BIOS
configuration job, which neither sushy nor sushy-oem-idrac can create, is scheduled and read through sushy's
connector (`Managers/iDRAC.Embedded.1/Jobs`); its states are sushy-oem-idrac's (Dell's job queue).

Credentials come from the environment (IRONSERVE_REDFISH_USER, IRONSERVE_REDFISH_PASSWORD) or a private
`user:password` file (0600, outside the repository); they are sent only in the Authorization header, only over
https to an iDRAC whose certificate was verified, and never appear in a message, a repr, a log line or a report:
sushy's exceptions become a RedfishError naming the method, the path and the iDRAC's own message.

Trust (`https_address`, `tls_context`): the address is `https://` with an ASCII host name or an IP literal
(a look-alike Unicode name would be IDNA-encoded to someone else's domain). The certificate is verified
against the system's CAs, or only against `ca_file` (the site CA or the iDRAC's own certificate, PEM),
host name included; a pinned `fingerprint` (SHA-256 of the DER certificate) is compared right after the
handshake of every connection, before any byte of a request is sent. Verification cannot be turned off.
sushy's HTTP session carries all of it (`_Session`, `_Transport`): one transport, mounted on the iDRAC's base
URL only (a link in an answer to any other address is refused before a connection), redirects not followed,
no proxy, CA bundle or .netrc taken from the environment.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import ssl
import time
import unicodedata
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import requests
import sushy
import urllib3
from requests.adapters import BaseAdapter, HTTPAdapter
from sushy.auth import BasicAuth
from sushy.connector import Connector
from sushy.resources.chassis.power.power import Power
from sushy_oem_idrac.resources.taskservice.constants import JobState
from urllib3.connection import HTTPSConnection
from urllib3.connectionpool import HTTPSConnectionPool

from ironserve.run import PowerSupplyInfo
from ironserve.secrets import credentials_refused, private_file

SYSTEM = "/redfish/v1/Systems/System.Embedded.1"
BIOS_SETTINGS = f"{SYSTEM}/Bios/Settings"  # the TargetSettingsURI of the Dell job; sushy follows Bios' own link
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"  # where an iDRAC takes the reset (sushy reads the system's target)
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
# sushy logs its own account of a failure (URL, status, the iDRAC's message; no credentials) before raising it;
# the RedfishError says it once. With no handler configured anywhere, Python would print those lines on stderr.
logging.getLogger("sushy").addHandler(logging.NullHandler())
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
        context.verify_mode = ssl.CERT_NONE  # replaced by the pin, checked in _PinnedConnection.connect
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class CertificateMismatch(ssl.SSLError):
    """The iDRAC presented a certificate other than the pinned one; nothing was sent.

    A TLS error to urllib3 and requests, so neither retries it and sushy raises it at once."""

    def __init__(self, presented: str) -> None:
        super().__init__(presented)
        self.presented = presented


class _PinnedConnection(HTTPSConnection):
    """urllib3's https connection, comparing the certificate's SHA-256 with `pin` right after the handshake."""

    pin: str | None = None

    def connect(self) -> None:
        super().connect()
        if self.pin is None:
            return
        peer_certificate = getattr(self.sock, "getpeercert", None)
        der = peer_certificate(binary_form=True) if peer_certificate else None
        presented = hashlib.sha256(der).hexdigest() if der else "none"
        if presented != self.pin:
            self.close()
            raise CertificateMismatch(presented)
        self.is_verified = True  # by the pin (urllib3 would warn of an unverified request)


class _Transport(HTTPAdapter):
    """requests' adapter to the iDRAC: TLS by `context` alone (requests adds no CA bundle of its own to it),
    every connection a `_PinnedConnection`."""

    def __init__(self, context: ssl.SSLContext, pin: str | None) -> None:
        self._context = context
        self._cert_reqs = "CERT_NONE" if context.verify_mode == ssl.CERT_NONE else "CERT_REQUIRED"
        connection = type("PinnedConnection", (_PinnedConnection,), {"pin": pin})
        self._pool = type("PinnedPool", (HTTPSConnectionPool,), {"ConnectionCls": connection})
        super().__init__()

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, ssl_context=self._context, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {"https": self._pool}

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        conn.cert_reqs, conn.ca_certs, conn.ca_cert_dir = self._cert_reqs, None, None


class _Session(requests.Session):
    """sushy's HTTP session: `transport` for URLs under the iDRAC's base URL and no adapter for any other (requests
    refuses one before connecting), a redirect returned as the answer (then an error), never followed; nothing
    from the environment (proxies, REQUESTS_CA_BUNDLE, .netrc). Each request is logged as (method, path) as it
    is sent (as (method, URL) when the URL is not the iDRAC's)."""

    def __init__(self, base_url: str, transport: BaseAdapter, sent: list[tuple[str, str]]) -> None:
        super().__init__()
        self.trust_env = False
        self.adapters.clear()
        self.mount(f"{base_url}/", transport)
        self.base_url = base_url
        self.sent = sent

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        return None

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        url = str(request.url)
        ours = url.lower().startswith(f"{self.base_url}/".lower())
        self.sent.append((str(request.method), url[len(self.base_url) :] if ours else url))
        return super().send(request, **kwargs)


class _Connector(Connector):  # type: ignore[misc]  # sushy has no type hints
    """sushy's connector on a `_Session`, one attempt per request (sushy's default is three for a connection
    error, ten for a server error on GET: one retry remains, at once); `last` is the last answer (the Location
    of a PATCH, the body of an error)."""

    _session: requests.Session

    def __init__(self, base_url: str, session: _Session, timeout_s: float) -> None:
        super().__init__(
            base_url,
            response_callback=self._answered,
            server_side_retries=1,
            server_side_retries_delay=0,
            default_request_timeout=timeout_s,
        )
        session.headers.update(self._session.headers)  # sushy's `Connection: close`
        self._session.close()
        self._session = session
        self.last: requests.Response | None = None

    def _answered(self, response: requests.Response) -> None:
        self.last = response
        if 300 <= response.status_code < 400:  # not followed (_Session): an error, as any non-2xx answer
            raise sushy.exceptions.HTTPError(response.request.method, response.url, response)


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password=<hidden>)"

    def basic(self) -> tuple[bytes, bytes]:
        """User and password for HTTP Basic, UTF-8 (requests would encode text as Latin-1)."""
        return self.user.encode(), self.password.encode()


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
    """One iDRAC through sushy over verified https (see the module's docstring); nothing is sent before a read."""

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
        self._connector: _Connector | None = None
        self._service: Any = None  # sushy.Sushy, the service root, read once

    def __repr__(self) -> str:
        return f"RedfishClient({self.base_url!r})"

    def _transport(self) -> BaseAdapter:
        """The adapter every request goes through (the tests answer from recorded iDRAC bodies here)."""
        return _Transport(self._context, self.fingerprint)

    @property
    def connector(self) -> _Connector:
        if self._connector is None:
            self._connector = _Connector(
                self.base_url, _Session(self.base_url, self._transport(), self.requests), self.timeout_s
            )
            # Before sushy reads the service root: an iDRAC answers it without credentials, the lab's emulator not.
            self._connector.set_http_basic_auth(*self._credentials.basic())
        return self._connector

    def system(self) -> Any:
        """The iDRAC's system as sushy reads it now (sushy.resources.system.system.System)."""
        with self.errors():
            if self._service is None:
                auth = BasicAuth(*self._credentials.basic())
                self._service = sushy.Sushy(self.base_url, auth=auth, connector=self.connector)
            return self._service.get_system(SYSTEM)

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Response:
        """One request through sushy's connector, for what sushy has no resource for (the Dell job)."""
        with self.errors():
            answer = getattr(self.connector, method.lower())(path, data=body)
        return Response(answer.status_code, dict(answer.headers), _json(answer.content))

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path).body

    def location(self) -> str | None:
        """The Location header of the last answer (the job a PATCH or POST created)."""
        last = self.connector.last
        return last.headers.get("Location") if last is not None else None

    @contextmanager
    def errors(self) -> Iterator[None]:
        """sushy's exceptions (and the requests and urllib3 ones they wrap) as a RedfishError."""
        try:
            yield
        except sushy.exceptions.HTTPError as exc:
            raise self._refused(exc.status_code) from None
        except sushy.exceptions.ConnectionError as exc:
            raise self._unreachable(exc) from None
        except (sushy.exceptions.SushyError, requests.exceptions.JSONDecodeError) as exc:
            raise RedfishError(f"{self._sent()}: unexpected answer from {self.base_url}: {exc}") from None

    def _sent(self) -> str:
        return " ".join(self.requests[-1]) if self.requests else "(nothing sent)"

    def _refused(self, status: int) -> RedfishError:
        last = self.connector.last
        message = (_redfish_message(_json(last.content)) or last.reason) if last is not None else ""
        return RedfishError(f"{self._sent()}: HTTP {status}: {message}")

    def _unreachable(self, exc: BaseException) -> RedfishError:
        causes = list(_causes(exc))
        for cause in causes:
            if isinstance(cause, CertificateMismatch):
                return RedfishError(
                    f"{self._sent()}: {self.base_url} presented a certificate with SHA-256 fingerprint "
                    f"{_colons(cause.presented)}, not the pinned bios_tls_fingerprint; nothing was sent (if the "
                    "iDRAC's certificate was replaced, compare it on the iDRAC's console before pinning it)"
                )
            if isinstance(cause, ssl.SSLCertVerificationError):
                return RedfishError(
                    f"{self._sent()}: the certificate of {self.base_url} is not trusted ({cause.verify_message}); "
                    + TRUST_ADVICE
                )
        wrappers = (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, sushy.exceptions.SushyError)
        reason = [c for c in causes if not isinstance(c, wrappers)] or causes
        return RedfishError(f"{self._sent()}: cannot reach {self.base_url}: {reason[-1]}")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it wraps (cause, context, urllib3's reason, exception arguments), outermost first."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        linked = (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args)
        todo += [e for e in linked if isinstance(e, BaseException)]


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
    return _read(client)[0]


def _read(client: RedfishClient) -> tuple[BiosState, Any]:
    """The state, and the sushy System it was read from (apply changes its Bios and resets it)."""
    with client.errors():
        system = client.system()
        bios = system.bios
        attributes, pending = bios.attributes or {}, bios.pending_attributes or {}
        try:
            allowed = system.get_allowed_reset_system_values()
        except sushy.exceptions.MissingAttributeError:  # no ComputerSystem.Reset action
            allowed = set()
        power_state = system.power_state
        # Dell lists its PCIe devices in the system; read as they are (sushy's collection reads each twice).
        refs = [ref["@odata.id"] for ref in system.json.get("PCIeDevices") or [] if isinstance(ref, dict)]
        devices = [client.get(ref) for ref in refs]
        state = BiosState(
            model=system.model,
            bios_version=system.bios_version,
            power_state=power_state.value if power_state else None,
            reset_types=tuple(t.value for t in sushy.ResetType if t in allowed),
            attributes={k: str(v) for k, v in attributes.items()},
            pending={k: str(v) for k, v in pending.items()},
            power_supplies=_power_supplies(client),
            pcie_devices=devices,
        )
    return state, system


def _power_supplies(client: RedfishClient) -> list[PowerSupplyInfo]:
    """The chassis' power supplies; none when the iDRAC does not say (the preflight then reads dmidecode)."""
    try:
        with client.errors():
            supplies = Power(client.connector, POWER).power_supplies or []
            return [
                PowerSupplyInfo(
                    name=str(p.name or p.identity or "PSU"),
                    capacity_w=int(p.power_capacity_watts) if p.power_capacity_watts else None,
                    present=p.status is None or p.status.state != sushy.State.ABSENT,
                )
                for p in supplies
            ]
    except RedfishError:
        return []


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
    state, system = _read(client)
    diffs = differences(desired, state.attributes)
    if not diffs:
        result.state = state
        return result
    unknown = [k for k in diffs if k not in state.attributes]
    if unknown:
        raise RedfishError(f"this BIOS has no attribute {', '.join(unknown)} (check the iDRAC firmware)")
    to_patch = {k: v for k, v in diffs.items() if state.pending.get(k) != v}
    if to_patch:
        with client.errors():
            system.bios.set_attributes(to_patch, apply_time=sushy.ApplyTime.ON_RESET)
        result.patched = to_patch
        result.job = _job_id(client.location())  # iDRAC 4.40 and later create the job on this PATCH
    if result.job is None:
        # Older iDRAC firmware creates no job on PATCH: schedule the BIOS configuration job ourselves.
        try:
            client.request("POST", JOBS, {"TargetSettingsURI": BIOS_SETTINGS})
            result.job = _job_id(client.location()) or "scheduled"
        except RedfishError as exc:
            # iDRAC's SYS011 "Pending configuration values are already committed": the PATCH scheduled the job
            # itself. Any other refusal (RAC0679 "A job operation is already running": someone else's) is an error.
            if "already committed" not in str(exc):
                raise
            result.job = "already scheduled"
    if reboot:
        result.reset = _reset_type(state)
        with client.errors():
            system.reset_system(sushy.ResetType(result.reset))
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


JOB_DONE = {state.value for state in (JobState.COMPLETED, JobState.COMPLETED_ERRORS, JobState.FAILED)}


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
