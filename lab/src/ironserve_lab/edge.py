"""The simulated hardware edge of a lab host: stand-in tools inside it, a Redfish iDRAC beside it.

`attach` installs the stand-in `lspci`, `dmidecode` and `lscpu` (standins.py) under
/usr/local/bin with the host's hardware profile as JSON, and starts one Redfish emulator per host on this
machine's 127.0.0.1 (the admin side, like a real iDRAC on the management network), over https with the
lab's self-signed iDRAC certificate (its path and fingerprint in `extra`). A VM also gets the
boot unit of its simulated nvidia module (standin_module.py), off until a test flags it.
After a Redfish reset the emulator writes the applied BIOS attributes into the host, so the stand-ins show it.
`detach` stops the emulator. Both are idempotent; the emulator's pid and URL live in the lab state.
Each host also gets its own server of the lab's signed apt mirror (aptrepo.py: NVIDIA's
repository and pkgs.k8s.io's Kubernetes one under kubernetes/core:/stable:/v1.31/deb/, one key for both),
started and stopped the same way (pid, URL and key path in the host's `extra`), and one of the lab's pip
index of the engine lock's wheels (wheelhouse.py; pid and URL in `extra`).
"""

from __future__ import annotations

import io
import json
import secrets
import shlex
import subprocess
import tarfile
import time
from pathlib import Path

from ironserve_lab import aptrepo, redfish_emulator, remote, standin_module, standin_nvml, state, wheelhouse
from ironserve_lab.hardware import read_hardware_profile
from ironserve_lab.network import GATEWAY
from ironserve_lab.paths import lab_dir
from ironserve_lab.state import LabHost

STANDINS = Path(__file__).resolve().parent / "standins.py"
REMOTE_LIB = "/usr/local/lib/ironserve-lab/standins.py"
HARDWARE_JSON = "/etc/ironserve-lab/hardware.json"
BIOS_JSON = "/etc/ironserve-lab/bios.json"
TOOLS = ("lspci", "dmidecode", "lscpu")


def credentials_file() -> Path:
    """The lab iDRAC's `user:password` (random, outside the repository, created once)."""
    path = lab_dir() / "redfish-credentials"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(f"root:{secrets.token_urlsafe(18)}\n")
    path.chmod(0o600)  # the BIOS role refuses a credentials file others can read
    return path


def _archive(files: dict[str, tuple[str, int]]) -> bytes:
    """A tar archive of absolute paths -> (content, mode), extracted on the host with `tar -x -C /`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, (content, mode) in files.items():
            data = content.encode()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def install_standins(host: LabHost, attempts: int = 3) -> None:
    files = {
        HARDWARE_JSON: (json.dumps(read_hardware_profile(host.hardware_profile).model_dump(), indent=1) + "\n", 0o644),
        REMOTE_LIB: (STANDINS.read_text(), 0o644),
        **{f"/usr/local/bin/{tool}": (f'#!/bin/sh\nexec python3 {REMOTE_LIB} {tool} "$@"\n', 0o755) for tool in TOOLS},
        # A VM reboots: its simulated nvidia module (off until a test sets the flag) follows the installed driver.
        **(standin_module.files() if host.kind == "vm" else {}),
    }
    archive = _archive(files)
    # A fresh emulator starts from the profile's BIOS, so the host forgets any earlier applied state.
    command = f"rm -f {BIOS_JSON} && tar -x --no-same-owner -C / -f -"
    if host.kind == "vm":
        command += f" && {standin_module.ENABLE}"
    for attempt in range(attempts):
        result = subprocess.run([*remote.ssh_argv(host), command], input=archive, capture_output=True, timeout=60)
        if result.returncode == 0:
            return
        if attempt + 1 < attempts:
            time.sleep(1)  # a host that just booted may drop the first sessions
    raise RuntimeError(f"{host.name}: installing the stand-in tools failed: {result.stderr.decode().strip()}")


def _running(host: LabHost) -> bool:
    pid = host.extra.get("redfish_pid")
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"ironserve_lab.redfish_emulator" in cmdline


def attach(host: LabHost, credentials: Path | None = None) -> LabHost:
    """Give `host` its stand-in tools and a running Redfish emulator; record it in the lab state.

    `credentials` (a `user:password` file) replaces the lab's shared one for this host's iDRAC.
    """
    install_standins(host)
    if _running(host) and not host.extra.get("redfish_url", "").startswith("https://"):
        redfish_emulator.stop(int(host.extra["redfish_pid"]))  # started before the lab iDRAC spoke https
    if not _running(host):
        workdir = lab_dir() / f"{host.name}-idrac"
        workdir.mkdir(parents=True, exist_ok=True)
        sync = shlex.join([*remote.ssh_argv(host), f"cat > {BIOS_JSON}"])
        tls = redfish_emulator.certificate(lab_dir() / "idrac-tls")  # self-signed, like a factory iDRAC's
        pid, port = redfish_emulator.start(
            host.hardware_profile,
            workdir,
            credentials or credentials_file(),
            sync,
            host.pids[0] if host.pids else None,
            tls=tls,
        )
        host.extra["redfish_pid"] = str(pid)
        host.extra["redfish_url"] = f"https://127.0.0.1:{port}"
        host.extra["redfish_ca_file"] = str(tls[0])
        host.extra["redfish_tls_fingerprint"] = redfish_emulator.fingerprint(tls[0])
    _attach_mirror(host)
    _attach_pip_index(host)
    current = state.load()
    for known in current.hosts:
        if known.name == host.name:
            known.extra.update(host.extra)
    state.save(current)
    return host


def detach(host: LabHost) -> None:
    """Stop the host's Redfish emulator (only the process this module started, by its recorded pid)."""
    if _running(host):
        redfish_emulator.stop(int(host.extra["redfish_pid"]))
    for key in ("redfish_pid", "redfish_url", "redfish_ca_file", "redfish_tls_fingerprint"):
        host.extra.pop(key, None)
    _detach_mirror(host)
    _detach_pip_index(host)


# --- the NVIDIA apt mirror: a signed repository of stand-in packages, one server per host -----------


def _attach_mirror(host: LabHost) -> None:
    """Serve the lab NVIDIA mirror (aptrepo.py) to `host`, as an air-gapped site's mirror.

    Container hosts reach it on the lab bridge; a VM (qemu user networking) reaches this machine's
    127.0.0.1 as 10.0.2.2.
    """
    pid = host.extra.get("aptrepo_pid")
    if pid and aptrepo.running(int(pid)):
        return
    bind, seen_as = ("127.0.0.1", "10.0.2.2") if host.kind == "vm" else (str(GATEWAY), str(GATEWAY))
    log = lab_dir() / f"{host.name}-aptrepo.log"
    new_pid, url = aptrepo.start(bind, host.pids[0] if host.pids else None, log)
    host.extra["aptrepo_pid"] = str(new_pid)
    host.extra["aptrepo_url"] = url.replace(bind, seen_as, 1)
    host.extra["aptrepo_key"] = str(aptrepo.key_path())


def _detach_mirror(host: LabHost) -> None:
    pid = host.extra.pop("aptrepo_pid", None)
    if pid:
        aptrepo.stop(int(pid))
    host.extra.pop("aptrepo_url", None)
    host.extra.pop("aptrepo_key", None)


# --- the pip index: the engine lock's wheels (wheelhouse.py), one server per host ---------------


def _attach_pip_index(host: LabHost) -> None:
    """Serve the lab pip index to `host`, as a site's PyPI/PyTorch mirror (downloaded first if missing)."""
    pid = host.extra.get("pip_index_pid")
    if pid and wheelhouse.running(int(pid)):
        return
    bind, seen_as = ("127.0.0.1", "10.0.2.2") if host.kind == "vm" else (str(GATEWAY), str(GATEWAY))
    new_pid, url = wheelhouse.start(bind, host.pids[0] if host.pids else None, lab_dir() / f"{host.name}-pip.log")
    host.extra["pip_index_pid"] = str(new_pid)
    host.extra["pip_index_url"] = url.replace(bind, seen_as, 1)


def _detach_pip_index(host: LabHost) -> None:
    pid = host.extra.pop("pip_index_pid", None)
    if pid:
        wheelhouse.stop(int(pid))
    host.extra.pop("pip_index_url", None)


# --- GPUs that answer through NVML: the stand-in libnvidia-ml.so.1 (standin_nvml.py) -----------------------------


def plug_gpus(host: LabHost, gpus: standin_nvml.NvmlState | None = None) -> standin_nvml.NvmlState:
    """Give `host` GPUs that NVML answers for, as loading the driver's kernel module does on an R740: their state
    (default: the host's profile GPUs, healthy), then the stand-in library where NVIDIA's driver puts it, unless the
    lab mirror's driver package installed it already. Returns the state written."""
    state = gpus or standin_nvml.from_profile(read_hardware_profile(host.hardware_profile).model_dump()["gpus"])
    set_gpus(host, state)
    if not remote.run(host, f"test -e {standin_nvml.INSTALL_PATH} && echo installed; true").strip():
        _put(host, str(standin_nvml.INSTALL_PATH), standin_nvml.library_bytes(), 0o644)
    return state


def set_gpus(host: LabHost, gpus: standin_nvml.NvmlState) -> None:
    """Replace the GPUs' state on `host` in one rename: the library reads it again on every NVML call."""
    _put(host, str(standin_nvml.DEFAULT_STATE_PATH), gpus.render().encode(), 0o644)


def unplug_gpus(host: LabHost) -> None:
    """The driver unloaded: NVML answers "Driver Not Loaded" again (the library, if plug_gpus put it, goes too)."""
    remote.run(host, f"rm -f {standin_nvml.DEFAULT_STATE_PATH}; dpkg -S {standin_nvml.INSTALL_PATH} >/dev/null 2>&1 "
                     f"|| rm -f {standin_nvml.INSTALL_PATH}")  # fmt: skip


def _put(host: LabHost, path: str, data: bytes, mode: int) -> None:
    """Write `data` to `path` on the host through a temporary file and a rename."""
    temporary = f"{path}.ironserve-lab-new"
    quoted, quoted_temporary = shlex.quote(path), shlex.quote(temporary)
    command = (
        f"mkdir -p {shlex.quote(str(Path(path).parent))} && cat > {quoted_temporary} && "
        f"chmod {mode:o} {quoted_temporary} && mv -f {quoted_temporary} {quoted}"
    )
    result = subprocess.run([*remote.ssh_argv(host), command], input=data, capture_output=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{host.name}: writing {path} failed: {result.stderr.decode().strip()}")
