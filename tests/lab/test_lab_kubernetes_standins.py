"""The lab mirror's Kubernetes repository on real lab hosts: apt, the pins against the decoys, kubelet's crash loop,
kubeadm init on one host and a join of the other with the token and CA pin the first one gives.

Outputs compared with real captures: `apt-cache madison kubeadm` of pkgs.k8s.io (`kubeadm | 1.31.4-1.1 |
https://pkgs.k8s.io/core:/stable:/v1.31/deb  Packages`), and kubelet 1.31 on Debian 12 before `kubeadm init`
(`systemctl status kubelet`: `Drop-In: /usr/lib/systemd/system/kubelet.service.d`, journal: `run.go:72] "command
failed" err="failed to load kubelet config file, path: /var/lib/kubelet/config.yaml, ...`), both cited in
lab/src/ironserve_lab/standin_kubernetes.py.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from ironserve_lab import aptrepo
from ironserve_lab.state import LabHost
from tests.lab.ssh import ssh_run

pytestmark = pytest.mark.lab

KEYRING = "/etc/apt/keyrings/kubernetes-apt-keyring.gpg"
SOURCES = "/etc/apt/sources.list.d/kubernetes.list"
PINNED = "kubeadm=1.31.4-1.1 kubelet=1.31.4-1.1 kubectl=1.31.4-1.1 cri-tools=1.31.1-1.1 kubernetes-cni=1.5.1-1.1"
PACKAGES = "kubeadm kubelet kubectl cri-tools kubernetes-cni"


def must(host: LabHost, command: str, timeout: float = 300) -> str:
    rc, out, err = ssh_run(host, command, timeout=timeout)
    assert rc == 0, f"{host.name}: {command}: {out}{err}"
    return out


def write(host: LabHost, remote_path: str, content: bytes) -> None:
    encoded = base64.b64encode(content).decode()
    must(host, f"mkdir -p {shlex.quote(str(Path(remote_path).parent))} && echo {encoded} | base64 -d > {remote_path}")


@pytest.fixture(scope="module")
def kubernetes_hosts(container_hosts: list[LabHost]) -> Iterator[list[LabHost]]:
    """Both lab hosts with the lab's Kubernetes repository as the role would add it; put back afterwards."""
    for host in container_hosts:
        write(host, KEYRING, Path(host.extra["aptrepo_key"]).read_bytes())
        url = f"{host.extra['aptrepo_url']}/{aptrepo.kubernetes_repo_path()}/"
        must(host, f"echo 'deb [signed-by={KEYRING}] {url} /' > {SOURCES} && apt-get update")
    yield container_hosts
    for host in container_hosts:
        must(host, f"systemctl disable --now kubelet || true; apt-get purge -y --autoremove {PACKAGES}")
        must(
            host, f"rm -rf /etc/kubernetes /var/lib/kubelet /var/lib/ironserve-lab/kubeadm-join.log {SOURCES} {KEYRING}"
        )
        must(host, "apt-get update")


def test_without_pins_apt_would_take_the_decoys(kubernetes_hosts: list[LabHost]) -> None:
    host = kubernetes_hosts[0]
    policy = must(host, "apt-cache policy kubeadm cri-tools kubernetes-cni")
    candidates = re.findall(r"^  Candidate: (\S+)$", policy, re.M)
    assert candidates == ["1.32.0-1.1", "1.32.0-1.1", "1.6.0-1.1"]
    madison = must(host, "apt-cache madison kubeadm").splitlines()
    base = f"{host.extra['aptrepo_url']}/{aptrepo.kubernetes_repo_path()}"
    assert madison[-1] == f"   kubeadm | 1.31.4-1.1 | {base}  Packages"


def test_the_pinned_set_installs_and_kubelet_crash_loops_until_kubeadm(kubernetes_hosts: list[LabHost]) -> None:
    for host in kubernetes_hosts:
        must(host, f"DEBIAN_FRONTEND=noninteractive apt-get install -y {PINNED}", timeout=600)
        must(host, "systemctl enable --now kubelet")
    host = kubernetes_hosts[0]
    installed = must(host, f"dpkg-query -W -f '${{Package}}=${{Version}}\\n' {PACKAGES}").split()
    assert sorted(installed) == sorted(PINNED.split())
    assert must(host, "kubeadm version -o short") == "v1.31.4\n"
    assert must(host, "kubelet --version") == "Kubernetes v1.31.4\n"
    assert must(host, "crictl --version") == "crictl version v1.31.1\n"
    status = ssh_run(host, "sleep 1; systemctl status kubelet --no-pager")[1]
    assert "Drop-In: /usr/lib/systemd/system/kubelet.service.d" in status and "status=1/FAILURE" in status
    journal = must(host, "journalctl -u kubelet --no-pager")
    assert (
        'run.go:72] "command failed" err="failed to load kubelet config file, path: /var/lib/kubelet/config.yaml'
        in journal
    )


def test_init_then_join_with_the_control_planes_token_and_pin(kubernetes_hosts: list[LabHost]) -> None:
    control_plane, worker = kubernetes_hosts
    init = (
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: InitConfiguration\nlocalAPIEndpoint:\n"
        f"  advertiseAddress: {control_plane.ssh_address}\n---\n"
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: v1.31.4\n---\n"
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: systemd\n"
    )
    write(control_plane, "/root/kubeadm-init.yaml", init.encode())
    output = must(control_plane, "kubeadm init --config /root/kubeadm-init.yaml --skip-token-print --upload-certs")
    assert "Your Kubernetes control-plane has initialized successfully!" in output
    assert must(control_plane, "sleep 1; systemctl is-active kubelet") == "active\n"  # its config is there now
    assert (
        must(control_plane, "pgrep -x kubelet").strip()
        == must(control_plane, "systemctl show -P MainPID kubelet").strip()
    )
    token = must(control_plane, "kubeadm token create --ttl 10m0s").strip()
    assert re.fullmatch(r"[a-z0-9]{6}\.[a-z0-9]{16}", token)
    pin = (
        "sha256:"
        + must(
            control_plane,
            "openssl x509 -pubkey -noout -in /etc/kubernetes/pki/ca.crt | openssl pkey -pubin -outform der | sha256sum",
        ).split()[0]
    )
    assert f"--discovery-token-ca-cert-hash {pin}" in output

    join = (
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: JoinConfiguration\ndiscovery:\n  bootstrapToken:\n"
        f"    apiServerEndpoint: {control_plane.ssh_address}:6443\n    token: {token}\n    caCertHashes:\n"
        f"    - {pin}\n"
    )
    write(worker, "/root/kubeadm-join.yaml", join.encode())
    joined = must(worker, "kubeadm join --config /root/kubeadm-join.yaml")
    assert "This node has joined the cluster:" in joined
    record = must(worker, "cat /var/lib/ironserve-lab/kubeadm-join.log")
    token_id, secret = token.split(".")
    assert f"token-id={token_id} endpoint={control_plane.ssh_address}:6443 ca-cert-hashes={pin}" in record
    assert secret not in record
    known = json.loads(must(control_plane, "cat /etc/kubernetes/.ironserve-lab/bootstrap-tokens.json"))
    assert token_id in {entry["token"].split(".")[0] for entry in known}
    assert must(worker, "sleep 1; systemctl is-active kubelet") == "active\n"
    refused = ssh_run(worker, "kubeadm join --config /root/kubeadm-join.yaml")
    assert refused[0] == 1 and "[ERROR FileAvailable--etc-kubernetes-kubelet.conf]" in refused[2]
