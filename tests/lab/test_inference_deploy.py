"""roles/inference on a real lab container host: the whole service deployed, served through Envoy, gated,
re-run without changes, drift put back, and a version change deployed as a hot swap under load.

Simulated at the edge: the host has no GPU, so the engine is vLLM's CPU build (files/inference/
requirements-cpu.lock, served by the lab's pip index) and the model a tiny Qwen2-architecture one with
random weights (lab/src/ironserve_lab/inference.py). Everything else is the real thing: Debian's etcd and
Prometheus, Envoy, systemd units as ai-runner in the service slice under the seccomp filter.
"""

from __future__ import annotations

import functools
import json
import posixpath
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ironserve.owned import backup_path
from ironserve.validators import release_version
from ironserve_lab import remote
from ironserve_lab.demo import api_key, chat_completion, listener_url
from ironserve_lab.deploying import DeployResult, deploy, verify
from ironserve_lab.inference import ENGINE_ENVIRONMENT, inventory_data, model_versions
from ironserve_lab.state import LabHost
from roles import stack_config
from roles.inference import PORTS_SYSCTL_FILE, UNIT_DIR
from roles.inference.operations import model_version_dir, parse_port_list
from roles.inference.render_kubernetes import host_settings
from roles.inference.settings import CONFIG_PATH
from tests.lab.conftest import lab_containers

ROLES = ("security", "inference")
ROUTER_UNIT = f"{UNIT_DIR}/ironserve-router.service"
pytestmark = pytest.mark.lab
SETTINGS = stack_config("lab", {}).inference
V2_INVENTORY = """\
from ironserve_lab.inventory import lab_groups

lab_containers, lab_vms = lab_groups()
for _, data in lab_containers:
    data["inference_model_source"] = {source!r}
"""
# The other lab version, with the drained colour kept running (the lab's own overrides kept).
KEEP_WARM_INVENTORY = """\
from ironserve_lab.inventory import lab_groups

lab_containers, lab_vms = lab_groups()
for _, data in lab_containers:
    data["inference_model_source"] = {source!r}
    service = data["inference_service"]
    data["inference_service"] = {{**service, "swap": {{**service["swap"], "keep_previous": True}}}}
"""


def complete(
    host: LabHost, stream: bool = False, timeout_s: float = 120, key: str | None = None
) -> tuple[int, str, str]:
    """(status, colour that served it, body) of one chat completion through the host's Envoy, as the demo asks."""
    url, model = _listener(host.name)
    return chat_completion(url, key or KEYS[host.name], model, stream=stream, timeout_s=timeout_s)


@functools.cache
def _listener(name: str) -> tuple[str, str]:
    return listener_url(name)


def _status(host: LabHost) -> dict[str, Any]:
    return json.loads(remote.run(host, f"{SETTINGS.venv}/bin/ironserve-service status; true").splitlines()[-1])


KEYS: dict[str, str] = {}  # host name -> its first API key, read after the first deploy


def _deployed(result: DeployResult) -> DeployResult:
    assert result.returncode == 0, result.output[-6000:]
    return result


@pytest.fixture(scope="module")
def served() -> Iterator[LabHost]:
    with lab_containers(1) as hosts:
        started = time.monotonic()
        first = _deployed(deploy(hosts, roles=ROLES))
        print(f"first deploy of {ROLES}: {time.monotonic() - started:.1f} s, {first.changed} changes")
        assert first.changed > 0
        KEYS[hosts[0].name] = api_key(hosts[0])
        yield hosts[0]


def test_second_deploy_reports_zero_changes(served: LabHost) -> None:
    again = _deployed(deploy([served], roles=ROLES))
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]


def test_an_environment_value_with_spaces_and_quotes_reaches_the_engine_as_written(served: LabHost) -> None:
    status = _status(served)
    unit = f"ai-service@{status['colour']}.service"
    pid = remote.run(served, f"systemctl show --property=MainPID --value {unit}").strip()
    environ = remote.run(served, f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines()
    assert f"IRONSERVE_LAB_NOTE={ENGINE_ENVIRONMENT['IRONSERVE_LAB_NOTE']}" in environ


@pytest.mark.invariant("svc-engine-vllm", "hot-swap-envoy-follows-etcd")
@pytest.mark.parametrize("stream", [False, True])
def test_completion_through_envoy_from_outside_the_host(served: LabHost, stream: bool) -> None:
    assert complete(served, stream=stream, key="x" * 43)[0] == 401  # a key the host does not know
    status, colour, body = complete(served, stream=stream)
    assert status == 200, body
    assert colour in {"blue", "green"}
    assert body.rstrip().endswith("data: [DONE]") if stream else json.loads(body)["usage"]["completion_tokens"] >= 1


def test_the_demos_last_step_prints_a_served_completion_and_no_key(served: LabHost) -> None:
    """`make demo`'s last step as scripts/demo.sh runs it: a 200 with the colour and usage, and the key it read
    from the host nowhere in what it prints."""
    demo = subprocess.run(
        [sys.executable, "-m", "ironserve_lab.demo", served.name], capture_output=True, text=True, timeout=180
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.splitlines()
    assert lines[0].endswith("/v1/chat/completions: HTTP 200"), demo.stdout
    assert lines[1] in {"served by colour: blue", "served by colour: green"}, demo.stdout
    assert lines[2].startswith("usage: prompt_tokens ") and "completion_tokens " in lines[2], demo.stdout
    assert KEYS[served.name] not in demo.stdout + demo.stderr


def test_acceptance_gate_passes(served: LabHost) -> None:
    result = verify([served], roles=ROLES)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_drift_is_put_back_then_zero_changes(served: LabHost) -> None:
    venv = SETTINGS.venv
    remote.run(
        served,
        f"systemctl stop ironserve-router.service; {venv}/bin/pip uninstall --yes --quiet gguf; "
        "echo '# edited by hand' >> /etc/systemd/system/ai-service@.service; "
        "sed -i 's/drain_idle_s: 10.0/drain_idle_s: 1.0/' /etc/ironserve/service.yaml",
    )
    restored = _deployed(deploy([served], roles=ROLES))
    assert restored.changed >= 4, restored.output[-6000:]
    assert remote.run(served, "systemctl is-active ironserve-router.service").strip() == "active"
    assert "gguf" in remote.run(served, f"{venv}/bin/pip list --format=freeze")
    assert "edited by hand" not in remote.run(served, "cat /etc/systemd/system/ai-service@.service")
    again = _deployed(deploy([served], roles=ROLES))
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]
    assert complete(served)[0] == 200


def test_damaged_weights_unreserved_ports_an_etcd_drop_in_and_an_open_unit_are_named_then_restored_in_one_deploy(
    served: LabHost,
) -> None:
    """One round of four drifts, as an admin makes them: a file of the served version truncated, the service's
    ports no longer reserved (live value emptied and the sysctl.d file deleted), a `systemctl edit`-style drop-in
    on etcd.service, the router's unit another user's and world-writable. The gate names each; one deploy restores
    all four, checked on the host; the next deploy
    changes nothing; the gate passes."""
    config = stack_config("lab", inventory_data())  # the default inventory's version: the one this test deploys
    source = config.inference.model_source
    assert source is not None
    damaged = "config.json"
    served_file = f"{model_version_dir(str(host_settings(config).swap.models_root), config.inference.version())}/"
    served_file += damaged
    override = "/etc/systemd/system/etcd.service.d/override.conf"
    wanted = {listener.port for listener in config.inference.listeners() if listener.reserved}
    sealed = remote.run(served, f"sha256sum {shlex.quote(served_file)}").split()[0]
    started = time.monotonic()
    remote.run(
        served,
        f"truncate -s 100 {shlex.quote(served_file)} && "
        f"sysctl -qw net.ipv4.ip_local_reserved_ports= && rm {PORTS_SYSCTL_FILE} && "
        f"mkdir -p {posixpath.dirname(override)} && "
        f"printf '[Service]\\nEnvironment=IRONSERVE_DRIFT=admin-override\\n' > {override} && "
        f"systemctl daemon-reload && chown nobody {ROUTER_UNIT} && chmod 0666 {ROUTER_UNIT}",
    )
    assert "IRONSERVE_DRIFT=admin-override" in remote.run(served, "systemctl show -p Environment --value etcd.service")

    gate = verify([served], "-q", "-rfE", roles=ROLES)
    failed = [line for line in gate.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    print("gate with the drifts:", *failed, sep="\n  ")
    assert gate.returncode != 0
    for test in (
        "test_the_served_versions_files_match_its_sealed_manifest",
        "test_the_services_ports_are_reserved_from_ephemeral_use",
        "test_no_admin_drop_in_overrides_a_service_unit",
        "test_files_deciding_what_runs_as_root_are_root_only",
    ):
        assert any(test in line and served.name in line for line in failed), (test, failed, gate.stdout[-4000:])
    assert any("drop_in" in line and "etcd.service" in line for line in failed), failed

    restored = _deployed(deploy([served], roles=ROLES))
    assert override in restored.output, restored.output[-6000:]  # the deploy names what it moved aside
    assert remote.run(served, f"sha256sum {shlex.quote(served_file)}").split()[0] == sealed
    in_force = parse_port_list(remote.run(served, "cat /proc/sys/net/ipv4/ip_local_reserved_ports"))
    assert sorted(wanted - in_force) == [], in_force
    assert remote.run(served, f"[ -f {PORTS_SYSCTL_FILE} ] && echo present").strip() == "present"
    assert remote.run(served, f"[ -e {override} ] || echo gone; cat {backup_path(override)}").startswith(
        "gone\n[Service]"
    )
    shown = remote.run(served, "systemctl show -p DropInPaths,Environment etcd.service")
    assert override not in shown and "IRONSERVE_DRIFT" not in shown, shown
    assert remote.run(served, "systemctl is-active etcd.service").strip() == "active"
    assert remote.run(served, f"stat -c %U:%G:%a {ROUTER_UNIT}").strip() == "root:root:644"

    again = _deployed(deploy([served], roles=ROLES))
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]
    after = verify([served], "-q", "-rfE", roles=ROLES)
    assert after.returncode == 0, after.stdout[-6000:] + after.stderr[-2000:]
    assert complete(served)[0] == 200
    print(f"four drifts named, restored, re-deployed and gated: {time.monotonic() - started:.1f} s")


def test_a_sigkilled_engine_is_restarted_by_its_unit(served: LabHost) -> None:
    """The active colour's launcher killed with SIGKILL: Envoy answers 503 at once (no hang) until systemd's
    Restart=on-failure has the same colour ready again; no deploy and no swap needed. Prints the outage."""
    status = _status(served)
    unit = f"ai-service@{status['colour']}.service"
    remote.run(served, f"kill -KILL $(systemctl show --property=MainPID --value {unit})")
    killed = time.monotonic()
    answers: list[int] = []
    while time.monotonic() - killed < 400:
        code, colour, _ = complete(served, timeout_s=30)
        answers.append(code)
        if code == 200:
            break
        time.sleep(0.5)
    outage, refused = time.monotonic() - killed, answers[:-1]
    print(f"SIGKILL of {unit}: {len(refused)} requests refused {sorted(set(refused))}, back in {outage:.1f} s")
    assert answers[-1] == 200 and colour == status["colour"]
    assert set(refused) <= {503}
    assert int(remote.run(served, f"systemctl show --property=NRestarts --value {unit}")) >= 1


@pytest.mark.invariant("hot-swap-load-atomicity", "hot-swap-route-atomicity", "hot-swap-protocol-steps")
def test_a_version_change_in_the_inventory_is_a_hot_swap_without_failed_requests(
    served: LabHost, tmp_path: Path
) -> None:
    before = complete(served)[1]
    inventory = tmp_path / "lab_v2.py"
    inventory.write_text(V2_INVENTORY.format(source=str(model_versions()["lab-v2"])))
    outcomes: list[tuple[int, str]] = []
    stop = threading.Event()

    def client(stream: bool) -> None:
        while not stop.is_set():
            status, colour, _ = complete(served, stream=stream)
            outcomes.append((status, colour))

    clients = [threading.Thread(target=client, args=(i % 2 == 1,)) for i in range(4)]
    for thread in clients:
        thread.start()
    try:
        swapped = _deployed(deploy([served], inventory=str(inventory), roles=ROLES))
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=180)
    failed = [o for o in outcomes if o[0] != 200]
    colours = {c for _, c in outcomes}
    print(f"hot swap by deploy: {len(outcomes)} requests, {len(failed)} failed, colours {sorted(colours)}")
    assert swapped.changed > 0
    assert not failed, failed[:5]
    after = complete(served)[1]
    assert after != before and colours == {before, after}
    status = _status(served)
    v2 = release_version(model_versions()["lab-v2"])
    assert (status["active"], status["colour"], status["ready"]) == (v2, after, True)
    assert remote.run(served, f"systemctl is-active ai-service@{before}.service; true").strip() == "inactive"


@pytest.mark.invariant("hot-swap-dual-instances", "rel-rollback-git-tag")
def test_with_keep_previous_the_drained_colour_stays_warm_and_a_rollback_to_it_starts_nothing(
    served: LabHost, tmp_path: Path
) -> None:
    """The role leaves the warm colour alone (no drift, the gate passes with it running); `rollback` on the host
    then brings traffic back on the previous version without an engine start."""
    first = _status(served)
    source = next(path for path in model_versions().values() if release_version(path) != first["active"])
    inventory = tmp_path / "lab_keep_warm.py"
    inventory.write_text(KEEP_WARM_INVENTORY.format(source=str(source)))
    _deployed(deploy([served], inventory=str(inventory), roles=ROLES))
    swapped = _status(served)
    assert (swapped["active"], swapped["ready"]) == (release_version(source), True)
    assert swapped["colour"] != first["colour"]
    warm = f"ai-service@{first['colour']}.service"
    assert remote.run(served, f"systemctl is-active {warm}; true").strip() == "active"

    again = _deployed(deploy([served], inventory=str(inventory), roles=ROLES))
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]
    gate = verify([served], roles=ROLES, inventory=str(inventory))
    assert gate.returncode == 0, gate.stdout[-6000:] + gate.stderr[-2000:]

    started = time.monotonic()
    output = remote.run(
        served, f"{SETTINGS.venv}/bin/ironserve-service rollback {SETTINGS.model_name} --config {CONFIG_PATH} 2>&1"
    )
    took = time.monotonic() - started
    back = _status(served)
    print(f"rollback to the colour kept warm: {took:.1f} s (including the drain of the colour rolled away from)")
    assert (back["active"], back["colour"], back["ready"]) == (first["active"], first["colour"], True)
    assert "(kept warm): no start" in output, output
    assert complete(served)[:2] == (200, first["colour"])
