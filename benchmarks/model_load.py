"""Print model-load figures for three loaders of the same safetensors checkpoint: time, peak RSS, page cache left.

Usage: ~/.cache/ironserve/venv/bin/python benchmarks/model_load.py [--gib 2] [--runs 3] [--dir /var/tmp]

The catalog's storage_io items (io-direct-model-load, io-direct-alignment, io-direct-load-results) propose
loading weights with O_DIRECT so that the page cache does not fill; its correction allows aligned O_DIRECT
reads or a read followed by posix_fadvise(DONTNEED), and otherwise vLLM's own loader. This compares them on a
synthetic checkpoint (random bf16 tensors of a 7B-like layer shape, written once under --dir, on a disk, not
tmpfs), each run in a fresh process of the engine venv's Python with the file evicted first (fadvise
DONTNEED on the file only; the machine's caches are left alone):

- vllm: what vLLM's default safetensors loader does (safe_open, get_tensor, copy into the allocated parameter);
- vllm+fadvise: the same, then posix_fadvise(DONTNEED) on the file;
- o_direct: the whole file read with O_DIRECT in 16 MiB chunks into a 4096-aligned buffer (offsets and lengths
  aligned, io-direct-alignment), tensors cut from it and copied into the parameters.

Figures only; no assertions. Page cache left = the file's resident pages after the load (util-linux fincore).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
sys.path.insert(0, str(SERVICE / "tests"))

from conftest import ENGINE_PYTHON  # noqa: E402

# A Qwen2-7B decoder layer's projections (hidden 3584, intermediate 18944), repeated to the size asked for.
LAYER = {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "o": (3584, 3584), "gate": (18944, 3584),
         "up": (18944, 3584), "down": (3584, 18944)}  # fmt: skip

WRITE = """
import sys, torch
from safetensors.torch import save_file
layer = {layer!r}
per_layer = sum(a * b for a, b in layer.values()) * 2
tensors = {{}}
for i in range(max(1, int({gib} * 2**30 // per_layer))):
    for name, shape in layer.items():
        tensors[f"layers.{{i}}.{{name}}.weight"] = torch.randn(shape, dtype=torch.bfloat16)
save_file(tensors, sys.argv[1])
"""

LOAD = r"""
import json, mmap, os, resource, struct, sys, time
import torch
from safetensors import safe_open

path, strategy = sys.argv[1], sys.argv[2]
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: this file's pages evicted, nothing else
os.close(fd)
params = {}


def param_like(name, tensor):
    params[name] = torch.empty_like(tensor)
    params[name].copy_(tensor)


start = time.perf_counter()
if strategy in ("vllm", "vllm+fadvise"):
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            param_like(name, f.get_tensor(name))
    if strategy == "vllm+fadvise":
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
else:
    size = os.path.getsize(path)
    aligned = (size + 4095) // 4096 * 4096
    buffer = mmap.mmap(-1, aligned)  # anonymous mappings are page aligned: O_DIRECT's buffer alignment
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    chunk = 16 << 20
    offset = 0
    while offset < aligned:
        read = os.preadv(fd, [view[offset : offset + min(chunk, aligned - offset)]], offset)
        if read <= 0:
            break
        offset += read
    os.close(fd)
    header_len = struct.unpack("<Q", bytes(view[:8]))[0]
    header = json.loads(bytes(view[8 : 8 + header_len]))
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        count = (end - begin) // dtype.itemsize
        tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=base + begin).view(info["shape"])
        param_like(name, tensor)
    del tensor, view
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def resident_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return int(out.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2 GiB)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="a directory on a disk (not tmpfs)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint for another run")
    args = parser.parse_args()
    checkpoint = args.dir / f"ironserve-load-bench-{args.gib:g}gib.safetensors"
    if not checkpoint.exists():
        code = WRITE.format(layer=LAYER, gib=args.gib)
        subprocess.run([str(ENGINE_PYTHON), "-c", code, str(checkpoint)], check=True)
    size = checkpoint.stat().st_size
    print(f"checkpoint {checkpoint}: {size / 2**30:.2f} GiB; {args.runs} cold runs each, medians")
    print(f"{'loader':<14}{'seconds':>9}{'GiB/s':>8}{'peak RSS GiB':>14}{'page cache left GiB':>21}")
    for strategy in ("vllm", "vllm+fadvise", "o_direct"):
        seconds, rss, cached = [], [], []
        for _ in range(args.runs):
            out = subprocess.run([str(ENGINE_PYTHON), "-c", LOAD, str(checkpoint), strategy], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
            figures = json.loads(out.strip().splitlines()[-1])
            seconds.append(figures["seconds"])
            rss.append(figures["peak_rss"])
            cached.append(resident_bytes(checkpoint))
        t = statistics.median(seconds)
        print(f"{strategy:<14}{t:>9.2f}{size / 2**30 / t:>8.2f}{statistics.median(rss) / 2**30:>14.2f}"
              f"{statistics.median(cached) / 2**30:>21.2f}")  # fmt: skip
    if not args.keep:
        checkpoint.unlink()


if __name__ == "__main__":
    main()
