"""`ironserve rollout`: the plan and every mistake refused before any host is contacted, and the record it keeps.

The inference role's traffic commands are tested in tests/unit/test_inference_role.py; the rollout itself runs
against lab hosts in tests/lab/test_rollout.py and tests/lab/test_inference_deploy.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ironserve import rollout
from ironserve.rollout import HostRecord, Plan, Rollout, RolloutError, make_plan, max_unavailable_hosts
from ironserve.traffic import TrafficControl
from tests.unit.test_inventory_boundary import Listener

HOSTS = ["r1", "r2", "r3", "r4"]


@pytest.mark.parametrize(
    ("batch", "unavailable", "canary", "order", "batches"),
    [
        (None, "1", None, None, [["r1"], ["r2"], ["r3"], ["r4"]]),
        (None, "50%", None, None, [["r1", "r2"], ["r3", "r4"]]),
        (1, "3", None, None, [["r1"], ["r2"], ["r3"], ["r4"]]),
        (2, "2", "r3", None, [["r3"], ["r1", "r2"], ["r4"]]),
        (None, "1", None, ["r4", "r2"], [["r4"], ["r2"], ["r1"], ["r3"]]),
        (3, "75%", "r2", ["r2", "r4"], [["r2"], ["r4", "r1", "r3"]]),
    ],
)
def test_the_plan_is_the_canary_alone_then_the_order_then_the_inventory(
    batch: int | None, unavailable: str, canary: str | None, order: list[str] | None, batches: list[list[str]]
) -> None:
    assert make_plan(HOSTS, batch, unavailable, canary, order).batches == batches


@pytest.mark.parametrize(
    ("text", "fleet", "hosts"), [("1", 4, 1), ("3", 4, 3), ("25%", 4, 1), ("74%", 4, 2), ("10%", 16, 1), ("50%", 3, 1)]
)
def test_max_unavailable_is_a_number_or_a_share_rounded_down(text: str, fleet: int, hosts: int) -> None:
    assert max_unavailable_hosts(text, fleet) == hosts


@pytest.mark.parametrize(
    ("hosts", "batch", "unavailable", "canary", "order", "words"),
    [
        (HOSTS, 0, "1", None, None, "--batch 0: at least 1"),
        (HOSTS, None, "4", None, None, "all 4 hosts of the fleet out of service"),
        (HOSTS, None, "100%", None, None, "all 4 hosts"),
        (HOSTS, None, "10%", None, None, "is 0 hosts"),
        (HOSTS, None, "0", None, None, "is 0 hosts"),
        (HOSTS, None, "-1", None, None, "a number of hosts"),
        (HOSTS, None, "two", None, None, "a number of hosts"),
        (HOSTS, None, "150%", None, None, "between 1% and 100%"),
        (HOSTS, 3, "2", None, None, "--batch 3 would take 3 hosts"),
        (HOSTS, None, "1", "r9", None, "--canary r9: not in the inventory"),
        (HOSTS, None, "1", None, ["r1", "r5"], "--order r5: not in the inventory"),
        (HOSTS, None, "1", None, ["r1", "r1"], "names a host twice"),
        (["r1"], None, "1", None, None, "one host cannot be rolled"),
    ],
)
def test_a_mistaken_plan_is_refused_naming_it(
    hosts: list[str], batch: int | None, unavailable: str, canary: str | None, order: list[str] | None, words: str
) -> None:
    with pytest.raises(RolloutError, match=words.replace("%", "%").replace("(", r"\(")):
        make_plan(hosts, batch, unavailable, canary, order)


def _inventory(folder: Path, port: int) -> Path:
    """Four hosts that all point at one local listener: any connection is counted."""
    path = folder / "fleet.py"
    hosts = [(f"r{n}.invalid", {"ssh_hostname": "127.0.0.1", "ssh_port": port}) for n in range(1, 5)]
    path.write_text(
        f"from ironserve.inventory import site\n\nfleet = site({hosts!r}, {{'ironserve_roles': 'host_tuning'}})\n"
    )
    return path


def _stopped_record(reports: Path) -> None:
    plan = Plan([["r1.invalid"], ["r2.invalid"], ["r3.invalid"], ["r4.invalid"]], 1, None)
    hosts = {name: HostRecord(batch=i) for i, [name] in enumerate(plan.batches)}
    hosts["r1.invalid"] = HostRecord(batch=0, phase="return", result="ok")
    hosts["r2.invalid"] = HostRecord(batch=1, phase="prove", result="failed", reason="gate failed: test_x")
    record = Rollout("fleet.py", "2026-12-06T10:00:00+00:00", plan, {}, hosts, status="stopped")
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "rollout.json").write_text(record.to_json())


@pytest.mark.parametrize(
    ("args", "record", "words"),
    [
        (["--batch", "0"], None, "--batch 0: at least 1 host per batch"),
        (["--max-unavailable", "4"], None, "would take all 4 hosts of the fleet out of service"),
        (["--max-unavailable", "100%"], None, "would take all 4 hosts"),
        (["--canary", "r9.invalid"], None, "--canary r9.invalid: not in the inventory"),
        (["--resume"], None, "no rollout to resume"),
        (["--deploy-file", "missing.py"], None, "deploy file missing.py does not exist"),
        (
            [],
            "stopped",
            "stopped (r2.invalid in prove (failed): gate failed: test_x): `ironserve rollout INVENTORY --resume`",
        ),
        (["--resume", "--batch", "2"], "stopped", "--resume continues the recorded plan: drop --batch"),
        (["--resume", "--roles", "security"], "stopped", "--resume continues the recorded plan: its roles are all"),
        (["--resume"], "completed", "--resume: the rollout started 2026-12-06T10:00:00+00:00 completed"),
        (["--resume"], "not json", "is not a rollout's record"),
    ],
)
def test_bad_input_is_refused_before_any_host_is_contacted(
    tmp_path: Path, args: list[str], record: str | None, words: str
) -> None:
    listener = Listener()
    reports = tmp_path / "reports"
    if record in ("stopped", "completed"):
        _stopped_record(reports)
    if record == "completed":
        document = json.loads((reports / "rollout.json").read_text())
        document.update(status="completed", finished="2026-12-06T11:00:00+00:00")
        (reports / "rollout.json").write_text(json.dumps(document))
    if record == "not json":
        reports.mkdir()
        (reports / "rollout.json").write_text("{")
    try:
        inventory = _inventory(tmp_path, listener.port)
        run = subprocess.run(
            [sys.executable, "-m", "ironserve", "rollout", "--reports", str(reports), *args, "fleet.py"],
            cwd=inventory.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        listener.close()
    assert run.returncode == 2, run.stdout + run.stderr
    assert words in run.stderr
    assert "Traceback" not in run.stderr
    assert listener.connections == 0


def test_a_control_plane_beside_the_nodes_it_drains_is_refused_before_any_host_is_contacted(tmp_path: Path) -> None:
    """cp1 runs the kubectl of r2's drain and return (roles/kubernetes): the two in one batch is refused, the
    control plane alone first is the plan the message proposes, and it passes."""
    listener = Listener()
    nodes = [(f"r{n}.invalid", {"ssh_hostname": "127.0.0.1", "ssh_port": listener.port}) for n in (2, 3, 4)]
    first = {"kubernetes_role": "control-plane", "kubernetes_advertise_address": "192.0.2.10"}
    plane = [("cp1.invalid", {"ssh_hostname": "127.0.0.1", "ssh_port": listener.port, **first})]
    data = {"ironserve_roles": "kubernetes", "kubernetes_role": "worker", "kubernetes_repo_key": __file__}
    (tmp_path / "fleet.py").write_text(
        f"from ironserve.inventory import site\n\nfleet = site({plane + nodes!r}, {data!r})\n"
    )
    argv = [sys.executable, "-m", "ironserve", "rollout", "--reports", str(tmp_path / "reports")]
    try:
        together = subprocess.run([*argv, "--batch", "2", "--max-unavailable", "2", "fleet.py"], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        listener.close()
    assert together.returncode == 2, together.stdout + together.stderr
    assert (
        "batch 1 changes cp1.invalid and r2.invalid together, but cp1.invalid runs r2.invalid's kubernetes traffic "
        "commands: give cp1.invalid a batch of its own (--canary cp1.invalid, or --batch 1)"
    ) in together.stderr
    assert listener.connections == 0
    plan = make_plan(["cp1", "r2", "r3"], 2, "2", "cp1", None)
    via = {"r2": [TrafficControl("kubernetes", "d", "h", "r", via="cp1")], "cp1": [TrafficControl("k", "d", "h", "r")]}
    rollout.check_traffic_hosts(plan, via)  # cp1 alone first, then r2 and r3
    with pytest.raises(RolloutError, match="batch 2 changes cp1 and r2 together"):
        rollout.check_traffic_hosts(make_plan(["r3", "r4", "cp1", "r2"], 2, "2", None, None), via)


def test_the_record_reads_back_and_its_table_names_each_hosts_phase_and_reason() -> None:
    plan = make_plan(["a", "b", "c"], None, "1", None, None)
    hosts = {
        "a": HostRecord(0, "return", "ok", None, {"drain": 10.2, "change": 40.0, "prove": 9.1, "return": 0.3}, 12, True,
                        "inference qwen 1 on blue, traffic None", "inference qwen 2 on green, traffic None"),
        "b": HostRecord(1, "drain", "returned", "inference drain: 1 requests still running", {"drain": 5.0},
                        serving_before="inference qwen 1 on blue, traffic None"),
        "c": HostRecord(2),
    }  # fmt: skip
    record = Rollout("inventory/site.py", "2026-12-06T10:00:00+00:00", plan, {"roles": None}, hosts, "stopped")
    assert Rollout.from_json(record.to_json()) == record
    lines = rollout.table(record).splitlines()
    assert lines[0].split() == ["host", "batch", "phase", "result", "changes", "reboot", "drain", "s", "change", "s",
                                "prove", "s", "return", "s", "reason"]  # fmt: skip
    assert lines[1].split()[:10] == ["a", "1", "return", "ok", "12", "yes", "10.2", "40.0", "9.1", "0.3"]
    assert lines[2].split()[:7] == ["b", "2", "drain", "returned", "-", "-", "5.0"]
    assert lines[2].endswith("inference drain: 1 requests still running")
    assert lines[3].split() == ["c", "3", "-", "pending", "-", "-", "-", "-", "-", "-"]
    # A stopped model rollout states the fleet's mix.
    assert rollout.mix(record) == (
        "inference qwen 2 on green, traffic None: a; inference qwen 1 on blue, traffic None: b; "
        "not reached, as before the rollout: c"
    )


def test_a_failed_deploy_is_named_by_the_hosts_error_line_not_by_pyinfras_closing_words() -> None:
    # As pyinfra printed a swap that failed on a lab host (the operation's stderr first, then its stdout).
    output = """\
--> Starting operation: Inference service | Serve qwen2-7b 20260102-000000 (blue/green swap when it changes)
    [lab-c1] FAILED gate route-switch: Envoy still not serving green 10.0s after the write
    [lab-c1] OK verify /srv/ai/models/qwen2-7b/20260102-000000
    [lab-c1] OK compare-and-swap /models/qwen2-7b/active: 20260101-000000 -> 20260102-000000 (revision 5)
    [lab-c1] Error: executed 0 commands

--> Disconnecting from hosts...
--> pyinfra error: No hosts remaining!
"""
    assert rollout.deploy_failure(output, "lab-c1") == (
        "FAILED gate route-switch: Envoy still not serving green 10.0s after the write"
    )
    assert rollout.deploy_failure("--> pyinfra error: No hosts remaining!\n", "h") == (
        "--> pyinfra error: No hosts remaining!"
    )
