"""Operation tests: facts in, commands out (or a no-op, or an error), on a fake host; no root, network or lab.

Each tests/operations/<module.operation>/<case>.json gives the operation's kwargs, every fact it reads
("fact": dotted class, "kwargs", "value"; a dataclass fact's value as a dict) and what it must do: "commands"
(exactly, in order), "noop" (part of a no-op message) or "raises" (part of the OperationError). A fact the
case gives but the operation does not read fails the case too, so a case lists exactly what it reads.
Cases that need Python objects (reboot checks with callables, a deploy's config) are the functions below.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.command import FunctionCommand
from pyinfra.api.exceptions import OperationError

from ironserve.facts import ContainerKind
from ironserve.profiles import read_profile
from ironserve.reboot import REBOOT_MARKER, REBOOT_REASONS, RebootCheck, reboot_for_needs
from ironserve.run import HostRun
from roles.host_tuning import kernel_args_reboot
from roles.host_tuning.facts import KernelCmdline
from roles.nvidia import driver_reboot
from roles.nvidia.facts import LoadedModule, ModuleObserved
from tests.unit.operation_harness import (
    FactKey,
    FakeHost,
    FakeState,
    MissingFact,
    collect,
    declared_reads,
    fact_key,
    facts_table,
    render,
    run_operation,
)

CASES = Path(__file__).resolve().parents[1] / "operations"
CASE_KEYS = {"description", "source", "kwargs", "facts", "commands", "noop", "raises", "fails", "executing"}
# Every operation ironserve defines, each with a folder of JSON cases or the functions in this module.
OPERATION_MODULES = (
    "ironserve.operations",
    "ironserve.dropins",
    "ironserve.modprobe",
    "ironserve.apt",
    "ironserve.helm",
    "ironserve.kubectl",
    "ironserve.owned",
    "ironserve.sysctl_boot",
    "ironserve.reboot",
    "roles.host_tuning",
    "roles.nvidia.operations",
    "roles.container_runtime",
    "roles.kubernetes.operations",
    "roles.security",
    "roles.inference.operations",
    "roles.preflight",
    "roles.bios",
)
ALWAYS_CHANGE = {
    "ironserve.apt.apt_updated",  # run only _if a source changed: no no-op to test
    "ironserve.operations.stop_host",  # queued only to stop a host
}
TESTED_HERE = {"ironserve.reboot.reboot_for_needs", "roles.preflight.preflight_gate", "roles.bios.bios_attributes"}


def resolve(dotted: str) -> Callable[..., Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def case_files() -> list[Path]:
    return sorted(CASES.glob("*/*.json"))


def assert_all_read(host: FakeHost) -> None:
    unread = [f"{name} {dict(arguments)}" for name, arguments in host.facts if (name, arguments) not in host.read]
    assert not unread, f"facts given but not read by the operation: {unread}"


@pytest.mark.parametrize("path", case_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_operation_case(path: Path) -> None:
    case = json.loads(path.read_text())
    assert set(case) <= CASE_KEYS, f"unknown keys {set(case) - CASE_KEYS}"
    assert {"commands", "noop", "raises", "fails"} & set(case), "a case says what the operation does"
    operation = resolve(path.parent.name)
    host = FakeHost(facts_table(case.get("facts", [])))
    state = FakeState(executing=case.get("executing", True))
    if "raises" in case:
        with pytest.raises(OperationError) as raised:
            run_operation(operation, host, state, **case.get("kwargs", {}))
        assert case["raises"] in str(raised.value)
    elif "fails" in case:  # the operation stops this host only: its last command fails with the message
        commands = run_operation(operation, host, state, **case.get("kwargs", {}))
        assert commands[:-1] == case.get("commands", []), json.dumps(commands, indent=2)
        last = commands[-1] if commands else ""
        assert isinstance(last, str) and last.startswith("echo ") and last.endswith(" >&2; exit 1"), last
        assert case["fails"] in shlex.split(last.removesuffix(" >&2; exit 1"))[1], last
    else:
        commands = run_operation(operation, host, state, **case.get("kwargs", {}))
        assert commands == case.get("commands", []), json.dumps(commands, indent=2)
        if "noop" in case:
            assert any(case["noop"] in message for message in host.noops), host.noops
    assert_all_read(host)
    if "noop" in case:
        assert_declared(operation, host, case.get("kwargs", {}))


# Reads whose arguments come from an earlier read of the same operation, so they cannot be declared when it is
# queued: the exact-version closure asks apt-cache for what the previous round's stanzas named.
FOLLOWS_EARLIER_READS = {
    "ironserve.apt.repository_offers": {
        "ironserve.facts.AptShow",
        "ironserve.facts.DpkgPackages",
        "ironserve.facts.AptSimulation",
        "ironserve.facts.AptProviders",
    }
}


def assert_declared(operation: Callable[..., Any], host: FakeHost, kwargs: dict[str, Any]) -> None:
    """Every fact an operation reads to find nothing to do was declared when it was queued, so a no-op deploy
    fetches it with the host's others in one command (ironserve.speed.reads); a change may read more."""
    declared = declared_reads(operation, **kwargs)
    following = FOLLOWS_EARLIER_READS.get(f"{operation.__module__}.{operation.__name__}", set())
    undeclared = [
        f"{name} {dict(arguments)}"
        for name, arguments in host.read
        if (name, arguments) not in (declared or set()) and name not in following
    ]
    assert not undeclared, f"read but not declared in @reading_operation(reads=...): {undeclared}"


def defined_operations() -> set[str]:
    found = set()
    for name in OPERATION_MODULES:
        for attr, value in vars(importlib.import_module(name)).items():
            inner = getattr(value, "_inner", None)  # a @deploy has one too, but no generator
            if inspect.isgeneratorfunction(inner) and inner.__module__ == name:
                found.add(f"{name}.{attr}")
    return found


def test_every_operation_has_cases() -> None:
    """Each operation has cases: one that changes something (or fails), one that changes nothing."""
    folders = {p.name: [json.loads(c.read_text()) for c in p.glob("*.json")] for p in CASES.iterdir()}
    assert defined_operations() - set(folders) - TESTED_HERE == set()
    assert set(folders) <= defined_operations(), "a case folder names no operation"
    for name, cases in folders.items():
        # refuse_secure_boot and verify_stack only judge: their change is an error.
        assert any(c.get("commands") or {"raises", "fails"} & set(c) for c in cases), (
            f"{name}: no case that changes or fails"
        )
        assert name in ALWAYS_CHANGE or any("noop" in c for c in cases), f"{name}: no no-op case"


# --- the harness itself ---------------------------------------------------------------------------------------


def host_with(*facts: tuple[FactKey, Any]) -> FakeHost:
    return FakeHost(dict(facts))


def test_missing_fact_names_what_the_operation_read() -> None:
    swap: tuple[FactKey, Any] = (fact_key("roles.container_runtime.facts.SwapState"), {"active": [], "fstab": []})
    with pytest.raises(MissingFact, match=r"read ironserve\.facts\.ContainerKind with \{\}, which the test does not"):
        run_operation(resolve("roles.container_runtime.swap_off"), host_with(swap))


def test_fact_arguments_match_however_passed() -> None:
    """Positional or keyword, list or tuple: one key (kernel_headers passes Command's argument positionally)."""
    assert fact_key("pyinfra.facts.server.Command", ("uname -r",)) == fact_key(
        "pyinfra.facts.server.Command", (), {"command": "uname -r"}
    )
    sysctl = "ironserve.facts.SysctlState"
    assert fact_key(sysctl, (), {"keys": ("a.b",)}) == fact_key(sysctl, (), {"keys": ["a.b"]})


# --- reboot_for_needs: each policy, and a container host ------------------------------------------------------

NEEDS = (
    RebootCheck("host_tuning", lambda: "kernel arguments not yet active: systemd.unified_cgroup_hierarchy=1", print),
    RebootCheck("security", lambda: None, print),
    RebootCheck("nvidia", lambda: "the loaded nvidia kernel module is 525.60.13", print),
)
REASONS = (
    "host_tuning: kernel arguments not yet active: systemd.unified_cgroup_hierarchy=1\n"
    "nvidia: the loaded nvidia kernel module is 525.60.13\n"
)
REBOOT_COMMANDS = [  # pyinfra's server.reboot between ironserve's boot-id record and its proof
    "function:_record_boot_id",
    "function:remove_any_askpass_file",
    "function:capture_uptime",
    "( sleep 1 && reboot ) </dev/null >/dev/null 2>&1 &",
    "function:wait_and_reconnect",
    "function:clean_sudo_info",
    "function:_prove_reboot",
]


def marker_facts(container: str | None) -> FakeHost:
    """Neither marker file there yet; /run exists, /run/ironserve not."""
    run_dir = {"user": "root", "group": "root", "mode": 755}
    return host_with(
        (fact_key(ContainerKind), container),
        (fact_key("pyinfra.facts.files.File", (), {"path": REBOOT_MARKER}), None),
        (fact_key("pyinfra.facts.files.Directory", (), {"path": REBOOT_MARKER}), None),
        (fact_key("pyinfra.facts.files.Directory", (), {"path": "/run"}), run_dir),
        (fact_key("pyinfra.facts.files.File", (), {"path": REBOOT_REASONS}), None),
        (fact_key("pyinfra.facts.files.Directory", (), {"path": REBOOT_REASONS}), None),
        (fact_key("pyinfra.facts.files.Directory", (), {"path": "/run/ironserve"}), None),
    )


def test_reboot_nothing_needed() -> None:
    host = host_with()  # no fact read: the checks answer None
    assert run_operation(reboot_for_needs, host, checks=NEEDS[1:2], policy="auto", timeout_s=600) == []
    assert host.noops == ["no role needs a reboot"]


def test_reboot_policy_never_reports() -> None:
    host = host_with()
    assert run_operation(reboot_for_needs, host, checks=NEEDS, policy="never", timeout_s=600) == []
    assert host.noops == [
        "reboot needed (host_tuning: kernel arguments not yet active: systemd.unified_cgroup_hierarchy=1; "
        "nvidia: the loaded nvidia kernel module is 525.60.13), but ironserve_reboot_policy is never"
    ]


def test_reboot_policy_defer_leaves_markers() -> None:
    host = marker_facts(None)
    commands = run_operation(reboot_for_needs, host, checks=NEEDS, policy="defer", timeout_s=600)
    assert commands == [
        {"upload": REBOOT_MARKER, "content": "*** System restart required ***\n"},
        "mkdir -p /run/ironserve",
        {"upload": REBOOT_REASONS, "content": REASONS},
    ]
    assert_all_read(host)


def test_reboot_policy_auto_in_container_defers() -> None:
    host = marker_facts("lxc")
    commands = run_operation(reboot_for_needs, host, checks=NEEDS, policy="auto", timeout_s=600)
    where = "container host (lxc): the machine that runs it reboots, not the deploy\n"
    assert commands == [
        {"upload": REBOOT_MARKER, "content": "*** System restart required ***\n"},
        "mkdir -p /run/ironserve",
        {"upload": REBOOT_REASONS, "content": REASONS + where},
    ]


def test_reboot_policy_auto_reboots_and_proves() -> None:
    host = host_with((fact_key(ContainerKind), None))
    assert run_operation(reboot_for_needs, host, checks=NEEDS, policy="auto", timeout_s=600) == REBOOT_COMMANDS


class ShellHost:
    """A pyinfra host for a FunctionCommand: answers `run_shell_command` from a queue of outputs."""

    name = "testhost"

    def __init__(self, *outputs: str) -> None:
        self.outputs = list(outputs)
        self.commands: list[str] = []

    def run_shell_command(self, command: str) -> tuple[bool, Any]:
        self.commands.append(command)
        return True, type("Output", (), {"stdout_lines": [self.outputs.pop(0)]})()


def run_functions(commands: list[Any], shell: ShellHost, names: set[str]) -> None:
    for command in commands:
        if isinstance(command, FunctionCommand) and command.function.__name__ in names:
            command.function(None, shell, *command.args, **command.kwargs)


@pytest.mark.parametrize(("after", "proven"), [("boot-2", True), ("boot-1", False)])
def test_reboot_proof_needs_a_new_boot_id(after: str, proven: bool) -> None:
    took_effect: list[str] = []
    checks = (RebootCheck("nvidia", lambda: "module", lambda h: took_effect.append(h.name)),)
    host = host_with((fact_key(ContainerKind), None))
    commands = collect(reboot_for_needs, host, checks=checks, policy="auto", timeout_s=5)
    shell = ShellHost("boot-1", after)
    if proven:
        run_functions(commands, shell, {"_record_boot_id", "_prove_reboot"})
        assert took_effect == ["testhost"]
    else:
        with pytest.raises(OperationError, match="the boot id did not change"):
            run_functions(commands, shell, {"_record_boot_id", "_prove_reboot"})
        assert took_effect == []
    assert shell.commands == ["cat /proc/sys/kernel/random/boot_id"] * 2


# --- the roles' reboot checks, read through reboot_for_needs ---------------------------------------------------

DRIVER = "525.85.12"
CGROUP_ARG = ("systemd.unified_cgroup_hierarchy=1",)


@pytest.mark.parametrize(
    ("loaded", "reason"),
    [
        (ModuleObserved(nvidia="525.60.13"), "the loaded nvidia kernel module is 525.60.13, the installed driver"),
        (ModuleObserved(nvidia=None, nouveau=True), "nouveau is loaded and holds the GPU"),
        (ModuleObserved(nvidia=DRIVER), None),
        (ModuleObserved(nvidia=None, nouveau=False), None),
    ],
)
def test_driver_reboot(loaded: ModuleObserved, reason: str | None) -> None:
    host = host_with((fact_key(LoadedModule), loaded))
    run_operation(reboot_for_needs, host, checks=(driver_reboot(DRIVER),), policy="never", timeout_s=600)
    if reason:
        assert host.noops[0].startswith(f"reboot needed (nvidia: {reason}")
    else:
        assert host.noops == ["no role needs a reboot"]


@pytest.mark.parametrize(
    ("container", "running", "needed"),
    [(None, ["ro", "quiet"], True), (None, ["ro", *CGROUP_ARG], False), ("lxc", ["ro"], False)],
)
def test_kernel_args_reboot(container: str | None, running: list[str], needed: bool) -> None:
    facts = [(fact_key(ContainerKind), container)] + ([] if container else [(fact_key(KernelCmdline), running)])
    host = host_with(*facts)
    run_operation(reboot_for_needs, host, checks=(kernel_args_reboot(CGROUP_ARG),), policy="never", timeout_s=600)
    want = "reboot needed (host_tuning: kernel arguments not yet active: systemd.unified_cgroup_hierarchy=1)"
    if needed:
        assert host.noops[0].startswith(want)
    else:
        assert host.noops == ["no role needs a reboot"]
    assert_all_read(host)


def test_kernel_args_took_effect() -> None:
    check = kernel_args_reboot(CGROUP_ARG)
    check.took_effect(ShellHost("BOOT_IMAGE=/vmlinuz ro systemd.unified_cgroup_hierarchy=1", "cgroup2fs"))
    with pytest.raises(OperationError, match=r"/sys/fs/cgroup is tmpfs, not cgroup2fs"):
        check.took_effect(ShellHost("ro systemd.unified_cgroup_hierarchy=1", "tmpfs"))
    with pytest.raises(OperationError, match=r"the kernel still lacks systemd\.unified_cgroup_hierarchy=1"):
        check.took_effect(ShellHost("ro quiet"))


# --- operations that always hand over to a function at execution time ---------------------------------------


def test_preflight_gate_runs_the_gate() -> None:
    config, observed, run = object(), object(), HostRun("testhost")
    host = host_with()
    commands = collect(resolve("roles.preflight.preflight_gate"), host, config=config, observed=observed, run=run)
    assert [render(c) for c in commands] == ["function:_gate"]
    assert commands[0].args == (config, observed, run)


def test_bios_attributes_applies_through_redfish_at_execution() -> None:
    settings, run = object(), HostRun("testhost")
    desired = {"SriovGlobalEnable": "Enabled"}
    commands = collect(resolve("roles.bios.bios_attributes"), host_with(), settings=settings, desired=desired, run=run)
    assert [render(c) for c in commands] == ["function:_apply_now"]
    assert commands[0].args == (settings, desired, run)
    # The bios @deploy marks the run before calling it: pyinfra -y prepares without running op generators.
    assert not run.bios_changing


# --- known product bugs, reported to the lead: each flips to a failure (strict) once fixed -------------------


def test_remove_strays_keeps_dependencies_of_the_lock() -> None:
    """What apt installs for the r740-a10 lock on debian12 from NVIDIA's repository: the metapackages' dependencies
    match STRAY_PATTERNS but carry the lock's versions (or no CUDA line), so they stay; a CUDA 12 toolkit and a
    cuDNN for CUDA 12 do not."""
    lock = read_profile("r740-a10").lock
    keep = ["nvidia-driver", "nvidia-kernel-dkms", "cuda-toolkit-11-8", "libcudnn8", "libnvinfer8", "tensorrt"]
    installed = {
        **{name: {"version": "1", "held": True} for name in keep},
        "cuda-toolkit-11-8-config-common": {"version": "11.8.89-1", "held": False},  # cuda-cudart-11-8 needs these
        "cuda-toolkit-11-config-common": {"version": "11.8.89-1", "held": False},
        "cuda-toolkit-config-common": {"version": "12.3.101-1", "held": False},  # shared by every CUDA line
        "libnvinfer-plugin8": {"version": "8.6.1.6-1+cuda11.8", "held": False},  # tensorrt depends on it
        "nvidia-driver-bin": {"version": "525.85.12-1", "held": False},  # nvidia-driver depends on it
        "cuda-toolkit-12-2": {"version": "12.2.2-1", "held": False},
        "libcudnn8-cuda-12": {"version": "8.9.7.29-1+cuda12.2", "held": False},
    }
    patterns = ["nvidia-driver*", "cuda-toolkit-*", "cuda-drivers*", "libcudnn*", "libnvinfer*", "tensorrt"]
    host = FakeHost(
        facts_table([{"fact": "ironserve.facts.DpkgPackages", "kwargs": {"patterns": patterns}, "value": installed}])
    )
    commands = run_operation(resolve("roles.nvidia.operations.remove_strays"), host, keep=keep, lock=lock)
    assert [c.rsplit(" purge ", 1)[-1] for c in commands] == ["cuda-toolkit-12-2 libcudnn8-cuda-12"]
