"""``bench_s3``: distckpt save/load vs DCP's stock ``FsspecWriter``/``FsspecReader`` (s3fs) on the
same S3 server, side by side.

    python -m benchmarks.bench_s3 --out benchmarks/results/s3          # starts SeaweedFS (weed) itself
    python -m benchmarks.bench_s3 --sizes-mib 256 --world-sizes 1 --repeats 1 --out /tmp/b3

Each world size runs in one set of spawned CPU/gloo ranks. Per (size, round) every rank builds
``size / world_size`` of float32 tensors (16 MiB each, its own keys), then, in a rotated order:

* ``stock_save``: ``dcp.save`` through ``FsspecWriter`` (s3fs) into a fresh prefix;
* ``distckpt_save``: ``dcp.save`` through ``distckpt.dcp.FileSystemWriter`` (distckpt's S3 write
  path: hash while writing, multipart, the hash sidecar) into a fresh prefix;
* ``stock_load`` / ``distckpt_load``: each reads what its save wrote back into the tensors
  (distckpt: ``distckpt.dcp.FileSystemReader``, every object's size and xxh3-128 checked against
  the sidecar).

Times are wall seconds of the whole operation, the max over ranks (barrier before, max after);
median over ``--repeats`` rounds. Output: ``results.json``, ``results.md``, ``plot.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._output import machine_info, pyplot, write_outputs  # noqa: E402

BUCKET = "distckpt-bench"
MODES = ("stock_save", "distckpt_save", "stock_load", "distckpt_load")


def _timed(fn: Any) -> float:
    """Wall seconds of ``fn()`` on every rank, the max over ranks (barrier first)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _round(rank: int, world_size: int, sd: dict, size_mib: int, rnd: int, thread_count: int) -> list[dict]:
    """One round of the four modes on ``sd`` (this rank's tensors) into fresh prefixes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from distckpt.dcp import FileSystemReader, FileSystemWriter

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    tag = f"ws{world_size}-{size_mib}m-{rnd}"
    stock_url = f"s3://{BUCKET}/{tag}-stock"
    location = f"s3://{BUCKET}/{tag}"

    def stock_save() -> None:
        dcp.save(sd, storage_writer=FsspecWriter(stock_url, endpoint_url=endpoint, sync_files=False))

    def distckpt_save() -> None:
        dcp.save(sd, storage_writer=FileSystemWriter(location, thread_count=thread_count, endpoint_url=endpoint))

    def stock_load() -> None:
        dcp.load(
            {k: torch.empty_like(v) for k, v in sd.items()},
            storage_reader=FsspecReader(stock_url, endpoint_url=endpoint),
        )

    def distckpt_load() -> None:
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(target, storage_reader=FileSystemReader(location, thread_count=2, endpoint_url=endpoint))
        assert all(torch.equal(target[k], sd[k]) for k in sd)

    fns = {
        "stock_save": stock_save,
        "distckpt_save": distckpt_save,
        "stock_load": stock_load,
        "distckpt_load": distckpt_load,
    }
    order = [("stock_save", "distckpt_save"), ("distckpt_save", "stock_save")][rnd % 2]
    rows = [
        {"mode": mode, "size_mib": size_mib, "world_size": world_size, "round": rnd, "seconds": _timed(fns[mode])}
        for mode in (*order, *(m.replace("save", "load") for m in order))
    ]
    dist.barrier()
    if rank == 0:  # free the server's space for the next round
        for prefix in (f"{tag}/", f"{tag}-stock/"):
            _delete_prefix(endpoint, prefix)
    return rows


def _delete_prefix(endpoint: str, prefix: str) -> None:
    """Delete every object under ``prefix`` of the bucket (keys from ``$AWS_*``)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def _rank(rank: int, world_size: int, init: str, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    rows = []
    for size_mib in args["sizes_mib"]:
        per_rank, chunk = size_mib * (1 << 20) // world_size, 16 << 20
        sd = {f"r{rank}.t{i}": torch.randn(chunk // 4) for i in range(max(1, per_rank // chunk))}
        for rnd in range(args["repeats"]):
            rows += _round(rank, world_size, sd, size_mib, rnd, args["thread_count"])
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def _run_world(world_size: int, args: dict) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(
            _rank, args=(world_size, os.path.join(tmp, "init"), args, out), nprocs=world_size, start_method="spawn"
        )
        return torch.load(out)


def summarize(rows: list[dict]) -> list[dict]:
    """Median seconds per (mode, size, world size) and GB/s."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["size_mib"], r["world_size"]), []).append(r["seconds"])
    return [
        {
            "mode": m,
            "size_mib": s,
            "world_size": w,
            "seconds": statistics.median(v),
            "gbps": s * (1 << 20) / statistics.median(v) / 1e9,
            "rounds": len(v),
        }
        for (m, s, w), v in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], MODES.index(kv[0][0])))
    ]


def render(results: dict) -> str:
    by = {(r["mode"], r["size_mib"], r["world_size"]): r["seconds"] for r in results["summary"]}
    lines = [
        "| size | ranks | stock save s | distckpt save s | save speed-up | stock load s | distckpt load s "
        "| load speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in results["meta"]["sizes_mib"]:
        for ws in results["meta"]["world_sizes"]:
            s0, s1 = by.get(("stock_save", size, ws)), by.get(("distckpt_save", size, ws))
            l0, l1 = by.get(("stock_load", size, ws)), by.get(("distckpt_load", size, ws))
            if s0 is None or s1 is None or l0 is None or l1 is None:
                continue
            lines.append(
                f"| {size} MiB | {ws} | {s0:.2f} | {s1:.2f} | {s0 / s1:.2f}x | {l0:.2f} | {l1:.2f} | {l0 / l1:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, width = [], 0.2
    cases = [(s, w) for s in results["meta"]["sizes_mib"] for w in results["meta"]["world_sizes"]]
    by = {(r["mode"], r["size_mib"], r["world_size"]): r["seconds"] for r in results["summary"]}
    for i, mode in enumerate(MODES):
        ax.bar(
            [j + i * width for j in range(len(cases))], [by.get((mode, s, w), 0) for s, w in cases], width, label=mode
        )
    labels = [f"{s} MiB, ws {w}" for s, w in cases]
    ax.set_xticks([j + 1.5 * width for j in range(len(cases))], labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title("S3 (local SeaweedFS): distckpt vs DCP FsspecWriter/Reader")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/s3")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--thread-count", type=int, default=4, help="distckpt writer threads (files) per rank")
    args = p.parse_args(argv)
    from launch.s3_server import S3Server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = S3Server().start()
    try:
        server.create_bucket(BUCKET)
        os.environ.update(server.env())
        rows: list[dict] = []
        for ws in args.world_sizes:
            rows += _run_world(
                ws, {"sizes_mib": args.sizes_mib, "repeats": args.repeats, "thread_count": args.thread_count}
            )
            print(f"world size {ws}: done", flush=True)
    finally:
        server.stop()
    results = {
        "meta": {
            "sizes_mib": args.sizes_mib,
            "world_sizes": args.world_sizes,
            "repeats": args.repeats,
            "distckpt_thread_count": args.thread_count,
            "server": "SeaweedFS (weed) on loopback",
            "machine": machine_info(out),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "summary": summarize(rows),
        "rows": rows,
    }
    write_outputs(out, results, render, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
