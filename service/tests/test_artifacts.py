"""Every artifact check rejects its corrupted fixture with a precise message, never a traceback."""

from __future__ import annotations

import json
import struct
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from ironserve_service import artifacts
from ironserve_service.cli import main

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], trailing: bytes = b"") -> None:
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = int(np.prod(shape)) * artifacts.DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset) + trailing)


def write_gguf(path: Path, arch: str = "qwen2", rope: float = 1_000_000.0, file_type: int = 17) -> None:
    writer = GGUFWriter(str(path), arch)
    writer.add_rope_freq_base(rope)
    writer.add_file_type(file_type)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def good_model(root: Path, gguf: bool = False) -> Path:
    model = root / "model"
    model.mkdir()
    write_safetensors(model / "model.safetensors", {Q_PROJ: ("BF16", [4, 4]), "lm_head.weight": ("BF16", [8, 4])})
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 1_000_000.0}))
    if gguf:
        write_gguf(model / "qwen2-7b-instruct.Q5_K_M.gguf")
        digest = artifacts.sha256_file(model / "qwen2-7b-instruct.Q5_K_M.gguf")
        provenance = {"source_sha256": "a" * 64, "gguf_sha256": digest, "tool": "llama-quantize"}
        (model / artifacts.PROVENANCE_NAME).write_text(json.dumps(provenance))
    artifacts.seal_model_dir(model, datetime(2026, 11, 30, 3, 4, 5, tzinfo=UTC))
    return model


def verify(model: Path) -> artifacts.Report:
    return artifacts.verify_model_dir(model, model / artifacts.MANIFEST_NAME)


def failures(report: artifacts.Report) -> str:
    return "\n".join(f.detail for f in report.findings if not f.ok)


def reseal(model: Path) -> None:
    artifacts.seal_model_dir(model, datetime(2026, 11, 30, 3, 4, 5, tzinfo=UTC))


@pytest.mark.invariant("model-weights-self-sourced", "model-sha256-verify", "model-version-naming")
def test_good_model_passes_and_is_versioned(tmp_path: Path) -> None:
    model = good_model(tmp_path, gguf=True)
    report = verify(model)
    assert report.ok, report.render()
    release = json.loads((model / artifacts.RELEASE_NAME).read_text())
    assert release["version"] == "20261130-030405"
    assert artifacts.SHA256_PATTERN.match(release["sha256"])


@pytest.mark.invariant("model-sha256-verify")
def test_flipped_byte_fails_checksum(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (model / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors" in str([f.subject for f in verify(model).findings if not f.ok])
    assert "!= manifest" in failures(verify(model))


@pytest.mark.invariant("model-sha256-verify")
def test_unlisted_weight_and_missing_file_are_reported(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    write_safetensors(model / "extra.safetensors", {"x": ("BF16", [1])})
    (model / "config.json").unlink()
    text = failures(verify(model))
    assert "weight file not listed in the manifest" in text
    assert "listed in the manifest but missing" in text


def test_malformed_manifest_is_precise(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    (model / artifacts.MANIFEST_NAME).write_text("not-a-hash  model.safetensors\n")
    assert "manifest line 1 is not '<sha256>  <file>'" in failures(verify(model))


@pytest.mark.invariant("model-safetensors-structure")
@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:5]), "truncated: 5 bytes"),
        (lambda p: p.write_bytes(p.read_bytes()[:-8]), "file truncated: tensors end at"),
        (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "has trailing bytes"),
        (lambda p: p.write_bytes(struct.pack("<Q", 10**9) + b"{}"), "exceeds the file"),
        (lambda p: p.write_bytes(struct.pack("<Q", 3) + b"{x}"), "header is not valid JSON"),
    ],
    ids=["short", "truncated-data", "trailing", "huge-header", "bad-json"],
)
def test_corrupt_safetensors_rejected(tmp_path: Path, corrupt: object, message: str) -> None:
    model = good_model(tmp_path)
    path = model / "model.safetensors"
    corrupt(path)  # type: ignore[operator]
    reseal(model)  # the manifest matches: only the structure check can catch it
    assert message in failures(verify(model))


@pytest.mark.invariant("model-safetensors-structure")
def test_gap_in_data_offsets_rejected(tmp_path: Path) -> None:
    header = {Q_PROJ: {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(artifacts.ArtifactError, match="leaves a gap before byte 0"):
        artifacts.read_safetensors_header(path)


@pytest.mark.invariant("model-safetensors-structure")
def test_missing_key_layer_rejected(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    write_safetensors(model / "model.safetensors", {"lm_head.weight": ("BF16", [8, 4])})
    reseal(model)
    assert f"{Q_PROJ}" in str([f.subject for f in verify(model).findings if not f.ok])


@pytest.mark.invariant("model-dtype-no-fp32")
def test_f32_tensor_refused_bf16_accepted(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    write_safetensors(model / "model.safetensors", {Q_PROJ: ("BF16", [4, 4]), "lm_head.weight": ("F32", [8, 4])})
    reseal(model)
    assert "dtype outside F16/BF16: lm_head.weight (F32)" in failures(verify(model))


@pytest.mark.invariant("model-gguf-rope-freq-base")
def test_gguf_wrong_rope_base_rejected(tmp_path: Path) -> None:
    path = tmp_path / "m.Q5_K_M.gguf"
    write_gguf(path, rope=10_000.0)
    text = "\n".join(f.detail for f in artifacts.check_gguf(path, "qwen2", 1e6, ["Q5_K_M"]) if not f.ok)
    assert "qwen2.rope.freq_base=10000.0 (want 1000000.0)" in text


@pytest.mark.invariant("model-quant-q5km", "model-quant-q4ks-fallback")
def test_gguf_quantization_and_label(tmp_path: Path) -> None:
    mislabelled = tmp_path / "m.Q5_K_M.gguf"
    write_gguf(mislabelled, file_type=14)
    detail = [f.detail for f in artifacts.check_gguf(mislabelled, "qwen2", 1e6, ["Q5_K_M", "Q4_K_S"]) if not f.ok]
    assert detail == ["mislabelled: file name does not say Q4_K_S, which general.file_type=14 is"]
    fallback = tmp_path / "m.Q4_K_S.gguf"
    write_gguf(fallback, file_type=14)
    assert all(f.ok for f in artifacts.check_gguf(fallback, "qwen2", 1e6, ["Q5_K_M", "Q4_K_S"]))
    q6 = tmp_path / "m.Q6_K.gguf"
    write_gguf(q6, file_type=18)
    assert "(Q6_K) is not one of" in str(artifacts.check_gguf(q6, "qwen2", 1e6, ["Q5_K_M", "Q4_K_S"]))


def test_gguf_wrong_architecture_and_garbage(tmp_path: Path) -> None:
    llama = tmp_path / "m.Q5_K_M.gguf"
    write_gguf(llama, arch="llama")
    assert "general.architecture='llama' (want 'qwen2')" in str(artifacts.check_gguf(llama, "qwen2", 1e6, ["Q5_K_M"]))
    garbage = tmp_path / "g.Q5_K_M.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    (finding,) = artifacts.check_gguf(garbage, "qwen2", 1e6, ["Q5_K_M"])
    assert not finding.ok and finding.detail.startswith("not a readable GGUF file")


@pytest.mark.invariant("model-no-third-party-gguf")
def test_gguf_without_local_provenance_rejected(tmp_path: Path) -> None:
    model = good_model(tmp_path, gguf=True)
    (model / artifacts.PROVENANCE_NAME).write_text(json.dumps({"gguf_sha256": "0" * 64, "tool": "downloaded"}))
    reseal(model)
    assert "no provenance record with this gguf_sha256" in failures(verify(model))


@pytest.mark.invariant("model-version-naming", "model-bit-identical-fleet")
def test_release_must_be_timestamp_plus_content_hash(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    (model / artifacts.RELEASE_NAME).write_text(json.dumps({"version": "qwen2-7b-abc123", "sha256": "f" * 64}))
    text = failures(verify(model))
    assert "'qwen2-7b-abc123' is not YYYYMMDD-HHMMSS" in text
    assert "!= content hash" in text


def test_rope_theta_in_config_must_match(tmp_path: Path) -> None:
    model = good_model(tmp_path)
    (model / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 10000.0}}))
    reseal(model)
    assert "rope_theta=10000.0 != expected 1000000.0" in failures(verify(model))


def test_cli_verify_exit_codes_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = good_model(tmp_path)
    assert main(["verify", str(model), "--manifest", str(model / artifacts.MANIFEST_NAME)]) == 0
    assert "verified:" in capsys.readouterr().out
    (model / "model.safetensors").write_bytes(b"\x00")
    assert main(["verify", str(model)]) == 1
    out = capsys.readouterr().out
    assert "REJECTED" in out and "FAIL" in out and "Traceback" not in out
    assert main(["verify", str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().out
