"""The Redfish client and BIOS workflow against the lab's iDRAC emulator (sushy-tools based, https on 127.0.0.1)."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from requests.adapters import BaseAdapter
from test_fact_data import real_sample

from ironserve.profiles import read_profile
from ironserve_lab import hardware, redfish_emulator
from roles.bios import client as bios_client
from roles.bios.client import Credentials, RedfishClient, RedfishError, apply, load_credentials, read_state

SENTINEL = "s3ntinel-PASSWORD-9f2c"
DESIRED = {
    "MmioAbove4Gb": "Enabled",
    "SriovGlobalEnable": "Disabled",
    "ProcVirtualization": "Enabled",
    "SysProfile": "PerfOptimized",
}


class Emulator:
    """The lab's simulated iDRAC on 127.0.0.1, over https with a self-signed certificate (the lab's own kind)."""

    def __init__(self, profile: str, tmp: Path, sync: str | None = None, tls: tuple[Path, Path] | None = None) -> None:
        self.tree = tmp / "tree"
        redfish_emulator.build_tree(hardware.read_hardware_profile(profile), self.tree)
        creds = tmp / "credentials"
        creds.write_text(f"root:{SENTINEL}\n")
        self.cert, self.key = tls or redfish_emulator.certificate(tmp / "tls")
        self.server: Any = redfish_emulator.make_server(self.tree, 0, creds, sync, tls=(self.cert, self.key))
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.fingerprint = redfish_emulator.fingerprint(self.cert)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def client(self, password: str = SENTINEL, **trust: Any) -> RedfishClient:
        trust = trust or {"ca_file": str(self.cert)}
        return RedfishClient(self.url, Credentials("root", password), timeout_s=5, **trust)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def emulator(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Emulator]:
    emu = Emulator(getattr(request, "param", "r740-a10x4"), tmp_path)
    try:
        yield emu
    finally:
        emu.close()


def test_read_state(emulator: Emulator) -> None:
    state = read_state(emulator.client())
    assert state.model == "PowerEdge R740" and state.bios_version == "2.19.1" and state.power_state == "On"
    assert state.attributes["MmioAbove4Gb"] == "Enabled" and state.pending == {}
    assert [(p.name, p.capacity_w) for p in state.power_supplies] == [("PSU1", 2000), ("PSU2", 2000)]
    assert [d["PCIeInterface"]["LanesInUse"] for d in state.pcie_devices] == [16, 16, 8, 8]
    assert "GracefulRestart" in state.reset_types


def test_nothing_to_apply_sends_no_patch(emulator: Emulator) -> None:
    client = emulator.client()
    result = apply(client, DESIRED, reboot=True)
    assert result.proven and result.patched == {} and result.note() == "nothing to apply"
    assert [m for m, _ in client.requests] == ["GET"] * len(client.requests)


@pytest.mark.parametrize("emulator", ["r740-a10x4-above4g-off"], indirect=True)
def test_apply_patches_schedules_job_resets_and_proves(emulator: Emulator) -> None:
    client = emulator.client()
    result = apply(client, DESIRED, reboot=True, poll_s=0)
    assert result.patched == {"MmioAbove4Gb": "Enabled"}
    assert result.job is not None and result.job.startswith("JID_")
    assert result.reset == "GracefulRestart"
    assert result.proven and result.stuck == {}
    sent = [(m, p) for m, p in client.requests if m != "GET"]
    assert sent == [("PATCH", bios_client.BIOS_SETTINGS), ("POST", bios_client.JOBS), ("POST", bios_client.RESET)]
    job = client.get(f"{bios_client.JOBS}/{result.job}")
    assert job["JobState"] == "Completed"
    again = emulator.client()
    assert apply(again, DESIRED, reboot=True).patched == {}
    assert {m for m, _ in again.requests} == {"GET"}  # the second run sends no PATCH, no job, no reset


@pytest.mark.parametrize("emulator", ["r740-a10x4-above4g-off"], indirect=True)
def test_apply_without_reboot_leaves_settings_pending(emulator: Emulator) -> None:
    result = apply(emulator.client(), DESIRED, reboot=False)
    assert result.reset is None and not result.proven
    assert result.state is not None and result.state.pending == {"MmioAbove4Gb": "Enabled"}
    assert "no reset (bios_reboot_policy: never)" in result.note()
    # Run again: the value is already pending and the job scheduled, so nothing is PATCHed twice.
    client = emulator.client()
    second = apply(client, DESIRED, reboot=False)
    assert second.patched == {} and second.job == "already scheduled"
    assert ("PATCH", bios_client.BIOS_SETTINGS) not in client.requests


@pytest.mark.parametrize("emulator", ["r740-a10x4-sriov-stuck"], indirect=True)
def test_setting_stuck_pending_is_not_a_success(emulator: Emulator) -> None:
    result = apply(emulator.client(), DESIRED, reboot=True, poll_s=0, timeout_s=5)
    assert result.reset is not None
    assert result.stuck == {"SriovGlobalEnable": "Disabled"}
    assert not result.proven and result.remaining == {"SriovGlobalEnable": "Disabled"}
    assert emulator.client().get(f"{bios_client.JOBS}/{result.job}")["JobState"] == "CompletedWithErrors"


def test_unknown_attribute_is_a_redfish_error(emulator: Emulator) -> None:
    client = emulator.client()
    with pytest.raises(RedfishError, match="The property NoSuchKnob is not in the list of valid properties"):
        client.request("PATCH", bios_client.BIOS_SETTINGS, {"Attributes": {"NoSuchKnob": "On"}})
    with pytest.raises(RedfishError, match="this BIOS has no attribute NoSuchKnob"):
        apply(client, {"NoSuchKnob": "On"}, reboot=False)


def test_wrong_password_is_refused(emulator: Emulator) -> None:
    with pytest.raises(RedfishError, match="HTTP 401"):
        read_state(emulator.client("wrong"))


def test_sentinel_password_never_appears(
    emulator: Emulator, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    client = emulator.client()
    messages = [repr(client), repr(client._credentials), str(client._credentials)]
    apply(client, {**DESIRED, "MmioAbove4Gb": "Disabled"}, reboot=True, poll_s=0)
    other_cert, _ = redfish_emulator.certificate(tmp_path / "other")
    attempts = (
        lambda: read_state(emulator.client("wrong")),
        lambda: client.get("/redfish/v1/Nope"),
        lambda: emulator.client(fingerprint="00" * 32).get(bios_client.SYSTEM),  # pinned to another certificate
        lambda: emulator.client(ca_file=str(other_cert)).get(bios_client.SYSTEM),  # signed by no CA it trusts
        lambda: RedfishClient(f"https://root:{SENTINEL}@127.0.0.1", Credentials("root", SENTINEL)),
        lambda: load_credentials(SENTINEL, {}),  # the password typed where the file's path belongs
    )
    for attempt in attempts:
        with pytest.raises(RedfishError) as info:
            attempt()
        messages.append(str(info.value))
    out, err = capfd.readouterr()
    text = "\n".join([*messages, out, err, caplog.text])
    assert "redfish: PATCH /redfish/v1/Systems/System.Embedded.1/Bios/Settings" in text  # the log exists
    encoded = base64.b64encode(f"root:{SENTINEL}".encode()).decode()
    assert SENTINEL not in text and encoded not in text and "Authorization" not in text


def test_credentials_from_environment_and_file(tmp_path: Path) -> None:
    env = {bios_client.ENV_USER: "root", bios_client.ENV_PASSWORD: SENTINEL}
    assert load_credentials(None, env) == Credentials("root", SENTINEL)
    assert SENTINEL not in repr(load_credentials(None, env))
    path = tmp_path / "idrac"
    path.write_text(f"admin:{SENTINEL}\n")
    path.chmod(0o600)
    assert load_credentials(str(path), {}).user == "admin"
    with pytest.raises(RedfishError, match="no iDRAC credentials: set IRONSERVE_REDFISH_USER"):
        load_credentials(None, {})
    with pytest.raises(RedfishError, match="inside the repository"):
        load_credentials(str(Path(bios_client.__file__)), {})
    path.chmod(0o640)
    with pytest.raises(RedfishError, match=r"has mode 0640, readable or writable by group or others: `chmod 600"):
        load_credentials(str(path), {})


# --- TLS: https only, the certificate verified (a CA file, a pinned fingerprint, or the system's CAs) ---------------


def test_the_ca_file_and_the_pin_each_trust_the_self_signed_idrac(emulator: Emulator) -> None:
    for trust in ({"ca_file": str(emulator.cert)}, {"fingerprint": emulator.fingerprint}):
        assert read_state(emulator.client(**trust)).model == "PowerEdge R740"
    both = emulator.client(ca_file=str(emulator.cert), fingerprint=emulator.fingerprint.replace(":", "").lower())
    assert read_state(both).model == "PowerEdge R740"


def test_an_untrusted_certificate_is_refused_before_any_request(
    emulator: Emulator, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        RedfishError, match=r"is not trusted \(.*self.signed.*\); trust its certificate with bios_ca_file"
    ):
        emulator.client(ca_file=None, fingerprint=None).get(bios_client.SYSTEM)  # the system's CAs do not know it
    other_cert, _ = redfish_emulator.certificate(tmp_path / "other")
    with pytest.raises(RedfishError, match="is not trusted"):
        emulator.client(ca_file=str(other_cert)).get(bios_client.SYSTEM)
    with pytest.raises(RedfishError, match=r"presented a certificate with SHA-256 fingerprint [0-9A-F:]{95}, not the"):
        emulator.client(fingerprint="ab" * 32).get(bios_client.SYSTEM)
    # Both must hold: the right CA does not excuse a wrong pin.
    with pytest.raises(RedfishError, match="not the pinned bios_tls_fingerprint; nothing was sent"):
        emulator.client(ca_file=str(emulator.cert), fingerprint="ab" * 32).get(bios_client.SYSTEM)
    assert "redfish: GET" not in capfd.readouterr().err  # the emulator never saw a request


def test_the_certificate_must_name_the_address(tmp_path: Path) -> None:
    """A CA file verifies the host name too: a certificate for another name is refused (pin it instead)."""
    cert_path, key_path = redfish_emulator.certificate(tmp_path / "other-name", [x509.DNSName("idrac-other.example")])
    emu = Emulator("r740-a10x4", tmp_path, tls=(cert_path, key_path))
    try:
        with pytest.raises(RedfishError, match=r"is not trusted .*mismatch"):
            emu.client(ca_file=str(cert_path)).get(bios_client.SYSTEM)
        assert read_state(emu.client(fingerprint=emu.fingerprint)).model == "PowerEdge R740"
    finally:
        emu.close()


def test_the_environment_steers_no_connection(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """requests would take a proxy and a CA bundle from the environment: the client takes neither."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there: a proxy taken would fail
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(emulator.cert))  # would make the system-CA client trust it
    monkeypatch.setenv("CURL_CA_BUNDLE", str(emulator.cert))
    assert read_state(emulator.client(fingerprint=emulator.fingerprint)).model == "PowerEdge R740"
    with pytest.raises(RedfishError, match="is not trusted"):
        emulator.client(ca_file=None, fingerprint=None).get(bios_client.SYSTEM)


def test_nothing_is_sent_to_another_address_nor_after_a_redirect(
    emulator: Emulator, capfd: pytest.CaptureFixture[str]
) -> None:
    """The credentials go to the iDRAC's base URL only: not to a link elsewhere (here another name of the same
    emulator), not where a redirect points."""
    elsewhere = emulator.url.replace("127.0.0.1", "localhost") + bios_client.SYSTEM
    with pytest.raises(RedfishError, match="No connection adapters"):
        emulator.client().get(elsewhere)
    assert "redfish: GET" not in capfd.readouterr().err

    class Redirecting(RecordedIdrac):
        def _transport(self) -> BaseAdapter:
            return Redirect(self)

    client = Redirecting({})
    with pytest.raises(RedfishError, match="HTTP 302"):
        read_state(client)
    assert client.requests == [("GET", "/redfish/v1/")]  # the redirect was not followed


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("http://10.0.0.21", "is plain http: the iDRAC password would cross the network in clear text"),
        ("https://idr\u0430c.example", "is not ASCII ('\u0430' CYRILLIC SMALL LETTER A)"),
        ("https://xn--idrc-43d.example", "is an IDNA-encoded (xn--) name"),
        ("https://10.0.0.21/redfish/v1", "without a path or query"),
        ("https://10.0.0.21:0", "the port must be a number from 1 to 65535"),
        ("https://10.0.0.999", "looks like an IPv4 address but is not one"),
        ("https://idrac_01.example", "neither an IP address nor a DNS name"),
        ("https://idrac.example\\@evil.example", "backslash"),  # urllib's host: evil.example; a browser's: idrac
        ("https://root@idrac.example", "carries credentials"),
        ("ftp://10.0.0.21", "is not an https:// URL"),
    ],
)
def test_the_client_refuses_an_address_it_would_not_trust(address: str, words: str) -> None:
    with pytest.raises(RedfishError) as info:
        RedfishClient(address, Credentials("root", SENTINEL))
    assert words in str(info.value) and str(info.value).startswith("bios_redfish_address ")


@pytest.mark.parametrize(
    "address", ["https://10.0.0.21", "https://idrac-r740-01.example.internal/", "https://[fd00::21]:8443"]
)
def test_ascii_names_and_ip_literals_are_accepted(address: str) -> None:
    host, port = bios_client.https_address(address)
    assert host in address and port in {443, 8443}


# --- real iDRAC responses (../shared/samples/realworld/redfish) ----------------------------------------------------


# The capture holds no service root, which sushy reads first: a stand-in, as an iDRAC 9 answers it.
SERVICE_ROOT = {
    "@odata.id": "/redfish/v1",
    "Id": "RootService",
    "Name": "Root Service",
    "RedfishVersion": "1.11.0",
    "Systems": {"@odata.id": "/redfish/v1/Systems"},
}


class RecordedIdrac(RedfishClient):
    """The client, sushy included, on recorded iDRAC bodies: GET answers the recorded body (404 when none),
    PATCH an empty 200, other requests the recorded error with HTTP 400; nothing leaves the process."""

    def __init__(self, bodies: dict[str, dict[str, Any]], error: dict[str, Any] | None = None) -> None:
        super().__init__("https://idrac.invalid", Credentials("root", SENTINEL))
        self.bodies = {"/redfish/v1": SERVICE_ROOT, **bodies}
        self.error = error

    def _transport(self) -> BaseAdapter:
        return Recorded(self)


class Recorded(BaseAdapter):
    def __init__(self, idrac: RecordedIdrac) -> None:
        super().__init__()
        self.idrac = idrac

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        path = str(request.path_url).split("?")[0].rstrip("/")
        if request.method == "GET":
            found = self.idrac.bodies.get(path)
            status, body = (200, found) if found is not None else (404, {"error": {"message": "not recorded"}})
        elif request.method == "PATCH":
            status, body = 200, None
        else:
            status, body = 400, self.idrac.error or {"error": {"message": "not recorded"}}
        response = requests.Response()
        response.status_code, response.url, response.request = status, str(request.url), request
        response._content = json.dumps(body).encode() if body is not None else b""
        return response

    def close(self) -> None:
        pass


class Redirect(Recorded):
    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        response = super().send(request, **kwargs)
        response.status_code, response.headers["Location"] = 302, "https://elsewhere.example/redfish/v1/"
        return response


def recorded_bodies(name: str) -> dict[str, dict[str, Any]]:
    """`## <path>` headings, each followed by its JSON body in a ``` block (the iserver capture's layout)."""
    text = real_sample(name).read_text()
    bodies = {}
    for block in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        path, _, rest = block.partition("\n")
        bodies[path.strip()] = json.loads(rest.split("```")[1])
    return bodies


def recorded_json(name: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(real_sample(name).read_text())
    return value


def test_read_state_of_a_real_r650() -> None:
    client = RecordedIdrac(recorded_bodies("redfish/r650-idrac510-iserver.txt"))
    state = read_state(client)
    assert (state.model, state.bios_version, state.power_state) == ("PowerEdge R650", "1.2.4", "On")
    assert "GracefulRestart" in state.reset_types
    assert {k: state.attributes[k] for k in DESIRED} == DESIRED and state.pending == {}
    assert [(p.capacity_w, p.present) for p in state.power_supplies] == [(1400, True), (1400, True)]
    assert len(state.pcie_devices) == 12


def test_applying_the_profile_to_a_real_r650_that_has_it_sends_nothing() -> None:
    client = RecordedIdrac(recorded_bodies("redfish/r650-idrac510-iserver.txt"))
    result = apply(client, dict(read_profile("r740-a10").hardware.bios_attributes), reboot=True)
    assert result.proven and result.patched == {} and result.note() == "nothing to apply"
    assert {m for m, _ in client.requests} == {"GET"}


def test_job_id_from_the_task_location_idrac_returns() -> None:
    task = recorded_json("redfish/sushy-oem-idrac-task-jid-scheduled.json.txt")
    assert bios_client._job_id(task["@odata.id"]) == "JID_257309938313"
    assert task["Oem"]["Dell"]["JobState"] == "Scheduled"


def test_a_reboot_job_in_the_queue_is_never_polled() -> None:
    queue = recorded_json("redfish/sushy-oem-idrac-jobs-running-reboot.json.txt")
    (job,) = queue["Members"]
    client = RecordedIdrac({job["@odata.id"]: job})
    assert job["JobState"] == "Running" and not bios_client._job_finished(client, job["Id"])
    assert client.requests == []  # RID_ jobs are iDRAC's reboots, not the BIOS job apply() waits for


def test_pending_changes_error_is_raised_with_idracs_message() -> None:
    bodies = recorded_bodies("redfish/r650-idrac510-iserver.txt")
    client = RecordedIdrac(bodies, recorded_json("redfish/sushy-oem-idrac-error-lc068-pending.json.txt"))
    with pytest.raises(RedfishError, match="there are pending attribute changes or a configuration job is in progress"):
        apply(client, {"SriovGlobalEnable": "Enabled"}, reboot=False)


def test_another_running_job_is_not_taken_for_the_bios_job() -> None:
    bodies = recorded_bodies("redfish/r650-idrac510-iserver.txt")
    error = recorded_json("redfish/sushy-oem-idrac-error-rac0679-running.json.txt")
    assert "A job operation is already running" in bios_client._redfish_message(error)
    client = RecordedIdrac(bodies, error)
    with pytest.raises(RedfishError, match="already running"):
        apply(client, {"SriovGlobalEnable": "Enabled"}, reboot=False)
