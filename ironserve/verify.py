"""`ironserve verify INVENTORY`: run the acceptance gate (pytest-testinfra) against every host.

The inventory is validated first; each host's StackBase is handed to the tests through a JSON
file, and an SSH config is generated so testinfra reaches the hosts exactly as pyinfra does.
The acceptance conftest writes one JSON report per host: invariant id -> pass/fail/skip + observed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ironserve.config import StackBase
from ironserve.inventory import InventoryHost

# The gate is part of the product (ironserve.acceptance): the same files from a checkout and from an install.
ACCEPTANCE_DIR = Path(__file__).resolve().parent / "acceptance"


def ssh_config(hosts: list[InventoryHost], control_dir: Path) -> str:
    """An OpenSSH client config with one block per inventory host, from its pyinfra ssh_* data."""
    blocks = []
    for host in hosts:
        data = host.data
        lines = [f"Host {host.name}", f"  HostName {data.get('ssh_hostname', host.name)}"]
        options = {
            "Port": data.get("ssh_port"),
            "User": data.get("ssh_user"),
            "IdentityFile": data.get("ssh_key"),
            "UserKnownHostsFile": data.get("ssh_known_hosts_file"),
            "StrictHostKeyChecking": data.get("ssh_strict_host_key_checking"),
        }
        lines += [f"  {option} {value}" for option, value in options.items() if value is not None]
        lines += ["  BatchMode yes", "  ControlMaster auto", f"  ControlPath {control_dir}/%C", "  ControlPersist 60"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def acceptance_files(configs: dict[str, StackBase]) -> list[str]:
    """The acceptance files of the roles these hosts run (acceptance/test_<role>.py mirrors roles/<role>)."""
    roles = {role for config in configs.values() for role in config.roles}
    return [str(path) for path in sorted(ACCEPTANCE_DIR.glob("test_*.py")) if path.stem.removeprefix("test_") in roles]


def run(hosts: list[InventoryHost], configs: dict[str, StackBase], report_dir: Path, pytest_args: list[str]) -> int:
    report_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ironserve-verify-") as tmp:
        config_file = Path(tmp) / "ssh_config"
        config_file.write_text(ssh_config(hosts, Path(tmp)))
        stack_file = Path(tmp) / "stack.json"
        stack_file.write_text(
            json.dumps({name: c.model_dump(mode="json", by_alias=True) for name, c in configs.items()})
        )
        # -P: the installed ironserve and roles, never a same-named folder of the current directory.
        argv = [
            sys.executable,
            "-P",
            "-m",
            "pytest",
            *acceptance_files({h.name: configs[h.name] for h in hosts}),
            "-p",
            "no:cacheprovider",
            f"--ssh-config={config_file}",
            "--hosts=" + ",".join(f"ssh://{h.name}" for h in hosts),
            f"--ironserve-stack={stack_file}",
            f"--ironserve-reports={report_dir}",
            "-q",
            *pytest_args,
        ]
        return subprocess.call(argv)
