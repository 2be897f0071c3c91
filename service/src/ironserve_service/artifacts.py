"""Proves a model directory's bytes before anything serves them.

Every check returns findings instead of raising, so a corrupt, truncated or mislabelled
file ends in a precise message and a non-zero exit, never in a traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MANIFEST_NAME = "MANIFEST.sha256"
RELEASE_NAME = "release.json"
PROVENANCE_NAME = "gguf-provenance.json"
VERSION_PATTERN = re.compile(r"^[0-9]{8}-[0-9]{6}$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
REQUIRED_TENSORS = ("model.layers.0.self_attn.q_proj.weight",)
# Qwen2 ships in bf16; F32 would double memory and slow inference, anything else is not a plain checkpoint.
ALLOWED_DTYPES = frozenset({"F16", "BF16"})
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# A header larger than this is corruption, not a real checkpoint (real ones are a few MB at most).
MAX_HEADER_BYTES = 100 * 1024 * 1024
GGUF_FILE_TYPES = {"Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Finding:
    check: str
    subject: str
    ok: bool
    detail: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.findings) and all(f.ok for f in self.findings)

    def add(self, check: str, subject: str, ok: bool, detail: str) -> None:
        self.findings.append(Finding(check, subject, ok, detail))

    def extend(self, findings: Iterable[Finding]) -> None:
        self.findings.extend(findings)

    def render(self) -> str:
        lines = [f"{'OK  ' if f.ok else 'FAIL'} {f.check:<12} {f.subject}: {f.detail}" for f in self.findings]
        failed = sum(not f.ok for f in self.findings)
        lines.append(f"{'verified' if self.ok else 'REJECTED'}: {len(self.findings)} checks, {failed} failed")
        return "\n".join(lines)


class ArtifactError(Exception):
    """A precise, user-facing reason an artifact is not acceptable."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """Parses sha256sum output ('<hex>  <name>' or '<hex> *<name>')."""
    entries: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line)
        if match is None:
            raise ArtifactError(f"manifest line {number} is not '<sha256>  <file>': {raw!r}")
        name = match.group(2)
        if name.startswith("/") or ".." in Path(name).parts:
            raise ArtifactError(f"manifest line {number} points outside the model directory: {name!r}")
        entries[name] = match.group(1).lower()
    if not entries:
        raise ArtifactError("manifest lists no files")
    return entries


def render_manifest(hashes: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(hashes.items()))


def content_hash(hashes: dict[str, str]) -> str:
    """One hash for a multi-file model: SHA256 of its canonical manifest."""
    return hashlib.sha256(render_manifest(hashes).encode()).hexdigest()


def verify_checksums(model_dir: Path, manifest: dict[str, str]) -> list[Finding]:
    findings = []
    for name, expected in sorted(manifest.items()):
        path = model_dir / name
        if not path.is_file():
            findings.append(Finding("sha256", name, False, "listed in the manifest but missing"))
            continue
        actual = sha256_file(path)
        if actual == expected:
            findings.append(Finding("sha256", name, True, "matches the manifest"))
        else:
            findings.append(Finding("sha256", name, False, f"sha256 {actual} != manifest {expected}"))
    weights = {p.name for p in model_dir.iterdir() if p.suffix in {".safetensors", ".gguf"}}
    for name in sorted(weights - manifest.keys()):
        findings.append(Finding("sha256", name, False, "weight file not listed in the manifest"))
    return findings


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Reads and validates the 8-byte length + JSON header and the data layout it describes."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ArtifactError(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ArtifactError(f"header length {header_len} exceeds the file ({size} bytes): truncated or corrupt")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(f"header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise ArtifactError("header is not a JSON object")
    tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
    _check_layout(tensors, data_bytes=size - 8 - header_len)
    return tensors


def _check_layout(tensors: dict[str, Any], data_bytes: int) -> None:
    spans = []
    for name, spec in tensors.items():
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
            raise ArtifactError(f"tensor {name!r} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise ArtifactError(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ArtifactError(f"tensor {name!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expected:
            raise ArtifactError(
                f"tensor {name!r}: {end - begin} bytes at {offsets} but {dtype} {shape} needs {expected}"
            )
        spans.append((begin, end, name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            kind = "overlaps" if begin < cursor else "leaves a gap before"
            raise ArtifactError(f"tensor {name!r} {kind} byte {cursor}: data offsets are not contiguous")
        cursor = end
    if cursor != data_bytes:
        state = "truncated" if cursor > data_bytes else "has trailing bytes"
        raise ArtifactError(f"file {state}: tensors end at {cursor}, data section is {data_bytes} bytes")


def check_safetensors(paths: list[Path], required: Iterable[str] = REQUIRED_TENSORS) -> list[Finding]:
    findings = []
    names: set[str] = set()
    for path in paths:
        try:
            tensors = read_safetensors_header(path)
        except ArtifactError as error:
            findings.append(Finding("safetensors", path.name, False, str(error)))
            continue
        except OSError as error:
            findings.append(Finding("safetensors", path.name, False, f"unreadable: {error.strerror}"))
            continue
        names.update(tensors)
        findings.append(Finding("safetensors", path.name, True, f"{len(tensors)} tensors, layout contiguous"))
        bad = sorted(f"{n} ({s['dtype']})" for n, s in tensors.items() if s["dtype"] not in ALLOWED_DTYPES)
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            findings.append(Finding("dtype", path.name, False, f"dtype outside F16/BF16: {shown}"))
        else:
            findings.append(Finding("dtype", path.name, True, "all tensors F16/BF16, no F32"))
    if paths:
        for name in required:
            ok = name in names
            findings.append(Finding("tensors", name, ok, "present" if ok else "missing from every shard"))
    return findings


def _gguf_scalar(reader: Any, key: str) -> Any:
    field_ = reader.fields.get(key)
    if field_ is None:
        return None
    return field_.contents()


def check_gguf(path: Path, architecture: str, rope_freq_base: float, allowed_quants: Iterable[str]) -> list[Finding]:
    """Checks architecture, rope base and quantization, and that the file name states the quantization."""
    from gguf import GGUFReader  # numpy-heavy; only needed when GGUF files exist

    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader raises many types for corrupt input
        return [Finding("gguf", path.name, False, f"not a readable GGUF file: {type(error).__name__}: {error}")]
    findings = []
    arch = _gguf_scalar(reader, "general.architecture")
    findings.append(
        Finding("gguf", path.name, arch == architecture, f"general.architecture={arch!r} (want {architecture!r})")
    )
    key = f"{architecture}.rope.freq_base"
    base = _gguf_scalar(reader, key)
    ok = base is not None and float(base) == rope_freq_base
    findings.append(Finding("gguf", path.name, ok, f"{key}={base!r} (want {rope_freq_base!r})"))
    file_type = _gguf_scalar(reader, "general.file_type")
    names = {number: name for name, number in GGUF_FILE_TYPES.items()}
    quant = names.get(int(file_type)) if file_type is not None else None
    allowed = set(allowed_quants)
    if quant not in allowed:
        detail = f"general.file_type={file_type!r} ({quant or 'unknown'}) is not one of {sorted(allowed)}"
        findings.append(Finding("gguf", path.name, False, detail))
    elif quant not in path.name:
        detail = f"mislabelled: file name does not say {quant}, which general.file_type={file_type} is"
        findings.append(Finding("gguf", path.name, False, detail))
    else:
        findings.append(Finding("gguf", path.name, True, f"quantization {quant} (file_type {file_type})"))
    return findings


def check_provenance(model_dir: Path, gguf_hashes: dict[str, str]) -> list[Finding]:
    """Every GGUF must be a local llama-quantize product of verified weights, never a third-party file."""
    path = model_dir / PROVENANCE_NAME
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [Finding("provenance", PROVENANCE_NAME, False, "missing: GGUF files need a provenance record")]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return [Finding("provenance", PROVENANCE_NAME, False, f"not valid JSON: {error}")]
    records = records if isinstance(records, list) else [records]
    by_hash = {r.get("gguf_sha256"): r for r in records if isinstance(r, dict)}
    findings = []
    for name, digest in sorted(gguf_hashes.items()):
        record = by_hash.get(digest)
        if record is None:
            findings.append(Finding("provenance", name, False, "no provenance record with this gguf_sha256"))
        elif record.get("tool") != "llama-quantize":
            findings.append(Finding("provenance", name, False, f"tool={record.get('tool')!r}, not llama-quantize"))
        elif not SHA256_PATTERN.match(str(record.get("source_sha256", ""))):
            findings.append(Finding("provenance", name, False, "source_sha256 missing or not a sha256"))
        else:
            findings.append(Finding("provenance", name, True, "quantized locally by llama-quantize"))
    return findings


def make_version(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y%m%d-%H%M%S")


def release_record(hashes: dict[str, str], now: datetime) -> dict[str, str]:
    return {"version": make_version(now), "sha256": content_hash(hashes)}


def check_release(model_dir: Path, hashes: dict[str, str]) -> list[Finding]:
    path = model_dir / RELEASE_NAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [Finding("release", RELEASE_NAME, False, "missing: a model needs a version and content hash")]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return [Finding("release", RELEASE_NAME, False, f"not valid JSON: {error}")]
    if not isinstance(record, dict):
        return [Finding("release", RELEASE_NAME, False, "not a JSON object")]
    version, digest = str(record.get("version", "")), str(record.get("sha256", ""))
    findings = []
    if VERSION_PATTERN.match(version):
        findings.append(Finding("release", "version", True, version))
    else:
        findings.append(Finding("release", "version", False, f"{version!r} is not YYYYMMDD-HHMMSS"))
    expected = content_hash(hashes)
    if digest == expected:
        findings.append(Finding("release", "sha256", True, "matches the manifest's content hash"))
    else:
        findings.append(Finding("release", "sha256", False, f"{digest!r} != content hash {expected}"))
    return findings


def expected_rope_theta(model_dir: Path) -> float | None:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta) if theta is not None else None


def verify_model_dir(
    model_dir: Path,
    manifest_path: Path,
    architecture: str = "qwen2",
    rope_freq_base: float = 1_000_000.0,
    gguf_quants: Iterable[str] = ("Q5_K_M", "Q4_K_S"),
    require_release: bool = True,
) -> Report:
    report = Report()
    if not model_dir.is_dir():
        report.add("model_dir", str(model_dir), False, "not a directory")
        return report
    try:
        manifest = parse_manifest(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        report.add("manifest", str(manifest_path), False, "missing")
        return report
    except (ArtifactError, UnicodeDecodeError) as error:
        report.add("manifest", str(manifest_path), False, str(error))
        return report
    report.extend(verify_checksums(model_dir, manifest))
    report.extend(check_safetensors(sorted(model_dir.glob("*.safetensors"))))
    theta = expected_rope_theta(model_dir)
    if theta is not None and theta != rope_freq_base:
        report.add("config", "config.json", False, f"rope_theta={theta} != expected {rope_freq_base}")
    gguf_files = sorted(model_dir.glob("*.gguf"))
    for path in gguf_files:
        report.extend(check_gguf(path, architecture, rope_freq_base, gguf_quants))
    if gguf_files:
        report.extend(check_provenance(model_dir, {p.name: manifest.get(p.name, sha256_file(p)) for p in gguf_files}))
    if require_release:
        report.extend(check_release(model_dir, manifest))
    return report


def seal_model_dir(model_dir: Path, now: datetime) -> dict[str, str]:
    """Writes MANIFEST.sha256 and release.json for a directory whose weights were verified upstream."""
    hashes = {
        p.name: sha256_file(p)
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name not in {MANIFEST_NAME, RELEASE_NAME} and not p.name.startswith(".")
    }
    (model_dir / MANIFEST_NAME).write_text(render_manifest(hashes), encoding="utf-8")
    record = release_record(hashes, now)
    (model_dir / RELEASE_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
