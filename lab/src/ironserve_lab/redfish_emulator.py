"""A simulated iDRAC for one lab host: sushy-tools' static mockup server plus the BIOS settings it lacks.

Lab edge only. The Redfish tree is generated from the host's hardware profile. sushy-tools serves GETs
from the tree on disk; its PATCH/POST handlers only log, so this module adds the small part ironserve
needs, keeping the state in the same files:

- PATCH Bios/Settings stores pending attributes; an unknown attribute is refused with a Redfish error;
- POST Managers/iDRAC.Embedded.1/Jobs schedules the BIOS configuration job (as older iDRAC 9 firmware needs);
- POST ComputerSystem.Reset applies pending settings when a job is scheduled, except the profile's
  `bios_stuck_pending` ones, which stay pending (the job then completes with errors).

Like a real iDRAC it speaks https only, with a self-signed certificate (`certificate()`: made once in the
lab's cache, like an iDRAC's factory certificate; the lab inventory hands its path and fingerprint to the
BIOS role). Every request needs HTTP Basic credentials (from a file). Requests are logged as method and
path only, never headers: sushy-tools prints them, Authorization included.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sushy_tools.static import main as sushy_static  # type: ignore[import-untyped]

from ironserve_lab import servers
from ironserve_lab.hardware import HardwareProfile, read_hardware_profile

MODULE = "ironserve_lab.redfish_emulator"  # how emulators are started, and recognised by their command line
SYSTEM = "Systems/System.Embedded.1"
MANAGER = "Managers/iDRAC.Embedded.1"
CHASSIS = "Chassis/System.Embedded.1"
RESET_TYPES = ["On", "ForceOff", "ForceRestart", "GracefulRestart", "GracefulShutdown", "PushPowerButton", "Nmi"]
# Attributes a real R740 BIOS has besides the profile's; enough that "unknown attribute" means something.
EXTRA_ATTRIBUTES = {
    "BootMode": "Uefi",
    "LogicalProc": "Enabled",
    "NodeInterleave": "Disabled",
    "SysProfile": "PerfPerWattOptimizedDapc",
    "ProcVirtualization": "Enabled",
    "SriovGlobalEnable": "Disabled",
    "MmioAbove4Gb": "Enabled",
}


CERTIFICATE, KEY = "idrac-cert.pem", "idrac-key.pem"


def certificate(folder: Path, names: list[x509.GeneralName] | None = None) -> tuple[Path, Path]:
    """(certificate, key) of the lab iDRAC under `folder`, made once: self-signed, EC P-256, for `names` (default
    127.0.0.1 and localhost), valid ten years; the key is 0600."""
    cert_path, key_path = folder / CERTIFICATE, folder / KEY
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ironserve lab iDRAC")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(
            x509.SubjectAlternativeName(
                names or [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the certificate's DER form, as `openssl x509 -fingerprint -sha256` shows it."""
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_path.read_text())).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def _odata(path: str) -> str:
    return "/redfish/v1" + (f"/{path}" if path else "")


def _write(root: Path, path: str, body: dict[str, Any]) -> None:
    """Write one resource; its Id and Name (which Redfish requires, and sushy checks) default to its last segment."""
    folder = root / path
    folder.mkdir(parents=True, exist_ok=True)
    name = path.rsplit("/", 1)[-1] or "RootService"
    document = {"@odata.id": _odata(path), "Id": name, "Name": name, **body}
    (folder / "index.json").write_text(json.dumps(document, indent=2) + "\n")


def _read(root: Path, path: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / path / "index.json").read_text())
    return data


def build_tree(profile: HardwareProfile, root: Path) -> None:
    """Write the Redfish tree (index.json per resource) for `profile` under `root`."""
    _write(
        root,
        "",
        {
            "@odata.type": "#ServiceRoot.v1_6_0.ServiceRoot",
            "RedfishVersion": "1.11.0",
            "Systems": {"@odata.id": _odata("Systems")},
            "Chassis": {"@odata.id": _odata("Chassis")},
            "Managers": {"@odata.id": _odata("Managers")},
        },
    )
    _write(root, "Systems", {"Members": [{"@odata.id": _odata(SYSTEM)}], "Members@odata.count": 1})
    devices = [f"{CHASSIS}/PCIeDevices/{gpu.pci_address.split(':')[1]}-0" for gpu in profile.gpus]
    _write(
        root,
        SYSTEM,
        {
            "@odata.type": "#ComputerSystem.v1_12_0.ComputerSystem",
            "Id": "System.Embedded.1",
            "Manufacturer": profile.system.manufacturer,
            "Model": profile.system.model,
            "SerialNumber": profile.system.serial,
            "BiosVersion": profile.system.bios_version,
            "PowerState": "On",
            "ProcessorSummary": {"Count": profile.cpu.sockets, "Model": profile.cpu.model},
            "Bios": {"@odata.id": _odata(f"{SYSTEM}/Bios")},
            "PCIeDevices": [{"@odata.id": _odata(d)} for d in devices],
            "Actions": {
                "#ComputerSystem.Reset": {
                    "target": _odata(f"{SYSTEM}/Actions/ComputerSystem.Reset"),
                    "ResetType@Redfish.AllowableValues": RESET_TYPES,
                }
            },
        },
    )
    _write(
        root,
        f"{SYSTEM}/Bios",
        {
            "@odata.type": "#Bios.v1_1_0.Bios",
            "Attributes": {**EXTRA_ATTRIBUTES, **profile.bios_attributes},
            "@Redfish.Settings": {"SettingsObject": {"@odata.id": _odata(f"{SYSTEM}/Bios/Settings")}},
        },
    )
    _write(root, f"{SYSTEM}/Bios/Settings", {"@odata.type": "#Bios.v1_1_0.Bios", "Attributes": {}})
    _write(root, "Chassis", {"Members": [{"@odata.id": _odata(CHASSIS)}], "Members@odata.count": 1})
    _write(root, CHASSIS, {"Id": "System.Embedded.1", "Power": {"@odata.id": _odata(f"{CHASSIS}/Power")}})
    _write(
        root,
        f"{CHASSIS}/Power",
        {
            "PowerSupplies": [
                {
                    "MemberId": psu.name,
                    "Name": psu.name,
                    "PowerCapacityWatts": psu.capacity_w,
                    "Status": {"State": "Enabled", "Health": "OK"},
                }
                for psu in profile.power_supplies
            ]
        },
    )
    for path, gpu in zip(devices, profile.gpus, strict=True):
        _write(
            root,
            path,
            {
                "Id": path.rsplit("/", 1)[-1],
                "Name": gpu.model,
                "Manufacturer": "NVIDIA Corporation",
                "Slot": {"Location": {"PartLocation": {"LocationOrdinalValue": gpu.slot, "LocationType": "Slot"}}},
                "PCIeInterface": {
                    "PCIeType": f"Gen{_gen(gpu.link_status.speed_gts)}",
                    "LanesInUse": gpu.link_status.width,
                    "MaxPCIeType": f"Gen{_gen(gpu.link_capability.speed_gts)}",
                    "MaxLanes": gpu.link_capability.width,
                },
            },
        )
    _write(root, "Managers", {"Members": [{"@odata.id": _odata(MANAGER)}], "Members@odata.count": 1})
    _write(root, MANAGER, {"Id": "iDRAC.Embedded.1", "Jobs": {"@odata.id": _odata(f"{MANAGER}/Jobs")}})
    _write(root, f"{MANAGER}/Jobs", {"Members": [], "Members@odata.count": 0})
    (root / ".stuck.json").write_text(json.dumps(profile.bios_stuck_pending))


def _gen(speed: float) -> int:
    return {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5}.get(float(speed), 0)


def _error(message_id: str, message: str) -> dict[str, Any]:
    return {
        "error": {
            "code": "Base.1.8.GeneralError",
            "message": message,
            "@Message.ExtendedInfo": [{"MessageId": message_id, "Message": message, "Severity": "Warning"}],
        }
    }


class Handler(sushy_static.RequestHandler):  # type: ignore[misc]
    """sushy-tools' static handler with authentication, quiet logs and stateful BIOS settings."""

    root: Path
    expected_auth: str
    sync_command: str | None = None

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"redfish: {self.command} {self.path.split('?')[0]}\n")

    def _log_request(self, method: str) -> None:
        """sushy-tools prints every header (the password too): log nothing here, log_message says enough."""

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") == self.expected_auth:
            return True
        self._reply(401, _error("Base.1.8.InsufficientPrivilege", "authentication required"))
        return False

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length", 0))
        try:
            value = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def _reply(self, status: int, body: dict[str, Any] | None = None, location: str | None = None) -> None:
        payload = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _path(self) -> str:
        return str(self.path).split("?")[0].rstrip("/").removeprefix("/redfish/v1").lstrip("/")

    def do_GET(self) -> None:
        # sushy-tools' own do_GET reads one process-wide tree; each server here has its own.
        if not self._authorised():
            return
        path = self._path()
        target = self.root / path / "index.json"
        if path.startswith(".") or ".." in path.split("/") or not target.is_file():
            self._reply(404, _error("Base.1.8.ResourceMissingAtURI", f"The resource at {self.path} does not exist"))
            return
        self._reply(200, json.loads(target.read_text()))

    def do_PATCH(self) -> None:
        if not self._authorised():
            return
        body = self._body()
        if self._path() != f"{SYSTEM}/Bios/Settings":
            self._reply(405, _error("Base.1.8.OperationNotAllowed", f"PATCH is not supported on {self.path}"))
            return
        known = _read(self.root, f"{SYSTEM}/Bios")["Attributes"]
        wanted = body.get("Attributes") or {}
        unknown = [k for k in wanted if k not in known]
        if unknown:
            self._reply(
                400,
                _error(
                    "Base.1.8.PropertyUnknown",
                    f"The property {unknown[0]} is not in the list of valid properties for the resource.",
                ),
            )
            return
        settings = _read(self.root, f"{SYSTEM}/Bios/Settings")
        settings["Attributes"] = {**settings["Attributes"], **wanted}
        _write(self.root, f"{SYSTEM}/Bios/Settings", settings)
        self._reply(
            200,
            {"@Message.ExtendedInfo": [{"MessageId": "Base.1.8.Success", "Message": "Successfully Completed Request"}]},
        )

    def do_POST(self) -> None:
        if not self._authorised():
            return
        body = self._body()
        path = self._path()
        if path == f"{MANAGER}/Jobs":
            self._create_job(body)
        elif path == f"{SYSTEM}/Actions/ComputerSystem.Reset":
            if body.get("ResetType") not in RESET_TYPES:
                self._reply(400, _error("Base.1.8.ActionParameterNotSupported", f"ResetType {body.get('ResetType')!r}"))
                return
            self._reset()
            self._reply(204)
        else:
            self._reply(405, _error("Base.1.8.OperationNotAllowed", f"POST is not supported on {self.path}"))

    def _jobs(self) -> list[dict[str, Any]]:
        return [
            _read(self.root, f"{MANAGER}/Jobs/{p.name}")
            for p in sorted((self.root / MANAGER / "Jobs").iterdir())
            if p.is_dir()
        ]

    def _create_job(self, body: dict[str, Any]) -> None:
        if body.get("TargetSettingsURI") != _odata(f"{SYSTEM}/Bios/Settings"):
            self._reply(400, _error("IDRAC.2.8.SYS011", "Unsupported TargetSettingsURI"))
            return
        if any(job["JobState"] == "Scheduled" for job in self._jobs()):
            self._reply(400, _error("IDRAC.2.8.SYS011", "Pending configuration values are already committed"))
            return
        if not _read(self.root, f"{SYSTEM}/Bios/Settings")["Attributes"]:
            self._reply(400, _error("IDRAC.2.8.SYS019", "No pending data present to create a Configuration job"))
            return
        job_id = f"JID_{int(time.time() * 1000) % 10**12:012d}"
        _write(
            self.root,
            f"{MANAGER}/Jobs/{job_id}",
            {
                "Id": job_id,
                "JobType": "BIOSConfiguration",
                "JobState": "Scheduled",
                "Message": "Task successfully scheduled.",
            },
        )
        self._reply(200, location=_odata(f"{MANAGER}/Jobs/{job_id}"))

    def _reset(self) -> None:
        scheduled = [job for job in self._jobs() if job["JobState"] == "Scheduled"]
        if not scheduled:
            return  # no configuration job: a real iDRAC leaves the settings pending too
        stuck = set(json.loads((self.root / ".stuck.json").read_text()))
        bios = _read(self.root, f"{SYSTEM}/Bios")
        settings = _read(self.root, f"{SYSTEM}/Bios/Settings")
        pending = settings["Attributes"]
        bios["Attributes"].update({k: v for k, v in pending.items() if k not in stuck})
        settings["Attributes"] = {k: v for k, v in pending.items() if k in stuck}
        _write(self.root, f"{SYSTEM}/Bios", bios)
        _write(self.root, f"{SYSTEM}/Bios/Settings", settings)
        for job in scheduled:
            job["JobState"] = "CompletedWithErrors" if settings["Attributes"] else "Completed"
            _write(self.root, f"{MANAGER}/Jobs/{job['Id']}", {k: v for k, v in job.items() if k != "@odata.id"})
        if self.sync_command:
            # The host "rebooted": let its stand-in tools see the new BIOS (e.g. GPU BARs above 4 GB).
            subprocess.run(
                self.sync_command,
                shell=True,
                input=json.dumps(bios["Attributes"]),
                text=True,
                capture_output=True,
                timeout=60,
                check=False,
            )


class TlsServer(http.server.ThreadingHTTPServer):
    """A threading HTTPS server: each connection's TLS handshake runs in its own thread, so a client that
    connects and says nothing (the lab's readiness probe) holds up no one."""

    context: ssl.SSLContext

    def finish_request(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        if not isinstance(request, socket.socket):
            return
        try:
            request = self.context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            sys.stderr.write(f"redfish: TLS handshake with {client_address[0]} failed: {exc}\n")
            return
        super().finish_request(request, client_address)

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        sys.stderr.write(f"redfish: request from {client_address[0]} failed: {sys.exc_info()[1]}\n")


def make_server(
    root: Path, port: int, credentials_file: Path, sync_command: str | None = None, *, tls: tuple[Path, Path]
) -> Any:
    """A ready (not yet serving) HTTPS server for the tree under `root` on 127.0.0.1:`port` (0: any port),
    with the certificate and key `tls`."""
    user_password = credentials_file.read_text().strip()
    handler = type(
        "BoundHandler",
        (Handler,),
        {
            "root": root,
            "expected_auth": "Basic " + base64.b64encode(user_password.encode()).decode(),
            "sync_command": sync_command,
        },
    )
    server = TlsServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.context.minimum_version = ssl.TLSVersion.TLSv1_2
    server.context.load_cert_chain(*tls)
    return server


def serve(
    root: Path,
    port: int,
    credentials_file: Path,
    sync_command: str | None,
    watch_pid: int | None,
    tls: tuple[Path, Path],
) -> None:
    server = make_server(root, port, credentials_file, sync_command, tls=tls)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    servers.exit_with(watch_pid, server.shutdown)
    server.serve_forever()


def start(
    profile: str,
    workdir: Path,
    credentials_file: Path,
    sync_command: str | None = None,
    watch_pid: int | None = None,
    *,
    tls: tuple[Path, Path],
) -> tuple[int, int]:
    """Generate the tree for `profile` under `workdir` and serve it over https on 127.0.0.1 with the
    certificate and key `tls`; return (pid, port).

    With `watch_pid` (the lab host's supervisor) the emulator exits by itself when the host is gone.
    """
    tree = workdir / "redfish"
    build_tree(read_hardware_profile(profile), tree)
    port = servers.free_port()
    argv = [
        sys.executable,
        "-m",
        MODULE,
        "--tree",
        str(tree),
        "--port",
        str(port),
        "--credentials-file",
        str(credentials_file),
        "--tls-cert",
        str(tls[0]),
        "--tls-key",
        str(tls[1]),
    ]
    if sync_command:
        argv += ["--sync", sync_command]
    if watch_pid:
        argv += ["--watch-pid", str(watch_pid)]
    pid = servers.start(argv, "127.0.0.1", port, workdir / "redfish.log", "redfish emulator")
    return pid, port


def stop(pid: int) -> None:
    """Stop an emulator this module started (by its pid)."""
    servers.stop(pid, MODULE)


def main() -> int:
    parser = argparse.ArgumentParser(prog="redfish_emulator")
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--credentials-file", type=Path, required=True)
    parser.add_argument("--tls-cert", type=Path, required=True, help="the certificate (PEM) the emulator serves")
    parser.add_argument("--tls-key", type=Path, required=True, help="its private key (PEM)")
    parser.add_argument("--sync", help="shell command run after a reset, the BIOS attributes as JSON on stdin")
    parser.add_argument("--watch-pid", type=int, help="exit when this process (the lab host) is gone")
    args = parser.parse_args()
    serve(args.tree, args.port, args.credentials_file, args.sync, args.watch_pid, (args.tls_cert, args.tls_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
