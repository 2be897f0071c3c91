"""The compatibility lock: driver, CUDA, cuDNN, TensorRT and the inference engine as one set.

`check_lock` is pure: it returns every rule the set breaks, each naming what would work,
so an incompatible set is refused before any host is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from ironserve.versions import Version, major_minor


def _valid_version(text: str) -> str:
    Version(text)  # raises ValueError naming the expected shape
    return text


VersionText = Annotated[str, AfterValidator(_valid_version)]

# Minimum Linux driver for each CUDA toolkit ("CUDA Toolkit and Corresponding Driver Versions",
# Table 3 of the CUDA Toolkit release notes). We require the toolkit's own minimum rather than
# relying on minor-version compatibility, because that excludes PTX JIT, which Triton-based
# engines need (CUDA Compatibility guide, "Minor Version Compatibility" limitations); the R740 build notes this
# project follows saw torch report no GPU with CUDA 12.1 on driver 525.85.12.
CUDA_MINIMUM_DRIVER: dict[str, str] = {
    "11.7": "515.43.04",
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.4": "550.54.14",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

# Drivers known bad for this stack: the A100 build notes behind the a100-cuda117 profile report a context-switch
# bug in 525.60.13.
FORBIDDEN_DRIVERS: dict[str, str] = {"525.60.13": "context-switch bug reported on A100 (the A100 build notes)"}

# Engine builds that exist per CUDA line, for the "what would work" hint. vLLM publishes
# CUDA 11.8 wheels up to 0.6.1.post1 (vLLM 0.6.x installation docs); current releases ship
# CUDA 12.9 builds (vLLM GPU installation docs).
ENGINE_BUILDS: dict[str, str] = {
    "11.8": "vllm 0.6.1.post1+cu118 (the last official CUDA 11.8 wheel)",
    "12.9": "vllm >= 0.11 (current wheels, CUDA 12.9)",
}


@dataclass(frozen=True)
class LockViolation:
    rule: str
    message: str


class Component(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    version: VersionText
    cuda: VersionText  # the CUDA major.minor this build targets


class Engine(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: VersionText
    cuda: VersionText
    torch: str


class StackLock(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    driver: VersionText
    cuda: VersionText
    cuda_runfile: str
    cudnn: Component
    tensorrt: Component | None
    engine: Engine
    # NVIDIA container toolkit release (nvidia-container-toolkit, libnvidia-container); None: not part of the set.
    container_toolkit: VersionText | None = None


def newest_cuda_for_driver(driver: str) -> str | None:
    usable = [c for c, minimum in CUDA_MINIMUM_DRIVER.items() if Version(driver) >= Version(minimum)]
    return max(usable, key=Version) if usable else None


def check_lock(lock: StackLock) -> list[LockViolation]:
    violations: list[LockViolation] = []
    cuda_line = major_minor(lock.cuda)
    ceiling = newest_cuda_for_driver(lock.driver) or "none known"

    if lock.driver in FORBIDDEN_DRIVERS:
        violations.append(
            LockViolation("driver-not-forbidden", f"driver {lock.driver}: {FORBIDDEN_DRIVERS[lock.driver]}")
        )

    minimum = CUDA_MINIMUM_DRIVER.get(cuda_line)
    if minimum is None:
        known = ", ".join(CUDA_MINIMUM_DRIVER)
        violations.append(LockViolation("cuda-known", f"CUDA {lock.cuda} is not in the driver table; known: {known}"))
    elif Version(lock.driver) < Version(minimum):
        violations.append(
            LockViolation(
                "driver-meets-cuda-minimum",
                f"CUDA {lock.cuda} needs driver >= {minimum}, the lock has {lock.driver}; "
                f"use a driver >= {minimum} or CUDA <= {ceiling}",
            )
        )

    runfile_driver = lock.cuda_runfile.removesuffix("_linux.run").rsplit("_", 1)[-1]
    if not lock.cuda_runfile.startswith(f"cuda_{lock.cuda}_"):
        violations.append(
            LockViolation(
                "runfile-matches-cuda",
                f"runfile {lock.cuda_runfile} is not CUDA {lock.cuda}'s (cuda_{lock.cuda}_<driver>_linux.run)",
            )
        )
    elif Version(runfile_driver) > Version(lock.driver):
        violations.append(
            LockViolation(
                "runfile-driver-not-newer",
                f"the runfile bundles driver {runfile_driver}, newer than the pinned {lock.driver}; "
                f"pin a driver >= {runfile_driver}",
            )
        )

    for label, component in (("cudnn", lock.cudnn), ("tensorrt", lock.tensorrt)):
        if component is not None and component.cuda != cuda_line:
            violations.append(
                LockViolation(
                    f"{label}-matches-cuda",
                    f"{label} {component.version} is built for CUDA {component.cuda}, the lock has CUDA {cuda_line}; "
                    f"use the {label} {component.version} build for CUDA {cuda_line}",
                )
            )

    engine_minimum = CUDA_MINIMUM_DRIVER.get(lock.engine.cuda)
    if engine_minimum is None or Version(lock.driver) < Version(engine_minimum):
        buildable = [c for c in ENGINE_BUILDS if ceiling != "none known" and Version(c) <= Version(ceiling)]
        works = ENGINE_BUILDS[max(buildable, key=Version)] if buildable else f"an engine built for CUDA <= {ceiling}"
        violations.append(
            LockViolation(
                "engine-runs-on-driver",
                f"{lock.engine.name} {lock.engine.version} is built for CUDA {lock.engine.cuda}, which needs driver "
                f">= {engine_minimum or 'unknown'}; driver {lock.driver} runs CUDA <= {ceiling}. "
                f"What works: {works}, or a driver branch >= {engine_minimum or 'the engine CUDA minimum'}",
            )
        )
    if not lock.engine.torch.endswith(f"+cu{lock.engine.cuda.replace('.', '')}"):
        violations.append(
            LockViolation(
                "engine-torch-matches-cuda",
                f"torch {lock.engine.torch} is not the CUDA {lock.engine.cuda} build the engine needs "
                f"(+cu{lock.engine.cuda.replace('.', '')})",
            )
        )
    return violations
