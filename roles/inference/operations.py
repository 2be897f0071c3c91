"""The inference role's operations: each reads state through facts and yields commands only when it differs.

Every value from the configuration reaches the shell as a QuoteString (shlex.quote); `model_version_dir` is the
deletion guard the model sync's destination passes right before the sync.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable
from urllib.parse import urlsplit

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.context import host, state
from pyinfra.facts.files import Directory, File

from ironserve.operations import Commands, failing
from ironserve.owned import OwnedPath
from ironserve.speed.reads import Read, read, reading_operation
from ironserve.validators import SYSTEM_DIRS, check_model_version, check_path
from roles.inference.facts import ModelStore, ServingStatus, StoreFilesystem, VenvPackages
from roles.inference.render import environment_drift
from roles.inference.settings import MODELS_ROOTS

RESERVED_PORTS_KEY = "net.ipv4.ip_local_reserved_ports"


def port_list(ports: Iterable[int]) -> str:
    """Ports as the kernel prints net.ipv4.ip_local_reserved_ports: ascending, each run of consecutive ports as
    `first-last`, comma-separated (so the live value compares equal to it)."""
    runs: list[list[int]] = []
    for port in sorted(set(ports)):
        if runs and port == runs[-1][1] + 1:
            runs[-1][1] = port
        else:
            runs.append([port, port])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def parse_port_list(text: str) -> set[int]:
    """net.ipv4.ip_local_reserved_ports as the kernel prints it (`8000-8001,8080`, empty for none) -> its ports."""
    ports: set[int] = set()
    for item in text.strip().split(","):
        first, _, last = item.strip().partition("-")
        if first:
            ports.update(range(int(first), int(last or first) + 1))
    return ports


def model_version_dir(models_root: str, version: str) -> str:
    """<models_root>/<version>, the only directory the model sync (delete=True) may delete in, checked again.

    Pure: raises OperationError for /, a system directory, a root outside the documented models roots, a
    version that is not YYYYMMDD-HHMMSS, or a result that is not a direct child of models_root.
    """
    try:
        root = check_path(models_root, roots=MODELS_ROOTS)
        check_model_version(version)
    except ValueError as exc:
        raise OperationError(f"model sync with deletion refused: {models_root!r}, {version!r}: {exc}") from None
    dest = posixpath.join(root, version)
    if posixpath.normpath(dest) != dest or posixpath.dirname(dest) != root or dest in SYSTEM_DIRS:
        raise OperationError(f"model sync with deletion refused: {dest!r} is not a version directory in {root}")
    return dest


def gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def model_store_problems(
    store: StoreFilesystem | None, *, nvme: bool, mount: str | None, version_bytes: int, headroom: float
) -> list[str]:
    """Why the models root cannot take this version (empty: it can). Pure.

    Room: after the upload, one more version of the same size (the next swap keeps both on disk) and `headroom` of
    the filesystem must still be free.
    """
    if store is None:
        return ["its filesystem could not be read (findmnt)"]
    problems = []
    on = f"{store.target} ({store.source}, {store.fstype})"
    if mount is not None and store.target != mount:
        problems.append(f"it is on {on}, not on the mount {mount}: mount the model drive there")
    disks = [d for d in store.devices if d.type == "disk"]
    if nvme and not disks:
        problems.append(f"{on} is not on a local block device (NVMe required)")
    elif nvme:
        slow = [f"{d.kname} ({'rotational' if d.rotational else d.transport or 'no transport'})" for d in disks
                if d.rotational or d.transport != "nvme"]  # fmt: skip
        if slow:
            problems.append(f"{on} is not on NVMe: {', '.join(slow)}")
    missing = max(version_bytes - store.version_bytes, 0)
    needed = missing + version_bytes + int(headroom * store.size_bytes)
    if store.avail_bytes < needed:
        problems.append(
            f"{gib(store.avail_bytes)} free on {store.target}; this version needs {gib(missing)} more, the next "
            f"{gib(version_bytes)} and the headroom {gib(int(headroom * store.size_bytes))}: {gib(needed)}"
        )
    return problems


def _store_reads(models_root: str, version: str, **_: object) -> list[Read]:
    return [Read(ModelStore, {"models_root": models_root, "version": version})]


@reading_operation(reads=_store_reads)
def model_store_ready(
    models_root: str, version: str, version_bytes: int, nvme: bool, mount: str | None, headroom: float
) -> Commands:
    """Stop this host before anything is installed when the models root is not where the settings say (the
    mount, NVMe) or has no room for this version and the next one."""
    store = read(ModelStore, models_root=models_root, version=version)
    problems = model_store_problems(store, nvme=nvme, mount=mount, version_bytes=version_bytes, headroom=headroom)
    if problems:
        yield failing(f"model store {models_root}: " + "; ".join(problems))
        return
    assert store is not None
    host.noop(f"model store {models_root}: {store.target} ({store.source}), {gib(store.avail_bytes)} free")


@reading_operation(reads=lambda venv, **_: [Read(VenvPackages, {"venv": venv})])
def locked_environment(venv: str, python: str, lock: str, pins: dict[str, str], index_url: str) -> Commands:
    """The venv holds exactly the lock: created from the distribution's Python, installed with
    --require-hashes from the configured index, packages beside the lock removed."""
    installed = read(VenvPackages, venv=venv)
    if installed is None:
        yield StringCommand(QuoteString(python), "-m", "venv", QuoteString(venv))
        installed = {}
    wrong, extra = environment_drift(pins, installed)
    if not wrong and not extra:
        host.noop(f"{venv}: {len(pins)} packages at their locked versions")
        return
    pip = QuoteString(f"{venv}/bin/pip")
    if extra:
        yield StringCommand(pip, "uninstall", "--yes", *map(QuoteString, extra))
    if wrong:
        # The index URL may carry a site's credentials: hidden in pyinfra's output and logs. A plain-HTTP
        # index (a mirror on the site's own network) is trusted explicitly: every wheel is hash-checked.
        trust = (
            ("--trusted-host", QuoteString(urlsplit(index_url).netloc.rpartition("@")[2]))
            if index_url.startswith("http:")
            else ()
        )
        yield StringCommand(
            pip, "install", "--quiet", "--disable-pip-version-check", "--require-hashes", "--no-deps",
            "--index-url", QuoteString(HiddenValue(index_url)), *trust, "-r", QuoteString(lock),
        )  # fmt: skip


def _package_reads(venv: str, digest: str, **_: object) -> list[Read]:
    return [Read(VenvPackages, {"venv": venv}), Read(File, {"path": f"{venv}/.ironserve-service-{digest}"})]


@reading_operation(reads=_package_reads)
def service_package(venv: str, wheel: str, digest: str) -> Commands:
    """ironserve-service from the wheel built from this checkout (its dependencies are in the lock)."""
    marker = f"{venv}/.ironserve-service-{digest}"
    installed = read(VenvPackages, venv=venv) or {}
    if "ironserve-service" in installed and read(File, path=marker):
        host.noop(f"ironserve-service {installed['ironserve-service']} from sources {digest}")
        return
    yield StringCommand(
        QuoteString(f"{venv}/bin/pip"), "install", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--force-reinstall", QuoteString(wheel),
    )  # fmt: skip
    # The glob stays outside the quotes: only the old markers in this venv match it.
    yield f"rm -f {shlex.quote(venv)}/.ironserve-service-* && touch {shlex.quote(marker)}"


@reading_operation(reads=lambda paths, **_: [Read(Directory, {"path": p}) for p in paths])
def runtime_dirs(config_file: str, paths: list[str]) -> Commands:
    """Create the tmpfiles.d directories now when any is missing (systemd creates them at every boot)."""
    missing = [p for p in paths if not read(Directory, path=p)]
    if not missing:
        host.noop("runtime directories exist: " + ", ".join(paths))
        return
    yield StringCommand("systemd-tmpfiles", "--create", QuoteString(config_file))


@reading_operation(reads=lambda venv, config, **_: [Read(ServingStatus, {"venv": venv, "config": config})])
def serving(venv: str, config: str, model: str, version: str) -> Commands:
    """The configured version serves, ready: else the blue/green swap brings it in (verify, start the idle
    colour, readiness, compare-and-swap in etcd, route switch, drain, stop the old colour)."""
    if not state.is_executing:
        host.noop("checked after the service is installed, while the deploy runs")
        return
    status = read(ServingStatus, venv=venv, config=config)
    if status and status.get("active") == version and status.get("ready"):
        host.noop(f"{model} {version} serving on {status['colour']}")
        return
    yield StringCommand(
        QuoteString(f"{venv}/bin/ironserve-service"), "swap", QuoteString(model), QuoteString(version), "--config",
        QuoteString(config),
    )  # fmt: skip


@reading_operation(reads=lambda path, **_: [Read(OwnedPath, {"path": path})])
def api_keys_present(venv: str, config: str, path: str, group: str) -> Commands:
    """The keys file Envoy's API routes check, root:<group> 0640 (the control loop reads it as the service
    account). When absent, one key for client "default" is generated on the host by `ironserve-service api-key
    add --quiet`: no key passes through the deploy machine or its output. Its content is the admin's: never
    compared, never rewritten."""
    shape = read(OwnedPath, path=path)
    if shape.kind not in {"absent", "file"}:
        yield failing(f"{path} is a {shape.kind}, not the API keys file; move it away")
        return
    changed = False
    if shape.kind == "absent":
        cli = QuoteString(f"{venv}/bin/ironserve-service")
        yield StringCommand(cli, "api-key", "add", "default", "--quiet", "--config", QuoteString(config))
        changed = True
    if changed or (shape.mode, shape.user, shape.group) != ("640", "root", group):
        yield StringCommand("chown", QuoteString(f"root:{group}"), QuoteString(path))
        yield StringCommand("chmod", "0640", QuoteString(path))
        return
    host.noop(f"{path}: root:{group} 0640")
