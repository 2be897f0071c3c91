"""The admin's install works: `pip install CHECKOUT` with no extras, into a fresh venv, gives a working
`ironserve lock|validate|deploy|verify` run from a folder outside the checkout (issue 11, item 5).

The checkout is copied first (its tracked and untracked-but-not-ignored files, what a clean clone holds,
without this tree's build leftovers), then installed with the pip that `python -m venv` bundles, with
pip's own cache. Measured on 2 shared cores with a warm pip cache: about 60 s for the module, of which
~43 s is the venv and `pip install` (resolving against the index, building ironserve and ironserve-service),
~5 s building the host's service wheel, the rest the commands; about 80 s the first time. Nothing here
contacts a host; `-m "not slow"` leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from ironserve_service.artifacts import seal_model_dir

from ironserve.paths import REPO_ROOT
from roles import REGISTRY

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Install:
    checkout: Path  # the copy that was installed
    venv: Path
    elsewhere: Path  # the working directory of every command: outside the checkout
    env: dict[str, str]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.venv / "bin" / argv[0]), *argv[1:]],
            cwd=self.elsewhere,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run("python", "-P", "-c", code)


def _copy_checkout(target: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not in a clean checkout either
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs the git checkout (copies its files)")
    root = tmp_path_factory.mktemp("admin")
    checkout, venv, elsewhere = root / "ironserve", root / "venv", root / "site"
    _copy_checkout(checkout)
    elsewhere.mkdir()
    # Only the new venv: nothing of this test's own environment on PATH or PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    env |= {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "IRONSERVE_CACHE": str(root / "cache")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(checkout)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return Install(checkout, venv, elsewhere, env)


def test_the_test_extra_is_not_installed(install: Install) -> None:
    listed = install.run("python", "-m", "pip", "list", "--format=json")
    installed = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    assert {"ironserve", "ironserve-service", "pytest", "pytest-testinfra", "pyinfra"} <= installed.keys()
    assert not {"ruff", "mypy", "sushy-tools", "types-pyyaml"} & installed.keys()


def test_lock_prints_the_profiles_pinned_set(install: Install) -> None:
    result = install.run("ironserve", "lock", "--profile", "r740-a10")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["driver"]


def test_deploy_help(install: Install) -> None:
    result = install.run("ironserve", "deploy", "--help")
    assert result.returncode == 0, result.stderr
    assert "--deploy-file" in result.stdout


def test_the_example_inventory_validates_with_its_site_files(install: Install) -> None:
    site = install.elsewhere / "site"
    site.mkdir(exist_ok=True)
    (site / "requirements-cu118.lock").write_text("torch==2.1.2+cu118 --hash=sha256:" + "0" * 64 + "\n")
    model = site / "models/qwen2-7b/20260101-000000"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    seal_model_dir(model, datetime(2026, 1, 1, tzinfo=UTC))
    # A binary keyring's first bytes are an OpenPGP packet header (RFC 4880 4.2), not ASCII armour.
    keys = install.elsewhere / "keys"
    keys.mkdir(exist_ok=True)
    (keys / "cuda-archive-keyring.gpg").write_bytes(b"\x99\x01\x0d\x04" + bytes(64))
    # An admin's copy of the template: its relative paths (site/...) are read from its own folder.
    inventory = shutil.copy(install.checkout / "inventory" / "example_r740.py", install.elsewhere / "mysite.py")
    result = install.run("ironserve", "validate", str(inventory))
    assert result.returncode == 0, result.stdout + result.stderr
    roles = ",".join(REGISTRY.default_names)
    assert result.stdout.splitlines() == [
        f"r740-01.example.internal\tr740-a10\t{roles}",
        f"r740-02.example.internal\tr740-a10\t{roles}",
    ]


def test_importing_the_cli_and_roles_loads_neither_the_lab_nor_pytest(install: Install) -> None:
    result = install.python(
        "import json, sys, roles, ironserve.cli\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {'pytest', '_pytest', 'testinfra'}"
        " or m.startswith('ironserve_lab'))))"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    lab = install.run("ironserve", "lab", "status")
    assert lab.returncode == 2
    assert "development install" in lab.stderr


def test_deploy_file_gate_and_service_sources_are_found_from_the_install(install: Install) -> None:
    result = install.python(
        "import json, ironserve.cli, ironserve.verify\n"
        "from roles.inference.render import service_source\n"
        "print(json.dumps([ironserve.cli.deploy_file(None), str(ironserve.verify.ACCEPTANCE_DIR),"
        " str(service_source())]))"
    )
    assert result.returncode == 0, result.stderr
    deploy, gate, service = json.loads(result.stdout)
    assert deploy == str(install.checkout / "deploy.py")
    assert service == str(install.checkout / "service")
    assert Path(gate).is_relative_to(install.venv)
    shipped = sorted(p.name for p in Path(gate).glob("test_*.py"))
    assert shipped == sorted(p.name for p in (install.checkout / "ironserve" / "acceptance").glob("test_*.py"))
    assert {name.removeprefix("test_").removesuffix(".py") for name in shipped} <= {r.name for r in REGISTRY.roles}
    # The gate collects from the install, its `invariant` marker registered by ironserve's pytest plugin.
    collected = install.run("python", "-P", "-m", "pytest", "--collect-only", "-q", "--strict-markers", gate)
    assert collected.returncode == 0, collected.stdout + collected.stderr


def test_the_hosts_service_wheel_builds_from_the_install(install: Install) -> None:
    result = install.python("from roles.inference.render import service_wheel; print(service_wheel()[0])")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).name.startswith("ironserve_service-0.1.0-")
