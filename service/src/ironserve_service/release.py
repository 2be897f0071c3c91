"""The release gate: the source documents' 12-item canary checklist as named checks on one candidate colour.

`ironserve-service release-check` runs it on the colour being served; `swap` runs it on the new colour after
its readiness check and before the etcd write, so a failed check leaves traffic where it was. Each result
carries what was observed. Where an item of the checklist is wrong as written, the check follows the
catalog's correction: containerd instead of docker, HTTP 200 from vLLM's /health (its body is empty), the
exporter's port for GPU metrics, `pgrep -fc`-style counting of the vLLM entrypoint, the chat API instead
of `/infer`. GPU-only items skip, with the reason, only where settings say the host has no GPU.
"""

from __future__ import annotations

import grp
import itertools
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ironserve_service.exporter import GpuReading, read_gpus
from ironserve_service.health import ProbeResult, check_engine, http_json
from ironserve_service.launcher import ENGINE_MODULE
from ironserve_service.settings import Colour, ServiceSettings

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
# The state column of /proc/net/tcp (include/net/tcp_states.h): ESTABLISHED and CLOSE_WAIT are connections a
# process holds open (what `lsof -i` lists); TIME_WAIT and the other closing states are the kernel's
# bookkeeping after a close, thousands of them on a busy listener whose clients do not keep connections alive.
TCP_OPEN_STATES = frozenset({"01", "08"})


@dataclass(frozen=True)
class CheckResult:
    item: int
    name: str
    ok: bool
    observed: str
    expected: str
    # Why the check did not run (ok stays True): only the GPU items, on a host configured without a GPU.
    skipped: str = ""


@dataclass(frozen=True)
class Candidate:
    """The colour under test; `retiring_pids`: the processes that stop after a swap (their GPU memory is freed)."""

    settings: ServiceSettings
    colour: Colour
    retiring_pids: frozenset[int] = frozenset()

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.engine.host}:{self.settings.swap.port(self.colour)}"


def _result(item: int, name: str, ok: bool, observed: str, expected: str) -> CheckResult:
    return CheckResult(item, name, ok, observed, expected)


def gpu_memory(candidate: Candidate) -> CheckResult:
    limit = candidate.settings.release.gpu_memory_max_ratio
    expected = f"each GPU below {limit:.0%} used, the retiring colour's processes not counted"
    skipped = _gpu_skip(candidate, 1, "gpu-memory", expected)
    if skipped:
        return skipped
    readings = read_gpus(candidate.settings.exporter.max_gpus)
    if not readings:
        return _result(1, "gpu-memory", False, "NVML unusable or no GPU found", expected)
    shares = gpu_shares(readings, candidate.retiring_pids)
    # A GPU the host should have that NVML could not read (off the bus, or fewer enumerated) is no GPU to release on.
    read = {gpu.index for gpu in readings}
    unread = [f"gpu{i} not read" for i in range(candidate.settings.gpu_health.expected_gpus) if i not in read]
    observed = ", ".join([*(f"{device} {share:.1%}" for device, share in shares.items()), *unread])
    ok = not unread and all(share < limit for share in shares.values())
    return _result(1, "gpu-memory", ok, observed, expected)


def gpu_shares(readings: Iterable[GpuReading], retiring_pids: frozenset[int]) -> dict[str, float]:
    """Used share of each GPU once the retiring processes are gone (both colours share the GPUs in a swap)."""
    shares = {}
    for gpu in readings:
        retiring = sum(used for pid, used in gpu.process_bytes.items() if pid in retiring_pids)
        shares[f"gpu{gpu.index}"] = (gpu.used_bytes - retiring) / gpu.total_bytes
    return shares


def free_ratio(path: Path) -> float:
    """Free share as df reports it: available / (used + available); root's reserved blocks count as neither."""
    stats = os.statvfs(path)
    used = stats.f_blocks - stats.f_bfree
    return stats.f_bavail / (used + stats.f_bavail) if used + stats.f_bavail else 0.0


def runtime_storage(candidate: Candidate) -> CheckResult:
    release = candidate.settings.release
    expected = f"more than {release.runtime_min_free_ratio:.0%} free"
    if release.runtime_storage is None:
        return CheckResult(2, "runtime-storage", True, "", expected, "release.runtime_storage is unset: no runtime")
    try:
        ratio = free_ratio(release.runtime_storage)
    except OSError as error:
        return _result(2, "runtime-storage", False, f"{release.runtime_storage}: {error.strerror}", expected)
    observed = f"{release.runtime_storage}: {ratio:.1%} free"
    return _result(2, "runtime-storage", ratio > release.runtime_min_free_ratio, observed, expected)


def health(candidate: Candidate) -> CheckResult:
    try:
        status, _ = http_json(f"{candidate.base_url}/health", candidate.settings.readiness.probe_timeout_s)
        observed = f"/health answered {status}"
    except OSError as error:
        status, observed = 0, f"/health unreachable: {error}"
    return _result(3, "health", status == 200, observed, "HTTP 200 from the candidate's /health")


def exporter_text(candidate: Candidate) -> str:
    exporter = candidate.settings.exporter
    with urllib.request.urlopen(f"http://{exporter.host}:{exporter.port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def metrics(candidate: Candidate) -> CheckResult:
    wanted = ["ironserve_vllm_up", "gpu_nvml_available"]
    if candidate.settings.release.require_gpu:
        wanted.append("gpu_utilization_percent{")
    expected = "the exporter serves " + ", ".join(name.rstrip("{") for name in wanted)
    try:
        text = exporter_text(candidate)
    except OSError as error:
        return _result(4, "metrics", False, f"exporter unreachable: {error}", expected)
    missing = [name.rstrip("{") for name in wanted if f"\n{name}" not in f"\n{text}"]
    observed = f"missing {', '.join(missing)}" if missing else "all present"
    return _result(4, "metrics", not missing, observed, expected)


def engine_processes(port: int, proc: Path = Path("/proc")) -> list[int]:
    """PIDs whose command line runs vLLM's API server on this port (what `pgrep -f` would match, minus pgrep)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # the process ended while we looked
        words = [word.decode(errors="replace") for word in argv]
        if ENGINE_MODULE in words and any(a == "--port" and b == str(port) for a, b in itertools.pairwise(words)):
            found.append(int(entry.name))
    return found


def one_process(candidate: Candidate) -> CheckResult:
    port = candidate.settings.swap.port(candidate.colour)
    pids = engine_processes(port)
    expected = f"exactly one {ENGINE_MODULE} on port {port}"
    return _result(5, "one-process", len(pids) == 1, f"{len(pids)} ({', '.join(map(str, pids)) or 'none'})", expected)


def open_connections(port: int, tables: Iterable[Path] = TCP_TABLES) -> int:
    """Open TCP connections with this local port, IPv4 and IPv6 (what `lsof -i :PORT` lists, less the listener)."""
    count = 0
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 on this host
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in TCP_OPEN_STATES:
                count += 1
    return count


def connections(candidate: Candidate) -> CheckResult:
    limit = candidate.settings.release.max_connections
    swap = candidate.settings.swap
    counted = [(name, port, open_connections(port))
               for name, port in (("listener", swap.listen_port), ("engine", swap.port(candidate.colour)))]  # fmt: skip
    observed = ", ".join(f"{name} :{port} {count}" for name, port, count in counted)
    return _result(6, "connections", all(count < limit for *_, count in counted), observed, f"fewer than {limit} each")


def error_lines(lines: Iterable[str]) -> list[str]:
    """The seed's `grep -i error`: any line naming an error, whatever its priority."""
    return [line for line in lines if "error" in line.lower()]


def runtime_journal(candidate: Candidate) -> CheckResult:
    release = candidate.settings.release
    expected = f"no 'error' in the last {release.journal_lines} lines"
    if release.runtime_unit is None:
        return CheckResult(7, "runtime-journal", True, "", expected, "release.runtime_unit is unset: no runtime")
    if shutil.which("journalctl") is None:
        return _result(7, "runtime-journal", False, "journalctl not found", expected)
    command = ["journalctl", "--unit", release.runtime_unit, "--no-pager", "--output", "cat",
               "--lines", str(release.journal_lines)]  # fmt: skip
    lines = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30).stdout.splitlines()
    errors = error_lines(lines)
    observed = f"{len(errors)} of {len(lines)} lines: {errors[-1][:200]}" if errors else f"0 of {len(lines)} lines"
    return _result(7, "runtime-journal", not errors, f"{release.runtime_unit}: {observed}", expected)


def port_range(candidate: Candidate, path: Path = PORT_RANGE_FILE) -> CheckResult:
    wanted = candidate.settings.release.port_range
    try:
        observed = " ".join(path.read_text().split())
    except OSError as error:
        observed = f"{path}: {error.strerror}"
    return _result(8, "port-range", observed == wanted, observed, wanted)


def service_group(candidate: Candidate) -> CheckResult:
    name = candidate.settings.release.service_group
    entries = subprocess.run(["getent", "group", name], capture_output=True, text=True, check=False).stdout
    count = len(entries.splitlines())
    observed = f"{count} entries"
    if count == 1:
        observed += f" (gid {grp.getgrnam(name).gr_gid})"
    return _result(9, "service-group", count == 1, observed, f"exactly one group {name}")


def _gpu_skip(candidate: Candidate, item: int, name: str, expected: str) -> CheckResult | None:
    if candidate.settings.release.require_gpu:
        return None
    return CheckResult(item, name, True, "", expected, "release.require_gpu is false: this host has no GPU")


def device_nodes(candidate: Candidate) -> CheckResult:
    nodes = candidate.settings.release.device_nodes
    expected = "character devices " + ", ".join(map(str, nodes))
    skipped = _gpu_skip(candidate, 10, "device-nodes", expected)
    if skipped:
        return skipped
    missing = [str(node) for node in nodes if not node.is_char_device()]
    return _result(10, "device-nodes", not missing, f"missing {', '.join(missing)}" if missing else "all present",
                   expected)  # fmt: skip


def cuda_in_torch(candidate: Candidate) -> CheckResult:
    expected = "torch.cuda.is_available() is True in the engine's Python"
    skipped = _gpu_skip(candidate, 11, "cuda-torch", expected)
    if skipped:
        return skipped
    python = str(candidate.settings.engine.engine_python or "python3")
    command = [python, "-c", "import torch; print(torch.cuda.is_available())"]
    try:
        answer = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
        observed = answer.stdout.strip() or answer.stderr.strip()[-200:]
    except (OSError, subprocess.TimeoutExpired) as error:
        observed = str(error)
    return _result(11, "cuda-torch", observed == "True", observed, expected)


def canary(candidate: Candidate) -> CheckResult:
    engine = candidate.settings.engine.model_copy(update={"port": candidate.settings.swap.port(candidate.colour)})
    probe: ProbeResult = check_engine(engine, candidate.settings.readiness.probe_timeout_s)
    return _result(12, "canary", probe.ok, probe.reason, "a chat completion answered by the candidate")


CHECKS: tuple[Callable[[Candidate], CheckResult], ...] = (
    gpu_memory, runtime_storage, health, metrics, one_process, connections,
    runtime_journal, port_range, service_group, device_nodes, cuda_in_torch, canary,
)  # fmt: skip


def process_tree(pid: int, proc: Path = Path("/proc")) -> frozenset[int]:
    """pid and all its descendants (the launcher, vLLM's API server and its engine-core workers)."""
    found, pending = set(), [pid]
    while pending:
        current = pending.pop()
        found.add(current)
        for children in (proc / str(current) / "task").glob("*/children"):
            try:
                pending.extend(int(child) for child in children.read_text().split())
            except OSError:
                continue  # the task ended while we looked
    return frozenset(found)


def run_checks(candidate: Candidate) -> list[CheckResult]:
    return [check(candidate) for check in CHECKS]


def failed(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [result for result in results if not result.ok]


def summary(results: Iterable[CheckResult]) -> str:
    """One line naming every failed check with what it observed."""
    return "; ".join(f"{r.item:02d} {r.name}: {r.observed} (expected {r.expected})" for r in failed(results))


def report_json(results: Iterable[CheckResult]) -> str:
    rows = list(results)
    return json.dumps({"ok": not failed(rows), "checks": [asdict(r) for r in rows]}, indent=1)
