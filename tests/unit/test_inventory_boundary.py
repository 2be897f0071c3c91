"""An inventory is validated when it is loaded, before any connection, on every entry point (issue 12, item 1).

The real pyinfra command line runs on inventories whose hosts point at a TCP listener of this test on
127.0.0.1 and at TEST-NET-1 (192.0.2.1, never routed); nothing else is ever contacted. Each pyinfra run
takes about 2 s on 2 shared cores.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pyinfra_cli.main
import pytest
from pyinfra.api.exceptions import DeployError

from ironserve import cli
from ironserve.config import ConfigError
from ironserve.deploying import config_for
from ironserve.inventory import REPORT_TITLE, load_inventory, report, validate_inventory
from ironserve.paths import REPO_ROOT
from ironserve.registry import registry

DEPLOY = str(REPO_ROOT / "deploy.py")

BAD = """
from ironserve.inventory import site

gpu_servers = site(
    [
        (
            "r740-01.invalid",
            {{"ssh_hostname": "127.0.0.1", "ssh_port": {port}, "ironserve_reboot_policy": "sometimes"}},
        ),
        ("r740-02.invalid", {{"ssh_hostname": "192.0.2.1", "ironserve_profle": "r740-a10"}}),
    ],
    {{"ironserve_roles": "host_tuning", "ssh_connect_retries": 0}},
)
"""


class Listener:
    """A TCP listener on 127.0.0.1 that counts (and closes) the connections it receives."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    served = Listener()
    yield served
    served.close()


def _pyinfra(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    return run, time.monotonic() - start


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_pyinfra_stops_before_connecting_with_every_hosts_problems(
    tmp_path: Path, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "inventory.py", BAD.format(port=listener.port))
    run, seconds = _pyinfra(tmp_path, "inventory.py", DEPLOY)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert REPORT_TITLE in output
    assert "host r740-01.invalid: ironserve_reboot_policy: Input should be 'auto', 'defer' or 'never'" in output
    assert "host r740-02.invalid: ironserve_profle: unknown key" in output
    assert "did you mean ironserve_profile?" in output
    assert "Connecting" not in output and "Connected" not in output and "No hosts remaining" not in output
    assert "Traceback" not in output
    assert listener.connections == 0
    assert seconds < 30  # an SSH attempt to 192.0.2.1 alone would wait for its connect timeout
    # The same report as `ironserve validate` prints.
    monkeypatch.chdir(tmp_path)
    _, problems = validate_inventory(load_inventory("inventory.py"), registry())
    assert report(problems) in run.stderr


def test_the_listener_sees_pyinfra_connect_when_the_inventory_is_valid(tmp_path: Path, listener: Listener) -> None:
    """The control of the test above: a valid inventory does reach the listener (then fails its SSH handshake)."""
    inventory = BAD.format(port=listener.port).replace('"sometimes"', '"defer"')
    _write(tmp_path / "inventory.py", inventory.replace(', "ironserve_profle": "r740-a10"', ""))
    run, _ = _pyinfra(tmp_path, "--limit", "r740-01.invalid", "inventory.py", DEPLOY)
    assert REPORT_TITLE not in run.stdout + run.stderr
    assert listener.connections >= 1


def test_the_check_at_load_sees_data_overrides_and_group_data(tmp_path: Path, listener: Listener) -> None:
    _write(tmp_path / "inventory.py", BAD.format(port=listener.port))
    _write(tmp_path / "group_data/all.py", "ironserve_reboot_timeout_s = 0\n")  # the working directory's
    run, _ = _pyinfra(tmp_path, "--data", "ironserve_roles=nvida", "inventory.py", DEPLOY)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    for host in ("r740-01.invalid", "r740-02.invalid"):
        assert f"host {host}: ironserve_roles: unknown role 'nvida'; did you mean nvidia?" in output
        assert f"host {host}: ironserve_reboot_timeout_s: Input should be greater than 0 (got 0)" in output
    assert listener.connections == 0


@pytest.mark.parametrize("command", ["validate", "deploy", "verify"])
def test_every_ironserve_command_prints_the_same_report_before_any_connection(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = _write(tmp_path / "inventory.py", BAD.format(port=9))
    monkeypatch.chdir(tmp_path)
    _, problems = validate_inventory(load_inventory(str(inventory)), registry())

    def never(*args: object, **kwargs: object) -> int:
        raise AssertionError("a host would be contacted")

    monkeypatch.setattr(pyinfra_cli.main, "main", never)  # deploy runs pyinfra in this process
    monkeypatch.setattr(cli.verify, "run", never)
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, str(inventory)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == report(problems)
    assert len(problems) == 2


def test_relative_paths_are_read_from_the_inventory_folder_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inventory = _write(
        tmp_path / "site/inventory.py",
        """
        from ironserve.inventory import site

        gpu_servers = site(
            [("r740-01", {"inference_requirements": "files/requirements.lock"}), "r740-02"],
            {"nvidia_repo_key": "keys/repo.gpg", "preflight_report_dir": "/var/tmp/reports"},
        )
        """,
    )
    seen = []
    for cwd, name in ((tmp_path, "site/inventory.py"), (tmp_path / "site", "inventory.py"), (Path("/"), inventory)):
        monkeypatch.chdir(cwd)
        seen.append({h.name: h.data for h in load_inventory(str(name))})
    assert seen[0] == seen[1] == seen[2]
    assert seen[0]["r740-01"]["inference_requirements"] == str(tmp_path / "site/files/requirements.lock")
    assert seen[0]["r740-02"]["nvidia_repo_key"] == str(tmp_path / "site/keys/repo.gpg")
    assert seen[0]["r740-02"]["preflight_report_dir"] == "/var/tmp/reports"  # absolute: as written


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # Plain pyinfra groups (no site()): pyinfra's own refusals become a message, not a traceback.
        ('g = ([("h1", {})], "not a dict")', "inventory.py: pyinfra cannot load it: ValueError"),
        ('g = ([("h1", "x")], {})', "inventory.py: pyinfra cannot load it: "),
        ('g = ([("h1",)], {})', "inventory.py: pyinfra cannot load it: IndexError"),
        ("g = ([(5, {})], {})", "inventory.py: pyinfra cannot load it: TypeError"),
        ("g = ()", "inventory.py: pyinfra cannot load it: IndexError"),
        ('g = ([("h1", {1: 2})], {})', "host h1: 1: an inventory key is text"),
        ("g = []", "the inventory lists no hosts"),
        ("raise RuntimeError('site file missing')", "inventory.py: RuntimeError (line 1): site file missing"),
        # site() names the entry.
        ("from ironserve.inventory import site\ng = site([('h1',)])", 'host entry 1: expected "name" or'),
        ("from ironserve.inventory import site\ng = site([('h1', 'x')])", "host h1: its data is a mapping"),
        ("from ironserve.inventory import site\ng = site('h1')", "site(): the hosts are a list of entries"),
        ("from ironserve.inventory import site\ng = site(['h1'], ['x'])", "site(): the group data is a mapping"),
    ],
)
def test_a_malformed_inventory_is_a_message(
    body: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "inventory.py", body + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["validate", "inventory.py"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(REPORT_TITLE)
    assert expected in err
    assert "Traceback" not in err


def test_a_bad_site_inventory_under_pyinfra_names_the_entry(tmp_path: Path) -> None:
    _write(tmp_path / "inventory.py", "from ironserve.inventory import site\ng = site([('h1', {}, 3)])\n")
    run, _ = _pyinfra(tmp_path, "inventory.py", DEPLOY)
    assert run.returncode == 2
    assert f'{REPORT_TITLE}\n  inventory {tmp_path}/inventory.py: host entry 1: expected "name" or' in run.stderr


def test_deploy_py_still_refuses_an_inventory_built_without_site() -> None:
    data = {"ironserve_reboot_policy": "sometimes"}
    pyinfra_host = SimpleNamespace(name="h1", data=SimpleNamespace(dict=lambda: data))
    with pytest.raises(DeployError) as error:
        config_for(pyinfra_host, registry())
    assert str(error.value).startswith("invalid inventory, nothing was changed:\nhost h1: ironserve_reboot_policy: ")


def test_load_inventory_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_inventory(str(tmp_path / "missing.py"))
