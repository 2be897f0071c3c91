"""Acceptance gate plumbing: the stack config per host, observed values, per-host JSON reports.

Run through `ironserve verify INVENTORY`, which passes --hosts, --ssh-config and the two options below.
"""

from __future__ import annotations

import json
import shlex
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.facts import FactBase

from ironserve import manifests
from ironserve.kubectl import ADMIN_KUBECONFIG, KubectlDiff, ObjectsDiff
from ironserve.secrets import redact_text
from roles import StackConfig

# Worst first: one failing test makes the invariant fail on that host.
SEVERITY = {"fail": 0, "pass": 1, "skip": 2}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--ironserve-stack", help="JSON file: host name -> StackConfig (from ironserve verify)")
    parser.addoption("--ironserve-reports", help="folder for per-host invariant reports")
    parser.addoption(
        "--ironserve-held",
        action="store_true",
        help="the hosts are held out of their load balancer by `ironserve rollout` (prove phase): a draining /health "
        "is expected, not a fault",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The `invariant` marker is registered by ironserve's pytest plugin (ironserve/invariant_collector.py).
    results: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    config.stash[RESULTS] = results


RESULTS = pytest.StashKey[dict[str, dict[str, dict[str, Any]]]]()


@pytest.fixture(scope="session")
def stack_configs(pytestconfig: pytest.Config) -> dict[str, StackConfig]:
    path = pytestconfig.getoption("--ironserve-stack")
    if not path:
        pytest.exit("run the acceptance gate through `ironserve verify INVENTORY`", returncode=4)
    raw = json.loads(Path(path).read_text())
    return {name: StackConfig.model_validate(data) for name, data in raw.items()}


@pytest.fixture
def config(host: Any, stack_configs: dict[str, StackConfig]) -> StackConfig:
    return stack_configs[host.backend.get_hostname()]


@pytest.fixture
def container_kind(host: Any) -> str | None:
    kind = host.run("systemd-detect-virt --container").stdout.strip()
    return None if kind in {"", "none"} else kind


@pytest.fixture
def held(request: pytest.FixtureRequest) -> bool:
    """The rollout's prove phase: the host is out of its load balancer on purpose while the gate runs."""
    return bool(request.config.getoption("--ironserve-held"))


@pytest.fixture
def kubectl(host: Any) -> Any:
    """`kubectl(*args)`: the output of `kubectl ARGS` run on the host as the cluster's admin (kubeadm's admin
    kubeconfig, on a control plane), JSON parsed when ARGS ask for `-o json`; a failure fails the test."""

    def run(*args: str) -> Any:
        argv = ("kubectl", "--kubeconfig", ADMIN_KUBECONFIG, "--request-timeout=20s", *args)
        output = host.check_output(" ".join(shlex.quote(a) for a in argv))
        return json.loads(output) if args[-2:] == ("-o", "json") else output

    return run


@pytest.fixture
def deploy_fact(host: Any) -> Any:
    """`deploy_fact(FactClass, **kwargs)`: one of the deploy's own facts read on the host, its command run there and
    its output parsed by its own `process`, so the gate and the deploy agree on what they read."""

    def read(fact_class: type[FactBase[Any]], **kwargs: Any) -> Any:
        fact = fact_class()
        return fact.process(host.run(fact.command(**kwargs)).stdout.splitlines())

    return read


@pytest.fixture
def cluster_diff(deploy_fact: Any) -> Any:
    """`cluster_diff(objects)`: the deploy's own KubectlDiff fact run on the host for those objects (a list), as
    the cluster's admin: what a server-side apply of them would change now (None without the admin kubeconfig)."""

    def run(objects: list[dict[str, Any]]) -> ObjectsDiff | None:
        diff: ObjectsDiff | None = deploy_fact(
            KubectlDiff, objects=manifests.dump_all(objects), kubeconfig=ADMIN_KUBECONFIG
        )
        return diff

    return run


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Any:
    """Record the value a test observed on the host, for the report."""

    def record(value: object) -> None:
        # What a host holds may carry a credential (a URL's login, an API key in a file): never into a report.
        request.node.user_properties.append(("observed", redact_text(str(value))))

    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        marker_ids = [i for m in item.iter_markers("invariant") for i in m.args]
        host_param = getattr(item, "callspec", None)
        hostname = host_param.params.get("_testinfra_host") if host_param else None
        host_name = hostname.backend.get_hostname() if hostname is not None else "local"
        status = {"passed": "pass", "failed": "fail", "skipped": "skip"}[report.outcome]
        observed = dict(item.user_properties).get("observed")
        detail = str(report.longrepr[-1]) if report.skipped and isinstance(report.longrepr, tuple) else None
        results = item.config.stash[RESULTS][host_name]
        for invariant in marker_ids:
            result = results.setdefault(invariant, {"status": status, "observed": observed, "test": item.name})
            if SEVERITY[status] < SEVERITY[result["status"]]:
                result.update(status=status, observed=observed, test=item.name)
            if detail:
                # A pass on one host aspect never hides that another was not checked here, and why.
                result.setdefault("skipped", []).append(f"{item.name}: {detail}")
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = session.config.getoption("--ironserve-reports")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    for host_name, results in session.config.stash[RESULTS].items():
        path = Path(folder) / f"{host_name}.json"
        path.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for host_name, results in sorted(config.stash[RESULTS].items()):
        counts: defaultdict[str, int] = defaultdict(int)
        for result in results.values():
            counts[result["status"]] += 1
        terminalreporter.write_line(
            f"invariants on {host_name}: {counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip"
        )
