"""The lab's Kubernetes repository (pkgs.k8s.io's layout) and its stand-in programs, run in a folder as their root.

Real outputs these are held to (the strings in lab/src/ironserve_lab/standin_kubernetes.py cite them):
- `kubeadm version` of v1.31.4 and `apt-cache madison kubeadm` of pkgs.k8s.io's v1.31 repository: a captured
  kubeadm 1.31.0 -> 1.31.4 upgrade session (found by code search), also `kubelet --version` -> Kubernetes v1.31.4.
- kubelet 1.31 before `kubeadm init` on Debian 12 (journal): `E0117 16:14:53.701110   17651 run.go:72] "command
  failed" err="failed to load kubelet config file, path: /var/lib/kubelet/config.yaml, error: ..."`.
- kubelet's Depends, sections and summaries: pkgs.k8s.io Packages as quoted in kubernetes/release issues and
  other projects' fixtures; the unit and drop-in: kubernetes/release#3279, #3392, #3625.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ironserve_lab import aptrepo, inventory, state
from ironserve_lab import standin_kubernetes as standin

STANDIN = Path(standin.__file__)
INIT_CONFIG = """\
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: 192.0.2.10
nodeRegistration:
  name: cp-1
  kubeletExtraArgs:
  - name: node-ip
    value: 192.0.2.10
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: v1.31.4
networking:
  podSubnet: 10.244.0.0/16  # the pods
---
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
maxPods: 64
"""


def run(root: Path, *args: str, version: str = "1.31.4", **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "IRONSERVE_STANDIN_KUBERNETES_ROOT": str(root),
        "IRONSERVE_STANDIN_KUBERNETES_VERSION": version,
        **env,
    }
    return subprocess.run([sys.executable, str(STANDIN), *args], capture_output=True, text=True, env=environment)


def offered() -> dict[tuple[str, str], aptrepo.StandinPackage]:
    return {(p.name, p.version): p for p in aptrepo.kubernetes_catalog()}


def test_repository_offers_the_pinned_set_and_newer_decoys() -> None:
    versions: dict[str, list[str]] = {}
    for name, version in offered():
        versions.setdefault(name, []).append(version)
    assert versions == {
        "kubeadm": ["1.31.4-1.1", "1.31.9-1.1", "1.32.0-1.1"],
        "kubelet": ["1.31.4-1.1", "1.31.9-1.1", "1.32.0-1.1"],
        "kubectl": ["1.31.4-1.1", "1.31.9-1.1", "1.32.0-1.1"],
        "cri-tools": ["1.31.1-1.1", "1.32.0-1.1"],
        "kubernetes-cni": ["1.5.1-1.1", "1.6.0-1.1"],
    }
    assert aptrepo.kubernetes_repo_path() == "kubernetes/core:/stable:/v1.31/deb"


def test_packages_carry_pkgs_k8s_io_control_fields(tmp_path: Path) -> None:
    kubelet = offered()[("kubelet", "1.31.4-1.1")]
    deb = aptrepo.build_deb(kubelet, tmp_path)
    fields = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "Section: net\n" in fields and "Homepage: https://kubernetes.io\n" in fields
    assert "Description: Node agent for Kubernetes clusters\n" in fields
    depends = "iptables (>= 1.4.21), kubernetes-cni (>= 1.2.0), iproute2, mount, util-linux, ethtool, conntrack"
    assert f"Depends: {depends}\n" in fields
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    for installed in ("./usr/bin/kubelet", "./usr/lib/systemd/system/kubelet.service", "./etc/default/kubelet"):
        assert installed in listing
    assert offered()[("kubeadm", "1.31.4-1.1")].depends == "cri-tools (>= 1.30.0)"
    assert offered()[("kubeadm", "1.32.0-1.1")].depends == ""  # krel's metadata.yaml: no dependency from 1.32
    assert {"/opt/cni/bin/bridge", "/opt/cni/bin/loopback"} <= set(offered()[("kubernetes-cni", "1.5.1-1.1")].files)


def test_unit_and_drop_in_are_the_packaged_ones() -> None:
    kubeadm = offered()[("kubeadm", "1.31.4-1.1")]
    dropin = kubeadm.files["/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"][0]
    assert "EnvironmentFile=-/etc/default/kubelet\n" in dropin  # the deb's, not the rpm's /etc/sysconfig
    assert dropin.endswith(
        "ExecStart=\nExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS "
        "$KUBELET_EXTRA_ARGS\n"
    )
    unit = offered()[("kubelet", "1.31.4-1.1")].files["/usr/lib/systemd/system/kubelet.service"][0]
    assert "ExecStart=/usr/bin/kubelet\nRestart=always\nStartLimitInterval=0\nRestartSec=10\n" in unit
    wrapper = offered()[("kubelet", "1.31.4-1.1")].files["/usr/bin/kubelet"][0]
    assert "ironserve lab stand-in" in wrapper and "IRONSERVE_STANDIN_KUBERNETES_VERSION=1.31.4 " in wrapper


def test_versions_print_as_the_real_tools(tmp_path: Path) -> None:
    assert run(tmp_path, "kubeadm", "version", "-o", "short").stdout == "v1.31.4\n"
    assert run(tmp_path, "kubeadm", "version").stdout == (
        'kubeadm version: &version.Info{Major:"1", Minor:"31", GitVersion:"v1.31.4", '
        'GitCommit:"a78aa47129b8539636eb86a9d00e31b2720fe06b", GitTreeState:"clean", '
        'BuildDate:"2024-12-10T11:42:09Z", GoVersion:"go1.22.9", Compiler:"gc", Platform:"linux/amd64"}\n'
    )
    assert run(tmp_path, "kubelet", "--version").stdout == "Kubernetes v1.31.4\n"
    assert (
        run(tmp_path, "kubectl", "version", "--client").stdout == "Client Version: v1.31.4\nKustomize Version: v5.4.2\n"
    )
    client = json.loads(run(tmp_path, "kubectl", "version", "--client", "-o", "json").stdout)
    assert client["clientVersion"]["gitVersion"] == "v1.31.4" and client["kustomizeVersion"] == "v5.4.2"
    assert run(tmp_path, "crictl", "--version", version="1.31.1").stdout == "crictl version v1.31.1\n"
    plugin = run(tmp_path, "cni-bridge", version="1.5.1", CNI_COMMAND="VERSION")
    assert json.loads(plugin.stdout)["cniVersion"] == "1.1.0"
    assert "ironserve lab stand-in" in run(tmp_path, "kubeadm", "--help").stdout


def test_kubelet_fails_without_its_config_like_the_real_one(tmp_path: Path) -> None:
    result = run(
        tmp_path, "kubelet", "--kubeconfig=/etc/kubernetes/kubelet.conf", "--config=/var/lib/kubelet/config.yaml"
    )
    assert result.returncode == 1
    assert re.fullmatch(
        r'E\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ run\.go:72\] "command failed" err="failed to load kubelet config file, '
        r"path: /var/lib/kubelet/config\.yaml, error: failed to load Kubelet config file "
        r"/var/lib/kubelet/config\.yaml, error failed to read kubelet config file "
        r'\\"/var/lib/kubelet/config\.yaml\\", error: open '
        r'/var/lib/kubelet/config\.yaml: no such file or directory"\n',
        result.stderr,
    )


def test_init_writes_the_control_plane_and_refuses_a_second_time(tmp_path: Path) -> None:
    config = tmp_path / "init.yaml"
    config.write_text(INIT_CONFIG)
    root = tmp_path / "root"
    init = run(root, "kubeadm", "init", "--config", str(config), "--skip-token-print")
    assert init.returncode == 0, init.stderr
    assert init.stdout.startswith("[init] Using Kubernetes version: v1.31.4\n[preflight] Running pre-flight checks\n")
    assert "Your Kubernetes control-plane has initialized successfully!" in init.stdout
    assert "[bootstrap-token] Using token" not in init.stdout and "--token <value withheld>" in init.stdout
    subject = subprocess.run(
        ["openssl", "x509", "-noout", "-subject", "-in", str(root / "etc/kubernetes/pki/ca.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert subject.strip() == "subject=CN = kubernetes"
    pin = standin.ca_cert_hash(root / "etc/kubernetes/pki/ca.crt")
    assert f"--discovery-token-ca-cert-hash {pin}" in init.stdout
    admin = yaml.safe_load((root / "etc/kubernetes/admin.conf").read_text())
    assert admin["clusters"][0]["cluster"]["server"] == "https://192.0.2.10:6443"
    manifest = yaml.safe_load((root / "etc/kubernetes/manifests/kube-apiserver.yaml").read_text())
    assert manifest["spec"]["containers"][0]["image"] == "registry.k8s.io/kube-apiserver:v1.31.4"
    assert (root / "var/lib/kubelet/config.yaml").read_text().endswith("cgroupDriver: systemd\nmaxPods: 64\n")
    flags = (root / "var/lib/kubelet/kubeadm-flags.env").read_text()
    assert "--container-runtime-endpoint=unix:///var/run/containerd/containerd.sock" in flags
    assert "--node-ip=192.0.2.10" in flags

    again = run(root, "kubeadm", "init", "--config", str(config))
    assert again.returncode == 1
    assert again.stderr.startswith("error execution phase preflight: [preflight] Some fatal errors occurred:\n")
    assert (
        "\t[ERROR FileAvailable--etc-kubernetes-manifests-kube-apiserver.yaml]: "
        "/etc/kubernetes/manifests/kube-apiserver.yaml already exists\n" in again.stderr
    )

    created = run(root, "kubeadm", "token", "create", "--ttl", "10m0s")
    assert re.fullmatch(r"[a-z0-9]{6}\.[a-z0-9]{16}\n", created.stdout), created
    tokens = json.loads((root / "etc/kubernetes/.ironserve-lab/bootstrap-tokens.json").read_text())
    assert [t["ttl"] for t in tokens] == ["24h0m0s", "10m0s"] and tokens[-1]["token"] == created.stdout.strip()


def test_token_create_needs_the_admin_kubeconfig(tmp_path: Path) -> None:
    result = run(tmp_path, "kubeadm", "token", "create")
    assert result.returncode == 1
    assert result.stderr.startswith(
        "failed to load admin kubeconfig: open /etc/kubernetes/admin.conf: no such file or directory\n"
    )


def join_config(token: str, pin: str) -> str:
    return (
        "apiVersion: kubeadm.k8s.io/v1beta4\nkind: JoinConfiguration\ndiscovery:\n  bootstrapToken:\n"
        f"    apiServerEndpoint: 192.0.2.10:6443\n    token: {token}\n    caCertHashes:\n    - {pin}\n"
        "nodeRegistration:\n  name: worker-1\n"
    )


def test_join_records_the_token_id_and_pin_and_refuses_a_joined_node(tmp_path: Path) -> None:
    pin = "sha256:" + "ab" * 32
    config = tmp_path / "join.yaml"
    config.write_text(join_config("abcdef.0123456789abcdef", pin))
    root = tmp_path / "root"
    joined = run(root, "kubeadm", "join", "--config", str(config))
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.endswith(
        "\nThis node has joined the cluster:\n"
        "* Certificate signing request was sent to apiserver and a response was received.\n"
        "* The Kubelet was informed of the new secure connection details.\n\n"
        "Run 'kubectl get nodes' on the control-plane to see this node join the cluster.\n\n"
    )
    log = (root / "var/lib/ironserve-lab/kubeadm-join.log").read_text()
    assert f"token-id=abcdef endpoint=192.0.2.10:6443 ca-cert-hashes={pin} node=worker-1" in log
    assert "0123456789abcdef" not in log
    assert (root / "etc/kubernetes/kubelet.conf").exists() and (root / "var/lib/kubelet/config.yaml").exists()
    again = run(root, "kubeadm", "join", "--config", str(config))
    assert again.returncode == 1
    assert (
        "[ERROR FileAvailable--etc-kubernetes-kubelet.conf]: /etc/kubernetes/kubelet.conf already exists"
        in again.stderr
    )


@pytest.mark.parametrize(
    ("token", "pin", "message"),
    [
        ("ABCDEF.0123456789abcdef", "sha256:" + "ab" * 32, "the bootstrap token is invalid"),
        ("abcdef.0123456789abcdef", "sha256:abc", "invalid hash"),
    ],
)
def test_join_refuses_a_malformed_token_or_pin(tmp_path: Path, token: str, pin: str, message: str) -> None:
    config = tmp_path / "join.yaml"
    config.write_text(join_config(token, pin))
    result = run(tmp_path / "root", "kubeadm", "join", "--config", str(config))
    assert result.returncode == 1 and message in result.stderr
    assert not (tmp_path / "root/etc/kubernetes/kubelet.conf").exists()


def test_what_is_not_simulated_says_so(tmp_path: Path) -> None:
    result = run(tmp_path, "kubeadm", "reset", "-f")
    assert (result.returncode, result.stderr) == (2, "ironserve lab stand-in: kubeadm reset -f is not simulated\n")


def test_yaml_subset_reads_what_pyyaml_writes() -> None:
    """The stand-in (no PyYAML on a lab host) reads a kubeadm file as PyYAML writes it."""
    document = {
        "apiVersion": "kubeadm.k8s.io/v1beta4",
        "kind": "JoinConfiguration",
        "discovery": {
            "bootstrapToken": {
                "apiServerEndpoint": "10.0.0.1:6443",
                "caCertHashes": ["sha256:" + "0" * 64],
                "token": "abcdef.0123456789abcdef",
                "unsafeSkipCAVerification": False,
            }
        },
        "nodeRegistration": {
            "kubeletExtraArgs": [{"name": "node-ip", "value": "10.0.0.2"}],
            "name": "worker-1",
            "taints": [],
        },
        "timeouts": {"discovery": "5m0s"},
        "note": "a: 'quoted' # not a comment",
    }
    assert standin.parse_yaml(yaml.safe_dump(document)) == document


def test_lab_inventory_points_the_kubernetes_role_at_the_mirror() -> None:
    host = state.LabHost(
        name="lab-c1",
        kind="container",
        ssh_address="10.213.0.11",
        extra={"aptrepo_url": "http://10.213.0.1:40187", "aptrepo_key": "/cache/mirror-keyring.gpg"},
    )
    _, data = inventory._entry(host)
    assert data["kubernetes_repo_url"] == "http://10.213.0.1:40187/kubernetes/core:/stable:"
    assert data["kubernetes_repo_key"] == "/cache/mirror-keyring.gpg"
