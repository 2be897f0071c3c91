"""One mistake of each class of issue 33, on every entry point: `ironserve validate`, the real `pyinfra INVENTORY
deploy.py` command line with hosts that must not be contacted, and deploy.py's own check inside pyinfra.

Each class's case is one host of one inventory, so one pyinfra run (about 3 s) proves them all: refused before any
connection (a TCP listener of this test on 127.0.0.1 counts them, the other hosts are TEST-NET-1, never routed),
each line naming the host, the key and what is accepted, and no credential anywhere in the output. The full
table of cases per class is tests/unit/test_inventory_mistakes.py (stack_config) and test_cluster_mistakes.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyinfra.api.exceptions import DeployError

from ironserve import cli
from ironserve.deploying import config_for
from ironserve.inventory import REPORT_TITLE, load_inventory, validate_inventory
from ironserve.paths import REPO_ROOT
from ironserve.registry import registry
from tests.unit.test_inventory_boundary import Listener

DEPLOY = str(REPO_ROOT / "deploy.py")
SECRET = "sk-" + "e5" * 20
KUBERNETES = {"ironserve_roles": "kubernetes"}

# class -> (one host's inventory data, words its report line carries besides the host)
CLASSES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "ports-collide": (
        {"inference_service": {"swap": {"listen_port": 2379}}},
        ("inference_service.swap.listen_port", "etcd (client)", "accepted: one port per listener"),
    ),
    "boolean-as-number": (
        {"ironserve_reboot_timeout_s": True},
        ("ironserve_reboot_timeout_s", "a boolean is not a number", "accepted: a number"),
    ),
    "duration-grammar": (
        {"inference_service": {"slo": {"fast_window": "1 minute"}}},
        ("inference_service", "slo.fast_window", "not a Prometheus duration", "accepted: digits with units"),
    ),
    "offload-spelling": (
        {"inference_service": {"engine": {"extra_args": ["--cpu_offload_gb=4"]}}},
        ("inference_service", "CPU offload is not allowed"),
    ),
    "scoped-listen-address": (
        {"inference_listen_address": "fe80::1%eth0"},
        ("inference_listen_address", "with a scope", "accepted: this host's address"),
    ),
    "credential-named-key": (
        {"inference_api_key": SECRET},
        ("inference_api_key", "unknown key (got ***)", "accepted:"),
    ),
    "unknown-service-section": (
        {"inference_service": {"swpa": {"listen_port": 8081}}},
        ("inference_service", "unknown section 'swpa'", "accepted: chaos, engine"),
    ),
    "kubelet-anonymous-auth": (
        {**KUBERNETES, "kubernetes_kubelet": {"authentication": {"anonymous": {"enabled": True}}}},
        ("kubernetes_kubelet", "kubelet-anonymous-auth", "kubernetes_allow_insecure"),
    ),
    "apiserver-always-allow": (
        {**KUBERNETES, "kubernetes_cluster": {"apiServer": {"extraArgs": {"authorization-mode": "AlwaysAllow"}}}},
        ("kubernetes_cluster", "apiserver-always-allow", "kubernetes_allow_insecure"),
    ),
    "api-server-on-kubelet-port": (
        {**KUBERNETES, "kubernetes_api_server_port": 10250},
        ("port 10250", "kubelet API", "kubernetes_api_server_port", "accepted: one port per listener"),
    ),
    "host-inside-pod-subnet": (
        {"ironserve_roles": "kubernetes", "ssh_hostname": "10.244.7.7"},
        ("kubernetes_pod_subnet", "contains 10.244.7.7", "ssh_hostname", "accepted: a network apart"),
    ),
    "loopback-advertise-address": (
        {**KUBERNETES, "kubernetes_advertise_address": "127.0.0.1"},
        ("kubernetes_advertise_address", "loopback", "kubernetes_allow_local_address"),
    ),
    "plain-http-registry-mirror": (
        {"container_runtime_registry_mirrors": {"registry.k8s.io": "http://mirror.lab:5000"}},
        ("container_runtime_registry_mirrors", "plain http", "container_runtime_allow_plain_http"),
    ),
    "acme-staging": (
        {"cluster_addons_acme_server": "https://acme-staging-v02.api.letsencrypt.org/directory"},
        ("cluster_addons_acme_server", "staging directory", "cluster_addons_acme_staging"),
    ),
    "token-variable-names-another-secret": (
        {"cluster_addons_cloudflare_token_env": "IRONSERVE_REDFISH_PASSWORD"},
        ("cluster_addons_cloudflare_token_env", "iDRAC password", "accepted: a variable of its own"),
    ),
}


def _inventory(path: Path, port: int) -> Path:
    hosts = []
    for number, (name, (data, _)) in enumerate(CLASSES.items()):
        connect = {"ssh_hostname": "127.0.0.1", "ssh_port": port} if number == 0 else {"ssh_hostname": "192.0.2.1"}
        hosts.append((f"{name}.invalid", {**connect, **data}))  # a case's own ssh_hostname comes last
    path.write_text(
        f"from ironserve.inventory import site\n\ngpu_servers = site({hosts!r}, {{'ssh_connect_retries': 0}})\n",
        encoding="utf-8",
    )
    return path


def _assert_every_class_named(output: str) -> None:
    for name, (_, words) in CLASSES.items():
        lines = [line for line in output.splitlines() if f"host {name}.invalid: " in line]
        assert any(all(word in line for word in words) for line in lines), (name, words, lines)
    assert SECRET not in output and SECRET[3:15] not in output
    assert "Traceback" not in output


def test_pyinfra_refuses_every_class_before_connecting(tmp_path: Path) -> None:
    listener = Listener()
    try:
        inventory = _inventory(tmp_path / "inventory.py", listener.port)
        run = subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", str(inventory), DEPLOY],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        listener.close()
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert REPORT_TITLE in output
    assert "Connecting" not in output and "Connected" not in output
    assert listener.connections == 0
    _assert_every_class_named(output)


def test_ironserve_validate_refuses_every_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = _inventory(tmp_path / "inventory.py", 9)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["validate", str(inventory)])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    _assert_every_class_named(captured.out + captured.err)


def test_a_host_address_inside_another_hosts_pod_subnet_is_named(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.py"
    hosts = [("cp.invalid", KUBERNETES), ("gpu.invalid", {"inference_listen_address": "10.244.0.9"})]
    inventory.write_text(f"from ironserve.inventory import site\n\ng = site({hosts!r})\n", encoding="utf-8")
    _, problems = validate_inventory(load_inventory(str(inventory)), registry())
    assert any(
        line.startswith(
            "host cp.invalid: kubernetes_pod_subnet: 10.244.0.0/16 contains 10.244.0.9, host gpu.invalid's "
            "inference_listen_address"
        )
        for line in problems
    ), problems


@pytest.mark.parametrize("name", CLASSES)
def test_deploy_py_inside_pyinfra_refuses_each_class(name: str) -> None:
    data, words = CLASSES[name]
    pyinfra_host = SimpleNamespace(name=f"{name}.invalid", data=SimpleNamespace(dict=lambda: data))
    with pytest.raises(DeployError) as error:
        config_for(pyinfra_host, registry())
    message = str(error.value)
    assert message.startswith("invalid inventory, nothing was changed:\n"), message
    assert any(all(word in line for word in words) for line in message.splitlines()), message
    assert SECRET[3:15] not in message
