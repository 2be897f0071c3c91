"""roles/inference on real lab container hosts: the whole service deployed, served through Envoy, gated,
re-run without changes, drift put back, a version change deployed as a hot swap under load, and rollouts: a model
rollout behind a balancer, a drain that cannot finish, and a rollout through four serving hosts under load. Then
roles/monitoring over the four hosts: alerts that reach a webhook receiver, and a sick GPU's host drained.

Simulated at the edge: the host has no GPU, so the engine is vLLM's CPU build (files/inference/
requirements-cpu.lock, served by the lab's pip index) and the model a tiny Qwen2-architecture one with
random weights (lab/src/ironserve_lab/inference.py); in the GPU test, the GPUs NVML reports are the lab's stand-in
libnvidia-ml.so.1 (lab/src/ironserve_lab/standin_nvml.py). Everything else is the real thing: Debian's etcd,
Prometheus and Alertmanager, Envoy, systemd units as ai-runner in the service slice under the seccomp filter.
"""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import posixpath
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ironserve.owned import backup_path
from ironserve.validators import release_version
from ironserve_lab import edge, remote
from ironserve_lab.demo import api_key, chat_completion, listener_url
from ironserve_lab.deploying import DeployResult, deploy, verify
from ironserve_lab.inference import ENGINE_ENVIRONMENT, SERVICE_OVERRIDES, inventory_data, model_versions
from ironserve_lab.kubernetes_control_plane import wait_for
from ironserve_lab.network import GATEWAY
from ironserve_lab.state import LabHost
from ironserve_lab.webhook import WebhookReceiver
from roles import stack_config
from roles.inference import PORTS_SYSCTL_FILE, UNIT_DIR
from roles.inference.operations import model_version_dir, parse_port_list
from roles.inference.render_kubernetes import host_settings
from roles.inference.settings import CONFIG_PATH
from tests.lab.conftest import lab_containers

ROLES = ("security", "inference")
ROUTER_UNIT = f"{UNIT_DIR}/ironserve-router.service"
ROUTER, CONTROL = "ironserve-router.service", "ironserve-control.service"
pytestmark = pytest.mark.lab
SETTINGS = stack_config("lab", {}).inference
NOTICE_S = SERVICE_OVERRIDES["swap"]["host_drain_notice_s"]  # the lab hosts' draining notice before new work stops
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
    """(status, colour that served it, body) of one chat completion through the host's Envoy, as the demo asks.
    A request that got no whole answer (refused, reset, cut short) is status 0 with the error as its body, so that
    a client thread counts it as failed instead of dying with it."""
    url, model = _listener(host.name)
    try:
        return chat_completion(url, key or KEYS[host.name], model, stream=stream, timeout_s=timeout_s)
    except (OSError, http.client.HTTPException) as error:
        return 0, "", f"{type(error).__name__}: {error}"


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
def fleet() -> Iterator[list[LabHost]]:
    """Four serving hosts, deployed in one run: the fleet of the rollout under load; the other tests use the first."""
    with lab_containers(4) as hosts:
        started = time.monotonic()
        first = _deployed(deploy(hosts, roles=ROLES))
        took = time.monotonic() - started
        print(f"first deploy of {ROLES} to {len(hosts)} hosts: {took:.1f} s, {first.changed} changes")
        assert first.changed > 0
        KEYS.update({host.name: api_key(host) for host in hosts})
        yield hosts


@pytest.fixture(scope="module")
def served(fleet: list[LabHost]) -> LabHost:
    return fleet[0]


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


def _main_pid(host: LabHost, unit: str) -> str:
    return remote.run(host, f"systemctl show --property=MainPID --value {unit}").strip()


@pytest.mark.invariant(
    "hot-swap-load-atomicity",
    "hot-swap-route-atomicity",
    "hot-swap-protocol-steps",
    "hot-swap-dual-instances",
    "rel-rollback-git-tag",
)
def test_a_version_and_settings_change_is_a_hot_swap_under_load_and_a_rollback_starts_nothing(
    served: LabHost, tmp_path: Path
) -> None:
    """The inventory names the other version and a swap setting (keep_previous): the deploy swaps under four clients
    (two streaming) and none fails. service.yaml changed, so the control loop restarts; Envoy's own files did not,
    so Envoy does not (its restart would cut the requests in flight). The role leaves the warm colour alone (no
    drift, the gate passes with it running); `rollback` on the host then brings traffic back on the previous
    version without an engine start."""
    first = _status(served)
    source = next(path for path in model_versions().values() if release_version(path) != first["active"])
    inventory = tmp_path / "lab_keep_warm.py"
    inventory.write_text(KEEP_WARM_INVENTORY.format(source=str(source)))
    pids = {unit: _main_pid(served, unit) for unit in (ROUTER, CONTROL)}
    outcomes: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def client(stream: bool) -> None:
        while not stop.is_set():
            outcomes.append(complete(served, stream=stream))

    clients = [threading.Thread(target=client, args=(i % 2 == 1,)) for i in range(4)]
    for thread in clients:
        thread.start()
    try:
        swapped_by = _deployed(deploy([served], inventory=str(inventory), roles=ROLES))
        # With keep_previous the deploy returns once the new colour serves; the clients go on until it answers them.
        swapped = _status(served)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(colour == swapped["colour"] for _, colour, _ in outcomes[-4:]):
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=180)
    failed = [(status, body[:200]) for status, _, body in outcomes if status != 200]
    colours = {colour for _, colour, _ in outcomes}
    print(f"hot swap by deploy: {len(outcomes)} requests, {len(failed)} failed, colours {sorted(colours)}")
    assert swapped_by.changed > 0
    assert not failed, failed[:5]
    assert colours == {first["colour"], swapped["colour"]}
    assert _main_pid(served, ROUTER) == pids[ROUTER] != "0"
    assert _main_pid(served, CONTROL) != pids[CONTROL]
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


# The fleet of the model rollout and drain tests: the serving host with the service, and the fleet's second host with
# host_tuning alone (it serves on, untouched by the rollout's traffic steps), which keeps each of them to one swap or
# none.
ROLLOUT_INVENTORY = """\
from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _ = lab_groups()
_data = dict(_containers)
fleet = site([({served!r}, {{**_data[{served!r}], **{served_data!r}}}),
              ({other!r}, {{**_data[{other!r}], "ironserve_roles": ["host_tuning"]}})])
"""
# What the deploy could change on the serving host, byte for byte: /etc (units, service.yaml, keys), the service's
# venv and the model store. The route Envoy serves is compared by its content: each traffic state is written to a
# new file behind the rds.json link (router.write_route), and the host returned to service has the same content.
ROUTER_DIR = host_settings(stack_config("lab", {})).swap.router_dir
HOST_SNAPSHOT = (
    f"find /etc /opt/ironserve /srv -xdev \\( -type f -o -type l \\) ! -path '{ROUTER_DIR}/*rds*' "
    "-printf '%p %s %m %u:%g %T@ %l\\n' | sort; "
    f"find /etc -xdev -type f ! -path '{ROUTER_DIR}/*rds*' -print0 | sort -z | xargs -0 sha256sum; "
    f"sha256sum < {ROUTER_DIR}/rds.json"
)


class Balancer:
    """The site's load balancer in front of the serving hosts: it checks each host's /health every 0.2 s from outside
    the host and sends completions, round robin, only to hosts whose last check answered 200, as a health-checking
    balancer does."""

    def __init__(self, *hosts: LabHost, pause_s: float = 0.0) -> None:
        self.hosts = hosts
        self.pause_s = pause_s  # between a completion and the next: the clients' think time
        self.outcomes: list[tuple[str, int]] = []  # (host, status) of each completion sent
        # Each change of a host's /health: (time, status, body).
        self.health: dict[str, list[tuple[float, int, str]]] = {host.name: [] for host in hosts}
        self.healthy = {host.name: threading.Event() for host in hosts}
        self.stop = threading.Event()
        self.turn = itertools.count()
        self.threads = [threading.Thread(target=self.check, args=(host,)) for host in hosts]
        self.threads.append(threading.Thread(target=self.send))

    def check(self, host: LabHost) -> None:
        url, seen, healthy = _listener(host.name)[0], self.health[host.name], self.healthy[host.name]
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    status, body = response.status, ""
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read().decode(errors="replace").strip()
            except OSError as error:
                status, body = 0, str(error)
            if not seen or seen[-1][1:] != (status, body):
                seen.append((time.monotonic(), status, body))
            (healthy.set if status == 200 else healthy.clear)()
            time.sleep(0.2)

    def send(self) -> None:
        while not self.stop.is_set():
            ready = [host for host in self.hosts if self.healthy[host.name].is_set()]
            if not ready:
                time.sleep(0.2)
                continue
            host = ready[next(self.turn) % len(ready)]
            self.outcomes.append((host.name, complete(host)[0]))
            self.stop.wait(self.pause_s)

    def ready(self, host: LabHost) -> list[bool]:
        """Whether the host was ready, at its first check and at each change after it."""
        ready = [status == 200 for _, status, _ in self.health[host.name]]
        return [ready[0], *(now for before, now in itertools.pairwise(ready) if now != before)]

    def fewest_serving(self) -> int:
        """The fewest hosts ready at any moment, from the first moment every host had been checked."""
        changes = sorted((at, name, status == 200) for name, seen in self.health.items() for at, status, _ in seen)
        start = max(seen[0][0] for seen in self.health.values())
        state: dict[str, bool] = {}
        fewest = len(self.hosts)
        for at, name, ready in changes:
            state[name] = ready
            if at >= start:
                fewest = min(fewest, sum(state.values()))
        return fewest

    def __enter__(self) -> Balancer:
        for thread in self.threads:
            thread.start()
        for event in self.healthy.values():
            event.wait(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)


def _rollout(inventory: Path, reports: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ironserve", "rollout", "--reports", str(reports), "--canary-pause", "0", *args]
    return subprocess.run([*argv, str(inventory)], capture_output=True, text=True, timeout=1800)


def test_a_model_rollout_drains_the_host_behind_its_balancer_swaps_proves_and_returns_it(
    fleet: list[LabHost], tmp_path: Path
) -> None:
    """The fleet-wide model rollout: the inventory names the other version; the serving host is drained (its /health
    says draining while requests still finish), swapped by its deploy, proven by the gate through its Envoy and
    returned, then the next host. A balancer that follows /health sends work all along: none fails."""
    served, other = fleet[:2]
    before = _status(served)
    source = next(path for path in model_versions().values() if release_version(path) != before["active"])
    inventory = tmp_path / "fleet.py"
    served_data = {"ironserve_roles": list(ROLES), "inference_model_source": str(source)}
    inventory.write_text(ROLLOUT_INVENTORY.format(served=served.name, other=other.name, served_data=served_data))
    with Balancer(served) as balancer:
        done = _rollout(inventory, tmp_path / "reports", "--order", served.name)
        time.sleep(2)  # the balancer sees the host back and sends to it again
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "reports" / "rollout.json").read_text())
    host = record["hosts"][served.name]
    failed = [status for _, status in balancer.outcomes if status != 200]
    health = balancer.health[served.name]
    shown = [(round(at - health[0][0], 1), status, body) for at, status, body in health]
    print(f"rollout under the balancer: {len(balancer.outcomes)} requests, {len(failed)} failed; /health: {shown}")
    assert not failed, failed[:5]
    # What the balancer saw: ready, then out (draining, and no answer at all while the change restarts Envoy), then
    # ready again once the host returned.
    assert balancer.ready(served) == [True, False, True]
    assert health[1][1:] == (503, "draining")
    assert host["result"] == "ok" and host["changes"] > 0 and host["seconds"]["drain"] >= NOTICE_S
    assert f"{release_version(source)} on" in host["serving_after"] and before["active"] in host["serving_before"]
    assert record["hosts"][other.name]["result"] == "ok"
    after = _status(served)
    assert (after["active"], after["ready"], after["traffic"]) == (release_version(source), True, "serving")
    # Without keep_previous the colour swapped away from is stopped.
    assert after["colour"] != before["colour"]
    assert remote.run(served, f"systemctl is-active ai-service@{before['colour']}.service; true").strip() == "inactive"


def test_a_drain_that_cannot_finish_returns_the_host_unchanged_and_stops_the_rollout(
    fleet: list[LabHost], tmp_path: Path
) -> None:
    """A request the engine never finishes (its processes stopped, as a hung GPU would hold it): the drain gives up
    after --drain-timeout, the host serves again exactly as it was, and the next host is never contacted."""
    served, other = fleet[:2]
    colour = _status(served)["colour"]
    inventory = tmp_path / "fleet.py"
    served_data = {"ironserve_roles": list(ROLES)}
    inventory.write_text(ROLLOUT_INVENTORY.format(served=served.name, other=other.name, served_data=served_data))
    before = remote.run(served, HOST_SNAPSHOT)
    other_before = remote.run(other, "find /etc -xdev -type f -print0 | sort -z | xargs -0 sha256sum")
    remote.run(served, f"systemctl kill --signal=SIGSTOP ai-service@{colour}.service")
    held: list[tuple[int, str, str]] = []
    request = threading.Thread(target=lambda: held.append(complete(served, timeout_s=300)))
    try:
        request.start()
        time.sleep(1)
        stopped = _rollout(inventory, tmp_path / "reports", "--order", served.name, "--drain-timeout", "3")
    finally:
        remote.run(served, f"systemctl kill --signal=SIGCONT ai-service@{colour}.service")
        request.join(timeout=300)
    print(stopped.stdout)
    record = json.loads((tmp_path / "reports" / "rollout.json").read_text())
    assert remote.run(other, "find /etc -xdev -type f -print0 | sort -z | xargs -0 sha256sum") == other_before
    assert stopped.returncode == 1, stopped.stdout[-6000:] + stopped.stderr[-3000:]
    host = record["hosts"][served.name]
    assert (host["phase"], host["result"]) == ("drain", "returned"), host
    assert "1 requests still running after 3 s; the host serves again" in host["reason"]
    assert record["hosts"][other.name]["phase"] is None
    assert remote.run(served, HOST_SNAPSHOT) == before
    assert held and held[0][0] == 200  # the held request finished once the engine ran again
    assert _status(served)["traffic"] == "serving" and complete(served)[0] == 200


# The rollout through the four serving hosts: host_tuning's settings, which the fixture did not deploy, rolled through
# the fleet while it serves. Each host keeps the version it serves (the tests before may have swapped the first).
FLEET_ROLES = ["host_tuning", *ROLES]
FLEET_INVENTORY = """\
from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _ = lab_groups()
_data = dict(_containers)
fleet = site([(name, {{**_data[name], "ironserve_roles": {roles!r}, "inference_model_source": source}})
              for name, source in {sources!r}])
"""
# A drift the deploy repairs and that comes straight back: the gate, a few seconds later, sees it.
DRIFT_UNIT = "rollout-test-drift"
DRIFT = "while :; do sysctl -qw net.ipv4.tcp_slow_start_after_idle=1; sleep 0.2; done"
# What the rollout could change on a host, byte for byte: the files of the service's snapshot, the packages, and the
# sysctls host_tuning sets, in force.
UNTOUCHED_SNAPSHOT = (
    f"{HOST_SNAPSHOT}; dpkg-query -W -f '${{Package}} ${{Version}} ${{Status}}\\n'; "
    f"sysctl {' '.join(stack_config('lab', {}).host_tuning.sysctls)}"
)


def test_a_rollout_through_four_serving_hosts_under_load_keeps_three_serving_stops_at_a_failure_and_resumes(
    fleet: list[LabHost], tmp_path: Path
) -> None:
    """One host at a time (the default), a balancer sending completions across the four hosts all along: the first
    host is drained, changed, proven and returned; the second's gate fails after its change (a unit puts a sysctl
    back), so the rollout stops with it drained and named, and the third and fourth are left byte for byte as they
    were, serving. Once the unit is stopped, `--resume` completes. No request fails, and at no moment do fewer than
    three hosts serve."""
    first, second, third, fourth = fleet
    versions = {release_version(path): str(path) for path in model_versions().values()}
    sources = [(host.name, versions[_status(host)["active"]]) for host in fleet]
    inventory = tmp_path / "fleet.py"
    inventory.write_text(FLEET_INVENTORY.format(roles=FLEET_ROLES, sources=sources))
    reports = tmp_path / "reports"
    remote.run(second, f"systemd-run --unit={DRIFT_UNIT} sh -c '{DRIFT}'")
    try:
        # A completion every second or so: on this machine's two cores the four engines, the deploy and the gate
        # share the CPU, and a client that keeps an engine busy all the time doubles the gate's time.
        with Balancer(*fleet, pause_s=0.5) as balancer:
            before = {host.name: remote.run(host, UNTOUCHED_SNAPSHOT) for host in (third, fourth)}
            stopped = _rollout(inventory, reports, "--roles", ",".join(FLEET_ROLES))
            print(stopped.stdout)
            record = json.loads((reports / "rollout.json").read_text())
            after = {host.name: remote.run(host, UNTOUCHED_SNAPSHOT) for host in (third, fourth)}
            second_while_stopped = balancer.health[second.name][-1][1:]
            remote.run(second, f"systemctl stop {DRIFT_UNIT}")
            resumed = _rollout(inventory, reports, "--resume")
            print(resumed.stdout)
            time.sleep(2)  # the balancer sees the last host back and sends to it again
    finally:
        remote.run(second, f"systemctl stop {DRIFT_UNIT} 2>/dev/null; true")
    failed = [outcome for outcome in balancer.outcomes if outcome[1] != 200]
    served_by = {host.name: sum(name == host.name for name, _ in balancer.outcomes) for host in fleet}
    print(
        f"rollout through 4 serving hosts: {len(balancer.outcomes)} requests, {len(failed)} failed, "
        f"at least {balancer.fewest_serving()} hosts serving at every moment; requests per host {served_by}"
    )

    assert stopped.returncode == 1, stopped.stdout[-6000:] + stopped.stderr[-3000:]
    hosts = record["hosts"]
    assert hosts[first.name]["result"] == "ok" and hosts[first.name]["changes"] > 0
    assert (hosts[second.name]["phase"], hosts[second.name]["result"]) == ("prove", "failed")
    assert "test_sysctl_live" in hosts[second.name]["reason"]
    assert f"{second.name}: prove FAILED" in stopped.stdout
    assert second_while_stopped == (503, "draining")  # held out of the balancer, named in the record
    for untouched in (third, fourth):
        assert (hosts[untouched.name]["phase"], hosts[untouched.name]["result"]) == (None, "pending")
        assert after[untouched.name] == before[untouched.name], f"{untouched.name} changed"

    assert resumed.returncode == 0, resumed.stdout[-6000:] + resumed.stderr[-3000:]
    record = json.loads((reports / "rollout.json").read_text())
    assert record["status"] == "completed"
    assert all(host["result"] == "ok" for host in record["hosts"].values()), record["hosts"]
    assert f"batch 2/4: {second.name}\n" in resumed.stdout and f"{first.name}: drain" not in resumed.stdout

    assert not failed, failed[:5]
    assert balancer.fewest_serving() >= 3
    assert all(balancer.ready(host) == [True, False, True] for host in fleet), balancer.health
    assert all(served_by.values()), served_by


# roles/monitoring over the serving fleet: the first host runs Alertmanager with a webhook to a receiver on this
# machine (the lab bridge's address) and watches the others' node exporters; the others send it their alerts.
MONITORING_INVENTORY = """\
from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _ = lab_groups()
_data = dict(_containers)
fleet = site([(name, {{**_data[name], **extra}}) for name, extra in {hosts!r}])
"""
HOST_DOWN_AFTER_S = 240  # HostDown's `for: 1m`, probes and evaluations every 5 s, a loaded machine


def _alertmanager_alerts(host: LabHost, name: str) -> list[dict[str, Any]]:
    """The alerts named `name` Alertmanager holds, with their state (active or suppressed and by what)."""
    url = "http://127.0.0.1:9093/api/v2/alerts?" + urllib.parse.urlencode({"filter": f'alertname="{name}"'})
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    return list(json.loads(remote.run(host, f"python3 -c {shlex.quote(code)}")))


@dataclass(frozen=True)
class Alerting:
    receiver: WebhookReceiver
    inventory: Path


@pytest.fixture(scope="module")
def alerting(fleet: list[LabHost], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alerting]:
    """roles/monitoring deployed over the serving fleet, with a webhook receiver on this machine."""
    watcher = fleet[0]
    with WebhookReceiver(str(GATEWAY)) as receiver:
        first = {
            "ironserve_roles": ["monitoring"],
            "monitoring_webhook_urls": [receiver.url],
            "monitoring_allow_plain_http": [receiver.url],
            "monitoring_group_wait": "2s",
            "monitoring_group_interval": "5s",
            "monitoring_watch_hosts": {host.name: host.ssh_address for host in fleet[1:]},
        }
        others = {
            "ironserve_roles": ["monitoring"],
            "monitoring_alertmanager": False,
            "monitoring_alertmanager_urls": [f"http://{watcher.ssh_address}:9093"],
        }
        inventory = tmp_path_factory.mktemp("monitoring") / "monitoring.py"
        hosts = [(watcher.name, first), *((host.name, others) for host in fleet[1:])]
        inventory.write_text(MONITORING_INVENTORY.format(hosts=hosts))
        started = time.monotonic()
        installed = _deployed(deploy(fleet, inventory=str(inventory)))
        print(f"monitoring on {len(fleet)} hosts: {time.monotonic() - started:.1f} s, {installed.changed} changes")
        yield Alerting(receiver, inventory)


def test_a_stopped_engine_pages_once_and_resolves_and_a_silent_host_pages_host_down_alone(
    fleet: list[LabHost], alerting: Alerting
) -> None:
    """The real Prometheus of each host, the real Alertmanager of the first and a webhook receiver: a stopped engine
    reaches the receiver as one notification of its host's paging group and resolves when the engine runs again; a
    host whose node exporter stops answering raises HostDown on the first host, and its own alert that follows (its
    engine stopped too) is held back by the inhibition, never notified."""
    watcher, stopped, silent = fleet[:3]
    receiver, inventory = alerting.receiver, alerting.inventory
    again = _deployed(deploy(fleet, inventory=str(inventory)))
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]
    gate = verify(fleet, "-q", "-rfE", inventory=str(inventory))
    print(gate.stdout[-3000:])
    assert gate.returncode == 0, gate.stdout[-6000:] + gate.stderr[-2000:]
    engines = {host.name: f"ai-service@{_status(host)['colour']}.service" for host in (stopped, silent)}
    try:
        caused = time.monotonic()
        remote.run(stopped, f"systemctl stop {engines[stopped.name]}")
        remote.run(silent, "systemctl stop prometheus-node-exporter.service")
        wait_for(lambda: _alertmanager_alerts(watcher, "HostDown"), HOST_DOWN_AFTER_S, "HostDown", interval=2)
        remote.run(silent, f"systemctl stop {engines[silent.name]}")
        engine_down = wait_for(
            lambda: _notified(receiver, stopped, "ServingEngineDown", "firing"),
            HOST_DOWN_AFTER_S,
            "the paging notification of the stopped engine",
        )
        print(f"paged {time.monotonic() - caused:.0f} s after the causes")
        remote.run(stopped, f"systemctl start {engines[stopped.name]}")
        suppressed = wait_for(
            lambda: [a for a in _alertmanager_alerts(watcher, "ServingEngineDown")
                     if a["labels"]["host"] == silent.name],
            HOST_DOWN_AFTER_S,
            f"ServingEngineDown of {silent.name} in Alertmanager",
            interval=2,
        )  # fmt: skip
        resolved = wait_for(
            lambda: _notified(receiver, stopped, "ServingEngineDown", "resolved"),
            HOST_DOWN_AFTER_S,
            "the resolved notification",
        )
        print(f"resolved {time.monotonic() - caused:.0f} s after the causes")
        # What reached the receiver while the silent host was down: once its node exporter answers again HostDown
        # resolves, and its alerts still firing are no longer held back.
        everything = list(receiver.notifications)
    finally:
        remote.run(stopped, f"systemctl start {engines[stopped.name]}")
        remote.run(silent, f"systemctl start prometheus-node-exporter.service {engines[silent.name]}")
        for host in (stopped, silent):  # the fleet left serving, as the next test finds it
            wait_for(functools.partial(_serving, host), 300, f"{host.name} serving again", interval=1)
    shown = [(n["status"], n["groupLabels"], sorted(a["labels"]["alertname"] for a in n["alerts"])) for n in everything]
    print(f"notifications: {shown}")
    # The stopped engine: one paging notification of its host's group, then the group resolved.
    firing = engine_down[0]
    assert (firing["receiver"], firing["groupLabels"]) == ("page", {"host": stopped.name, "severity": "page"})
    assert {a["labels"]["host"] for a in firing["alerts"]} == {stopped.name}
    down = next(a for a in firing["alerts"] if a["labels"]["alertname"] == "ServingEngineDown")
    assert "the engine Envoy routes to does not answer" in down["annotations"]["summary"]
    assert len(_notified(receiver, stopped, "ServingEngineDown", "firing")) == 1
    assert resolved[0]["groupLabels"] == firing["groupLabels"]
    # The silent host: HostDown alone; its own alerts are held by the inhibition, never notified.
    of_silent = [
        a["labels"]["alertname"] for n in everything for a in n["alerts"] if a["labels"]["host"] == silent.name
    ]
    assert of_silent and set(of_silent) == {"HostDown"}
    assert suppressed[0]["status"]["state"] == "suppressed" and suppressed[0]["status"]["inhibitedBy"]


def _notified(receiver: WebhookReceiver, host: LabHost, alert: str, status: str) -> list[dict[str, Any]]:
    """The notifications of `status` for `host`'s group that carry `alert`."""
    return [
        note
        for note in receiver.notifications
        if note["status"] == status
        and note["groupLabels"].get("host") == host.name
        and any(a["labels"]["alertname"] == alert for a in note["alerts"])
    ]


def _prometheus(host: LabHost, query: str) -> list[dict[str, Any]]:
    """The host's own Prometheus's answer to an instant query."""
    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    return list(json.loads(remote.run(host, f"python3 -c {shlex.quote(code)}"))["data"]["result"])


def _serving(host: LabHost) -> bool:
    return _health_problem(host) is None


def _health_problem(host: LabHost) -> str | None:
    """None while the host's /health answers 200, seen from outside the host as a balancer sees it; else the reason
    Envoy gives beside the 503, or the status and body, or the connection's error."""
    try:
        with urllib.request.urlopen(f"{_listener(host.name)[0]}/health", timeout=5):
            return None
    except urllib.error.HTTPError as error:
        return str(error.headers.get("x-ironserve-drain-reason") or f"{error.code} {error.read().decode().strip()}")
    except OSError as error:
        return str(error)


def test_simulated_gpu_ecc_error_drains_its_host_with_no_failed_request_pages_naming_the_gpu_and_it_returns(
    fleet: list[LabHost], alerting: Alerting
) -> None:
    """Simulated at the edge: the GPUs. The fourth host gets its profile's four A10s through the lab's stand-in
    libnvidia-ml.so.1 (ironserve_lab.standin_nvml, values from real nvidia-smi captures), as a loaded driver would
    give them. Everything else is real: the service's own NVML reader and GPU guard through pynvml, etcd, Envoy, each
    host's Prometheus, the first host's Alertmanager and the webhook receiver. GPU 0 reports a double-bit ECC error
    under the balancer's load: the guard drains the host (Envoy's /health says why), the page names the host, the
    GPU and its serial, and no request fails; after a GPU reset (the volatile count back to 0) the guard returns the
    host once the model answers a completion."""
    sick = fleet[3]
    interval_s = host_settings(stack_config("lab", {})).gpu_health.guard_interval_s
    ecc = 'gpu_ecc_errors{error_type="uncorrected", counter="volatile", device="gpu0"}'
    try:
        gpus = edge.plug_gpus(sick)
        serial = gpus.gpus[0].serial
        # The exporter and the guard see the healthy GPUs before the error: a count is an error only when it rises.
        wait_for(lambda: _prometheus(sick, f"count_over_time({ecc}[1m]) >= 2"), 60, "two scrapes of healthy GPUs")
        time.sleep(interval_s + 1)
        assert _status(sick)["traffic"] == "serving"
        with Balancer(*fleet, pause_s=0.5) as balancer:
            time.sleep(2)  # completions on every host first
            sick_at = time.monotonic()
            edge.set_gpus(sick, gpus.with_gpu(0, ecc_volatile_uncorrected=1, ecc_aggregate_uncorrected=1))
            wait_for(lambda: balancer.health[sick.name][-1][1] == 503, 60, "the sick GPU's host drained", interval=0.2)
            drained_s = time.monotonic() - sick_at
            reason = _health_problem(sick)
            page = wait_for(
                lambda: _notified(alerting.receiver, sick, "GpuUncorrectableEccError", "firing"),
                HOST_DOWN_AFTER_S,
                "the page of the ECC error",
            )
            paged_s = time.monotonic() - sick_at
            time.sleep(2)  # the drained host keeps answering what reaches it; the others take the new work
            reset_at = time.monotonic()
            edge.set_gpus(sick, gpus.with_gpu(0, ecc_aggregate_uncorrected=1))  # a GPU reset zeroes the volatile count
            wait_for(lambda: balancer.health[sick.name][-1][1] == 200, 120, "the host serving again", interval=0.5)
            returned_s = time.monotonic() - reset_at
            time.sleep(2)  # the balancer sends to it again
    finally:
        edge.unplug_gpus(sick)
    failed = [outcome for outcome in balancer.outcomes if outcome[1] != 200]
    print(
        f"sick GPU: drained {drained_s:.1f} s after the ECC error, paged at {paged_s:.0f} s, serving again "
        f"{returned_s:.1f} s after the reset; {len(balancer.outcomes)} requests, {len(failed)} failed; "
        f"reason: {reason}"
    )
    assert not failed, failed[:5]
    assert balancer.ready(sick) == [True, False, True], balancer.health[sick.name]
    assert all(balancer.ready(host) == [True] for host in fleet[:3]), balancer.health
    assert balancer.health[sick.name][1][1:] == (503, "draining")
    assert reason is not None and f"gpu0 (serial {serial})" in reason and "ECC" in reason, reason
    labels = next(a["labels"] for a in page[0]["alerts"] if a["labels"]["alertname"] == "GpuUncorrectableEccError")
    assert (labels["host"], labels["device"], labels["serial"]) == (sick.name, "gpu0", serial)
    assert page[0]["receiver"] == "page"
    log = remote.run(sick, f"journalctl -u {CONTROL} --no-pager -o cat | grep gpu-guard; true")
    assert "gpu-guard: draining the host" in log and "gpu-guard: serving again" in log, log[-3000:]
