"""`ironserve lab …`: the lab's commands, added to the `ironserve` command by the lab's entry point
(`ironserve.commands` in lab/pyproject.toml), so the product's CLI never imports the lab."""

from __future__ import annotations

import argparse
from typing import Any

from ironserve_lab import hardware, manager
from ironserve_lab import state as lab_state


def cmd_lab(args: argparse.Namespace) -> int:
    if args.lab_command == "up":
        profile = args.profile or hardware.DEFAULT_PROFILE
        if profile not in hardware.available():
            raise ValueError(f"unknown hardware profile {profile!r}; accepted: {', '.join(hardware.available())}")
        started = manager.up(args.hosts, args.vm, profile)
        for host in started:
            print(f"{host.name}\t{host.kind}\t{host.ssh_address}:{host.ssh_port}\t{host.hardware_profile}")
    elif args.lab_command == "status":
        hosts = lab_state.load().hosts
        if not hosts:
            print("lab: no hosts running")
        for host in hosts:
            print(f"{host.name}\t{host.kind}\t{host.ssh_address}:{host.ssh_port}\t{host.hardware_profile}")
    elif args.lab_command == "ssh":
        return manager.ssh(args.host, args.command)
    elif args.lab_command == "down":
        manager.down(set(args.hosts) or None)
        print(f"lab: stopped {', '.join(args.hosts)}" if args.hosts else "lab: all hosts stopped, machine restored")
    return 0


def register(sub: Any) -> None:
    """Add `lab` to the `ironserve` command's subcommands (argparse's _SubParsersAction)."""
    lab = sub.add_parser("lab", help="the local lab of disposable Debian 12 hosts")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True)
    up = lab_sub.add_parser("up", help="start lab hosts (kept running until `lab down`)")
    up.add_argument("--hosts", type=int, default=1, help="how many hosts to start (default 1)")
    up.add_argument("--vm", action="store_true", help="start qemu VMs (real kernel and GRUB) instead of containers")
    up.add_argument("--profile", default=None, help=f"simulated hardware profile ({', '.join(hardware.available())})")
    lab_sub.add_parser("status", help="list running lab hosts")
    ssh = lab_sub.add_parser("ssh", help="open SSH to a lab host")
    ssh.add_argument("host")
    ssh.add_argument("command", nargs=argparse.REMAINDER)
    down = lab_sub.add_parser("down", help="stop lab hosts (all by default) and undo every change the lab made")
    down.add_argument("hosts", nargs="*", help="stop only these hosts")
    lab.set_defaults(func=cmd_lab)
