"""Stand-in `libnvidia-ml.so.1` (NVML) for lab hosts without a GPU: build it, and write and read its state file.

The library (files/nvml-standin/nvml.c) answers every NVML call the inference service makes through pynvml
(ironserve_service.gpu_health, gpu_guard, exporter.read_gpus) from the state file this module writes, re-read on
every call: a test or a lab scenario changes a GPU (an uncorrectable ECC count, a lost GPU, an XID event) by
rewriting the file while the exporter runs. `from_profile` gives a lab host's profile GPUs the identities the lab's
stand-in nvidia-smi prints for them; edge.plug_gpus puts the library and the state on a host.

State file format, one item a line (the C file's header says the same):
    count N                     GPUs NVML reports
    gpu INDEX KEY VALUE...      one field of one GPU (GpuState's field names)
    xid ID INDEX CODE           an XID event; IDs increase; each NVML event set delivers each later ID once
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ironserve_lab import standin_nvidia_smi

SOURCE = Path(__file__).parent / "files" / "nvml-standin" / "nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"  # the name pynvml loads (CDLL("libnvidia-ml.so.1"))
# Where NVIDIA's Ubuntu driver package (libnvidia-compute-NNN) installs the library, on the loader's default path.
INSTALL_PATH = Path("/usr/lib/x86_64-linux-gnu") / LIBRARY_NAME
STATE_ENV = "IRONSERVE_NVML_STANDIN_STATE"
DEFAULT_STATE_PATH = Path("/etc/ironserve-lab/nvml-state")
A10_MEMORY_BYTES = 23028 * 1024 * 1024  # the A10's 23028 MiB (hardware_profiles/r740-a10x4.yaml)


@dataclass(frozen=True)
class GpuState:
    """One GPU as NVML reports it. Defaults: the idle A10 of service/tests/data/gpu_health/a10-nvidia-smi-q.txt
    (driver 550.90.12; source in a10-nvidia-smi-q.source), memory from the lab's A10 hardware profile."""

    name: str = "NVIDIA A10"
    uuid: str = "GPU-14705cc6-2e5b-ae28-e00a-0f87622e4299"
    serial: str = "1325221009692"
    pci_bus_id: str = "00000000:08:00.0"
    memory_total: int = A10_MEMORY_BYTES
    memory_used: int = 0
    utilization_gpu: int = 0
    utilization_memory: int = 0
    power_mw: int = 15650
    power_limit_mw: int = 150000
    power_default_limit_mw: int = 150000
    temperature_c: int = 33
    pcie_gen: int = 1  # an idle A10 drops its link to generation 1 of 4
    pcie_gen_max: int = 4
    pcie_width: int = 16
    pcie_width_max: int = 16
    ecc_enabled: int = 1
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remapped_pending: int = 0
    remapped_failure: int = 0
    throttle_mask: int = 0x4  # SW Power Cap "Active" in that capture
    lost: int = 0  # 1: every query on the GPU answers NVML_ERROR_GPU_IS_LOST
    xid_events: int = 1  # 0: nvmlDeviceRegisterEvents answers NOT_SUPPORTED
    processes: str = ""  # "PID:BYTES PID:BYTES", nvmlDeviceGetComputeRunningProcesses_v3


# The second real A10 (a10-second-nvidia-smi-q.txt, driver 550.127.05; source in its .source): Idle the only
# clock event reason, 21.30 W.
SECOND_A10 = GpuState(
    uuid="GPU-51ae0086-e1ac-4a20-f062-9caa44e4df6d",
    serial="1324722021038",
    pci_bus_id="00000000:06:00.0",
    power_mw=21300,
    throttle_mask=0x1,
)


@dataclass(frozen=True)
class XidEvent:
    id: int
    index: int
    code: int


@dataclass(frozen=True)
class NvmlState:
    gpus: tuple[GpuState, ...] = ()
    xids: tuple[XidEvent, ...] = field(default=())

    def render(self) -> str:
        lines = ["# ironserve lab: stand-in NVML state (ironserve_lab.standin_nvml)", f"count {len(self.gpus)}"]
        for index, gpu in enumerate(self.gpus):
            for item in fields(GpuState):
                value = getattr(gpu, item.name)
                if value != "":  # an empty value cannot be written; the library keeps its default
                    lines.append(f"gpu {index} {item.name} {value}")
        lines.extend(f"xid {x.id} {x.index} {x.code}" for x in self.xids)
        return "\n".join(lines) + "\n"

    def with_gpu(self, index: int, **changes: object) -> NvmlState:
        gpus = list(self.gpus)
        gpus[index] = replace(gpus[index], **changes)  # type: ignore[arg-type]
        return replace(self, gpus=tuple(gpus))

    def with_xid(self, index: int, code: int) -> NvmlState:
        next_id = max((x.id for x in self.xids), default=0) + 1
        return replace(self, xids=(*self.xids, XidEvent(next_id, index, code)))


def two_a10s() -> NvmlState:
    """Both real A10 captures as GPUs 0 and 1."""
    return NvmlState(gpus=(GpuState(), SECOND_A10))


def from_profile(gpus: Sequence[Mapping[str, Any]]) -> NvmlState:
    """The GPUs of a hardware profile (hardware_profiles/*.yaml `gpus`, as plain data) as NVML shows them, agreeing
    with what the lab's stand-in nvidia-smi and lspci print for the same host: name, UUID, serial, bus id, memory,
    power limit and PCIe link; the rest is the idle A10 capture's (GpuState's defaults)."""
    return NvmlState(
        gpus=tuple(
            GpuState(
                name=gpu["model"],
                uuid=gpu["uuid"],
                serial=standin_nvidia_smi.FIELDS["serial"][1](index, gpu),
                pci_bus_id=standin_nvidia_smi.FIELDS["pci.bus_id"][1](index, gpu),
                memory_total=gpu["memory_mib"] * 1024 * 1024,
                power_limit_mw=gpu["board_power_w"] * 1000,
                power_default_limit_mw=gpu["board_power_w"] * 1000,
                pcie_gen_max=int(standin_nvidia_smi.FIELDS["pcie.link.gen.max"][1](index, gpu)),
                pcie_width=gpu["link_status"]["width"],
                pcie_width_max=gpu["link_capability"]["width"],
            )
            for index, gpu in enumerate(gpus)
        )
    )


def parse(text: str) -> NvmlState:
    count = 0
    values: dict[int, dict[str, str]] = {}
    xids = []
    types = {item.name: item.type for item in fields(GpuState)}
    for line in text.splitlines():
        words = line.split(maxsplit=3)
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "count" and len(words) == 2:
            count = int(words[1])
        elif words[0] == "gpu" and len(words) >= 3 and words[2] in types:
            values.setdefault(int(words[1]), {})[words[2]] = words[3] if len(words) == 4 else ""
        elif words[0] == "xid" and len(words) == 4:
            xids.append(XidEvent(*(int(word, 0) for word in words[1:])))
    gpus = []
    for index in range(count):
        given = values.get(index, {})
        gpus.append(
            GpuState(**{name: value if types[name] == "str" else int(value, 0) for name, value in given.items()})  # type: ignore[arg-type]
        )
    return NvmlState(gpus=tuple(gpus), xids=tuple(xids))


def state_path() -> Path:
    return Path(os.environ.get(STATE_ENV) or DEFAULT_STATE_PATH)


def write_state(state: NvmlState, path: Path | None = None) -> Path:
    """Atomically (a rename), so the library never reads a half-written file."""
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(state.render())
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    return path


def read_state(path: Path | None = None) -> NvmlState:
    return parse((path or state_path()).read_text())


def add_xid(index: int, code: int, path: Path | None = None) -> NvmlState:
    """Appends one XID event for GPU `index`; every running NVML event set registered for it sees it once."""
    state = read_state(path).with_xid(index, code)
    write_state(state, path)
    return state


@functools.cache
def library_bytes() -> bytes:
    """The built library, once per process: what the lab mirror's libnvidia-ml1 and the driver runfile ship, and
    what edge.plug_gpus installs on a host without them."""
    with tempfile.TemporaryDirectory() as directory:
        return build(Path(directory)).read_bytes()


def build(directory: Path, compiler: str = "gcc") -> Path:
    """Compiles the library into `directory` as libnvidia-ml.so.1; returns its path."""
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"{compiler} not found: the stand-in NVML library needs a C compiler")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY_NAME
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(target), str(SOURCE), "-lpthread"],
        check=True,
        capture_output=True,
        text=True,
    )
    return target
