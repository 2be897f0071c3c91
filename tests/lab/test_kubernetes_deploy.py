"""roles/kubernetes on two real lab container hosts (a control plane and a worker), against the lab's signed
pkgs.k8s.io-layout mirror of stand-in packages (lab/src/ironserve_lab/standin_kubernetes.py) that also offers newer
decoys: the pins win, `kubeadm init` runs once on the control plane, the worker joins with a token the deploy
obtained from it in the same run, drift is restored, the next run changes nothing and the gate passes.

containerd is real (Debian's, from container_runtime); kubeadm, the kubelet and kubectl are the lab's stand-ins
(no 1.31 binaries or images are reachable here), so no API server runs: the gate's Ready check skips, and
tests/lab/test_kubernetes_node_vm.py proves a real kubelet (1.20.2) Ready instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve_lab import remote
from ironserve_lab.deploying import deploy, verify
from ironserve_lab.state import LabHost
from roles.kubernetes.settings import KubernetesSettings
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
ROLES = ("container_runtime", "kubernetes")
PINS = KubernetesSettings.model_validate({}).packages()
DECOY = "1.32.0-1.1"
INVENTORY = """\
from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _ = lab_groups()
_mine = [entry for entry in _containers if entry[0] in {names!r}]
for _name, _data in _mine:
    _data["ironserve_roles"] = {roles!r}
    _data.update({extra!r}.get(_name, {{}}))
cluster = site(_mine)
"""


def _inventory(path: Path, plane: LabHost, worker: LabHost, **plane_data: object) -> str:
    extra = {
        plane.name: {"kubernetes_advertise_address": plane.ssh_address, **plane_data},
        worker.name: {"kubernetes_role": "worker"},
    }
    path.write_text(INVENTORY.format(names=[plane.name, worker.name], roles=list(ROLES), extra=extra))
    return str(path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabHost, LabHost, str, str]]:
    with lab_containers(2) as hosts:
        plane, worker = hosts
        inventory = _inventory(tmp_path_factory.mktemp("k8s") / "cluster.py", plane, worker)
        first = deploy(hosts, inventory=inventory, roles=ROLES)
        assert first.returncode == 0, first.output
        yield plane, worker, inventory, first.output


def _versions(host: LabHost) -> dict[str, str]:
    out = remote.run(host, "dpkg-query -W -f '${Package} ${Version}\\n' " + " ".join(PINS))
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.mark.invariant("k8s-not-k3s")
def test_both_hosts_have_exactly_the_pins_although_apt_offers_newer(cluster: tuple[LabHost, LabHost, str, str]) -> None:
    plane, worker, _, _ = cluster
    for host in (plane, worker):
        assert _versions(host) == PINS
        assert set(remote.run(host, "apt-mark showhold").split()) >= set(PINS)
        offered = remote.run(host, "apt-cache madison kubeadm | awk '{print $3}'").split()
        assert DECOY in offered and PINS["kubeadm"] in offered  # without the pin apt would take the decoy
        assert remote.run(host, "kubeadm version -o short").strip() == "v1.31.4"


def test_the_control_plane_started_the_cluster_and_the_worker_joined_it(
    cluster: tuple[LabHost, LabHost, str, str],
) -> None:
    plane, worker, _, output = cluster
    assert remote.run(plane, "test -s /etc/kubernetes/admin.conf && echo yes").strip() == "yes"
    joined = remote.run(worker, "cat /var/lib/ironserve-lab/kubeadm-join.log")
    tokens = json.loads(remote.run(plane, "cat /etc/kubernetes/.ironserve-lab/bootstrap-tokens.json"))
    made = [entry["token"] for entry in tokens if entry.get("description") == f"ironserve: join {worker.name}"]
    assert made and made[-1].split(".")[0] in joined, (joined, tokens)
    assert f"{plane.ssh_address}:6443" in joined
    # The token was only ever in the uploaded file, which is gone; never on a command line or in the output.
    assert remote.run(worker, "test -e /etc/kubernetes/ironserve-join && echo left || echo gone").strip() == "gone"
    assert made[-1].split(".")[1] not in output and made[-1].split(".")[1] not in joined


def test_a_second_run_changes_nothing(cluster: tuple[LabHost, LabHost, str, str]) -> None:
    plane, worker, inventory, _ = cluster
    again = deploy([plane, worker], inventory=inventory, roles=ROLES)
    assert again.returncode == 0, again.output
    assert (again.changed, again.errors) == (0, 0), again.output


def test_drift_is_restored_then_nothing_changes(cluster: tuple[LabHost, LabHost, str, str]) -> None:
    plane, worker, inventory, _ = cluster
    remote.run(
        worker,
        "apt-mark unhold kubeadm kubelet >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
        f"--allow-change-held-packages kubeadm={DECOY} kubelet={DECOY} cri-tools={DECOY} >/dev/null 2>&1 && "
        "sed -i 's/^cgroupDriver: systemd/cgroupDriver: cgroupfs/' /var/lib/kubelet/config.yaml",
    )
    # Files the kubelet and kubeadm run as root with, opened to others: the gate names them, the deploy closes them.
    remote.run(plane, "chmod 0666 /var/lib/kubelet/config.yaml && chmod 0777 /etc/kubernetes")
    assert _versions(worker)["kubeadm"] == DECOY
    gate = verify([plane, worker], "-q", "-rfE", roles=ROLES, inventory=inventory)
    assert any(
        "test_files_deciding_what_runs_as_root_are_root_only" in line and plane.name in line
        for line in gate.stdout.splitlines()
    ), gate.stdout[-4000:]
    fixed = deploy([plane, worker], inventory=inventory, roles=ROLES)
    assert fixed.returncode == 0, fixed.output
    assert fixed.changed > 0
    assert _versions(worker) == PINS
    assert set(remote.run(worker, "apt-mark showhold").split()) >= set(PINS)
    assert "cgroupDriver: systemd" in remote.run(worker, "cat /var/lib/kubelet/config.yaml")
    modes = remote.run(plane, "stat -c %a:%U:%G /var/lib/kubelet/config.yaml /etc/kubernetes").split()
    assert modes == ["644:root:root", "755:root:root"], modes
    again = deploy([plane, worker], inventory=inventory, roles=ROLES)
    assert (again.returncode, again.changed) == (0, 0), again.output


def _runc_on_cgroupfs_stops_the_kubernetes_role(
    cluster: tuple[LabHost, LabHost, str, str], drift: str, undo: str
) -> None:
    """`drift` on the worker puts containerd's runc on cgroupfs: a deploy of the kubernetes role alone stops that
    host naming it; after `undo`, a deploy of both hosts succeeds."""
    plane, worker, inventory, _ = cluster
    remote.run(worker, drift)
    try:
        stopped = deploy([worker], inventory=inventory, roles=("kubernetes",))
        assert stopped.returncode != 0, stopped.output
        assert "runc uses cgroupfs" in stopped.output, stopped.output
    finally:
        remote.run(worker, undo)
    restored = deploy([plane, worker], inventory=inventory, roles=ROLES)
    assert restored.returncode == 0, restored.output


def test_containerd_on_another_driver_stops_the_host_before_its_kubelet_restarts(
    cluster: tuple[LabHost, LabHost, str, str],
) -> None:
    # A site drop-in imported by containerd, which ironserve's config.toml does not own: containerd's runc on
    # cgroupfs in force, while the file ironserve renders still says SystemdCgroup = true.
    drop_in = "/etc/containerd/conf.d/99-site.toml"
    _runc_on_cgroupfs_stops_the_kubernetes_role(
        cluster,
        "mkdir -p /etc/containerd/conf.d && printf '%s\\n' 'version = 2' "
        "'[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]' 'SystemdCgroup = false' "
        f"> {drop_in} && sed -i '1a imports = [\"{drop_in}\"]' /etc/containerd/config.toml",
        undo=f"rm -f {drop_in}",
    )


def test_containerd_started_with_another_config_stops_the_host_before_its_kubelet_restarts(
    cluster: tuple[LabHost, LabHost, str, str],
) -> None:
    """A `systemctl edit` drop-in starts containerd with another --config whose runc is on cgroupfs, while
    config.toml still says SystemdCgroup = true: the kubernetes role alone reads the running daemon's config and
    stops the host (the container_runtime role, when it runs first, moves the drop-in aside)."""
    override = "/etc/systemd/system/containerd.service.d/override.conf"
    other = "/etc/containerd/other.toml"
    _runc_on_cgroupfs_stops_the_kubernetes_role(
        cluster,
        f"sed 's/SystemdCgroup = true/SystemdCgroup = false/' /etc/containerd/config.toml > {other} && "
        f"mkdir -p /etc/systemd/system/containerd.service.d && printf '[Service]\\nExecStart=\\n"
        f'ExecStart=%s --config {other}\\n\' "$(command -v containerd)" > {override} && '
        "systemctl daemon-reload && systemctl restart containerd",
        undo=f"rm -f {override} {other} && systemctl daemon-reload && systemctl restart containerd",
    )


def test_a_new_minor_pinned_stops_the_control_plane_before_any_package_moves(
    cluster: tuple[LabHost, LabHost, str, str], tmp_path: Path
) -> None:
    plane, worker, _, _ = cluster
    upgraded = _inventory(tmp_path / "minor.py", plane, worker, kubernetes_version="1.32.0")
    result = deploy([plane], inventory=upgraded, roles=ROLES)
    assert result.returncode != 0, result.output
    assert "kubeadm upgrade apply v1.32.0" in result.output
    assert _versions(plane) == PINS


def test_the_gate_passes(cluster: tuple[LabHost, LabHost, str, str]) -> None:
    plane, worker, inventory, _ = cluster
    gate = verify([plane, worker], roles=ROLES, inventory=inventory)
    assert gate.returncode == 0, gate.stdout + gate.stderr
