"""The `ironserve` command: validate, deploy, rollout, verify, coverage, lock (and `lab` where the lab is installed)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from ironserve import rollout, speed, verify
from ironserve.config import ConfigError, StackBase, lock_messages
from ironserve.inventory import InventoryHost, load_inventory, report, validate_inventory
from ironserve.lock import check_lock
from ironserve.paths import CHECKOUT
from ironserve.profiles import available_profiles, read_profile
from ironserve.registry import registry
from ironserve.repocheck import check_repository
from ironserve.repocheck import report as repository_report

# The entry-point group through which other distributions add a subcommand (`register(subparsers)`): the lab's
# development install adds `ironserve lab`, so this CLI never imports the lab.
ADDED_COMMANDS = "ironserve.commands"


def _validated(
    inventory: str, override: dict[str, str] | None = None
) -> tuple[list[InventoryHost], dict[str, StackBase]]:
    """Every host of the inventory validated as pyinfra will load it (ironserve.inventory), or the report
    of every host's problems and exit status 2: the same report `pyinfra INVENTORY deploy.py` prints."""
    try:
        hosts = load_inventory(inventory, override)
        configs, problems = validate_inventory(hosts, registry())
    except ConfigError as exc:
        hosts, configs, problems = [], {}, str(exc).splitlines()
    if problems:
        sys.stderr.write(report(problems))
        raise SystemExit(2)
    return hosts, configs


def cmd_validate(args: argparse.Namespace) -> int:
    hosts, configs = _validated(args.inventory, {"ironserve_roles": args.roles} if args.roles else {})
    for host in hosts:
        config = configs[host.name]
        print(f"{host.name}\t{config.profile_name}\t{','.join(config.roles)}")
    print(f"{args.inventory}: {len(hosts)} hosts valid, no host was contacted", file=sys.stderr)
    return 0


def deploy_file(explicit: str | None) -> str:
    """The pyinfra deploy file `ironserve deploy` runs: --deploy-file, else the checkout's deploy.py.

    The checkout is the one ironserve runs from (dev venv) or was installed from (`pip install .`,
    `pipx install .`): its deploy.py goes with the roles installed from it.
    """
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"deploy file {explicit} does not exist")
        return explicit
    if CHECKOUT is None:
        raise FileNotFoundError(
            "ironserve was not installed from a checkout: pass --deploy-file CHECKOUT/deploy.py "
            "(or install with `pip install CHECKOUT`)"
        )
    return str(CHECKOUT / "deploy.py")


def cmd_deploy(args: argparse.Namespace) -> int:
    override = {"ironserve_roles": args.roles} if args.roles else {}
    _validated(args.inventory, override)
    deploy = deploy_file(args.deploy_file)
    if args.plain_pyinfra:  # read as deploy.py runs and as each operation is queued (ironserve/speed/README.md)
        os.environ[speed.PLAIN_PYINFRA] = "1"
    # pyinfra's command line in this process (no second interpreter start, nothing imported twice), as
    # `python -P -m pyinfra` would run it: with the installed ironserve and roles, never same-named folders of the
    # current directory. It runs in the current directory (its group_data/ was just validated); site() resolves
    # the inventory's relative paths against the inventory file's folder, and validates again as pyinfra loads it.
    limits = [arg for name in args.limit or [] for arg in ("--limit", name)]
    data = [arg for key, value in override.items() for arg in ("--data", f"{key}={value}")]
    here = os.getcwd()
    sys.path[:] = [entry for entry in sys.path if entry and os.path.abspath(entry) != here]
    sys.argv = ["pyinfra", "-y", *limits, *data, *args.pyinfra_args, args.inventory, deploy]
    from pyinfra_cli.main import main as pyinfra_main

    # What is loaded now (pyinfra, the roles' models, the validated inventory) lives until exit: no garbage
    # collection during the run, or at exit, needs to walk it again (gc.freeze, Python's gc docs).
    gc.freeze()
    try:
        pyinfra_main()
    except SystemExit as exited:
        return exited.code if isinstance(exited.code, int) else 1
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    """Everything is checked (the inventory, the plan, the record to resume) before any host is contacted."""
    reports = Path(args.reports)
    # A resume deploys and checks the roles the rollout recorded: the inventory is validated with them.
    resumed = rollout.resumable(reports) if args.resume else None
    recorded = resumed.options.get("roles") if resumed else None
    if args.resume and args.roles and args.roles != recorded:
        raise rollout.RolloutError(f"--resume continues the recorded plan: its roles are {recorded or 'all'}")
    roles = recorded if args.resume else args.roles
    hosts, configs = _validated(args.inventory, {"ironserve_roles": roles} if roles else {})
    names = [host.name for host in hosts]
    if resumed is not None:
        planned = {"--batch": args.batch, "--max-unavailable": args.max_unavailable, "--canary": args.canary,
                   "--order": args.order}  # fmt: skip
        given = [flag for flag, value in planned.items() if value is not None]
        if given:
            raise rollout.RolloutError(f"--resume continues the recorded plan: drop {', '.join(given)}")
        state = resumed
        missing = sorted(set(state.hosts) - set(names))
        if missing:
            raise rollout.RolloutError(f"--resume: the rollout's hosts {', '.join(missing)} are not in this inventory")
        if state.inventory != args.inventory:
            raise rollout.RolloutError(f"--resume: the rollout was of {state.inventory}, not {args.inventory}")
        chosen_file = state.options.get("deploy_file")
        gate_args = list(state.options.get("gate_args") or [])
        if args.gate_args:
            raise rollout.RolloutError("--resume continues the recorded plan: it keeps the gate's arguments")
    else:
        order = [name.strip() for name in args.order.split(",")] if args.order else None
        plan = rollout.make_plan(names, args.batch, args.max_unavailable or "1", args.canary, order)
        deploy_file(args.deploy_file)  # a missing file is said now, not at the first host's change
        chosen_file = args.deploy_file and str(Path(args.deploy_file).resolve())
        gate_args = args.gate_args
        options = {"roles": roles, "deploy_file": chosen_file, "gate_args": gate_args}
        state = rollout.new_rollout(args.inventory, plan, options, reports)
    roles_registry = registry()
    controls = {name: rollout.traffic_controls(roles_registry, name, configs, args.drain_timeout) for name in names}
    rollout.check_traffic_hosts(state.plan, controls)
    if args.confirm and not sys.stdin.isatty():
        raise rollout.RolloutError("--confirm asks on a terminal: run it in one, or use --canary-pause SECONDS")
    runner = rollout.Runner(
        rollout=state,
        inventory_hosts={host.name: host for host in hosts},
        controls=controls,
        reports=reports,
        roles=roles,
        deploy_file=chosen_file,
        gate_args=gate_args,
        settle_s=args.settle_timeout,
        canary_pause_s=args.canary_pause,
        confirm=_ask if args.confirm else None,
    )
    return runner.run()


def _ask(question: str) -> bool:
    return input(question).strip().lower() in ("y", "yes")


def cmd_verify(args: argparse.Namespace) -> int:
    hosts, configs = _validated(args.inventory, {"ironserve_roles": args.roles} if args.roles else {})
    if args.limit:
        unknown = set(args.limit) - {h.name for h in hosts}
        if unknown:
            raise KeyError(f"--limit names hosts not in {args.inventory}: {', '.join(sorted(unknown))}")
        hosts = [h for h in hosts if h.name in args.limit]
    return verify.run(hosts, configs, Path(args.reports), args.pytest_args)


def cmd_coverage(args: argparse.Namespace) -> int:
    if CHECKOUT is None:
        print("ironserve: coverage collects the checkout's tests: run it from a checkout", file=sys.stderr)
        return 2
    from ironserve import coverage  # runs pytest's collection of the whole checkout

    entries = coverage.catalog()
    tagged = coverage.tagged_tests()
    try:
        status = coverage.classify(entries, tagged)
    except ValueError as error:  # a waivers file the admin or a developer mistyped
        print(f"ironserve coverage: {error}", file=sys.stderr)
        return 2
    print(coverage.report(entries, status, args.missing))
    unknown = coverage.unknown_ids(entries, tagged)
    if unknown:
        print(f"\nids not in the catalog (typos?): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 1
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    profile = read_profile(args.profile)
    violations = check_lock(profile.lock)
    if args.check_repo is None:
        print(json.dumps(profile.lock.model_dump(), indent=2))
    for line in lock_messages(args.profile, violations):
        print(line, file=sys.stderr)
    if args.check_repo is None or violations:
        return 1 if violations else 0
    if "://" not in args.check_repo and args.os is None:
        raise ValueError(f"--check-repo {args.check_repo}: a Packages file is one repository; name its OS with --os")
    checks = check_repository(profile, args.check_repo, [args.os] if args.os else list(profile.platforms))
    print("\n".join(repository_report(profile, checks)))
    return 1 if any(check.problems for check in checks) else 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ironserve", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    # Commands other distributions add: the lab registers `ironserve lab` from its development install.
    for command in entry_points(group=ADDED_COMMANDS):
        command.load()(sub)

    validate = sub.add_parser(
        "validate", help="load and validate an inventory, print each host's profile and roles (no host is contacted)"
    )
    validate.add_argument("inventory")
    validate.add_argument("--roles", help="validate only these roles, comma-separated (default: all, in order)")
    validate.set_defaults(func=cmd_validate)

    deploy = sub.add_parser("deploy", help="validate the inventory, then run deploy.py with pyinfra")
    deploy.add_argument("inventory")
    deploy.add_argument(
        "--deploy-file", help="the pyinfra deploy file (default: deploy.py of the checkout ironserve is installed from)"
    )
    deploy.add_argument("--limit", action="append", help="deploy only this host (repeatable)")
    deploy.add_argument("--roles", help="apply only these roles, comma-separated (default: all, in order)")
    deploy.add_argument(
        "--plain-pyinfra",
        action="store_true",
        help=f"run with pyinfra's own functions, none of ironserve.speed (as {speed.PLAIN_PYINFRA}=1 does)",
    )
    deploy.add_argument("pyinfra_args", nargs=argparse.REMAINDER, help="passed to pyinfra, e.g. -v")
    deploy.set_defaults(func=cmd_deploy)

    roll = sub.add_parser(
        "rollout",
        help="deploy host by host in batches: each host drained, changed, proven by the gate, returned; "
        "a failure stops the rollout",
    )
    roll.add_argument("inventory")
    roll.add_argument("--batch", type=int, help="hosts changed at once (default: --max-unavailable)")
    roll.add_argument(
        "--max-unavailable", metavar="N|P%", help="hosts out of service at any moment, a number or a share (default 1)"
    )
    roll.add_argument("--canary", metavar="HOST", help="this host first and alone, then a pause or --confirm")
    roll.add_argument("--confirm", action="store_true", help="after the canary, ask before going on")
    roll.add_argument(
        "--canary-pause", type=float, default=60.0, metavar="S", help="seconds between the canary and the rest (60)"
    )
    roll.add_argument("--order", metavar="HOST,HOST", help="these hosts first, in this order; the rest as listed")
    roll.add_argument(
        "--drain-timeout", type=float, metavar="S", help="bound on in-flight requests finishing (default: the roles')"
    )
    roll.add_argument(
        "--settle-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="after a reboot, the gate is retried until it passes or S seconds have passed (600)",
    )
    roll.add_argument("--resume", action="store_true", help="continue the stopped rollout at its failed host")
    roll.add_argument("--roles", help="apply only these roles, comma-separated (default: all, in order)")
    roll.add_argument("--deploy-file", help="the pyinfra deploy file (default: the checkout's deploy.py)")
    roll.add_argument("--reports", default="reports", help="folder of rollout.json and the gate's reports (./reports)")
    roll.add_argument("gate_args", nargs=argparse.REMAINDER, help="passed to the gate's pytest, e.g. -k 'not clock'")
    roll.set_defaults(func=cmd_rollout)

    check = sub.add_parser("verify", help="run the acceptance gate against an inventory's hosts")
    check.add_argument("inventory")
    check.add_argument("--reports", default="reports", help="folder for per-host JSON reports (default: ./reports)")
    check.add_argument("--limit", action="append", help="verify only this host (repeatable)")
    check.add_argument(
        "--roles", help="check only these roles' invariants, comma-separated (default: the host's roles)"
    )
    check.add_argument("pytest_args", nargs=argparse.REMAINDER)
    check.set_defaults(func=cmd_verify)

    cover = sub.add_parser("coverage", help="catalog ids asserted, waived or missing, per area")
    cover.add_argument("--missing", action="store_true", help="list the ids not yet accounted for")
    cover.set_defaults(func=cmd_coverage)

    lock = sub.add_parser("lock", help="print a profile's pinned set and check its compatibility rules")
    lock.add_argument("--profile", default="r740-a10", choices=available_profiles())
    lock.add_argument(
        "--check-repo",
        metavar="URL|FILE",
        help="check the lock against a repository: the base URL of NVIDIA's CUDA repositories or a site mirror "
        "(its <dir>/x86_64/Packages.gz for each OS), or a Packages file with --os",
    )
    lock.add_argument("--os", help="the OS to check (ubuntu2204, debian12); default: every OS the profile supports")
    lock.set_defaults(func=cmd_lock)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lab"] and not entry_points(group=ADDED_COMMANDS, name="lab"):
        print("ironserve: the lab is in the development install only: `make setup` in a checkout", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ConfigError as exc:
        sys.stderr.write(report(str(exc).splitlines()))
        return 2
    except (FileNotFoundError, ValueError, KeyError) as exc:  # RolloutError is a ValueError
        print(f"ironserve: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
