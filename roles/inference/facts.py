"""Facts of the inference role: the engine environment's packages and what is being served."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pyinfra.api.facts import FactBase

from roles.inference.render import canonical


class VenvPackages(FactBase[dict[str, str] | None]):
    """{canonical name: version} installed in a venv (`pip list`); None when the venv has no pip."""

    def command(self, venv: str) -> str:
        pip = shlex.quote(f"{venv}/bin/pip")
        return f"if [ -x {pip} ]; then {pip} list --format=json --disable-pip-version-check; fi"

    def process(self, output: Iterable[str]) -> dict[str, str] | None:
        text = "".join(output).strip()
        if not text:
            return None
        return {canonical(item["name"]): item["version"] for item in json.loads(text)}


class ServingStatus(FactBase[dict[str, Any] | None]):
    """`ironserve-service status`: the active version, its colour and whether it is ready; None before install."""

    def command(self, venv: str, config: str) -> str:
        cli, config = shlex.quote(f"{venv}/bin/ironserve-service"), shlex.quote(config)
        return f"if [ -x {cli} ] && [ -f {config} ]; then {cli} status --config {config}; fi; true"

    def process(self, output: Iterable[str]) -> dict[str, Any] | None:
        lines = [line for line in output if line.strip()]  # a line logged before it: the status is the last
        return json.loads(lines[-1]) if lines else None


@dataclass(frozen=True)
class BlockDevice:
    """One row of `lsblk --pairs --inverse`: the filesystem's device, then each device under it."""

    kname: str
    type: str  # disk, part, lvm, crypt, raid1, ...
    rotational: bool
    transport: str  # nvme, sata, sas, usb, ... ("" for partitions, virtual and mapped devices)


@dataclass(frozen=True)
class StoreFilesystem:
    """The filesystem that holds (or will hold) the models root, read at its nearest existing directory."""

    existing: str  # the models root, or its nearest existing parent
    source: str  # findmnt SOURCE without a bind mount's [/subdir]
    fstype: str
    target: str  # the mount point
    size_bytes: int
    avail_bytes: int
    devices: tuple[BlockDevice, ...]  # empty when the source is not a block device (tmpfs, overlay, NFS)
    version_bytes: int  # bytes of the version's directory already there (0 when absent)


def _pairs(line: str) -> dict[str, str]:
    """KEY="value" pairs of `findmnt -P` / `lsblk --pairs` (values are quoted, specials \\x-escaped)."""
    return dict(field.split("=", 1) for field in shlex.split(line))


class ModelStore(FactBase[StoreFilesystem | None]):
    """Where the models root's bytes land: its filesystem (findmnt), free space and the block devices under it
    (lsblk), and what of the version is already there (du). None when nothing could be read."""

    def command(self, models_root: str, version: str) -> str:
        root, version_dir = shlex.quote(models_root), shlex.quote(f"{models_root}/{version}")
        return (
            f'p={root}; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; echo "EXISTING=$p"; '
            'findmnt -P -b -o SOURCE,FSTYPE,TARGET,SIZE,AVAIL -T "$p"; '
            'src=$(findmnt -n -o SOURCE -T "$p" | tail -n 1 | sed "s/\\[.*//"); '
            'lsblk --pairs --inverse -o KNAME,TYPE,ROTA,TRAN "$src" 2>/dev/null; '
            f"if [ -d {version_dir} ]; then du -sb {version_dir}; fi; true"
        )

    def process(self, output: Iterable[str]) -> StoreFilesystem | None:
        lines = [line for line in output if line.strip()]
        # Mounts stacked on one mount point are all listed, in mount order: the last one is the one in use.
        mounts = [_pairs(line) for line in lines if line.startswith("SOURCE=")]
        if not lines or not lines[0].startswith("EXISTING=") or not mounts:
            return None
        mount = mounts[-1]
        devices = []
        version_bytes = 0
        for line in lines[1:]:
            if line.startswith("KNAME="):
                row = _pairs(line)
                devices.append(BlockDevice(row["KNAME"], row["TYPE"], row["ROTA"] == "1", row["TRAN"]))
            elif line[:1].isdigit():
                version_bytes = int(line.split()[0])
        return StoreFilesystem(
            existing=lines[0].removeprefix("EXISTING="),
            source=mount["SOURCE"].split("[", 1)[0],
            fstype=mount["FSTYPE"],
            target=mount["TARGET"],
            size_bytes=int(mount["SIZE"]),
            avail_bytes=int(mount["AVAIL"]),
            devices=tuple(devices),
            version_bytes=version_bytes,
        )
