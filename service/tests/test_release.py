"""The release gate's checks, each passing and then broken on real inputs of this machine.

Real files, sockets, processes, the group database and a real exporter; the engine-facing items (health,
canary) are broken here with an unreachable port, and proven passing on real vLLM in test_hot_swap, which
also shows a failed check refusing a swap. GPU items: this machine has none, so they are shown failing
when a GPU is required and skipping, with the reason, when settings say there is none.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import start_http_server

from ironserve_service import exporter, release
from ironserve_service.cli import main
from ironserve_service.exporter import GpuReading
from ironserve_service.launcher import ENGINE_MODULE
from ironserve_service.settings import EngineSettings, ExporterSettings, ServiceSettings, SwapSettings

pytestmark = pytest.mark.invariant("rel-checklist-gate")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def candidate(tmp_path: Path, **release_settings: Any) -> release.Candidate:
    settings = ServiceSettings(
        engine=EngineSettings(model_dir=Path("/m"), engine_python=Path(sys.executable)),
        exporter=ExporterSettings(port=free_port()),
        swap=SwapSettings(
            router_dir=tmp_path / "envoy", blue_port=free_port(), green_port=free_port(), listen_port=free_port()
        ),
        release={"require_gpu": False, "runtime_storage": str(tmp_path), **release_settings},
    )
    return release.Candidate(settings, "green")


@pytest.mark.invariant("release-check-01")
def test_gpu_memory_counts_what_stays_after_the_retiring_colour_stops(tmp_path: Path) -> None:
    gib = 1 << 30
    # Two A10s (24 GiB) during a swap: each colour's engine holds 9.9 GiB of each GPU.
    readings = [GpuReading(i, 20 * gib, 24 * gib, 50.0, {101: 10 * gib, 202: 10 * gib}) for i in (0, 1)]
    assert release.gpu_shares(readings, frozenset()) == {"gpu0": 20 / 24, "gpu1": 20 / 24}
    assert release.gpu_shares(readings, frozenset({101})) == {"gpu0": 10 / 24, "gpu1": 10 / 24}
    required = release.gpu_memory(candidate(tmp_path, require_gpu=True))
    assert not required.ok and required.observed == "NVML unusable or no GPU found"
    skipped = release.gpu_memory(candidate(tmp_path))
    assert skipped.ok and "require_gpu is false" in skipped.skipped


def test_gpu_memory_fails_for_an_expected_gpu_nvml_could_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 1 << 30
    # read_gpus skips a GPU it cannot read (off the bus); the host's two expected GPUs (gpu_health.expected_gpus).
    monkeypatch.setattr(release, "read_gpus", lambda max_gpus: [GpuReading(0, 2 * gib, 24 * gib, 0.0, {})])
    result = release.gpu_memory(candidate(tmp_path, require_gpu=True))
    assert not result.ok and result.observed == "gpu0 8.3%, gpu1 not read"


@pytest.mark.invariant("release-check-02", "io-runtime-disk-free")
def test_runtime_storage_free_share(tmp_path: Path) -> None:
    share = release.free_ratio(tmp_path)
    assert 0 < share < 1
    assert release.runtime_storage(candidate(tmp_path)).ok
    refused = release.runtime_storage(candidate(tmp_path, runtime_min_free_ratio=min(0.99, share + 0.01)))
    assert not refused.ok and refused.observed.startswith(f"{tmp_path}: ") and refused.observed.endswith("% free")
    absent = release.runtime_storage(candidate(tmp_path, runtime_storage=str(tmp_path / "containerd")))
    assert not absent.ok and "No such file" in absent.observed
    unset = release.runtime_storage(candidate(tmp_path, runtime_storage=None))
    assert unset.ok and unset.skipped


@pytest.mark.invariant("release-check-03", "release-check-12")
def test_health_and_canary_fail_on_an_engine_that_does_not_answer(tmp_path: Path) -> None:
    unreachable = candidate(tmp_path)
    health, canary = release.health(unreachable), release.canary(unreachable)
    assert not health.ok and "unreachable" in health.observed
    assert not canary.ok and "unreachable" in canary.observed


@pytest.mark.invariant("release-check-04")
def test_metrics_come_from_the_running_exporter(tmp_path: Path) -> None:
    checked = candidate(tmp_path)
    assert not release.metrics(checked).ok  # nothing listens yet
    server, _ = start_http_server(checked.settings.exporter.port, addr="127.0.0.1",
                                  registry=exporter.build_registry(checked.settings))  # fmt: skip
    try:
        assert release.metrics(checked).ok
        gpu_host = checked.settings.release.model_copy(update={"require_gpu": True})
        missing = release.metrics(release.Candidate(checked.settings.model_copy(update={"release": gpu_host}), "green"))
        assert not missing.ok and missing.observed == "missing gpu_utilization_percent"  # NVML answers nothing here
    finally:
        server.shutdown()


@pytest.fixture
def engine_lookalikes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.invariant("release-check-05")
def test_exactly_one_engine_process_on_the_candidate_port(
    tmp_path: Path, engine_lookalikes: list[subprocess.Popen[bytes]]
) -> None:
    checked = candidate(tmp_path)
    port = checked.settings.swap.port("green")
    assert release.one_process(checked).observed == "0 (none)"

    def start() -> None:
        # argv as the launcher builds it: python -c <sleep> -m vllm... --port N (sys.argv of the sleeper).
        command = [sys.executable, "-c", "import time; time.sleep(60)", "-m", ENGINE_MODULE, "--port", str(port)]
        engine_lookalikes.append(subprocess.Popen(command))

    start()
    deadline = time.monotonic() + 10
    while not release.one_process(checked).ok and time.monotonic() < deadline:
        time.sleep(0.05)
    assert release.one_process(checked).ok
    start()
    time.sleep(0.2)
    two = release.one_process(checked)
    assert not two.ok and two.observed.startswith("2 (")


@pytest.mark.invariant("release-check-06")
def test_connections_counted_on_the_listener_and_engine_ports(tmp_path: Path) -> None:
    checked = candidate(tmp_path, max_connections=3)
    with socket.create_server(("127.0.0.1", checked.settings.swap.listen_port)) as server:
        clients = [socket.create_connection(("127.0.0.1", checked.settings.swap.listen_port)) for _ in range(3)]
        accepted = [server.accept()[0] for _ in clients]
        try:
            assert release.open_connections(checked.settings.swap.listen_port) == 3
            refused = release.connections(checked)
            assert not refused.ok and refused.observed.startswith(f"listener :{checked.settings.swap.listen_port} 3")
            allowed = checked.settings.model_copy(update={"release": checked.settings.release.model_copy(
                update={"max_connections": 4})})  # fmt: skip
            assert release.connections(release.Candidate(allowed, "green")).ok
            # Closed by the server first, then by the clients: the server's side waits in TIME_WAIT, which
            # `ss` still lists and no process holds open (as after every HTTP/1.1 client that does not keep alive).
            for sock in [*accepted, *clients]:
                sock.close()
            time.sleep(0.2)
            port = checked.settings.swap.listen_port
            waiting = subprocess.run(["ss", "-Htn", "state", "time-wait", f"sport = :{port}"],
                                     capture_output=True, text=True).stdout  # fmt: skip
            assert len(waiting.splitlines()) == 3 and release.open_connections(port) == 0
        finally:
            for sock in [*clients, *accepted]:
                sock.close()


@pytest.mark.invariant("release-check-07", "cri-runtime-journal-clean")
def test_runtime_journal_lines_naming_an_error(tmp_path: Path) -> None:
    # Lines as containerd writes them to the journal (logrus text format, as `journalctl -o cat` prints them).
    lines = [
        'time="2026-11-30T10:00:01.000000000Z" level=info msg="containerd successfully booted in 0.05s"',
        'time="2026-11-30T10:00:02.000000000Z" level=error msg="failed to load cni during init"',
    ]
    assert release.error_lines(lines) == lines[1:]
    unset = release.runtime_journal(candidate(tmp_path, runtime_unit=None))
    assert unset.ok and "runtime_unit is unset" in unset.skipped


@pytest.mark.invariant("release-check-08", "net-ip-local-port-range")
def test_port_range_read_as_the_kernel_prints_it(tmp_path: Path) -> None:
    proc_file = tmp_path / "ip_local_port_range"
    proc_file.write_text("32768\t60999\n")  # the kernel separates the two numbers with a tab
    assert release.port_range(candidate(tmp_path), proc_file).ok
    proc_file.write_text("40000\t40100\n")
    narrowed = release.port_range(candidate(tmp_path), proc_file)
    assert not narrowed.ok and narrowed.observed == "40000 40100"


@pytest.mark.invariant("release-check-09", "sec-ai-runner-group")
def test_service_group_exists_once(tmp_path: Path) -> None:
    assert release.service_group(candidate(tmp_path, service_group="root")).observed == "1 entries (gid 0)"
    missing = release.service_group(candidate(tmp_path, service_group="no-such-group"))
    assert not missing.ok and missing.observed == "0 entries"


@pytest.mark.invariant("release-check-10", "release-check-11")
def test_gpu_items_fail_without_a_gpu_unless_settings_say_there_is_none(tmp_path: Path) -> None:
    nodes = release.device_nodes(candidate(tmp_path, require_gpu=True, device_nodes=["/dev/null", "/dev/nvidia0"]))
    assert not nodes.ok and nodes.observed == "missing /dev/nvidia0"
    assert release.device_nodes(candidate(tmp_path, require_gpu=True, device_nodes=["/dev/null"])).ok
    not_char = tmp_path / "nvidiactl"
    not_char.write_text("")
    assert not release.device_nodes(candidate(tmp_path, require_gpu=True, device_nodes=[str(not_char)])).ok
    # This interpreter has no torch: the check reports Python's own error.
    torch = release.cuda_in_torch(candidate(tmp_path, require_gpu=True))
    assert not torch.ok and "No module named 'torch'" in torch.observed
    for check in (release.device_nodes, release.cuda_in_torch):
        skipped = check(candidate(tmp_path))
        assert skipped.ok and skipped.skipped == "release.require_gpu is false: this host has no GPU"


def test_process_tree_holds_the_launcher_and_its_descendants(tmp_path: Path) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(release.process_tree(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = release.process_tree(parent.pid)
        assert parent.pid in tree and len(tree) == 3
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()


def test_release_check_prints_every_result_and_names_each_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checked = candidate(tmp_path, service_group="no-such-group", runtime_unit=None)
    config = tmp_path / "service.yaml"
    config.write_text(json.dumps(checked.settings.model_dump(mode="json")))
    assert main(["release-check", "--colour", "green", "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [c["item"] for c in report["checks"]] == list(range(1, 13)) and report["ok"] is False
    failed = {c["name"] for c in report["checks"] if not c["ok"]}
    assert failed == {"health", "metrics", "one-process", "service-group", "canary"}
    assert "09 service-group: 0 entries (expected exactly one group no-such-group)" in err
    # Without --colour, the colour served: none here.
    assert main(["release-check", "--config", str(config)]) == 2
