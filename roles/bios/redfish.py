"""A small Redfish client for a Dell iDRAC 9 and the BIOS workflow built on it (read, diff, apply, prove).

Runs on the admin machine. Credentials come from the environment (IRONSERVE_REDFISH_USER,
IRONSERVE_REDFISH_PASSWORD) or a `user:password` file outside the repository; they are sent only in the
Authorization header and never appear in a message, a repr, a log line or a report.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ironserve.paths import REPO_ROOT
from ironserve.run import PowerSupplyInfo

SYSTEM = "/redfish/v1/Systems/System.Embedded.1"
BIOS = f"{SYSTEM}/Bios"
BIOS_SETTINGS = f"{BIOS}/Settings"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
JOBS = "/redfish/v1/Managers/iDRAC.Embedded.1/Jobs"
POWER = "/redfish/v1/Chassis/System.Embedded.1/Power"
ENV_USER = "IRONSERVE_REDFISH_USER"
ENV_PASSWORD = "IRONSERVE_REDFISH_PASSWORD"


class RedfishError(Exception):
    """A Redfish request failed; the message names the method, path and the service's own message only."""


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
    """Credentials from `file` (`user:password`, outside the repository) or from the environment."""
    env = os.environ if environ is None else environ
    if file:
        path = Path(file).expanduser().resolve()
        if path.is_relative_to(REPO_ROOT):
            raise RedfishError(f"bios_credentials_file {file} is inside the repository; keep credentials outside it")
        try:
            text = path.read_text().strip()
        except OSError as exc:
            raise RedfishError(f"bios_credentials_file {file}: {exc.strerror}") from None
        user, sep, password = text.partition(":")
        if not sep or not user:
            raise RedfishError(f"bios_credentials_file {file}: expected one line 'user:password'")
        return Credentials(user, password)
    env_user, env_password = env.get(ENV_USER), env.get(ENV_PASSWORD)
    if not env_user or env_password is None:
        raise RedfishError(f"no iDRAC credentials: set {ENV_USER} and {ENV_PASSWORD}, or bios_credentials_file")
    return Credentials(env_user, env_password)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


class RedfishClient:
    def __init__(self, base_url: str, credentials: Credentials, verify_tls: bool = True, timeout_s: float = 30) -> None:
        self.base_url = base_url.rstrip("/")
        self._credentials = credentials
        self.timeout_s = timeout_s
        self._context = ssl.create_default_context()
        if not verify_tls:
            self._context.check_hostname = False
            self._context.verify_mode = ssl.CERT_NONE
        self.requests: list[tuple[str, str]] = []  # (method, path) sent, for tests and the report

    def __repr__(self) -> str:
        return f"RedfishClient({self.base_url!r})"

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Response:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", self._credentials.header())
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        self.requests.append((method, path))
        context = self._context if self.base_url.startswith("https:") else None
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=context) as resp:
                return Response(resp.status, dict(resp.headers.items()), _json(resp.read()))
        except urllib.error.HTTPError as exc:
            message = _redfish_message(_json(exc.read())) or exc.reason
            raise RedfishError(f"{method} {path}: HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RedfishError(f"{method} {path}: cannot reach {self.base_url}: {reason}") from None

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
