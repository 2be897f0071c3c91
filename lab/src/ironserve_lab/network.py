"""The container lab's network: one bridge in the machine's root namespace, one veth per host.

Lab addresses exist only on devices the lab creates (the bridge and the hosts' veths) in a
lab-only /24. Hosts reach the Debian mirror through NAT in an nftables table of the lab's own,
so removing that table removes all of it and no other table is touched. Forwarding is switched on
for as long as the lab runs. Each change is recorded in the lab state *before* it is applied and
undone by `teardown_shared`, so a crash half-way still leaves `lab down` able to restore the machine.
"""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

from ironserve_lab import state
from ironserve_lab.state import LabHost, LabState

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
GATEWAY = SUBNET[1]  # the bridge's address: the hosts' default route and how the machine reaches them
FIRST_HOST = 11
BRIDGE = "ironlab0"
IP_FORWARD = "net.ipv4.ip_forward"
NFT_TABLE = ["ip", "ironserve_lab"]
NFT_CREATE = ["nft", "add", "table", *NFT_TABLE]
NFT_RULESET = f"""
table ip ironserve_lab {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {SUBNET} oifname != "{BRIDGE}" masquerade
    }}
}}
"""
# Where the FORWARD policy drops (e.g. on machines running Docker), an accept in our own table
# would not help: nftables drops a packet that any base chain drops.
FORWARD_RULES = [
    ["iptables", "-w", "-I", "FORWARD", "-i", BRIDGE, "-j", "ACCEPT"],
    ["iptables", "-w", "-I", "FORWARD", "-o", BRIDGE, "-j", "ACCEPT"],
]


def _run(*argv: str, stdin: str | None = None) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _subnet_in_use() -> str | None:
    """A route of this machine that overlaps the lab subnet (other than the lab's own), if any."""
    for line in _run("ip", "-4", "route", "show").splitlines():
        destination = line.split()[0]
        if destination == "default" or f" dev {BRIDGE} " in f" {line} ":
            continue
        if ipaddress.IPv4Network(destination, strict=False).overlaps(SUBNET):
            return line
    return None


def _forward_policy_drops() -> bool:
    # An absent filter table drops nothing; asking iptables about it could create it.
    if "table ip filter" not in _run("nft", "list", "tables"):
        return False
    return "-P FORWARD ACCEPT" not in _run("iptables", "-w", "-S", "FORWARD")


def ensure_shared(current: LabState) -> None:
    """Create the bridge, forwarding and NAT unless they exist; record each before applying it.

    `current` must be the state held under `state.locked()`.

    `nat_rules` holds the command that created each firewall change; teardown runs its inverse.
    """
    if _link_exists(BRIDGE):
        return
    clash = _subnet_in_use()
    if clash:
        raise RuntimeError(f"the lab subnet {SUBNET} is already routed on this machine ({clash})")
    forwarding = _sysctl_path(IP_FORWARD).read_text().strip()
    if forwarding != "1":
        current.restore_sysctls.setdefault(IP_FORWARD, forwarding)
    commands = [NFT_CREATE]
    if _forward_policy_drops():
        commands += FORWARD_RULES
    current.nat_rules.extend(command for command in commands if command not in current.nat_rules)
    state.save(current)

    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _sysctl_path(IP_FORWARD).write_text("1\n")
    _run("nft", "-f", "-", stdin=NFT_RULESET)
    for command in commands[1:]:
        _run(*command)


def _undo_firewall_change(command: list[str]) -> None:
    """Run the inverse of a recorded firewall command, if what it made (still) exists."""
    if command == NFT_CREATE:
        exists = ["nft", "list", "table", *NFT_TABLE]
        undo = ["nft", "delete", "table", *NFT_TABLE]
    else:
        exists = ["-C" if arg == "-I" else arg for arg in command]
        undo = ["-D" if arg == "-I" else arg for arg in command]
    if subprocess.run(exists, capture_output=True).returncode == 0:
        _run(*undo)


def teardown_shared(current: LabState) -> None:
    """Remove the bridge and the NAT and restore forwarding; each step tolerates a half setup.

    `current` must be the state held under `state.locked()`, which saves what is left on record.
    """
    if _link_exists(BRIDGE):
        _run("ip", "link", "del", BRIDGE)
    for command in [c for c in current.nat_rules if c in (NFT_CREATE, *FORWARD_RULES)]:
        _undo_firewall_change(command)
        current.nat_rules.remove(command)
    if IP_FORWARD in current.restore_sysctls:
        _sysctl_path(IP_FORWARD).write_text(current.restore_sysctls.pop(IP_FORWARD) + "\n")


def free_address(current: LabState) -> str:
    taken = {h.ssh_address for h in current.hosts}
    for index in range(FIRST_HOST, SUBNET.num_addresses - 1):
        address = str(SUBNET[index])
        if address not in taken:
            return address
    raise RuntimeError(f"no free address left in the lab subnet {SUBNET}")


def veth_name(host: LabHost) -> str:
    """The machine-side end of the host's veth (interface names have at most 15 characters)."""
    return f"il-{host.name}"[:15]


def attach(host: LabHost, netns_pid: int) -> None:
    """Give the network namespace of `netns_pid` an eth0 on the lab bridge with the host's address."""
    outside = veth_name(host)
    _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", str(netns_pid))
    _run("ip", "link", "set", outside, "master", BRIDGE, "up")
    inside = (
        "link set lo up\n"
        f"addr add {host.ssh_address}/{SUBNET.prefixlen} dev eth0\n"
        "link set eth0 up\n"
        f"route add default via {GATEWAY}\n"
    )
    _run("nsenter", f"--net=/proc/{netns_pid}/ns/net", "ip", "-batch", "-", stdin=inside)


def detach(host: LabHost) -> None:
    """Remove the host's veth if its namespace has not already taken it along when it ended."""
    if _link_exists(veth_name(host)):
        subprocess.run(["ip", "link", "del", veth_name(host)], capture_output=True)
