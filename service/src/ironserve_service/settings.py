"""Typed settings for every part of the service, loaded from one YAML file."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ironserve_service.gpu_health import FATAL_XIDS, PCIE_WIDTHS
from ironserve_service.kube import DNS_1123_LABEL, SERVICE_ACCOUNT_DIR


def _takes_number_only(annotation: object) -> bool:
    if get_origin(annotation) in {Union, types.UnionType}:
        options = get_args(annotation)
        return bool not in options and any(_takes_number_only(option) for option in options)
    return annotation in {int, float}


class _Strict(BaseModel):
    # Typos in the config file must fail loudly instead of silently using a default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: object, info: ValidationInfo) -> object:
        # pydantic reads `true` as 1 for a number field (a port of 1, a timeout of one second): refused instead.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _takes_number_only(field.annotation):
            raise ValueError("a boolean is not a number")
        return value


# The flags the launcher builds from typed settings (launcher.build_command): vLLM's argparse keeps the last of a
# flag given twice, so one in extra_args would silently replace the checked value (a port, the listen host).
LAUNCHER_FLAGS = frozenset(
    {
        "model", "served-model-name", "host", "port", "max-model-len", "gpu-memory-utilization", "max-num-seqs",
        "tensor-parallel-size", "dtype", "custom-histogram-buckets", "cudagraph-capture-sizes", "enforce-eager",
    }
)  # fmt: skip
# vLLM's short spellings of launcher flags (vllm/engine/arg_utils.py: -tp for --tensor-parallel-size).
SHORT_FLAGS = {"-tp": "tensor-parallel-size"}
# Never accepted: offloading weights or KV cache to CPU memory (the model stays resident on the GPU), and a config
# file, which would set any flag without these checks.
FORBIDDEN_FLAGS = {
    "cpu-offload-gb": "CPU offload is not allowed: the whole model stays resident on the GPU",
    "config": "a config file would set flags past these checks",
}


def _flag_name(arg: str) -> str | None:
    """The long flag an argument names as vLLM's parser reads it (`--cpu_offload_gb=4` -> `cpu-offload-gb`)."""
    if arg in SHORT_FLAGS:
        return SHORT_FLAGS[arg]
    if not arg.startswith("--") or arg == "--":
        return None
    # vLLM's FlexibleArgumentParser reads underscores as dashes.
    return arg[2:].split("=", 1)[0].replace("_", "-").lower()


def _extra_arg_problem(arg: str) -> str | None:
    name = _flag_name(arg)
    if name is None:
        return None
    if re.search(r"\s", arg.split("=", 1)[0]):
        return f"{arg!r} is not one flag; accepted: one argument per list item, --flag=value or --flag then value"
    # argparse also accepts an unambiguous prefix of a flag (`--cpu-offload`); every offload flag keeps weights or KV
    # cache off the GPU.
    if "offload" in name:
        return f"{arg!r}: {FORBIDDEN_FLAGS['cpu-offload-gb']}"
    forbidden = [why for flag, why in FORBIDDEN_FLAGS.items() if flag.startswith(name)]
    if forbidden:
        return f"{arg!r}: {forbidden[0]}"
    spelt = sorted(flag for flag in LAUNCHER_FLAGS if flag.startswith(name) and len(name) >= 3)
    if spelt:
        setting = spelt[0].replace("-", "_")
        return f"{arg!r} sets --{spelt[0]}, which the launcher sets from engine.{setting}; accepted: that setting"
    return None


class EngineSettings(_Strict):
    """How vLLM is started (svc-* and pipe-cuda-graph-sizes entries of the catalog)."""

    model_dir: Path
    served_model_name: str = "qwen2-7b"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_model_len: int = Field(default=4096, gt=0)
    gpu_memory_utilization: float = Field(default=0.90, gt=0.0, le=1.0)
    max_num_seqs: int = Field(default=8, gt=0)
    tensor_parallel_size: int = Field(default=2, gt=0)
    dtype: Literal["auto", "bfloat16", "float16"] = "auto"
    # Batch sizes (not input lengths) that vLLM captures CUDA graphs for; None lets vLLM choose.
    cudagraph_capture_sizes: list[int] | None = None
    enforce_eager: bool = False
    # Interpreter of the venv vLLM lives in; None means the one running this package.
    engine_python: Path | None = None
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _sizes_sorted_positive(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or any(s <= 0 for s in sizes) or sizes != sorted(set(sizes))):
            raise ValueError("cudagraph_capture_sizes must be distinct positive batch sizes in ascending order")
        return sizes

    @model_validator(mode="after")
    def _graphs_fit_the_batch(self) -> EngineSettings:
        sizes = self.cudagraph_capture_sizes
        if sizes and sizes[-1] > self.max_num_seqs:
            # A graph for a batch larger than max_num_seqs can never be replayed: wasted GPU memory.
            raise ValueError(
                f"cudagraph_capture_sizes are batch sizes; {sizes[-1]} exceeds max_num_seqs={self.max_num_seqs}"
            )
        if sizes and self.enforce_eager:
            raise ValueError("cudagraph_capture_sizes has no effect with enforce_eager")
        return self

    @field_validator("extra_args")
    @classmethod
    def _extra_args_as_a_command_line(cls, args: list[str]) -> list[str]:
        problems = [p for p in map(_extra_arg_problem, args) if p]
        if problems:
            raise ValueError("; ".join(problems))
        return args

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ReadinessSettings(_Strict):
    loading_marker: Path = Path("/tmp/model_loading")
    ready_marker: Path = Path("/tmp/model_ready")
    startup_timeout_s: float = Field(default=900.0, gt=0)
    poll_interval_s: float = Field(default=1.0, gt=0)
    drain_timeout_s: float = Field(default=10.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)


class QualitySettings(_Strict):
    """Model and business dimensions, scored on a sampled mirror of live traffic."""

    mirror_host: str = "127.0.0.1"
    mirror_port: int = Field(default=9401, ge=1, le=65535)
    # Share of prod chat requests Envoy copies to the sink (e.g. 2). Each copy is replayed once against the
    # serving engine with logprobs, so mirroring costs this share of its capacity; 0 turns mirroring off.
    mirror_percent: float = Field(default=2.0, ge=0, le=100)
    queue_size: int = Field(default=64, gt=0)
    logprob_std_normal_max: float = 0.8
    logprob_std_alert: float = 2.5
    semantic_threshold: float = Field(default=0.65, ge=-1.0, le=1.0)
    semantic_scorer: Literal["sentence-bert", "none"] = "sentence-bert"
    max_tokens: int = Field(default=64, gt=0)


class ExporterSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=9400, ge=1, le=65535)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    max_gpus: int = Field(default=8, gt=0)
    gpu_hour_usd: float = Field(default=0.85, ge=0)
    gpus_billed: int = Field(default=2, gt=0)


# Prometheus' duration grammar (docs: configuration, <duration>): units from the largest down, each at most once,
# `1h30m`, `5m`, `500ms`; no spaces, no fractions. The SLO rules write these into PromQL ranges and `for:` clauses.
PROMETHEUS_DURATION = re.compile(
    r"(?=[0-9])(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?"
)
# A metric name (Prometheus data model) and a label value the rules quote: nothing that ends the quoted string.
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_VALUE = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


def _duration(value: str) -> str:
    if not PROMETHEUS_DURATION.fullmatch(value) or not re.search(r"[1-9]", value):
        raise ValueError(
            "is not a Prometheus duration; accepted: digits with units y w d h m s ms, largest first, such as 5m, 1h30m"
        )
    return value


def _metric_name(value: str) -> str:
    if not METRIC_NAME.fullmatch(value):
        raise ValueError("is not a Prometheus metric name; accepted: [a-zA-Z_:][a-zA-Z0-9_:]*")
    return value


def _label_value(value: str) -> str:
    if not LABEL_VALUE.fullmatch(value):
        raise ValueError("is not a plain label value; accepted: 1-128 of A-Z a-z 0-9 _ . : / -")
    return value


Duration = Annotated[str, AfterValidator(_duration)]
# Seconds per unit of a Prometheus duration (docs: configuration, <duration>: a year is 365 days).
DURATION_UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}


def duration_seconds(value: str) -> float:
    """A Prometheus duration (`1h30m`) in seconds: the GPU guard holds a condition as long as the rule's `for:`."""
    return sum(int(count) * DURATION_UNITS[unit] for count, unit in re.findall(r"([0-9]+)(ms|[ywdhms])", value))


class SloSettings(_Strict):
    latency_metric: Annotated[str, AfterValidator(_metric_name)] = "http_request_duration_seconds"
    # slo-p95-latency's 400 ms, applied to what a user waits before the answer starts (time to first token):
    # on total request latency it would page on every long answer.
    ttft_p95_s: float = Field(default=0.4, gt=0)
    # Time per output token once streaming: 200 ms is the TPOT bound of MLPerf Inference's Llama 2 70B server
    # scenario (MLCommons, v4.0 rules), above human reading speed.
    tpot_p95_s: float = Field(default=0.2, gt=0)
    # How long the serving engine or the exporter may be unreachable before it pages.
    target_down_for: Duration = "1m"
    paging_latency_s: float = 0.5
    paging_fast_ratio: float = 0.999
    paging_error_ratio: float = 0.001
    semantic_success_min: float = 0.925
    semantic_success_page: float = 0.90
    cost_per_token_max_usd: float = 0.00015
    # Decimal bytes (20.8 GB = 20.8e9 B), not GiB: the seed's figure is an A10 headroom threshold.
    gpu_memory_alert_bytes: int = 20_800_000_000
    kv_cache_usage_max: float = Field(default=0.95, gt=0, le=1)
    kv_cache_for: Duration = "3m"
    memory_leak_max_bytes_per_hour: float = 300_000.0
    leak_window: Duration = "6h"
    # With a 5 s scrape interval, the 1 m window detects a latency regression in about a minute.
    fast_window: Duration = "1m"
    slo_window: Duration = "5m"
    # Mirrored samples are sparse; a longer window keeps the success rate from flapping.
    quality_window: Duration = "30m"
    job: Annotated[str, AfterValidator(_label_value)] = "ironserve"


class GpuHealthSettings(_Strict):
    """GPU health watched through NVML (gpu_health.py) and the page and ticket rules on it (slo.gpu_rules)."""

    # GPUs NVML enumerates on a healthy host; fewer pages as a GPU off the bus. 2: the design serves on two A10s
    # (hw-active-gpus-two); a host that keeps all four cards installed sets 4.
    expected_gpus: int = Field(default=2, ge=0, le=64)
    # PCIe lanes each checked GPU must train at: the hardware profile's serving_width (hw-pcie-link-width-x16).
    expected_pcie_width: int = 16
    # NVML indices held to expected_pcie_width; None: every GPU. On the R740 with four cards, slots 3-4 train at x8
    # and do not serve, so the serving two are listed.
    full_width_devices: list[int] | None = None
    # How long a link may stay narrower than expected before it pages (a GPU reset retrains it in seconds).
    degraded_link_for: Duration = "5m"
    # The window in which a new uncorrectable ECC error or a paging XID is looked for: at least two scrapes.
    error_window: Duration = "10m"
    # XIDs that page (gpu_health.FATAL_XIDS cites NVIDIA's Xid catalog for each default).
    fatal_xids: list[int] = Field(default_factory=lambda: list(FATAL_XIDS))
    # How long a clock slowdown, a power cap at the limit, a slow link under load or a changed power limit lasts
    # before it makes a ticket.
    sustained_for: Duration = "15m"
    # Power draw at or above this share of the enforced limit, with the SW power cap engaged, counts as capped: an
    # idle A10 reports the SW power cap "Active" at 15 W of 150 W (tests/data/gpu_health/a10-nvidia-smi-q.txt).
    power_limit_ratio: float = Field(default=0.95, gt=0, le=1)
    # Utilisation above which a PCIe generation below the platform's maximum means a degraded link: an idle GPU
    # lowers its link generation to save power.
    busy_utilization_percent: float = Field(default=80.0, gt=0, le=100)
    # The GPU guard (gpu_guard.py) in `ironserve-service control`: when a serving GPU meets a page rule's condition,
    # the host leaves its load balancer (traffic draining, the reason beside it) and comes back once the GPUs are fit
    # and the model answers. It never reboots the host nor resets a GPU.
    guard: bool = True
    # Seconds between the guard's readings: the control loop's own full-read period (control.RESYNC_S); an NVML
    # reading takes milliseconds.
    guard_interval_s: float = Field(default=5.0, gt=0)

    @field_validator("expected_pcie_width")
    @classmethod
    def _pcie_width(cls, width: int) -> int:
        if width not in PCIE_WIDTHS:
            raise ValueError(f"{width} is not a PCIe link width; accepted: {', '.join(map(str, PCIE_WIDTHS))}")
        return width

    @field_validator("full_width_devices")
    @classmethod
    def _devices(cls, devices: list[int] | None) -> list[int] | None:
        if devices is not None and (not devices or min(devices) < 0 or len(set(devices)) != len(devices)):
            raise ValueError(
                f"full_width_devices must be distinct NVML indices (0, 1, ...), or null for every GPU; got {devices}"
            )
        return devices

    @field_validator("fatal_xids")
    @classmethod
    def _xids(cls, xids: list[int]) -> list[int]:
        if not xids or any(not 1 <= xid <= 999 for xid in xids) or len(set(xids)) != len(xids):
            raise ValueError(
                f"fatal_xids must be one or more distinct XID codes from 1 to 999 (NVIDIA's Xid catalog); got {xids}"
            )
        return xids


class ReleaseSettings(_Strict):
    """The release gate (`release-check`, and `swap` before its etcd write): release-check-01..12 thresholds."""

    # False only on a host without a GPU (a CPU engine): the GPU items then skip, naming this setting.
    require_gpu: bool = True
    # release-check-01: used share of each GPU's memory, the retiring colour's processes not counted.
    gpu_memory_max_ratio: float = Field(default=0.85, gt=0, le=1)
    # release-check-02 / io-runtime-disk-free: containerd's root (the seed's /var/lib/docker); None: no runtime.
    runtime_storage: Path | None = Path("/var/lib/containerd")
    runtime_min_free_ratio: float = Field(default=0.20, ge=0, lt=1)
    # release-check-07: the runtime whose journal tail must hold no error; None: no runtime on this host.
    runtime_unit: str | None = "containerd.service"
    journal_lines: int = Field(default=20, gt=0)
    # release-check-06: open TCP connections on the listener and on the candidate's engine port, each.
    max_connections: int = Field(default=1000, gt=0)
    # release-check-08: the kernel's default ephemeral range (a narrowed one blocked new pods in the seed).
    port_range: str = Field(default="32768 60999", pattern=r"^[0-9]{1,5} [0-9]{1,5}$")
    # release-check-09: the service account's group, exactly one entry in the group database.
    service_group: str = Field(default="ai-runner", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    # release-check-10: the NVIDIA device nodes an engine opens.
    device_nodes: list[Path] = Field(
        default_factory=lambda: [Path("/dev/nvidia0"), Path("/dev/nvidiactl"), Path("/dev/nvidia-uvm")]
    )


class ChaosSettings(_Strict):
    """The load-and-chaos gate of `swap` (chaos.py): locust's load on the candidate, a baseline P99, then the
    P99 under stress-ng memory pressure in the service's slice (rel-locust-load-test, rel-chaos-*)."""

    # False: `swap` skips the gate (`load-chaos` still runs it on demand).
    enabled: bool = True
    # Concurrent locust users, each waiting between wait_min_s and wait_max_s (the catalog's 0.1-0.5 s).
    users: int = Field(default=8, gt=0, le=1000)
    wait_min_s: float = Field(default=0.1, ge=0)
    wait_max_s: float = Field(default=0.5, ge=0)
    # A request slower than this counts as failed (the catalog's 30 s).
    request_timeout_s: float = Field(default=30.0, gt=0)
    # Tokens each chat completion asks for: the same work in both phases, so their P99s compare.
    max_tokens: int = Field(default=16, gt=0)
    # One query per line (UTF-8), e.g. prompts taken from the service's logs; up to sample_queries of them are
    # sampled. None: the canary's prompt.
    queries_file: Path | None = None
    sample_queries: int = Field(default=1000, gt=0)
    # Seconds of load in each phase; stress-ng starts settle_s before the chaos phase and runs until it ends
    # (its --timeout, the catalog's 60 s, is settle_s + load_s + settle_s).
    load_s: float = Field(default=50.0, gt=0)
    settle_s: float = Field(default=5.0, ge=0)
    # Seconds of the same load before the baseline, not counted: a fresh engine's first requests (new batch
    # shapes) are slower than its steady state, and a handful of them would set the baseline's P99.
    warmup_s: float = Field(default=5.0, ge=0)
    # stress-ng --vm <vm_workers> --vm-bytes <vm_bytes> (per worker; the catalog's 2 and 4G).
    vm_workers: int = Field(default=2, gt=0, le=64)
    vm_bytes: str = Field(default="4G", pattern=r"^[1-9][0-9]{0,5}[KMG]?$|^[1-9][0-9]?%$")
    # The systemd slice stress-ng runs in (systemd-run --scope), the engines' own, so the pressure meets
    # their memory ceiling. None: stress-ng runs as a plain child process (hosts without systemd, tests).
    slice: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+\.slice$")
    # The P99 under chaos may exceed the baseline's by this share (the catalog's 15 %), else the swap is refused.
    max_p99_increase: float = Field(default=0.15, ge=0)
    # Fewer requests than this in a phase make no P99: the gate fails rather than guess.
    min_requests: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _wait_range(self) -> ChaosSettings:
        if self.wait_max_s < self.wait_min_s:
            raise ValueError(f"wait_max_s {self.wait_max_s} is below wait_min_s {self.wait_min_s}")
        return self

    @property
    def stress_timeout_s(self) -> int:
        return round(self.settle_s + self.load_s + self.settle_s)


Colour = Literal["blue", "green"]
COLOURS: tuple[Colour, Colour] = ("blue", "green")


class RoutingSettings(_Strict):
    """X-Env request-header colouring in Envoy (route-* entries of the catalog).

    No header (or any other value) -> prod, the active blue/green colour; ``X-Env: staging`` -> the staging
    backends; ``X-Env: canary`` -> a weighted split between the canary backends and prod (relative weights,
    not percentages). Backends are ``host:port`` (IP literal, ``[v6]``, or a DNS name). An empty list means
    that colour is not configured: its X-Env value then goes to prod like any unknown value.
    """

    staging: list[str] = Field(default_factory=list)
    canary: list[str] = Field(default_factory=list)
    canary_weight: int = Field(default=10, ge=0, le=10_000)
    prod_weight: int = Field(default=90, ge=0, le=10_000)

    @staticmethod
    def address(backend: str) -> tuple[str, int]:
        host, colon, port = backend.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        valid_host = bool(host) and (":" in host or all(c.isalnum() or c in ".-" for c in host))
        if not colon or not valid_host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"backend {backend!r} is not host:port")
        return host, int(port)

    @field_validator("staging", "canary")
    @classmethod
    def _backends(cls, backends: list[str]) -> list[str]:
        for backend in backends:
            cls.address(backend)
        if len(set(backends)) != len(backends):
            raise ValueError(f"duplicate backends: {backends}")
        return backends

    @model_validator(mode="after")
    def _weights(self) -> RoutingSettings:
        if self.canary and self.canary_weight + self.prod_weight == 0:
            raise ValueError("canary_weight + prod_weight must be positive")
        return self


class SwapSettings(_Strict):
    """Blue/green hot swap: etcd key, Envoy router and the two engine instances (hot-swap-* entries)."""

    model_name: str = "qwen2-7b"
    etcd_url: str = "http://127.0.0.1:2379"
    etcd_timeout_s: float = Field(default=2.0, gt=0)
    # VERSION of `swap MODEL VERSION` is the directory models_root/VERSION (sealed, see `seal`).
    models_root: Path = Path("/srv/models")
    verify_release: bool = True
    # Per-colour launcher configs, markers and logs (run_dir/<colour>/).
    run_dir: Path = Path("/run/ironserve")
    # systemd unit per colour, "{colour}" filled in (e.g. "ai-service@{colour}.service"): `swap` starts and
    # stops the colours through systemd (user, slice, seccomp come from the unit). None: `swap` starts the
    # launchers itself as detached processes (tests, benchmarks, hosts without systemd).
    colour_unit: str | None = None
    # Envoy's dynamic configuration files (cds.json, rds.json), replaced by atomic rename.
    router_dir: Path = Path("/etc/ironserve/envoy")
    envoy_binary: Path | None = None
    blue_port: int = Field(default=8000, ge=1, le=65535)
    green_port: int = Field(default=8001, ge=1, le=65535)
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(default=8080, ge=1, le=65535)
    # API keys Envoy checks (`Authorization: Bearer <key>`) on the OpenAI routes before any engine sees the
    # request: one "<client> <key>" per line, a file on the host readable by the service account only, re-read
    # by the control loop so that a rotation needs no restart. None: no key is asked (a test stack).
    api_keys_file: Path | None = None
    # The admin interface always binds 127.0.0.1; only the port is configurable.
    admin_port: int = Field(default=9901, ge=1, le=65535)
    stream_idle_timeout_s: int = Field(default=300, gt=0)
    # Envoy holds each request until its end (router.py: why HTTP/2 clients need it); larger bodies get 413.
    # 16 MiB: a full 128k-token context as JSON is a few MiB.
    max_request_bytes: int = Field(default=16 * 2**20, ge=2**16, le=2**30)
    drain_idle_s: float = Field(default=10.0, ge=0)
    drain_max_s: float = Field(default=600.0, gt=0)
    switch_timeout_s: float = Field(default=10.0, gt=0)
    ready_timeout_s: float = Field(default=900.0, gt=0)
    poll_interval_s: float = Field(default=0.5, gt=0)
    # Keep the drained colour's engine running on its version after a swap, so that a rollback to it is a readiness
    # check and a route switch instead of an engine start; costs a second engine's memory (on a GPU host, its GPUs'
    # memory), hence off by default.
    keep_previous: bool = False
    # `drain`: how long /health answers 503 `draining` while requests are still served, before new ones are refused:
    # the site load balancer takes the host out only once its health checks have failed (interval x unhealthy
    # threshold), and the requests it sends until then still get an answer.
    host_drain_notice_s: float = Field(default=10.0, ge=0)
    # `drain`: the bound on the requests in flight finishing once new ones are refused; past it the host serves again.
    host_drain_timeout_s: float = Field(default=300.0, gt=0)
    # X-Env staging/canary routes of the same Envoy (here because `router` and `control` get SwapSettings).
    routing: RoutingSettings = RoutingSettings()

    @field_validator("colour_unit")
    @classmethod
    def _unit_per_colour(cls, template: str | None) -> str | None:
        if template is not None and (template.count("{colour}") != 1 or not template.endswith(".service")):
            raise ValueError("colour_unit must name a .service unit with one {colour} placeholder")
        return template

    @model_validator(mode="after")
    def _distinct_ports(self) -> SwapSettings:
        ports = [self.blue_port, self.green_port, self.listen_port, self.admin_port]
        if len(set(ports)) != len(ports):
            raise ValueError(f"blue, green, listener and admin ports must differ: {ports}")
        return self

    @property
    def listener_url(self) -> str:
        """Where a process on this host reaches Envoy's listener (loopback when it listens on every interface)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.listen_host, self.listen_host)
        return f"http://[{host}]:{self.listen_port}" if ":" in host else f"http://{host}:{self.listen_port}"

    @property
    def key_prefix(self) -> str:
        return f"/models/{self.model_name}/"

    @property
    def active_key(self) -> str:
        return f"/models/{self.model_name}/active"

    @property
    def previous_key(self) -> str:
        """The version that was active before the last swap: what `rollback` swaps back to."""
        return f"/models/{self.model_name}/previous"

    @property
    def traffic_key(self) -> str:
        """The host's traffic state (`traffic`, `drain`): serving, draining or closed; absent means serving."""
        return f"/models/{self.model_name}/traffic"

    @property
    def traffic_reason_key(self) -> str:
        """Why the host left serving, one line, written with the traffic key by the GPU guard: Envoy's /health
        names it in a header and `status` shows it while the state is not serving."""
        return f"{self.traffic_key}/reason"

    @property
    def gpu_guard_key(self) -> str:
        """The GPU guard's record of its drain (gpu_guard.GuardRecord), written in the same transaction as the
        traffic key: equal modification revisions mean the drain in force is still the guard's."""
        return f"{self.traffic_key}/gpu-guard"

    def colour_key(self, colour: Colour) -> str:
        return f"/models/{self.model_name}/colours/{colour}"

    def port(self, colour: Colour) -> int:
        return self.blue_port if colour == "blue" else self.green_port

    def colour_dir(self, colour: Colour) -> Path:
        return self.run_dir / colour

    def unit(self, colour: Colour) -> str | None:
        return self.colour_unit.format(colour=colour) if self.colour_unit else None


# A container image by digest (name[:tag]@sha256:<64 hex>): the bytes a node runs are the ones the site built
# from the hash-locked requirements; a tag alone can be moved.
IMAGE_BY_DIGEST = r"[a-z0-9]([a-z0-9._/:-]*[a-z0-9])?@sha256:[0-9a-f]{64}"
# A Kubernetes resource quantity (apimachinery's resource.Quantity: decimal or binary suffix).
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"


class KubernetesServingSettings(_Strict):
    """How the engines run in `kubernetes` mode: one Deployment per colour in `namespace` (kube_objects.py)."""

    # k8s-ai-service-objects: namespace ai, Service ai-service, container ai-container.
    namespace: str = Field(default="ai", pattern=f"^{DNS_1123_LABEL}$")
    image: str | None = None
    # The account the engines run as, by number: a pod names no account by name, and the model store is
    # root:<group> 0750 on every node.
    run_as_user: int | None = Field(default=None, ge=1, le=2**31 - 1)
    run_as_group: int | None = Field(default=None, ge=1, le=2**31 - 1)
    gpus: int = Field(default=0, ge=0, le=16)
    # k8s-pod-memory-limit: 24Gi, with requests == limits (Guaranteed QoS, the catalog's correction).
    memory: str = Field(default="24Gi", pattern=QUANTITY)
    cpu: str = Field(default="8", pattern=QUANTITY)
    runtime_class: str | None = "nvidia"
    # The kubelet's Localhost profile, relative to <kubelet root>/seccomp (roles/security installs it).
    seccomp_profile: str = Field(default="profiles/ai-service.json", pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
    capabilities: list[str] = Field(default_factory=lambda: ["SYS_NICE"])
    startup_period_s: int = Field(default=10, gt=0)
    readiness_period_s: int = Field(default=5, gt=0)
    # How the swap and the scaler reach the API server: an https URL with the bearer token and CA files below;
    # None: in-cluster (KUBERNETES_SERVICE_HOST/PORT and the pod's service account files).
    api_server: str | None = Field(default=None, pattern=r"^https://[^/?#]+$")
    token_file: Path = SERVICE_ACCOUNT_DIR / "token"
    ca_file: Path = SERVICE_ACCOUNT_DIR / "ca.crt"

    @field_validator("image")
    @classmethod
    def _by_digest(cls, image: str | None) -> str | None:
        if image is not None and not re.fullmatch(IMAGE_BY_DIGEST, image):
            raise ValueError(
                f"{image!r} is not an image by digest; accepted: registry/name[:tag]@sha256:<64 hex digits> (a tag "
                "alone can be moved to other bytes)"
            )
        return image

    @field_validator("capabilities")
    @classmethod
    def _capability_names(cls, names: list[str]) -> list[str]:
        bad = [name for name in names if name.startswith("CAP_") or not re.fullmatch(r"[A-Z][A-Z_]*", name)]
        if bad:
            raise ValueError(f"{bad} are not Kubernetes capability names (SYS_NICE, IPC_LOCK: no CAP_ prefix)")
        return names


class ScalerSettings(_Strict):
    """The PID replica scaler (`ironserve-service scale`, scaler.py): GPU utilisation from the local Prometheus in,
    the active blue/green Deployment's scale subresource out (scale-* entries of the catalog, k8s-no-hpa). The
    Deployments are kube_objects' `ai-service-<colour>` in the `kubernetes` section's namespace."""

    # scale-pid-controller: the catalog's gains and setpoint, fixed (scaler.py documents their units).
    kp: float = Field(default=0.8, ge=0)
    ki: float = Field(default=0.1, ge=0)
    kd: float = Field(default=0.05, ge=0)
    setpoint_percent: float = Field(default=70.0, gt=0, lt=100)
    # scale-replica-bounds. At least 1: a colour scaled to 0 reads as the idle one and nothing would scale it back.
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=32, ge=1)
    # Seconds between decisions; the PID's time unit is the second whatever this is.
    interval_s: float = Field(default=1.0, gt=0)
    # Seconds from a scale-up until the new replicas serve and show in the utilisation (pod start, model load,
    # readiness, scrape and the metric's lag): replicas younger than this count as serving nothing.
    replica_ready_s: float = Field(default=60.0, ge=0)
    # Most replicas one decision adds or removes.
    max_step_up: int = Field(default=4, ge=1)
    max_step_down: int = Field(default=2, ge=1)
    # scale-metric-source: the local Prometheus, not metrics-server; the query must give one series or a scalar.
    prometheus_url: str = Field(default="http://127.0.0.1:9090", pattern=r"^https?://[^/?#]+(/[^?#]*)?$")
    query: str = Field(default="avg(gpu_utilization_percent)", min_length=1)
    # Each Prometheus query and each Kubernetes API request.
    request_timeout_s: float = Field(default=5.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> ScalerSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        return self


class ServiceSettings(_Strict):
    engine: EngineSettings
    readiness: ReadinessSettings = ReadinessSettings()
    exporter: ExporterSettings = ExporterSettings()
    gpu_health: GpuHealthSettings = GpuHealthSettings()
    quality: QualitySettings = QualitySettings()
    slo: SloSettings = SloSettings()
    swap: SwapSettings = SwapSettings()
    release: ReleaseSettings = ReleaseSettings()
    chaos: ChaosSettings = ChaosSettings()
    scaler: ScalerSettings = ScalerSettings()
    kubernetes: KubernetesServingSettings = KubernetesServingSettings()

    @model_validator(mode="after")
    def _gpus_watched(self) -> ServiceSettings:
        # The exporter reads up to exporter.max_gpus GPUs: one expected past that would never be watched.
        watched, health = self.exporter.max_gpus, self.gpu_health
        if health.expected_gpus > watched:
            raise ValueError(
                f"gpu_health.expected_gpus ({health.expected_gpus}) exceeds exporter.max_gpus ({watched}): the GPUs "
                "past max_gpus would not be watched; accepted: raise exporter.max_gpus"
            )
        beyond = [index for index in health.full_width_devices or [] if index >= watched]
        if beyond:
            raise ValueError(
                f"gpu_health.full_width_devices {beyond} are not below exporter.max_gpus ({watched}): never read"
            )
        return self


def load_settings(path: Path) -> ServiceSettings:
    with path.open(encoding="utf-8") as handle:
        return ServiceSettings.model_validate(yaml.safe_load(handle) or {})
