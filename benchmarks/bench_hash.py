"""Cost of hashing on the write path: blocking ``dcp.save`` of the same state with DCP's stock
``FileSystemWriter`` and with ``distckpt.dcp.FileSystemWriter`` (the same writer, hashing each file
while writing it, plus the hash sidecar), rounds rotating the order.

``python -m benchmarks.bench_hash --size-mib 1024 --rounds 3 --out DIR`` writes
``DIR/hash_cost.json`` and prints the median overhead (hashing / stock - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from distckpt import dcp as distckpt_dcp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_hash")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    n = args.size_mib * 2**20 // 4 // 16
    state = {"model": {f"w{i}": torch.randn(n) for i in range(16)}}
    base = tempfile.mkdtemp(dir=args.dir)
    times: dict[str, list[float]] = {"stock": [], "hashing": []}
    writers = {
        "stock": lambda d: FileSystemWriter(d, sync_files=True),
        "hashing": lambda d: distckpt_dcp.FileSystemWriter(d, sync_files=True, thread_count=1),
    }
    for r in range(args.rounds):
        order = ["stock", "hashing"] if r % 2 == 0 else ["hashing", "stock"]
        for mode in order:
            d = os.path.join(base, f"{mode}-{r}")
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writers[mode](d), no_dist=True)
            times[mode].append(time.perf_counter() - t0)
            shutil.rmtree(d)
    shutil.rmtree(base, ignore_errors=True)
    stock, hashing = statistics.median(times["stock"]), statistics.median(times["hashing"])
    result = {
        "size_bytes": args.size_mib * 2**20,
        "rounds": args.rounds,
        "stock_s": times["stock"],
        "hashing_s": times["hashing"],
        "median_overhead": hashing / stock - 1,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hash_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{args.size_mib} MiB: stock {stock:.3f} s, hashing {hashing:.3f} s, "
        f"overhead {100 * result['median_overhead']:+.1f}% (median of {args.rounds} rotating rounds)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
