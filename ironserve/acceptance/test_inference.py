"""Acceptance: roles/inference (areas inference_service, hot_swap, python_runtime, and Envoy's ingress settings).

Everything is observed on the host through its own interfaces: etcd's JSON gateway, Envoy's admin
(loopback) and listener, the engines' HTTP API, systemd, /proc and the venv's pip. On a lab host the
engine is vLLM's CPU build serving a tiny model; the GPU-only checks of torch are in test_nvidia.py.
A host in `inference_mode: kubernetes` runs only the tests named test_kubernetes_mode_* (its engines are
pods; the others only the systemd mode's); of those, test_kubernetes_mode_cluster_* read the cluster on a control
plane with kubeadm's admin kubeconfig (workers skip them).
"""

from __future__ import annotations

import base64
import json
import posixpath
import shlex
from typing import Any

import pytest
from ironserve_service.artifacts import MANIFEST_NAME, parse_manifest
from ironserve_service.kube_objects import CONTAINER, SCALER_ACCOUNT, deployment_name
from ironserve_service.router import parse_api_keys
from ironserve_service.settings import COLOURS

from ironserve import manifests
from ironserve.acceptance.checks import admin_dropins, not_root_only
from ironserve.kubectl import ADMIN_KUBECONFIG
from roles import StackConfig
from roles.inference import (
    COMPONENTS,
    ENGINE_TEMPLATE,
    KUBERNETES_OBJECTS,
    LOCK_PATH,
    PORTS_SYSCTL_FILE,
    SERVE_UNIT,
    TMPFILES,
    UNIT_DIR,
    WHEEL_DIR,
)
from roles.inference.facts import ModelStore
from roles.inference.operations import model_store_problems, model_version_dir, parse_port_list
from roles.inference.render import canonical, environment_drift, lock_pins, service_yaml
from roles.inference.render_kubernetes import deploy_objects, host_settings
from roles.inference.settings import API_KEYS_PATH, CONFIG_PATH, ENGINE_UNIT


def _python(host: Any, config: StackConfig, code: str) -> Any:
    return host.run(f"{config.inference.venv}/bin/python -c {shlex.quote(code)}")


def _http(
    host: Any, config: StackConfig, url: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON or text, headers) of a request made on the host with the venv's Python."""
    data = "None" if body is None else repr(json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    code = (
        "import json, urllib.request, urllib.error\n"
        f"req = urllib.request.Request({url!r}, data={data}, headers={headers!r})\n"
        "try:\n    r = urllib.request.urlopen(req, timeout=60)\n"
        "except urllib.error.HTTPError as e:\n    r = e\n"
        "print(json.dumps([r.status, r.read().decode(), dict(r.headers)]))"
    )
    result = _python(host, config, code)
    assert result.rc == 0, result.stderr
    status, text, headers = json.loads(result.stdout)
    try:
        return status, json.loads(text), headers
    except json.JSONDecodeError:
        return status, text, headers


def _service(config: StackConfig) -> Any:
    return host_settings(config)


@pytest.fixture(autouse=True)
def _serving_mode(request: pytest.FixtureRequest, config: StackConfig) -> None:
    kubernetes_test = request.node.name.startswith("test_kubernetes_mode_")
    if (config.inference.mode == "kubernetes") != kubernetes_test:
        pytest.skip(f"inference_mode is {config.inference.mode} on this host")


# A drop-in can re-point any of them: another config, user, port or ExecStart than the deploy's.
@pytest.mark.invariant("sec-non-root-service", "svc-engine-vllm", "ingress-envoy", "hot-swap-etcd-key")
@pytest.mark.parametrize("unit", ["etcd.service", *COMPONENTS, SERVE_UNIT])
def test_no_admin_drop_in_overrides_a_service_unit(host: Any, unit: str, observe: Any) -> None:
    # A `systemctl edit` override (another ExecStart, an environment) outranks the role's unit file.
    found = admin_dropins(host, unit)
    observe(found or "none")
    assert found == []


def _etcd_get(host: Any, config: StackConfig, key: str) -> str | None:
    service = _service(config)
    body = {"key": base64.b64encode(key.encode()).decode()}
    status, reply, _ = _http(host, config, f"{service.swap.etcd_url}/v3/kv/range", body)
    assert status == 200, reply
    kvs = reply.get("kvs", [])
    # etcd's JSON gateway leaves out an empty value: what a swap writes to the colour it stopped.
    return base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None


def _listener(config: StackConfig, path: str) -> str:
    swap = _service(config).swap
    return f"http://{swap.listen_host}:{swap.listen_port}{path}"


def _api_key(host: Any) -> str:
    """A client key from the host's keys file, read there as the admin would."""
    pairs = parse_api_keys(host.file(str(API_KEYS_PATH)).content_string, str(API_KEYS_PATH))
    assert pairs, f"{API_KEYS_PATH} holds no key"
    return pairs[0][1]


def _envoy_dump(host: Any, config: StackConfig) -> str:
    status, text, _ = _http(host, config, f"http://127.0.0.1:{_service(config).swap.admin_port}/config_dump")
    assert status == 200
    return json.dumps(text)


def _active_colour(host: Any, config: StackConfig) -> str:
    service = _service(config)
    version = _etcd_get(host, config, service.swap.active_key)
    colour = next(
        (c for c in ("blue", "green") if _etcd_get(host, config, service.swap.colour_key(c)) == version), None
    )
    assert colour is not None, f"no colour runs the active version {version}"
    return colour


@pytest.mark.invariant("hot-swap-etcd-key")
def test_etcd_names_the_configured_version(host: Any, config: StackConfig, observe: Any) -> None:
    service = _service(config)
    active = _etcd_get(host, config, service.swap.active_key)
    observe(f"{service.swap.active_key} = {active}")
    assert active == config.inference.version()


@pytest.mark.invariant("hot-swap-etcd-health")
def test_etcd_is_healthy(host: Any, config: StackConfig, observe: Any) -> None:
    status, reply, _ = _http(host, config, f"{_service(config).swap.etcd_url}/health")
    observe(reply)
    assert status == 200 and reply.get("health") == "true"


def _health_expected(held: bool) -> tuple[int, str | None]:
    """What Envoy's /health answers: the engine's 200, or 503 `draining` while a rollout holds the host out of
    its load balancer (the API stays open to the gate meanwhile)."""
    return (503, "draining") if held else (200, None)


@pytest.mark.invariant("hot-swap-envoy-follows-etcd", "svc-health-endpoint")
def test_envoy_routes_to_the_colour_etcd_names(host: Any, config: StackConfig, held: bool, observe: Any) -> None:
    colour = _active_colour(host, config)
    status, body, _ = _http(host, config, _listener(config, "/health"))
    # The API route shows the colour whatever the traffic state; /health only while the host takes traffic.
    _, _, headers = _http(host, config, _listener(config, "/v1/models"), key=_api_key(host))
    served = {k.lower(): v for k, v in headers.items()}.get("x-ironserve-colour")
    observe(f"etcd: {colour}, Envoy served: {served}, /health {status} {body if status != 200 else ''}")
    expected_status, expected_body = _health_expected(held)
    assert status == expected_status and served == colour
    assert expected_body is None or str(body).strip() == expected_body


def test_the_host_takes_traffic(host: Any, config: StackConfig, held: bool, observe: Any) -> None:
    """A host left drained (a stopped rollout, a hand-run `ironserve-service drain`) is named: its load balancer
    sends it nothing. During a rollout's prove phase it is held out on purpose (draining, the API open)."""
    traffic = _etcd_get(host, config, _service(config).swap.traffic_key)
    observe(f"{_service(config).swap.traffic_key} = {traffic}")
    assert (traffic == "draining") if held else traffic in (None, "serving"), (
        "held out of the load balancer: `ironserve rollout INVENTORY --resume`, or "
        "`ironserve-service traffic serving` on the host"
    )


@pytest.mark.invariant("svc-engine-vllm", "svc-infer-endpoint")
def test_completion_through_envoy(host: Any, config: StackConfig, observe: Any) -> None:
    model = _service(config).engine.served_model_name
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    status, reply, _ = _http(host, config, _listener(config, "/v1/chat/completions"), body, _api_key(host))
    observe(f"HTTP {status}, usage {reply.get('usage') if isinstance(reply, dict) else reply}")
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1


@pytest.mark.invariant("obs-logprobs-std")
def test_a_logprobs_request_is_answered_and_the_engine_survives_it(
    host: Any, config: StackConfig, held: bool, observe: Any
) -> None:
    """The first logprobs request makes torch compile a kernel on the host (g++, Python.h): the quality replays
    and any client asking for logprobs depend on it."""
    model = _service(config).engine.served_model_name
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    status, reply, _ = _http(host, config, _listener(config, "/v1/chat/completions"), body, _api_key(host))
    content = reply["choices"][0]["logprobs"]["content"] if status == 200 else reply
    after, _, _ = _http(host, config, _listener(config, "/health"))
    observe(f"HTTP {status}, {len(content)} tokens with logprobs; /health after it: {after}")
    assert status == 200 and len(content) >= 1 and all("logprob" in token for token in content)
    assert after == _health_expected(held)[0]


@pytest.mark.parametrize("unit", ["ironserve-router.service", "engine"])
def test_envoy_and_the_engine_may_hold_a_descriptor_per_connection(
    host: Any, config: StackConfig, unit: str, observe: Any
) -> None:
    """Envoy holds two descriptors per client (downstream and upstream), so its soft limit must exceed twice the
    release gate's connection limit; systemd's default is 1024."""
    if unit == "engine":
        unit = ENGINE_UNIT.format(colour=_active_colour(host, config))
    pid = host.run(f"systemctl show --property=MainPID --value {unit}").stdout.strip()
    limits = host.file(f"/proc/{pid}/limits").content_string.splitlines()
    line = next(row for row in limits if row.startswith("Max open files"))
    soft = int(line.split()[3])
    observe(f"{unit}: {line}")
    assert soft > 2 * _service(config).release.max_connections


@pytest.mark.invariant("io-nvme-model-store")
def test_the_model_versions_are_on_local_nvme(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.inference.model_store_nvme:
        pytest.skip("inference_model_store_nvme is off for this host")
    version = config.inference.version()
    fact = ModelStore()
    store = fact.process(host.run(fact.command(str(_service(config).swap.models_root), version)).stdout.splitlines())
    problems = model_store_problems(
        store, nvme=True, mount=config.inference.model_store_mount, version_bytes=0, headroom=0
    )
    observe(store)
    assert not problems


@pytest.mark.invariant("io-nvme-model-store")
def test_the_served_versions_files_match_its_sealed_manifest(host: Any, config: StackConfig, observe: Any) -> None:
    # A weight file truncated or damaged on disk fails here, not at the engine's next load; the deploy restores it.
    source = config.inference.model_source
    if source is None:
        pytest.skip("inference_model_source is not set: no sealed manifest on this machine to compare with")
    sealed = parse_manifest((source / MANIFEST_NAME).read_text(encoding="utf-8"))
    directory = model_version_dir(str(_service(config).swap.models_root), config.inference.version())
    names = " ".join(shlex.quote(name) for name in sealed)
    # sha256sum prints a line for each file it could read, in the manifest's own format; a missing one is absent.
    summed = host.run(f"cd {shlex.quote(directory)} && sha256sum -- {names}").stdout
    found = parse_manifest(summed) if summed.strip() else {}
    differs = {name: found.get(name, "missing") for name, digest in sealed.items() if found.get(name) != digest}
    observe(differs or f"{len(sealed)} files as sealed")
    assert differs == {}


@pytest.mark.invariant("net-ip-local-port-range", "net-port-inventory")
def test_the_services_ports_are_reserved_from_ephemeral_use(host: Any, config: StackConfig, observe: Any) -> None:
    # In force, not the file: an outgoing connection bound to one of them before the service starts makes it fail.
    in_force = host.run("cat /proc/sys/net/ipv4/ip_local_reserved_ports").stdout
    wanted = {listener.port for listener in config.inference.listeners() if listener.reserved}
    observe(in_force.strip() or "none")
    assert sorted(wanted - parse_port_list(in_force)) == []


def test_the_api_refuses_a_request_without_a_valid_key(host: Any, config: StackConfig, observe: Any) -> None:
    body = {"model": _service(config).engine.served_model_name, "messages": [], "max_tokens": 1}
    url = _listener(config, "/v1/chat/completions")
    statuses = {name: _http(host, config, url, body, key)[0] for name, key in (("none", None), ("wrong", "x" * 43))}
    observe(statuses)
    assert statuses == {"none": 401, "wrong": 401}


@pytest.mark.invariant("sec-non-root-service", "svc-engine-vllm")
def test_files_deciding_what_runs_as_root_are_root_only(host: Any, observe: Any) -> None:
    # systemd runs what the units say as whom they say; systemd-tmpfiles creates as root what tmpfiles.d names; pip
    # installs as root what the lock and the wheel folder hold; the kernel reserves the ports the sysctl file names.
    wheels = host.run(f"find {WHEEL_DIR} -mindepth 1 -maxdepth 1").stdout.split()
    units = [f"{UNIT_DIR}/{unit}" for unit in (ENGINE_TEMPLATE, SERVE_UNIT, *COMPONENTS)]
    paths = [*units, TMPFILES, PORTS_SYSCTL_FILE, posixpath.dirname(LOCK_PATH), LOCK_PATH, WHEEL_DIR, *wheels]
    paths += [str(CONFIG_PATH.parent), str(CONFIG_PATH)]
    wrong = not_root_only(host, paths)
    observe(wrong or f"{len(paths)} paths, all root:root, writable by root alone")
    assert wrong == {}


def test_the_keys_file_is_root_and_the_service_group_only(host: Any, config: StackConfig, observe: Any) -> None:
    keys = host.file(str(API_KEYS_PATH))
    observe(f"{keys.user}:{keys.group} {oct(keys.mode)}")
    assert keys.is_file and (keys.user, keys.group, keys.mode) == ("root", config.security.group, 0o640)


def test_envoy_listens_on_the_serving_address_only(host: Any, config: StackConfig, observe: Any) -> None:
    swap = _service(config).swap
    bound = [line.split()[3] for line in host.run("ss -Hltn").stdout.splitlines()
             if line.split()[3].endswith(f":{swap.listen_port}")]  # fmt: skip
    observe(bound)
    # One socket per Envoy worker thread (SO_REUSEPORT), all on the serving address.
    assert bound and set(bound) == {f"{swap.listen_host}:{swap.listen_port}"}


@pytest.mark.invariant("svc-port", "hot-swap-dual-instances")
def test_the_active_colour_listens_at_rest_and_the_other_only_when_kept_warm(
    host: Any, config: StackConfig, observe: Any
) -> None:
    swap = _service(config).swap
    listening = {c: host.socket(f"tcp://127.0.0.1:{swap.port(c)}").is_listening for c in ("blue", "green")}
    active = _active_colour(host, config)
    other = "green" if active == "blue" else "blue"
    previous = _etcd_get(host, config, swap.previous_key)
    # swap.keep_previous: the drained colour keeps its version (its colour key) for a rollback that starts nothing.
    warm = swap.keep_previous and bool(previous) and _etcd_get(host, config, swap.colour_key(other)) == previous
    observe(f"listening {listening}, active {active}, previous {previous} kept warm on {other}: {warm}")
    assert {c for c, up in listening.items() if up} == ({active, other} if warm else {active})


def test_development_endpoints_are_not_exposed(host: Any, config: StackConfig, observe: Any) -> None:
    statuses = {
        p: _http(host, config, _listener(config, p), key=_api_key(host))[0]
        for p in ("/metrics", "/v1/load_lora_adapter")
    }
    observe(f"through Envoy, with a key: {statuses}")
    assert statuses == {"/metrics": 404, "/v1/load_lora_adapter": 404}


def test_envoy_admin_listens_on_loopback_only(host: Any, config: StackConfig, observe: Any) -> None:
    port = _service(config).swap.admin_port
    listeners = [line for line in host.run("ss -Hltn").stdout.splitlines() if line.split()[3].endswith(f":{port}")]
    observe(listeners)
    assert listeners and all(line.split()[3] == f"127.0.0.1:{port}" for line in listeners)


# HTTP/2 without TLS (h2c, prior knowledge): the client preface, then an empty SETTINGS frame.
H2C_PROBE = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10); "
    "s.sendall(b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n' + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])); "
    "head = s.recv(9); print(head[3] if len(head) == 9 else -1)"
)


@pytest.mark.invariant("ingress-envoy", "ingress-envoy-http2")
def test_envoy_listener_speaks_http2(host: Any, config: StackConfig, observe: Any) -> None:
    swap = _service(config).swap
    probe = f"{config.inference.venv}/bin/python -c {shlex.quote(H2C_PROBE)} {swap.listen_host} {swap.listen_port}"
    frame = host.run(probe).stdout.strip()
    _, _, headers = _http(host, config, _listener(config, "/health"))
    server = {k.lower(): v for k, v in headers.items()}.get("server")
    observe(f"first frame type answering the h2c preface: {frame} (4 = SETTINGS); server: {server}")
    assert frame == "4"
    assert server == "envoy"
    assert '"http2_protocol_options"' in _envoy_dump(host, config)


@pytest.mark.invariant("ingress-envoy-stream-idle-timeout")
def test_envoy_stream_idle_timeout(host: Any, config: StackConfig, observe: Any) -> None:
    dump = _envoy_dump(host, config)
    found = '"stream_idle_timeout": "300s"' in dump
    observe("stream_idle_timeout 300s" if found else "absent")
    assert found


@pytest.mark.invariant("ingress-envoy-router-filter")
def test_envoy_router_filter(host: Any, config: StackConfig, observe: Any) -> None:
    dump = _envoy_dump(host, config)
    assert "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" in dump


@pytest.mark.parametrize("colour_unit", ["ai-service@.service"])
@pytest.mark.invariant("sec-non-root-service", "sec-seccomp-profile", "cgroup-ai-service-memory-max")
def test_engine_runs_unprivileged_in_the_slice_under_seccomp(
    host: Any, config: StackConfig, colour_unit: str, observe: Any
) -> None:
    unit = colour_unit.replace("@", f"@{_active_colour(host, config)}")
    pid = host.run(f"systemctl show --property=MainPID --value {unit}").stdout.strip()
    status = dict(line.split(":", 1) for line in host.file(f"/proc/{pid}/status").content_string.splitlines())
    lines = host.file(f"/proc/{pid}/cgroup").content_string.splitlines()
    cgroup = next((line for line in lines if line.startswith("0::")), "(no cgroup v2 line)")
    user = host.run(f"id -un {status['Uid'].split()[1]}").stdout.strip()
    observe(f"{unit}: user {user}, Seccomp {status['Seccomp'].strip()}, cgroup {cgroup}")
    assert user == config.security.user
    assert status["Seccomp"].strip() == "2"
    assert f"/{config.security.slice}/" in cgroup


@pytest.mark.parametrize("unit", ["etcd.service", "ironserve-router.service", "ironserve-control.service",
                                  "ironserve-exporter.service"])  # fmt: skip
def test_service_component_enabled_and_running(host: Any, unit: str, observe: Any) -> None:
    service = host.service(unit)
    observe(f"running={service.is_running} enabled={service.is_enabled}")
    assert service.is_running and service.is_enabled


def test_prometheus_loaded_the_slo_rules(host: Any, config: StackConfig, observe: Any) -> None:
    if not config.inference.prometheus:
        pytest.skip("inference_prometheus is off on this host")
    status, reply, _ = _http(host, config, "http://127.0.0.1:9090/api/v1/rules")
    names = sorted(r["name"] for g in reply["data"]["groups"] for r in g["rules"] if r.get("type") == "alerting")
    observe(names)
    assert status == 200 and len(names) >= 10


@pytest.mark.invariant("py-deps", "py-torch-sha256", "py-torch-version")
def test_environment_is_exactly_the_lock(host: Any, config: StackConfig, observe: Any) -> None:
    assert config.inference.requirements is not None
    pins = lock_pins(config.inference.requirements.read_text())
    listed = json.loads(host.run(f"{config.inference.venv}/bin/pip list --format=json").stdout)
    installed = {canonical(item["name"]): item["version"] for item in listed}
    wrong, extra = environment_drift(pins, installed)
    observe(f"{len(pins)} pinned; torch {installed.get('torch')}; wrong {wrong}; extra {extra}")
    assert not wrong and not extra


@pytest.mark.invariant("py-system-python-310", "py-pip-official-index")
def test_distribution_python_venv_without_index_overrides(host: Any, config: StackConfig, observe: Any) -> None:
    cfg = host.file(f"{config.inference.venv}/pyvenv.cfg").content_string
    overrides = host.run(f"{config.inference.venv}/bin/pip config list").stdout.strip()
    managers = host.run("command -v conda pyenv || true").stdout.strip()
    observe(f"{cfg.splitlines()[0]}; pip config: {overrides or '(none)'}; conda/pyenv: {managers or '(none)'}")
    assert "home = /usr/bin" in cfg
    assert "index-url" not in overrides
    assert not managers


@pytest.mark.invariant("py-import-torch-clean")
def test_torch_imports_without_symbol_errors(host: Any, config: StackConfig, observe: Any) -> None:
    result = host.run(f"LD_DEBUG=libs {config.inference.venv}/bin/python -c 'import torch' 2>&1")
    errors = [line for line in result.stdout.splitlines() if "symbol lookup error" in line]
    observe(f"exit {result.rc}, {len(errors)} symbol lookup errors")
    assert result.rc == 0 and not errors


@pytest.mark.invariant("py-torch-rpath")
def test_torch_resolves_its_bundled_libraries(host: Any, config: StackConfig, observe: Any) -> None:
    code = (
        "import os, torch; lib = os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_python.so'); "
        "print(lib, b'$ORIGIN' in open(lib, 'rb').read())"
    )
    result = _python(host, config, code)
    observe(result.stdout.strip())
    assert result.rc == 0 and result.stdout.split()[-1] == "True"


def test_service_config_is_the_validated_one(host: Any, config: StackConfig, observe: Any) -> None:
    text = host.file(str(CONFIG_PATH)).content_string
    observe(f"{len(text)} bytes")
    assert text == service_yaml(_service(config))


def test_kubernetes_mode_objects_are_the_validated_ones(host: Any, config: StackConfig, observe: Any) -> None:
    text = host.file(str(KUBERNETES_OBJECTS)).content_string
    observe(f"{len(text)} bytes")
    assert text == manifests.dump_all(deploy_objects(config))


def test_kubernetes_mode_runs_no_engine_unit_on_the_host(host: Any, config: StackConfig, observe: Any) -> None:
    units = [ENGINE_UNIT.format(colour=""), "ironserve-router.service", "ironserve-control.service"]
    states = {unit: host.run(f"systemctl show -P LoadState {unit}").stdout.strip() for unit in units}
    observe(states)
    assert set(states.values()) == {"not-found"}


def test_kubernetes_mode_the_account_has_the_pods_numbers(host: Any, config: StackConfig, observe: Any) -> None:
    pods = _service(config).kubernetes
    found = host.run(f"getent passwd {shlex.quote(config.security.user)}").stdout.split(":")[2:4]
    observe(":".join(found))
    assert found == [str(pods.run_as_user), str(pods.run_as_group)]


@pytest.mark.invariant("io-nvme-model-store")
def test_kubernetes_mode_the_version_the_pods_mount_is_on_the_node(
    host: Any, config: StackConfig, observe: Any
) -> None:
    version_dir = host.file(f"{_service(config).swap.models_root}/{config.inference.version()}")
    observe(f"{version_dir.user}:{version_dir.group} {version_dir.mode:o}")
    assert version_dir.is_directory and (version_dir.user, version_dir.group) == ("root", config.security.group)


# --- kubernetes mode, read from the cluster on a control plane (kubeadm's admin kubeconfig) -----------------------


@pytest.fixture
def control_plane(config: StackConfig) -> None:
    if config.kubernetes.role != "control-plane":
        pytest.skip("the service's objects are read from a control plane; this host is a worker")


def _colours_in_cluster(kubectl: Any, config: StackConfig) -> dict[str, dict[str, Any]]:
    """The colours' Deployments that a swap has applied, by colour; skips before the first swap."""
    namespace = _service(config).kubernetes.namespace
    deployments = kubectl("-n", namespace, "get", "deployments", "-o", "json")["items"]
    by_name = {d["metadata"]["name"]: d for d in deployments}
    found: dict[str, dict[str, Any]] = {
        colour: by_name[deployment_name(colour)] for colour in COLOURS if deployment_name(colour) in by_name
    }
    if not found:
        pytest.skip("no swap has applied a colour's Deployment yet (ironserve-service kube-swap)")
    return found


@pytest.mark.invariant("k8s-ai-service-objects")
def test_kubernetes_mode_cluster_has_the_services_objects_as_rendered(
    cluster_diff: Any, config: StackConfig, control_plane: None, observe: Any
) -> None:
    diff = cluster_diff(deploy_objects(config))
    observe(diff)
    assert diff is not None and (diff.status, diff.stderr) == (0, "")


@pytest.mark.invariant("scale-patch-deployment")
@pytest.mark.parametrize(("verb", "subresource", "allowed"), [("patch", "scale", "yes"), ("patch", "", "no")])
def test_kubernetes_mode_cluster_lets_the_scaler_change_only_the_scale(
    host: Any, config: StackConfig, control_plane: None, verb: str, subresource: str, allowed: str, observe: Any
) -> None:
    namespace = _service(config).kubernetes.namespace
    account = f"system:serviceaccount:{namespace}:{SCALER_ACCOUNT}"
    answers = {}
    for colour in COLOURS:
        argv = [
            "kubectl",
            "--kubeconfig",
            ADMIN_KUBECONFIG,
            "auth",
            "can-i",
            verb,
            f"deployments.apps/{deployment_name(colour)}",
        ]
        argv += ["-n", namespace, f"--as={account}", *([f"--subresource={subresource}"] if subresource else [])]
        answers[colour] = host.run(" ".join(shlex.quote(a) for a in argv)).stdout.strip()
    observe(answers)
    assert set(answers.values()) == {allowed}


@pytest.mark.invariant("k8s-no-hpa")
def test_kubernetes_mode_cluster_has_no_hpa_beside_the_scaler(
    kubectl: Any, config: StackConfig, control_plane: None, observe: Any
) -> None:
    namespace = _service(config).kubernetes.namespace
    autoscalers = kubectl("-n", namespace, "get", "horizontalpodautoscalers", "-o", "json")["items"]
    observe([a["metadata"]["name"] for a in autoscalers])
    assert autoscalers == []


@pytest.mark.invariant("k8s-pod-memory-limit")
def test_kubernetes_mode_cluster_colours_are_guaranteed_their_memory(
    kubectl: Any, config: StackConfig, control_plane: None, observe: Any
) -> None:
    pods = _service(config).kubernetes
    resources = {}
    for colour, deployment in _colours_in_cluster(kubectl, config).items():
        [container] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER]
        resources[colour] = container["resources"]
    observe(resources)
    for found in resources.values():
        assert found["limits"]["memory"] == pods.memory
        assert found["requests"] == found["limits"]


@pytest.mark.invariant("dns-policy-hostnet")
def test_kubernetes_mode_cluster_colours_resolve_through_the_clusters_dns(
    kubectl: Any, config: StackConfig, control_plane: None, observe: Any
) -> None:
    # The catalog's correction: the pod network and ClusterFirst, not hostNetwork with ClusterFirstWithHostNet.
    specs = {colour: d["spec"]["template"]["spec"] for colour, d in _colours_in_cluster(kubectl, config).items()}
    found = {colour: (spec.get("dnsPolicy"), spec.get("hostNetwork", False)) for colour, spec in specs.items()}
    observe(found)
    assert set(found.values()) == {("ClusterFirst", False)}
