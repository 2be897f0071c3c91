"""The compatibility lock: each rule fails on its own broken set and names what would work."""

from __future__ import annotations

import pytest

from ironserve.lock import StackLock, check_lock, newest_cuda_for_driver
from ironserve.profiles import profile_data, read_profile
from ironserve.versions import Version


def _primary(**changes: object) -> StackLock:
    return read_profile("r740-a10").lock.model_copy(update=changes)


@pytest.mark.invariant("drv-version", "cuda-version", "cudnn-version", "tensorrt-version", "drv-driver-cuda-compat")
def test_primary_profile_is_the_seed_set_and_compatible() -> None:
    lock = read_profile("r740-a10").lock
    assert (lock.driver, lock.cuda, lock.cuda_runfile) == ("525.85.12", "11.8.0", "cuda_11.8.0_520.61.05_linux.run")
    assert (lock.cudnn.version, lock.tensorrt and lock.tensorrt.version) == ("8.6.0", "8.6.1.6")
    assert check_lock(lock) == []


def test_alternative_a100_profile_is_compatible() -> None:
    lock = read_profile("a100-cuda117").lock
    assert (lock.driver, lock.cuda) == ("515.86.01", "11.7.1")
    assert check_lock(lock) == []


def test_driver_below_cuda_minimum() -> None:
    rules = {v.rule: v.message for v in check_lock(_primary(driver="515.86.01"))}
    assert "CUDA 11.8.0 needs driver >= 520.61.05" in rules["driver-meets-cuda-minimum"]


@pytest.mark.invariant("drv-avoid-525-60-13")
def test_forbidden_driver() -> None:
    assert "driver-not-forbidden" in {v.rule for v in check_lock(_primary(driver="525.60.13"))}


def test_tensorrt_for_another_cuda() -> None:
    lock = _primary(tensorrt=read_profile("r740-a10").lock.tensorrt.model_copy(update={"cuda": "12.0"}))  # type: ignore[union-attr]
    assert [v.rule for v in check_lock(lock)] == ["tensorrt-matches-cuda"]


@pytest.mark.invariant("cuda-no-12x")
def test_current_vllm_needs_a_newer_driver_and_the_lock_says_what_works() -> None:
    engine = read_profile("r740-a10").lock.engine.model_copy(
        update={"version": "0.11.0", "cuda": "12.9", "torch": "2.8.0+cu129"}
    )
    [violation] = check_lock(_primary(engine=engine))
    assert violation.rule == "engine-runs-on-driver"
    assert "driver 525.85.12 runs CUDA <= 12.0" in violation.message
    assert "vllm 0.6.1.post1+cu118" in violation.message
    assert ">= 575.51.03" in violation.message


def test_runfile_must_match_cuda_and_not_bundle_a_newer_driver() -> None:
    assert [v.rule for v in check_lock(_primary(cuda_runfile="cuda_11.7.1_515.65.01_linux.run"))] == [
        "runfile-matches-cuda"
    ]
    assert "runfile-driver-not-newer" in {
        v.rule for v in check_lock(_primary(driver="520.61.05", cuda_runfile="cuda_11.8.0_530.30.02_linux.run"))
    }


def test_engine_torch_build_must_match_engine_cuda() -> None:
    engine = read_profile("r740-a10").lock.engine.model_copy(update={"torch": "2.4.0+cu121"})
    assert [v.rule for v in check_lock(_primary(engine=engine))] == ["engine-torch-matches-cuda"]


def test_versions_compare_numerically() -> None:
    assert Version("525.85.12") > Version("525.60.13")
    assert Version("12.10") > Version("12.9")
    assert newest_cuda_for_driver("525.85.12") == "12.0"
    assert newest_cuda_for_driver("400.1") is None
    with pytest.raises(ValueError, match="malformed version"):
        Version("11.8-beta")


def test_a_profile_read_again_is_the_file_whatever_an_earlier_reader_changed() -> None:
    """The file is parsed once per process; each reader gets its own copy, overrides applied to it alone."""
    first = profile_data("r740-a10", {"cudnn": {"version": "9.0.0"}})
    first["lock"]["driver"] = "changed"
    first["server"]["model"] = "changed"
    again = profile_data("r740-a10")
    assert (again["lock"]["driver"], again["lock"]["cudnn"]["version"]) == ("525.85.12", "8.6.0")
    assert again["server"]["model"] != "changed"
