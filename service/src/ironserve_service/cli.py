"""Wires the modules into one command: verify, seal, launch, probe, exporter, rules, scale, router, control, swap,
kube-swap, rollback, release-check, load-chaos, api-key, status, traffic, drain."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from ironserve_service import (
    artifacts,
    chaos,
    control,
    exporter,
    gpu_guard,
    gpu_health,
    health,
    kube,
    kube_swap,
    launcher,
    quality,
    release,
    router,
    scaler,
    serving,
    slo,
    swap,
    traffic,
)
from ironserve_service.kube import KubeError
from ironserve_service.settings import COLOURS, Colour, ServiceSettings, SwapSettings, load_settings

DEFAULT_CONFIG = Path("/etc/ironserve/service.yaml")


def _settings(path: Path) -> ServiceSettings:
    try:
        return load_settings(path)
    except FileNotFoundError:
        raise SystemExit(f"config {path} not found") from None
    except ValidationError as error:
        raise SystemExit(f"config {path} is invalid:\n{error}") from None


def cmd_verify(args: argparse.Namespace) -> int:
    report = artifacts.verify_model_dir(
        args.model_dir,
        args.manifest or args.model_dir / artifacts.MANIFEST_NAME,
        architecture=args.architecture,
        rope_freq_base=args.rope_freq_base,
        gguf_quants=args.gguf_quant,
        require_release=not args.no_release,
    )
    print(report.render())
    return 0 if report.ok else 1


def cmd_seal(args: argparse.Namespace) -> int:
    record = artifacts.seal_model_dir(args.model_dir, datetime.now(UTC))
    print(f"sealed {args.model_dir}: version {record['version']} sha256 {record['sha256']}")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    return launcher.Launcher(_settings(args.config)).run()


def cmd_probe(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    if args.kind == "ready":
        result = health.probe_ready(settings.readiness)
    else:
        result = health.probe_live(settings.readiness, settings.engine)
    print(result.reason)
    return 0 if result.ok else 1


def cmd_exporter(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    logging.basicConfig(level=logging.INFO)
    # Blocked before any thread starts (threads inherit the mask), so SIGTERM reaches sigwait below and the XID
    # watcher is stopped instead of the default action ending the process under it.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    xids = gpu_health.XidWatcher(settings.exporter.max_gpus)
    xids.start()  # False on a host without NVML yet: each scrape that finds NVML tries again
    registry = exporter.build_registry(settings, xids=xids)
    metrics = quality.QualityMetrics(registry, settings.quality)
    embedder = quality.sentence_bert if settings.quality.semantic_scorer == "sentence-bert" else lambda: None
    scorer = quality.QualityScorer(settings, metrics, embedder)
    quality.start_quality(scorer)
    exporter.serve(settings.exporter, registry)
    print(f"exporter on {settings.exporter.host}:{settings.exporter.port}, mirror sink on "
          f"{settings.quality.mirror_host}:{settings.quality.mirror_port}", flush=True)  # fmt: skip
    signal.sigwait(stop_signals)
    xids.stop()
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return scaler.serve(settings)
    except KubeError as error:  # no API server to talk to (not in a cluster and no scaler.api_server)
        raise SystemExit(f"scale: {error}") from None


def cmd_rules(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    text = slo.render_rules(settings.slo, settings.quality, settings.gpu_health)
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def cmd_swap(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    if args.version is None:
        result = swap.rollback(settings, args.model_name)
    else:
        result = swap.swap(settings, args.model_name, args.version)
    if result.ok:
        print(f"swapped: {result.detail}")
        return 0
    print(f"FAILED gate {result.gate}: {result.detail}", file=sys.stderr)
    return 1


def cmd_kube_swap(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    try:
        api = kube.cluster_client(settings.kubernetes, settings.swap.switch_timeout_s)
        result = kube_swap.kube_swap(settings, api, args.version, args.replicas)
    except KubeError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    if result.ok:
        print(f"swapped: {result.detail}")
        return 0
    print(f"FAILED gate {result.gate}: {result.detail}", file=sys.stderr)
    return 1


def _colour(settings: ServiceSettings, named: Colour | None) -> Colour | None:
    """The --colour given, else the one served; None (said on stderr) when neither names one."""
    colour = named or serving.serving_engine(settings).colour
    if colour is None:
        print("no colour is served here: name one with --colour", file=sys.stderr)
    return colour


def cmd_release_check(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    colour = _colour(settings, args.colour)
    if colour is None:
        return 2
    results = release.run_checks(release.Candidate(settings, colour))
    print(release.report_json(results))
    if release.failed(results):
        print(f"FAILED release-check on {colour}: {release.summary(results)}", file=sys.stderr)
        return 1
    return 0


def cmd_load_chaos(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    colour = _colour(settings, args.colour)
    if colour is None:
        return 2
    candidate = release.Candidate(settings, colour)
    result = chaos.gate(settings.chaos, candidate.base_url, settings.engine.served_model_name,
                        lambda line: print(line, file=sys.stderr))  # fmt: skip
    print(json.dumps(result.as_dict(), indent=1))
    if not result.ok:
        print(f"FAILED load-chaos on {colour}: {result.detail}", file=sys.stderr)
        return 1
    return 0


def cmd_api_key(args: argparse.Namespace) -> int:
    path = _settings(args.config).swap.api_keys_file
    if path is None:
        raise SystemExit(f"swap.api_keys_file is not set in {args.config}: this service asks for no key")
    try:
        pairs = router.read_api_keys(path) if path.exists() else []
    except ValueError as error:
        raise SystemExit(str(error)) from None
    clients = [client for client, _ in pairs]
    if args.action == "list":
        print("\n".join(clients))
        return 0
    if not re.fullmatch(router.API_CLIENT, args.client):
        raise SystemExit(f"client {args.client!r}: 1-64 of A-Z a-z 0-9 _ . -")
    if args.action == "remove":
        if args.client not in clients:
            raise SystemExit(f"no key for {args.client} in {path}")
        router.write_api_keys(path, [(c, k) for c, k in pairs if c != args.client])
        print(f"removed {args.client}; Envoy refuses its key within seconds (the control loop re-reads {path})")
        return 0
    if args.client in clients:
        raise SystemExit(f"{args.client} already has a key in {path}: remove it first to rotate")
    key = secrets.token_urlsafe(32)
    router.write_api_keys(path, [*pairs, (args.client, key)])
    # Shown once, here, to the admin on the host; --quiet (the deploy) shows nothing.
    if not args.quiet:
        print(key)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = swap.serving_status(_settings(args.config))
    print(json.dumps(status, sort_keys=True))
    return 0 if status["ready"] else 1


def cmd_traffic(args: argparse.Namespace) -> int:
    try:
        took = traffic.set_traffic(_settings(args.config).swap, args.state)
    except traffic.TrafficError as error:
        print(f"FAILED traffic {args.state}: {error}", file=sys.stderr)
        return 1
    print(f"traffic: {args.state} (in force on Envoy after {took:.1f} s)")
    return 0


def _serve_again(settings: SwapSettings) -> str:
    """Puts serving back after a drain that did not finish; says what the host serves then."""
    try:
        traffic.set_traffic(settings, "serving")
    except traffic.TrafficError as error:
        return f"putting serving back failed too ({error}): run `ironserve-service traffic serving`"
    return "the host serves again"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def cmd_drain(args: argparse.Namespace) -> int:
    settings = _settings(args.config).swap
    notice_s = settings.host_drain_notice_s if args.notice is None else args.notice
    timeout_s = settings.host_drain_timeout_s if args.timeout is None else args.timeout
    if notice_s < 0 or timeout_s <= 0:
        raise SystemExit(f"drain: --notice must be >= 0 and --timeout > 0 (got {notice_s:g} and {timeout_s:g})")
    # A drain stopped by the service manager ends as one stopped by Ctrl-C: the host is put back in service.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        finished_s = traffic.drain(settings, notice_s, timeout_s, lambda line: print(line, file=sys.stderr, flush=True))
    except traffic.DrainTimeout as timeout:
        print(f"FAILED drain: {timeout.running} requests still running after {timeout_s:g} s; "
              f"{_serve_again(settings)}", file=sys.stderr)  # fmt: skip
        return 1
    except (Exception, KeyboardInterrupt) as error:
        reason = f"interrupted ({str(error) or 'Ctrl-C'})" if isinstance(error, KeyboardInterrupt) else str(error)
        print(f"FAILED drain: {reason}; {_serve_again(settings)}", file=sys.stderr)
        return 1
    print(f"drained: notice {notice_s:g}s, in-flight finished after {finished_s:.1f}s")
    return 0


def cmd_control(args: argparse.Namespace) -> int:
    settings = _settings(args.config)
    guard = gpu_guard.GpuGuard(settings) if settings.gpu_health.guard else None
    if guard is not None:
        guard.start()
    try:
        return control.run_controller(settings)
    finally:
        if guard is not None:
            guard.stop()


def cmd_router(args: argparse.Namespace) -> int:
    service = _settings(args.config)
    settings = service.swap
    bootstrap = settings.router_dir / router.BOOTSTRAP_FILE
    router.write_initial(settings, bootstrap, service.quality)
    if args.write_only:
        print(f"wrote {bootstrap}, {settings.router_dir / router.CDS_FILE}, {settings.router_dir / router.RDS_FILE}")
        return 0
    binary = settings.envoy_binary or Path(sys.executable).with_name("envoy")
    command = router.envoy_command(binary, bootstrap)
    os.execv(command[0], command)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="ironserve-service", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="prove a model directory's bytes before serving it")
    verify.add_argument("model_dir", type=Path)
    verify.add_argument("--manifest", type=Path, help="sha256sum manifest (default MODEL_DIR/MANIFEST.sha256)")
    verify.add_argument("--architecture", default="qwen2")
    verify.add_argument("--rope-freq-base", type=float, default=1_000_000.0)
    verify.add_argument("--gguf-quant", action="append", default=None, help="allowed GGUF quantization (repeat)")
    verify.add_argument("--no-release", action="store_true", help="do not require release.json")
    verify.set_defaults(handler=cmd_verify)

    seal = commands.add_parser("seal", help="write MANIFEST.sha256 and release.json for verified weights")
    seal.add_argument("model_dir", type=Path)
    seal.set_defaults(handler=cmd_seal)

    for name, handler, text in (
        ("launch", cmd_launch, "start vLLM with loading/ready markers"),
        ("exporter", cmd_exporter, "serve the five-dimension metrics and the mirror sink"),
        ("rules", cmd_rules, "print the Prometheus SLO rules"),
        ("scale", cmd_scale, "PID on GPU utilisation -> the serving Deployment's replicas, until SIGTERM"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
        command.set_defaults(handler=handler)
        if name == "rules":
            command.add_argument("--output", type=Path)

    swap_command = commands.add_parser("swap", help="blue/green hot swap to VERSION (models_root/VERSION)")
    swap_command.add_argument("model_name")
    swap_command.add_argument("version")
    swap_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    swap_command.set_defaults(handler=cmd_swap)
    kube_swap_command = commands.add_parser(
        "kube-swap", help="blue/green swap of the Kubernetes Deployments to VERSION (inference_mode kubernetes)"
    )
    kube_swap_command.add_argument("version")
    kube_swap_command.add_argument("--replicas", type=int, help="the new colour's replicas (default: the active's)")
    kube_swap_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    kube_swap_command.set_defaults(handler=cmd_kube_swap)
    rollback_command = commands.add_parser("rollback", help="swap back to the version active before the last swap")
    rollback_command.add_argument("model_name")
    rollback_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    rollback_command.set_defaults(handler=cmd_swap, version=None)

    release_command = commands.add_parser(
        "release-check", help="JSON: the 12-item release checklist on a colour (exit 1 naming every failed check)"
    )
    release_command.add_argument("--colour", choices=COLOURS, help="the colour to check (default: the one served)")
    release_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    release_command.set_defaults(handler=cmd_release_check)

    chaos_command = commands.add_parser(
        "load-chaos", help="JSON: locust's P99 on a colour, then under stress-ng (exit 1 when it moves too much)"
    )
    chaos_command.add_argument("--colour", choices=COLOURS, help="the colour to load (default: the one served)")
    chaos_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    chaos_command.set_defaults(handler=cmd_load_chaos)

    key_command = commands.add_parser("api-key", help="add (prints the new key once), remove or list API clients")
    key_command.add_argument("action", choices=["add", "remove", "list"])
    key_command.add_argument("client", nargs="?", default="default")
    key_command.add_argument("--quiet", action="store_true", help="add without printing the key")
    key_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    key_command.set_defaults(handler=cmd_api_key)

    status_command = commands.add_parser("status", help="JSON: active version, colour, ready (exit 0 when ready)")
    status_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    status_command.set_defaults(handler=cmd_status)

    traffic_command = commands.add_parser(
        "traffic", help="the host's traffic state in etcd, waited for until Envoy serves it (exit 1 when not in time)"
    )
    traffic_command.add_argument(
        "state", choices=router.TRAFFIC_STATES, help="draining: /health 503, requests served; closed: new ones 503"
    )
    traffic_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    traffic_command.set_defaults(handler=cmd_traffic)

    drain_command = commands.add_parser(
        "drain", help="draining, the notice, closed, in-flight requests finished (else serving again, exit 1)"
    )
    drain_command.add_argument("--notice", type=float, help="seconds of draining (default swap.host_drain_notice_s)")
    drain_command.add_argument(
        "--timeout", type=float, help="bound on in-flight requests finishing (default swap.host_drain_timeout_s)"
    )
    drain_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    drain_command.set_defaults(handler=cmd_drain)

    control_command = commands.add_parser(
        "control", help="watch etcd and move Envoy's route after a readiness check; the GPU guard beside it"
    )
    control_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    control_command.set_defaults(handler=cmd_control)

    router_command = commands.add_parser("router", help="write Envoy's bootstrap/cluster/route files and exec Envoy")
    router_command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    router_command.add_argument("--write-only", action="store_true", help="write the files, do not start Envoy")
    router_command.set_defaults(handler=cmd_router)

    probe = commands.add_parser("probe", help="exit 0 when ready/live (systemd, Kubernetes exec probes)")
    probe.add_argument("kind", choices=["ready", "live"])
    probe.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    probe.set_defaults(handler=cmd_probe)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "gguf_quant", "unset") is None:
        args.gguf_quant = ["Q5_K_M", "Q4_K_S"]
    code: int = args.handler(args)
    return code
