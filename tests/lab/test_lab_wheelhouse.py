"""A lab container host installs from the lab pip index (lab/src/ironserve_lab/wheelhouse.py) with --require-hashes.

The host gets the index at attach, like the apt mirror; it creates a venv with Debian 12's python3.11 and
installs a few of the engine lock's pins (PyYAML, pydantic and what pydantic imports) from it, with the
lock's hashes, as roles/inference installs the whole lock. The full lock (about 1 GB of wheels) is not
installed here: too slow for every run.
"""

from __future__ import annotations

import shlex
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from ironserve_lab import inventory, remote, wheelhouse
from ironserve_lab.state import LabHost
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
SUBSET = ("pyyaml", "pydantic", "pydantic-core", "annotated-types", "typing-extensions", "typing-inspection")
VENV = "/opt/ironserve-lab-venv"


@pytest.fixture(scope="module")
def host() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        remote.run(
            hosts[0],
            "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null",
            timeout=600,
        )
        remote.run(hosts[0], f"python3 -m venv {VENV}")
        yield hosts[0]


def _inventory_data(host: LabHost) -> dict[str, Any]:
    containers, _ = inventory.lab_groups()
    return next(data for name, data in containers if name == host.name)


def _install(host: LabHost, lines: list[str], *options: str) -> str:
    requirements = shlex.quote("\n".join(lines) + "\n")
    index = _inventory_data(host)["inference_pip_index_url"]
    # Plain HTTP: pip ignores the index unless its host is trusted; the lock's hashes vouch for every file.
    options += ("--trusted-host", str(urllib.parse.urlsplit(index).hostname))
    command = f"printf %s {requirements} > /tmp/req.txt && {VENV}/bin/pip install --no-cache-dir --require-hashes "
    command += f"--no-deps --disable-pip-version-check {' '.join(options)} --index-url {index} -r /tmp/req.txt 2>&1"
    return remote.run(host, command, timeout=300)


def test_the_lab_inventory_points_the_host_at_its_pip_index(host: LabHost) -> None:
    url = host.extra["pip_index_url"]
    assert url.startswith("http://10.213.0.1:")
    assert _inventory_data(host)["inference_pip_index_url"] == url + "/simple/"
    assert wheelhouse.running(int(host.extra["pip_index_pid"]))


def test_host_installs_locked_wheels_from_the_lab_index_with_their_hashes(host: LabHost) -> None:
    pins = {wheelhouse.normalize(p.name): p for p in wheelhouse.parse_lock(wheelhouse.LOCK.read_text())}
    _install(host, [pins[name].line() for name in SUBSET])
    out = remote.run(host, f"{VENV}/bin/python -c 'import yaml, pydantic; print(yaml.__version__, pydantic.VERSION)'")
    assert out.split() == [pins["pyyaml"].version, pins["pydantic"].version]


def test_a_wheel_whose_hash_is_not_the_locked_one_is_refused(host: LabHost) -> None:
    pyyaml = next(p for p in wheelhouse.parse_lock(wheelhouse.LOCK.read_text()) if p.name == "PyYAML")
    with pytest.raises(RuntimeError, match="DO NOT MATCH THE HASHES"):
        _install(host, [f"PyYAML=={pyyaml.version} --hash=sha256:{'0' * 64}"], "--force-reinstall")
