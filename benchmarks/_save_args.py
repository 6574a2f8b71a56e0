"""The command line of ``python -m benchmarks.bench_save`` (its module docstring says what each
part measures)."""

from __future__ import annotations

import argparse

from benchmarks._save_ranks import SAVE_MODES

__all__ = ["parse_args"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_save",
        description="Benchmark naive torch.save vs distckpt blocking/async saves on CPU/gloo ranks.",
        epilog="example: python -m benchmarks.bench_save --sizes-mib 64 --world-sizes 1 2 --repeats 2 "
        "--no-train --out /tmp/bench",
    )
    p.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[256, 1024],
        help="model + AdamW state of the whole job, MiB (default: 256 1024)",
    )
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=[1, 2],
        help="ranks (default: 1 2; add 4 for an oversubscribed 2-core box, ~+50%% run time)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every mode once (default: 3)")
    p.add_argument(
        "--saves-per-process",
        type=int,
        default=1,
        help="measured saves per rank set, after its warm-up save (default: 1)",
    )
    p.add_argument(
        "--step-compute-s",
        type=float,
        default=0.25,
        help="async modes: seconds between save() and wait_staged() standing for the next "
        "step's forward/backward (a sleep: on a GPU node the CPU waits for kernels) "
        "(default: 0.25)",
    )
    p.add_argument(
        "--disk-probes",
        type=int,
        default=2,
        help="plain sequential write + fsync probes per round, spread among the modes (default: 2)",
    )
    p.add_argument("--modes", nargs="+", default=list(SAVE_MODES), choices=SAVE_MODES, help="save modes")
    p.add_argument("--out", default="runs/bench_save", help="output directory (results.json/.md, plot.png)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="where checkpoints are written (default: OUT/data; removed after each rank set)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="upper limit per rank set (seconds)")
    p.add_argument(
        "--leave-page-reporting",
        action="store_true",
        help="do not hold a VM's free page reporting during the run (see benchmarks/_guest_memory.py)",
    )
    p.add_argument(
        "--no-thread-count",
        action="store_true",
        help="skip the blocking thread_count 1 vs 4 comparison at world size 1",
    )
    p.add_argument(
        "--thread-counts", type=int, nargs="+", default=[1, 4], help="thread_count values compared (default: 1 4)"
    )
    p.add_argument(
        "--thread-count-repeats",
        type=int,
        default=None,
        help="rounds of the thread_count comparison (default: --repeats)",
    )
    p.add_argument(
        "--no-save", action="store_true", help="skip the save matrix (run only the thread_count and/or training parts)"
    )
    p.add_argument("--no-train", action="store_true", help="skip the training-interference part")
    p.add_argument("--train-world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--train-steps", type=int, default=24, help="measured training steps per run (default: 24)")
    p.add_argument("--train-every", type=int, default=6, help="save every k steps (default: 6)")
    p.add_argument("--train-repeats", type=int, default=2, help="rounds of the training part (default: 2)")
    p.add_argument("--train-global-batch", type=int, default=8)
    p.add_argument("--train-async-mode", choices=("thread", "process"), default="thread")
    args = p.parse_args(argv)
    for name in ("repeats", "saves_per_process", "disk_probes", "train_steps", "train_every", "train_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.thread_count_repeats is not None and args.thread_count_repeats < 1:
        p.error("--thread-count-repeats must be >= 1")
    if any(w < 1 for w in args.world_sizes + args.train_world_sizes):
        p.error("world sizes must be >= 1")
    if any(s <= 0 for s in args.sizes_mib):
        p.error("--sizes-mib must be positive")
    return args
