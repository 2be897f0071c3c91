"""What the lab must leave as it found it on the machine that runs it.

Take a `snapshot()` before the lab starts and one after `lab down`, then assert that
`differences(before, after)` is empty. Values that change by themselves (counters, caches)
are left out; everything else a lab host could plausibly change is in.

The machine may be shared with someone else's lab hosts, started or stopped while a test
runs: name them in `others` and what is theirs (and what all hosts share) is left out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ironserve_lab.network import BRIDGE, NFT_TABLE

DEVICE_NODES = ["null", "zero", "full", "random", "urandom", "tty", "console", "ptmx", "pts/ptmx"]
SYSCTL_TREES = ["vm", "fs"]
SYSCTLS = [
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/forwarding",
    "net/ipv4/conf/default/forwarding",
    "net/ipv6/conf/all/forwarding",
    "kernel/hostname",
    "kernel/domainname",
]
# Counters and caches that change on their own while anything runs.
VOLATILE_SYSCTLS = {
    "fs/dentry-state",
    "fs/inode-nr",
    "fs/inode-state",
    "fs/file-nr",
    "fs/aio-nr",
    "fs/quota",
    "fs/xfs/stats",
    "vm/stat_refresh",
}


@dataclass
class Snapshot:
    device_nodes: dict[str, str] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    firewall: dict[str, str] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    nic_features: dict[str, str] = field(default_factory=dict)
    cgroup2_top: list[str] = field(default_factory=list)
    # Processes outside the machine's own namespaces (every lab host process is): pid -> "netns cmdline".
    namespaced_processes: dict[int, str] = field(default_factory=dict)


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _device_nodes() -> dict[str, str]:
    nodes = {}
    for name in DEVICE_NODES:
        path = Path("/dev", name)
        if path.exists():
            info = path.lstat()
            nodes[name] = f"mode={info.st_mode:o} uid={info.st_uid} gid={info.st_gid} rdev={info.st_rdev}"
    return nodes


def _read_sysctl(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # write-only or refused in this context
        return None


def _sysctls() -> dict[str, str]:
    root = Path("/proc/sys")
    paths = [root / key for key in SYSCTLS]
    for tree in SYSCTL_TREES:
        paths += sorted(p for p in (root / tree).rglob("*") if p.is_file())
    values = {}
    for path in paths:
        key = str(path.relative_to(root))
        if any(key == v or key.startswith(v + "/") for v in VOLATILE_SYSCTLS):
            continue
        value = _read_sysctl(path)
        if value is not None:
            values[key] = value
    return values


def _firewall() -> dict[str, str]:
    if not shutil.which("nft"):
        # Comments carry timestamps; counters change with traffic.
        lines = _run("iptables-save", "-t", "nat").splitlines()
        return {"iptables nat": "\n".join(line.split(" [", 1)[0] for line in lines if not line.startswith("#"))}
    # With nftables, iptables-save -t nat would create the nat table; the ruleset includes it anyway.
    return {"nft ruleset": _run("nft", "list", "ruleset")}


def _links() -> list[str]:
    return sorted(
        f"{link['ifname']} flags={','.join(link.get('flags', []))} mtu={link.get('mtu')} "
        f"address={link.get('address')} master={link.get('master')}"
        for link in json.loads(_run("ip", "-j", "link", "show"))
    )


def _addresses() -> list[str]:
    return sorted(
        f"{link['ifname']} {info['local']}/{info['prefixlen']}"
        for link in json.loads(_run("ip", "-j", "addr", "show"))
        for info in link.get("addr_info", [])
    )


def _nic_features() -> dict[str, str]:
    """Offload settings: switching forwarding on turns LRO off on every NIC, and nothing turns it back on."""
    if not shutil.which("ethtool"):
        return {}
    features = {}
    for path in Path("/sys/class/net").iterdir():
        if (path / "device").exists():
            result = subprocess.run(["ethtool", "-k", path.name], capture_output=True, text=True)
            features[path.name] = result.stdout
    return features


def _cgroup2_top() -> list[str]:
    """Top-level cgroup2 directories; the machine mounts no cgroup2, so look from a throwaway namespace."""
    with tempfile.TemporaryDirectory() as mountpoint:
        script = 'mount -t cgroup2 cgroup2 "$1" && find "$1" -mindepth 1 -maxdepth 2 -type d -printf "%P\\n"'
        listing = _run("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "-", mountpoint)
    return sorted(listing.split())


def _namespaced_processes() -> dict[int, str]:
    # The machine's init may hide its namespaces; the test runs in the machine's own.
    machine = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("mnt", "net", "pid")}
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # already dead; the machine's init reaps orphans only now and then
            if all(os.readlink(entry / "ns" / ns) == link for ns, link in machine.items()):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            netns = os.readlink(entry / "ns" / "net")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended while we looked, or the machine's init, which hides its namespaces
        if cmdline:  # kernel threads have none
            processes[int(entry.name)] = f"{netns} {cmdline.strip()}"
    return processes


def snapshot() -> Snapshot:
    return Snapshot(
        device_nodes=_device_nodes(),
        sysctls=_sysctls(),
        firewall=_firewall(),
        links=_links(),
        addresses=_addresses(),
        routes=sorted(_run("ip", "route", "show", "table", "all").splitlines()),
        netns=sorted(_run("ip", "netns", "list").splitlines()),
        mounts=sorted(Path("/proc/self/mounts").read_text().splitlines()),
        nic_features=_nic_features(),
        cgroup2_top=_cgroup2_top(),
        namespaced_processes=_namespaced_processes(),
    )


def _belongs_to(line: str, others: Collection[str], other_netns: set[str]) -> bool:
    """Whether a difference is another lab host's doing, or of what all container hosts share."""
    marks = [BRIDGE, NFT_TABLE[1], "ironserve-lab", "forwarding", "ip_forward"]
    marks += [f"il-{name}"[:15] for name in others]
    return any(mark in line for mark in marks) or any(netns in line for netns in other_netns)


def differences(before: Snapshot, after: Snapshot, others: Collection[str] = ()) -> list[str]:
    """One line per difference; processes count only when they are new (old ones may end).

    `others`: names of lab hosts that are not the test's own (see the module docstring).
    """
    found = []
    for name in Snapshot.__dataclass_fields__:
        old, new = getattr(before, name), getattr(after, name)
        if name == "namespaced_processes":
            found += [f"process left running: {pid} {cmd}" for pid, cmd in new.items() if pid not in old]
        elif isinstance(old, dict):
            for key in sorted(old.keys() | new.keys()):
                if old.get(key) != new.get(key):
                    found.append(f"{name}[{key}]: {old.get(key)!r} -> {new.get(key)!r}")
        elif old != new:
            found += [f"{name}: gone: {line}" for line in old if line not in new]
            found += [f"{name}: new: {line}" for line in new if line not in old]
    if not others:
        return found
    other_netns = {
        cmd.split()[0]
        for cmd in after.namespaced_processes.values()
        if any(f"container-supervisor.sh {name} " in cmd for name in others)
    }
    return [line for line in found if not _belongs_to(line, others, other_netns)]
