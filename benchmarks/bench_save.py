"""Save benchmark: naive ``torch.save`` vs distckpt blocking / async saves, side by side.

Usage (from the repository root)::

    python -m benchmarks.bench_save --out runs/bench_save
    python -m benchmarks.bench_save --sizes-mib 8 --world-sizes 1 2 --repeats 1 --no-train --out /tmp/b

Writes ``OUT/results.json``, ``OUT/results.md`` (printed too) and ``OUT/plot.png`` (when
matplotlib is installed: the ``bench`` extra). See ``benchmarks/README.md`` for every field.

What is saved: a synthetic FSDP2-like state -- a model of bias-free ``Linear`` layers sized so
that parameters + AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) total ``--sizes-mib`` for
the whole job; at world size > 1 every layer and the root are wrapped with ``fully_shard``
(built on the meta device, so each rank only ever holds its shard); the optimizer is stepped
once so its state exists.

Modes (per size and world size): ``naive_torch_save`` (FULL state dict gathered to rank 0,
``torch.save`` + fsync there), ``blocking`` (``async_mode="off"``), ``async_thread``,
``async_process``, ``async_thread_bgstage`` (thread + ``background_staging``). Beside them, a
plain sequential write + fsync of the same number of bytes into the same directory gives the
disk bandwidth (``disk_write_gbps``).

How it is measured, and why this way:

* **A fresh set of ranks per (mode, size, world size, round).** A mode's process state must
  not leak into another's timing or memory: distckpt's ``DefaultStager`` keeps its staging
  buffers for the life of the manager, DCP's process executor keeps a daemon process for the
  life of the rank, the allocator keeps freed arenas, and the RSS high-water mark
  (``ru_maxrss``) can only grow. So absolute times and peak RSS of a mode come from processes
  that ran that mode only. Ranks are forked from a ``forkserver`` that has already imported
  torch and distckpt, so a fresh set costs well under a second instead of seconds of imports;
  the per-process cost left (building the state, the warm-up save) is what we pay for
  isolation. (The alternative, one process per mode with all repeats inside, is cheaper but
  cannot rotate modes: all of a mode's samples would come from one stretch of time.)
* **Rounds rotate the modes.** Round ``r`` runs every mode (and the disk write) once, in an
  order rotated by ``r``, so slow drift on this noisy machine hits every mode alike. Ratios
  (async stall / blocking end-to-end, async / blocking end-to-end, blocking / disk bandwidth)
  are computed within each round and their median over rounds is reported.
* **Warm-up save per process.** Each process saves once before the measured saves
  (``--saves-per-process``, default 1); that first save (allocating staging buffers, starting
  DCP's checkpoint daemon for ``async_process``) is reported as ``first_save_s`` and kept out
  of the medians.
* ``stall_s`` = time ``save()`` blocked + ``wait_staged()`` (what the loop waits before its
  next ``optimizer.step()``). For the async modes ``--step-compute-s`` (0.25 s) of sleep sits
  between the two, standing for the next step's forward/backward: on a GPU node the CPU mostly
  waits for kernels then, and that window is what background staging hides its copy in.
  ``end_to_end_s`` = from the ``save()`` call until committed: the earlier of ``wait()``
  returning and the checkpoint directory appearing (the commit's rename; polled every 2 ms),
  so a compute window longer than the write does not inflate it. Both are per save the max
  over ranks; rows hold medians.
* **Disk reference.** ``--disk-probes`` (2) sequential writes + fsync of ``size_bytes`` from a
  RAM buffer of that size, placed among the modes of every round; the disk of this VM varies
  several-fold within seconds, so a single probe is not a reference.
* **Training interference** (``train_*`` rows): the project's launch model (``launch.model.GPT``)
  trained on random byte tokens, with no checkpointing, async saves every ``k`` steps and
  blocking saves every ``k`` steps, at world size 1 (one core spare for the background
  writer; every rank runs torch with one thread) and 2 (no spare core); again a fresh set of
  ranks per (mode, world size, round) with the modes rotated per round.

Every rank set runs under a hard timeout (the ranks and their children are killed); checkpoint
data is deleted after every rank set.

Defaults (``--sizes-mib 256 1024 --world-sizes 1 2 --repeats 3``, training 2 rounds) take about
7-11 minutes on the 2-core development box depending on what else runs there; world size 4
(``--world-sizes 1 2 4``) adds roughly half again and is left out of the default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks._ranks import BenchError, run_ranks

__all__ = ["main", "SAVE_MODES", "TRAIN_MODES"]

SAVE_MODES = ("naive_torch_save", "blocking", "async_thread", "async_process", "async_thread_bgstage")
ASYNC_MODES = ("async_thread", "async_process", "async_thread_bgstage")
TRAIN_MODES = ("train_none", "train_async", "train_blocking")
_DISK = "disk"
# fp32 parameter + AdamW exp_avg + exp_avg_sq (the per-tensor ``step`` scalars are extra).
_BYTES_PER_PARAM = 12
_MIB = 1 << 20
# Allowance on top of "baseline + 2 x local state" for allocator rounding, gloo groups and
# DCP's plans and metadata, which do not scale with the state.
_RSS_SLACK_BYTES = 64 * _MIB

# The launch model used by the training-interference part: about 4.8 M parameters
# (57 MiB of model + AdamW state), big enough that a save spans several training steps.
_TRAIN_MODEL = dict(vocab_size=256, seq_len=64, n_layer=6, n_head=4, d_model=256, dropout=0.0)


# ============================================================================ rank side
def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """High-water mark of this process's RSS (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _ChildRssSampler:
    """Samples the summed RSS of this process's descendants (DCP's checkpoint daemon)."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._period_s = period_s
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:  # psutil is optional: no child sampling then
            self._proc = None
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            total = 0
            try:
                for child in self._proc.children(recursive=True):
                    total += child.memory_info().rss
            except Exception:  # noqa: BLE001 - a child may exit while sampled
                continue
            self.peak_bytes = max(self.peak_bytes, total)

    def __enter__(self) -> "_ChildRssSampler":
        if self._proc is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


class _CommitWatcher:
    """Notes when a checkpoint directory appears (the commit's rename), polling every 2 ms.

    ``wait()`` may return later than the commit when the simulated compute window outlasts
    the background write; end-to-end time is taken from whichever is first.
    """

    def __init__(self, final: Path, *, enabled: bool) -> None:
        self.final, self.enabled, self.seen_at = final, enabled, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-commit-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.final.is_dir():
                self.seen_at = time.perf_counter()
                return
            self._stop.wait(0.002)

    def __enter__(self) -> "_CommitWatcher":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def _layer_rows(size_bytes: int) -> tuple[int, list[int]]:
    """``(width, [out_features per layer])`` so params + AdamW state ~= ``size_bytes``."""
    numel = max(size_bytes // _BYTES_PER_PARAM, 1)
    width = 1024 if size_bytes >= 64 * _MIB else 256
    full, rest = divmod(numel, width * width)
    rows = [width] * full + ([rest // width] if rest // width else [])
    return width, rows or [1]


def _build_state(size_bytes: int, world_size: int):
    """Synthetic model (FSDP2 at ``world_size > 1``) + AdamW stepped once.

    Returns:
        ``(model, optimizer, local_state_bytes, global_state_bytes)``.
    """
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    width, rows = _layer_rows(size_bytes)

    class SyntheticModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, r, bias=False) for r in rows)

    with torch.device("meta"):
        model = SyntheticModel()
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local(p).normal_(0.0, 0.02, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    local_bytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
    global_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local_bytes += local(v).numel() * v.element_size()
                global_bytes += v.numel() * v.element_size()
    return model, optimizer, local_bytes, global_bytes


class _NaiveSaver:
    """Baseline: FULL state dict gathered to rank 0 (CPU), one ``torch.save`` file + fsync."""

    def __init__(self, model, optimizer, root: str, rank: int) -> None:
        self.model, self.optimizer, self.root, self.rank = model, optimizer, Path(root), rank
        self.root.mkdir(parents=True, exist_ok=True)
        self.last_path: Path | None = None

    def save(self, step: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, [self.optimizer], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            final = self.root / f"step-{step:09d}.pt"
            tmp = final.with_name(final.name + ".tmp")
            with open(tmp, "wb") as f:
                torch.save({"model": model_sd, "optim": optim_sd, "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.last_path is not None:
                self.last_path.unlink(missing_ok=True)
            self.last_path = final
        del model_sd, optim_sd
        dist.barrier()

    # The manager-like surface the timing loop uses.
    def wait_staged(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def _make_saver(mode: str, spec: dict[str, Any], model, optimizer, rank: int):
    if mode == "naive_torch_save":
        return _NaiveSaver(model, optimizer, spec["root"], rank)
    from distckpt import CheckpointConfig, CheckpointManager

    async_mode = {"blocking": "off", "async_thread": "thread", "async_process": "process",
                  "async_thread_bgstage": "thread"}[mode]
    config = CheckpointConfig(root=spec["root"], interval_steps=None, keep_last=2, load=False,
                              async_mode=async_mode, background_staging=mode == "async_thread_bgstage",
                              thread_count=spec["thread_count"], timeout_s=spec["timeout_s"])
    return CheckpointManager(config, model=model, optimizer=optimizer, process_group=None)


def _save_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one (mode, size, world size, round): warm-up save + measured saves."""
    import torch.distributed as dist

    baseline_rss = _rss_bytes()
    t_build = time.perf_counter()
    model, optimizer, local_bytes, global_bytes = _build_state(spec["size_bytes"], world_size)
    t_build = time.perf_counter() - t_build
    saves = []
    with _ChildRssSampler() as children:
        saver = _make_saver(spec["mode"], spec, model, optimizer, rank)
        for i in range(1 + spec["saves_per_process"]):
            dist.barrier()
            final = Path(spec["root"]) / f"step-{i + 1:09d}"
            t0 = time.perf_counter()
            saver.save(i + 1)
            t1 = time.perf_counter()
            with _CommitWatcher(final, enabled=spec["mode"] in ASYNC_MODES) as watcher:
                if spec["mode"] in ASYNC_MODES and spec["step_compute_s"] > 0:
                    # The next step's forward/backward: on a GPU node the CPU mostly waits for
                    # kernels, so it is modelled as a sleep (it leaves the cores to the save).
                    time.sleep(spec["step_compute_s"])
                t2 = time.perf_counter()
                saver.wait_staged()  # before the next optimizer.step()
                t3 = time.perf_counter()
                saver.wait()
                t4 = time.perf_counter()
            committed = min(t4, watcher.seen_at or t4)
            saves.append({"call_s": t1 - t0, "stall_s": (t1 - t0) + (t3 - t2), "end_to_end_s": committed - t0})
        dist.barrier()
        timings = {}
        manifest = Path(spec["root"]) / f"step-{1 + spec['saves_per_process']:09d}" / "distckpt.json"
        if rank == 0 and manifest.exists():
            timings = json.loads(manifest.read_text()).get("timings_s", {})
        saver.close()
    return {"saves": saves, "timings_s": timings, "peak_rss_bytes": _peak_rss_bytes(),
            "baseline_rss_bytes": baseline_rss, "bg_peak_rss_bytes": children.peak_bytes,
            "local_state_bytes": local_bytes, "global_state_bytes": global_bytes,
            "build_s": t_build}


def _train_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``launch.model.GPT`` on random bytes; optionally save every ``k`` steps."""
    import torch
    import torch.distributed as dist

    from launch.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**spec["model"])
    model = GPT(cfg)
    if world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mode = spec["mode"]
    manager = None
    if mode != "train_none":
        from distckpt import CheckpointConfig, CheckpointManager

        config = CheckpointConfig(
            root=spec["root"], interval_steps=None, keep_last=2, load=False,
            async_mode=spec["async_mode"] if mode == "train_async" else "off",
            thread_count=spec["thread_count"], timeout_s=spec["timeout_s"])
        manager = CheckpointManager(config, model=model, optimizer=optimizer, process_group=None)
    gen = torch.Generator().manual_seed(1000 + rank)
    batch, seq = spec["batch_per_rank"], cfg.seq_len

    def train_step() -> tuple[float, float]:
        t = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        stall = 0.0
        if manager is not None:
            ts = time.perf_counter()
            manager.wait_staged()  # before the optimizer mutates parameters
            stall = time.perf_counter() - ts
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t, stall

    for _ in range(spec["warmup_steps"]):
        train_step()
    save_step = 0
    if manager is not None:  # warm-up save: staging buffers, executor start
        save_step += 1
        manager.save(save_step)
        manager.wait()
    dist.barrier()
    every, steps = spec["every"], spec["steps"]
    step_s, stalls, inflight_s = [], 0.0, []
    pending: Path | None = None
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        in_flight = pending is not None and not pending.is_dir()
        dt, stall = train_step()
        stalls += stall
        step_s.append(dt)
        if in_flight:
            inflight_s.append(dt - stall)
        if manager is not None and i % every == 0 and i < steps:
            save_step += 1
            ts = time.perf_counter()
            manager.save(save_step)
            stalls += time.perf_counter() - ts
            pending = Path(spec["root"]) / f"step-{save_step:09d}"
    if manager is not None:
        manager.wait()
    elapsed = time.perf_counter() - t_start
    if manager is not None:
        manager.close()
    return {"elapsed_s": elapsed, "steps": steps, "step_s": step_s, "stall_s": stalls,
            "inflight_step_s": inflight_s, "saves": save_step - (1 if manager else 0),
            "peak_rss_bytes": _peak_rss_bytes()}


_TARGETS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {
    "save": _save_worker,
    "train": _train_worker,
}


_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "distckpt",
            "launch.model")


def _run_ranks(target: str, world_size: int, spec: dict[str, Any], *, timeout_s: float) -> list[Any]:
    """Run ``_TARGETS[target]`` on ``world_size`` fresh ranks; their values, or ``BenchError``."""
    return run_ranks(f"benchmarks.bench_save:{_TARGETS[target].__name__}", world_size, spec, timeout_s=timeout_s,
                     preload=_PRELOAD, label=f"{target} {spec.get('mode')}")


def _tail(path: str, n_bytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def _disk_source(size_bytes: int):
    """A ``size_bytes`` buffer in RAM (touched, non-zero), written by the disk probe.

    The probe streams from DRAM like a checkpoint does; writing one small buffer over and
    over would read from the CPU cache and overstate what the disk path can do.
    """
    import torch

    buf = torch.empty(max(size_bytes, 1), dtype=torch.uint8)
    buf.fill_(0x5A)
    return memoryview(buf.numpy())


def _disk_write_seconds(directory: Path, source: memoryview, chunk_bytes: int = 16 * _MIB) -> float:
    """Seconds for one sequential write of ``source`` + fsync into a new file in ``directory``."""
    path = directory / f"disk-probe-{os.getpid()}.bin"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < len(source):
                offset += os.write(fd, source[offset: offset + chunk_bytes])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def _clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _log(msg: str) -> None:
    print(f"[bench_save {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _save_timeout(args: argparse.Namespace, size_bytes: int, world_size: int) -> float:
    """Per-rank-set limit: start-up allowance + 36 s per GiB per save (~10x what 2 cores need)."""
    saves = 1 + args.saves_per_process
    return min(args.timeout_s, 60.0 + world_size * 10.0 + 12.0 * saves * size_bytes / (1 << 30) * 3)


def _run_save_block(args, size_mib: float, world_size: int, modes: list[str], thread_counts: dict[str, int],
                    data_dir: Path, with_disk: bool) -> dict[str, Any]:
    """All rounds of one (size, world size) block: ``{mode: [per-round sample]}``."""
    size_bytes = int(size_mib * _MIB)
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    disk: list[float] = []  # per round: median of that round's probes
    errors: dict[str, str] = {}
    items = list(modes)
    source = _disk_source(size_bytes) if with_disk else None
    if with_disk:  # probes spread through the round: the disk's speed drifts within seconds
        for k in range(args.disk_probes):
            items.insert(round((k + 0.5) * len(modes) / args.disk_probes) + k, f"{_DISK}#{k}")
    for r in range(args.repeats):
        probes = []
        for mode in _rotated(items, r):
            if mode in errors:
                continue
            root = data_dir / f"{mode.replace('#', '')}-{size_mib:g}MiB-ws{world_size}-r{r}"
            _clean(root)
            try:
                if mode.startswith(_DISK):
                    probes.append(_disk_write_seconds(root, source))
                    continue
                t0 = time.perf_counter()
                spec = {"mode": mode.split("@")[0], "size_bytes": size_bytes, "root": str(root),
                        "saves_per_process": args.saves_per_process, "thread_count": thread_counts[mode],
                        "step_compute_s": args.step_compute_s}
                values = _run_ranks("save", world_size, spec,
                                    timeout_s=_save_timeout(args, size_bytes, world_size))
                samples[mode].append(_save_sample(values))
                _log(f"{mode:22s} {size_mib:g} MiB ws={world_size} round {r}: "
                     f"stall {samples[mode][-1]['stall_s']:.3f} s, e2e {samples[mode][-1]['end_to_end_s']:.3f} s "
                     f"(rank set {time.perf_counter() - t0:.1f} s, "
                     f"state built in {samples[mode][-1]['build_s']:.1f} s)")
            except BenchError as e:
                errors[mode] = str(e)
                samples[mode].append(None)
                _log(f"FAILED {mode} {size_mib:g} MiB ws={world_size}: {e}")
            finally:
                _clean(root)
        if probes:
            disk.append(_median(probes))
            _log(f"disk probe {size_mib:g} MiB round {r}: "
                 + ", ".join(f"{size_bytes / t / 1e9:.2f}" for t in probes) + " GB/s")
    return {"size_bytes": size_bytes, "samples": samples, "disk_s": disk, "errors": errors}


def _save_sample(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank set -> one sample: per save max over ranks, then median over measured saves."""
    n = len(values[0]["saves"])

    def per_save(key: str, i: int) -> float:
        return max(v["saves"][i][key] for v in values)

    measured = range(1, n)
    return {
        "stall_s": _median([per_save("stall_s", i) for i in measured]),
        "end_to_end_s": _median([per_save("end_to_end_s", i) for i in measured]),
        "call_s": _median([per_save("call_s", i) for i in measured]),
        "first_save_s": per_save("end_to_end_s", 0),
        "first_save_stall_s": per_save("stall_s", 0),
        "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values),
        "bg_peak_rss_bytes": max(v["bg_peak_rss_bytes"] for v in values),
        "rss_budget_bytes": max(v["baseline_rss_bytes"] + 2 * v["local_state_bytes"] for v in values),
        "rss_over_budget_bytes": max(v["peak_rss_bytes"] - v["baseline_rss_bytes"] - 2 * v["local_state_bytes"]
                                     for v in values),
        "baseline_rss_bytes": max(v["baseline_rss_bytes"] for v in values),
        "local_state_bytes": max(v["local_state_bytes"] for v in values),
        "global_state_bytes": values[0]["global_state_bytes"],
        "timings_s": values[0]["timings_s"],
        "build_s": max(v["build_s"] for v in values),
    }


def _save_rows(block: dict[str, Any], world_size: int, thread_counts: dict[str, int]) -> list[dict[str, Any]]:
    """Rows of one (size, world size) block; ratios are paired within rounds."""
    size_bytes = block["size_bytes"]
    disk_gbps = size_bytes / _median(block["disk_s"]) / 1e9 if block["disk_s"] else float("nan")
    by_mode = block["samples"]  # {mode: [sample or None (failed) per round]}

    def round_value(mode: str, r: int, key: str) -> float | None:
        s = by_mode.get(mode, [])
        return s[r][key] if r < len(s) and s[r] is not None else None

    def paired(mode: str, other: str, key: str, other_key: str) -> list[float]:
        n = max(len(by_mode.get(mode, [])), len(by_mode.get(other, [])))
        out = []
        for r in range(n):
            a, b = round_value(mode, r, key), round_value(other, r, other_key)
            if a is not None and b is not None:
                out.append(a / b)
        return out

    rows = []
    for mode, per_round in by_mode.items():
        samples = [s for s in per_round if s is not None]
        row: dict[str, Any] = {"experiment": "save", "mode": mode, "size_bytes": size_bytes,
                               "size_mib": size_bytes / _MIB, "world_size": world_size,
                               "thread_count": thread_counts[mode], "repeats": len(samples),
                               "disk_write_gbps": disk_gbps}
        if not samples:
            row["error"] = block["errors"].get(mode, "no samples")
            rows.append(row)
            continue
        if mode in block["errors"]:
            row["warning"] = "failed in some rounds: " + block["errors"][mode].splitlines()[0][:300]
        e2e = _median([s["end_to_end_s"] for s in samples])
        row.update({
            "stall_s": _median([s["stall_s"] for s in samples]),
            "end_to_end_s": e2e,
            "write_gbps": size_bytes / e2e / 1e9,
            "save_call_s": _median([s["call_s"] for s in samples]),
            "first_save_s": _median([s["first_save_s"] for s in samples]),
            "first_save_stall_s": _median([s["first_save_stall_s"] for s in samples]),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s in samples),
            "rss_budget_bytes": max(s["rss_budget_bytes"] for s in samples),
            "rss_over_budget_bytes": max(s["rss_over_budget_bytes"] for s in samples),
            "baseline_rss_bytes": max(s["baseline_rss_bytes"] for s in samples),
            "bg_peak_rss_bytes": max(s["bg_peak_rss_bytes"] for s in samples),
            "local_state_bytes": samples[0]["local_state_bytes"],
            "state_bytes": samples[0]["global_state_bytes"],
            "stall_s_samples": [s["stall_s"] for s in samples],
            "end_to_end_s_samples": [s["end_to_end_s"] for s in samples],
        })
        timings = [s["timings_s"] for s in samples if s["timings_s"]]
        for key in ("stage", "write", "commit"):
            if timings:
                row[f"manifest_{key}_s"] = _median([t.get(key, float("nan")) for t in timings])
        if mode in ASYNC_MODES and "blocking" in by_mode:
            row["stall_over_blocking_e2e"] = _median(paired(mode, "blocking", "stall_s", "end_to_end_s"))
            row["e2e_over_blocking_e2e"] = _median(paired(mode, "blocking", "end_to_end_s", "end_to_end_s"))
        if block["disk_s"]:
            ratios = [block["disk_s"][r] / e for r in range(len(block["disk_s"]))
                      if (e := round_value(mode, r, "end_to_end_s")) is not None]
            row["write_over_disk"] = _median(ratios)  # == write_gbps / disk_gbps, per round
        rows.append(row)
    return rows


def _run_train(args, data_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for world_size in args.train_world_sizes:
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in TRAIN_MODES}
        errors: dict[str, str] = {}
        for r in range(args.train_repeats):
            for mode in _rotated(list(TRAIN_MODES), r):
                if mode in errors:
                    continue
                root = data_dir / f"{mode}-ws{world_size}-r{r}"
                _clean(root)
                spec = {"mode": mode, "root": str(root), "model": _TRAIN_MODEL,
                        "batch_per_rank": max(1, args.train_global_batch // world_size),
                        "warmup_steps": 3, "steps": args.train_steps, "every": args.train_every,
                        "async_mode": args.train_async_mode, "thread_count": 1}
                try:
                    t0 = time.perf_counter()
                    values = _run_ranks("train", world_size, spec, timeout_s=min(args.timeout_s, 600.0))
                    steps = values[0]["steps"]
                    elapsed = max(v["elapsed_s"] for v in values)
                    compute = max(sum(v["step_s"]) - v["stall_s"] for v in values)
                    inflight = [dt for dt in values[0]["inflight_step_s"]]
                    samples[mode].append({
                        "steps_per_s": steps / elapsed, "compute_steps_per_s": steps / compute,
                        "inflight_steps_per_s": (len(inflight) / sum(inflight)) if inflight else float("nan"),
                        "inflight_steps": len(inflight), "stall_s": max(v["stall_s"] for v in values),
                        "saves": values[0]["saves"], "peak_rss_bytes": max(v["peak_rss_bytes"] for v in values)})
                    _log(f"{mode:14s} ws={world_size} round {r}: {steps / elapsed:.2f} steps/s, "
                         f"{len(inflight)} steps with a save in flight ({time.perf_counter() - t0:.1f} s)")
                except BenchError as e:
                    errors[mode] = str(e)
                    _log(f"FAILED {mode} ws={world_size}: {e}")
                finally:
                    _clean(root)
        base = samples["train_none"]
        for mode in TRAIN_MODES:
            s = samples[mode]
            row: dict[str, Any] = {"experiment": "train", "mode": mode, "world_size": world_size,
                                   "repeats": len(s), "save_every_steps": args.train_every,
                                   "async_mode": args.train_async_mode if mode == "train_async" else
                                   ("off" if mode == "train_blocking" else None),
                                   "model": dict(_TRAIN_MODEL), "global_batch": args.train_global_batch}
            if not s:
                row["error"] = errors.get(mode, "no samples")
                rows.append(row)
                continue
            row.update({"steps_per_s": _median([x["steps_per_s"] for x in s]),
                        "stall_s": _median([x["stall_s"] for x in s]),
                        "saves": s[0]["saves"],
                        "inflight_steps": _median([x["inflight_steps"] for x in s]),
                        "inflight_steps_per_s": _median([x["inflight_steps_per_s"] for x in s]),
                        "peak_rss_bytes": max(x["peak_rss_bytes"] for x in s),
                        "steps_per_s_samples": [x["steps_per_s"] for x in s]})
            paired = list(zip(s, base))
            row["throughput_ratio"] = _median([a["steps_per_s"] / b["steps_per_s"] for a, b in paired])
            if mode == "train_async":
                row["inflight_throughput_ratio"] = _median(
                    [a["inflight_steps_per_s"] / b["compute_steps_per_s"] for a, b in paired])
            rows.append(row)
    return rows


# ============================================================================ report
def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _mib(x: Any) -> str:
    return "-" if x is None else f"{x / _MIB:.0f}"


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per goal: met / missed, by how much."""
    save = [r for r in rows if r["experiment"] == "save" and "error" not in r]
    out = []

    def find(mode, size_bytes, ws):
        return next((r for r in save if r["mode"] == mode and r["size_bytes"] == size_bytes
                     and r["world_size"] == ws), None)

    sizes = sorted({r["size_bytes"] for r in save})
    if not sizes:
        return ["no save results"]
    target = min(sizes, key=lambda s: abs(s - (1 << 30)))
    tag = f"{target / _MIB:g} MiB" + ("" if target == 1 << 30 else " (largest size run; goal is at 1 GiB)")
    for mode, limit in (("async_thread", 0.10), ("async_process", 0.10), ("async_thread_bgstage", 0.03)):
        r = find(mode, target, 2)
        if r is None or "stall_over_blocking_e2e" not in r:
            out.append(f"- stall {mode} <= {limit:.0%} of blocking e2e at {tag}, ws=2: not measured")
            continue
        v = r["stall_over_blocking_e2e"]
        out.append(f"- stall {mode} <= {limit:.0%} of blocking e2e at {tag}, ws=2: "
                   f"**{'met' if v <= limit else 'missed'}** ({v:.1%}"
                   + ("" if v <= limit else f", {v / limit:.1f}x the limit") + ")")
    worst = [(r["e2e_over_blocking_e2e"], r) for r in save if r.get("e2e_over_blocking_e2e") is not None
             and math.isfinite(r["e2e_over_blocking_e2e"])]
    if worst:
        bad = [(v, r) for v, r in worst if v > 1.2]
        v, r = max(worst, key=lambda x: x[0])
        out.append(f"- async e2e <= 1.2x blocking: **{'met' if not bad else 'missed'}** (met in "
                   f"{len(worst) - len(bad)}/{len(worst)} cells); worst {v:.2f}x "
                   f"({r['mode']}, {r['size_mib']:g} MiB, ws={r['world_size']})")
    for ws in (1, 2):
        cells = [r for r in save if r["mode"] == "blocking" and r["world_size"] == ws
                 and r.get("write_over_disk") is not None]
        if not cells:
            out.append(f"- blocking write >= 80% of disk bandwidth at ws={ws}: not measured")
            continue
        parts = ", ".join(f"{r['size_mib']:g} MiB {r['write_over_disk']:.0%}" for r in cells)
        ok = all(r["write_over_disk"] >= 0.8 for r in cells)
        out.append(f"- blocking write >= 80% of disk bandwidth at ws={ws}: **{'met' if ok else 'missed'}** ({parts})")
    dist_rows = [r for r in save if r["mode"] != "naive_torch_save"]
    if dist_rows:
        slack = _RSS_SLACK_BYTES
        over = [r for r in dist_rows if r["rss_over_budget_bytes"] > slack]
        worst_r = max(dist_rows, key=lambda r: r["rss_over_budget_bytes"] / max(r["local_state_bytes"], 1))
        big = max(dist_rows, key=lambda r: (r["size_bytes"], r["rss_over_budget_bytes"]))
        out.append(
            f"- peak RSS <= baseline + local state + one staging copy per rank (+{slack // _MIB} MiB slack): "
            f"**{'met' if not over else 'missed'}** in {len(dist_rows) - len(over)}/{len(dist_rows)} distckpt "
            f"cells; worst relative: {worst_r['mode']} {worst_r['size_mib']:g} MiB ws={worst_r['world_size']} "
            f"{worst_r['rss_over_budget_bytes'] / _MIB:+.0f} MiB vs budget "
            f"({worst_r['rss_over_budget_bytes'] / max(worst_r['local_state_bytes'], 1):+.0%} of its local state); "
            f"at the largest size the worst is {big['mode']} ws={big['world_size']} "
            f"{big['rss_over_budget_bytes'] / _MIB:+.0f} MiB"
            + ("; over: " + ", ".join(f"{r['mode']} {r['size_mib']:g} MiB ws={r['world_size']} "
                                       f"{r['rss_over_budget_bytes'] / _MIB:+.0f} MiB" for r in over) if over else ""))
    train = [r for r in rows if r["experiment"] == "train" and r["mode"] == "train_async" and "error" not in r]
    for r in train:
        v = r.get("inflight_throughput_ratio")
        spare = "a core spare" if r["world_size"] == 1 else "no spare core"
        goal = " (goal: >= 95%)" if r["world_size"] == 1 else " (no goal: informative)"
        verdict = "" if r["world_size"] != 1 else (
            f"**{'met' if v is not None and math.isfinite(v) and v >= 0.95 else 'missed'}** ")
        out.append(f"- training throughput while an async save is in flight, ws={r['world_size']} ({spare})"
                   f"{goal}: {verdict}{_fmt(v, '.0%')} of no-checkpoint steps/s "
                   f"({_fmt(r.get('inflight_steps'), '.0f')} steps in flight); whole run incl. stalls "
                   f"{_fmt(r['throughput_ratio'], '.0%')}")
    return out


def render_markdown(results: dict[str, Any]) -> str:
    rows, meta = results["results"], results["meta"]
    lines = [f"# distckpt save benchmark ({meta['date']})", "",
             f"{meta['machine']['cpu_count']} CPUs, {meta['machine']['mem_total_gib']:.0f} GiB RAM, "
             f"torch {meta['torch_version']}, distckpt {meta['distckpt_version']}, data dir "
             f"`{meta['data_dir']}` ({meta['machine'].get('data_fs', '?')}); wall time "
             f"{meta['wall_s']:.0f} s; load average (1/5/15 min) at start "
             f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_start'])}, at end "
             f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_end'])}; "
             f"args `{' '.join(meta['argv']) or '(defaults)'}`", "",
             "Medians over rounds (each round: every mode once in a fresh set of ranks, order rotated). "
             "stall = save() + wait_staged(); e2e = save() until committed; ratios computed per round. "
             "RSS budget = baseline RSS before the state was built + 2 x local state.", ""]
    save = [r for r in rows if r["experiment"] == "save"]
    header = ("| size MiB | ws | mode | stall s | e2e s | write GB/s | disk GB/s | write/disk | stall/blk e2e "
              "| e2e/blk e2e | first save s | peak RSS MiB | RSS budget MiB | bg RSS MiB | n |")
    lines += ["## Save", "", header, "|" + "---|" * (header.count("|") - 1)]
    for r in save:
        if "error" in r:
            lines.append(f"| {r['size_mib']:g} | {r['world_size']} | {r['mode']} | FAILED: "
                         f"{r['error'].splitlines()[0][:120]} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['size_mib']:g} | {r['world_size']} | {r['mode']} | {_fmt(r['stall_s'])} | "
            f"{_fmt(r['end_to_end_s'])} | {_fmt(r['write_gbps'], '.2f')} | {_fmt(r['disk_write_gbps'], '.2f')} | "
            f"{_fmt(r.get('write_over_disk'), '.0%')} | {_fmt(r.get('stall_over_blocking_e2e'), '.1%')} | "
            f"{_fmt(r.get('e2e_over_blocking_e2e'), '.2f')} | {_fmt(r['first_save_s'])} | "
            f"{_mib(r['peak_rss_bytes'])} | {_mib(r['rss_budget_bytes'])} | {_mib(r['bg_peak_rss_bytes'])} | "
            f"{r['repeats']} |")
    tc = [r for r in rows if r["experiment"] == "thread_count"]
    if tc:
        lines += ["", "## thread_count (blocking, world size 1)", "",
                  "| size MiB | thread_count | e2e s | write GB/s | e2e / thread_count=1 | n |",
                  "|---|---|---|---|---|---|"]
        for r in tc:
            if "error" in r:
                lines.append(f"| {r['size_mib']:g} | {r['thread_count']} | FAILED | | | |")
                continue
            lines.append(f"| {r['size_mib']:g} | {r['thread_count']} | {_fmt(r['end_to_end_s'])} | "
                         f"{_fmt(r['write_gbps'], '.2f')} | {_fmt(r.get('e2e_over_tc1'), '.2f')} | {r['repeats']} |")
        if meta.get("thread_count_finding"):
            lines += ["", meta["thread_count_finding"]]
    train = [r for r in rows if r["experiment"] == "train"]
    if train:
        m = _TRAIN_MODEL
        lines += ["", "## Training interference", "",
                  f"launch.model.GPT d_model={m['d_model']} n_layer={m['n_layer']} seq_len={m['seq_len']}, "
                  f"global batch {train[0]['global_batch']}, one torch thread per rank, save every "
                  f"{train[0]['save_every_steps']} steps; throughput ratio = steps/s vs train_none in the same "
                  "round; in-flight ratio = steps/s of steps that began while an async save was in flight "
                  "(their own compute time) vs train_none's.", "",
                  "| ws | mode | steps/s | throughput ratio | in-flight steps/s | in-flight ratio | stall s (total) "
                  "| saves | n |", "|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            if "error" in r:
                lines.append(f"| {r['world_size']} | {r['mode']} | FAILED | | | | | | |")
                continue
            label = f"{r['mode']} ({r['async_mode']})" if r["mode"] == "train_async" else r["mode"]
            lines.append(f"| {r['world_size']} | {label} "
                         f"| {_fmt(r['steps_per_s'], '.2f')} | {_fmt(r['throughput_ratio'], '.1%')} | "
                         f"{_fmt(r.get('inflight_steps_per_s'), '.2f') if r['mode'] == 'train_async' else '-'} | "
                         f"{_fmt(r.get('inflight_throughput_ratio'), '.1%')} | {_fmt(r['stall_s'])} | "
                         f"{r['saves']} | {r['repeats']} |")
    lines += ["", "## Goals", ""] + meta.get("verdicts", [])
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    save = [r for r in results["results"] if r["experiment"] == "save" and "error" not in r]
    train = [r for r in results["results"] if r["experiment"] == "train" and "error" not in r]
    cells = sorted({(r["size_mib"], r["world_size"]) for r in save})
    fig, axes = plt.subplots(1, 2 if train else 1, figsize=(14 if train else 10, 5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(SAVE_MODES), 1)
    for i, mode in enumerate(SAVE_MODES):
        stall = [next((r["stall_s"] for r in save if r["mode"] == mode and (r["size_mib"], r["world_size"]) == c),
                      float("nan")) for c in cells]
        e2e = [next((r["end_to_end_s"] for r in save if r["mode"] == mode and (r["size_mib"], r["world_size"]) == c),
                    float("nan")) for c in cells]
        xs = [j + (i - len(SAVE_MODES) / 2 + 0.5) * width for j in range(len(cells))]
        bars = ax.bar(xs, e2e, width, alpha=0.35, label=f"{mode} e2e")
        ax.bar(xs, stall, width, color=bars.patches[0].get_facecolor()[:3] if bars.patches else None,
               label=f"{mode} stall")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{s:g} MiB\nws={w}" for s, w in cells])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (solid: stall, light: end-to-end)")
    ax.set_title("Save: training stall and end-to-end time")
    ax.legend(fontsize=7, ncol=2)
    if train:
        ax2 = axes[0][1]
        wss = sorted({r["world_size"] for r in train})
        for i, mode in enumerate(TRAIN_MODES):
            ys = [next((r["throughput_ratio"] for r in train if r["mode"] == mode and r["world_size"] == w),
                       float("nan")) for w in wss]
            ax2.bar([j + (i - 1) * 0.25 for j in range(len(wss))], ys, 0.25, label=mode)
        ax2.axhline(0.95, color="k", linestyle="--", linewidth=0.8, label="95% goal")
        ax2.set_xticks(range(len(wss)))
        ax2.set_xticklabels([f"ws={w}" for w in wss])
        ax2.set_ylabel("steps/s relative to train_none")
        ax2.set_title("Training throughput with checkpointing")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _machine(data_dir: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "processor": platform.processor()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = int(f.readline().split()[1]) / (1 << 20)
    except OSError:
        info["mem_total_gib"] = float("nan")
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        out = subprocess.run(["df", "-PT", str(data_dir)], capture_output=True, text=True, timeout=10).stdout
        fields = out.splitlines()[-1].split()
        info["data_fs"] = f"{fields[1]} on {fields[0]}, {int(fields[4]) / (1 << 20):.0f} GiB free"
    except Exception:  # noqa: BLE001 - informative only
        pass
    return info


# ============================================================================ CLI
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_save",
        description="Benchmark naive torch.save vs distckpt blocking/async saves on CPU/gloo ranks.",
        epilog="example: python -m benchmarks.bench_save --sizes-mib 64 --world-sizes 1 2 --repeats 2 "
               "--no-train --out /tmp/bench")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[256, 1024],
                   help="model + AdamW state of the whole job, MiB (default: 256 1024)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2],
                   help="ranks (default: 1 2; add 4 for an oversubscribed 2-core box, ~+50%% run time)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every mode once (default: 3)")
    p.add_argument("--saves-per-process", type=int, default=1,
                   help="measured saves per rank set, after its warm-up save (default: 1)")
    p.add_argument("--step-compute-s", type=float, default=0.25,
                   help="async modes: seconds between save() and wait_staged() standing for the next "
                        "step's forward/backward (a sleep: on a GPU node the CPU waits for kernels) "
                        "(default: 0.25)")
    p.add_argument("--disk-probes", type=int, default=2,
                   help="plain sequential write + fsync probes per round, spread among the modes (default: 2)")
    p.add_argument("--modes", nargs="+", default=list(SAVE_MODES), choices=SAVE_MODES, help="save modes")
    p.add_argument("--out", default="runs/bench_save", help="output directory (results.json/.md, plot.png)")
    p.add_argument("--data-dir", default=None,
                   help="where checkpoints are written (default: OUT/data; removed after each rank set)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="upper limit per rank set (seconds)")
    p.add_argument("--no-thread-count", action="store_true",
                   help="skip the blocking thread_count 1 vs 4 comparison at world size 1")
    p.add_argument("--thread-counts", type=int, nargs="+", default=[1, 4],
                   help="thread_count values compared (default: 1 4)")
    p.add_argument("--thread-count-repeats", type=int, default=None,
                   help="rounds of the thread_count comparison (default: --repeats)")
    p.add_argument("--no-save", action="store_true",
                   help="skip the save matrix (run only the thread_count and/or training parts)")
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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every rank set succeeded, 1 otherwise."""
    args = _parse(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    # Everything the ranks import must be importable from the repository root.
    repo_root = str(Path(__file__).resolve().parents[1])
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    import torch

    import distckpt

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    load_start = os.getloadavg()
    finding = None
    default_tc = {m: 1 for m in SAVE_MODES}
    try:
        for size_mib in ([] if args.no_save else args.sizes_mib):
            for ws in args.world_sizes:
                block = _run_save_block(args, size_mib, ws, list(args.modes), default_tc, data_dir, with_disk=True)
                rows += _save_rows(block, ws, default_tc)
        if not args.no_thread_count and len(args.thread_counts) > 1:
            size_mib = max(args.sizes_mib)
            tc_modes = [f"blocking@tc{n}" for n in args.thread_counts]
            tcs = {m: int(m.split("@tc")[1]) for m in tc_modes}
            tc_args = argparse.Namespace(**vars(args))
            tc_args.repeats = args.thread_count_repeats or args.repeats
            block = _run_save_block(tc_args, size_mib, 1, tc_modes, tcs, data_dir, with_disk=False)
            tc_rows = _save_rows(block, 1, tcs)
            base_mode = tc_modes[0]
            for row in tc_rows:
                row["experiment"] = "thread_count"
                row["mode"] = f"blocking_tc{row['thread_count']}"
                own = block["samples"][f"blocking@tc{row['thread_count']}"]
                base = block["samples"][base_mode]
                row["e2e_over_tc1"] = _median([a["end_to_end_s"] / b["end_to_end_s"] for a, b in zip(own, base)
                                               if a is not None and b is not None])
            rows += tc_rows
            ok = [r for r in tc_rows if "error" not in r]
            base = block["samples"][base_mode]
            if len(ok) == len(tc_rows) and len(ok) > 1:
                best = min(ok, key=lambda r: r["e2e_over_tc1"])
                parts = []
                for r in ok[1:]:
                    own = block["samples"][f"blocking@tc{r['thread_count']}"]
                    wins = sum(a is not None and b is not None and a["end_to_end_s"] < b["end_to_end_s"]
                               for a, b in zip(own, base))
                    parts.append(f"thread_count={r['thread_count']} took x{r['e2e_over_tc1']:.2f} the time of "
                                 f"thread_count={args.thread_counts[0]} (median of per-round ratios; faster in "
                                 f"{wins}/{r['repeats']} rounds)")
                finding = (f"Blocking save, {size_mib:g} MiB, world size 1: " + "; ".join(parts)
                           + f". Faster by the paired ratio: thread_count={best['thread_count']}.")
        if not args.no_train:
            rows += _run_train(args, data_dir)
    finally:
        _clean(data_dir)
    results: dict[str, Any] = {"results": rows, "meta": {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": argv_list, "args": vars(args), "torch_version": torch.__version__,
        "distckpt_version": distckpt.__version__, "machine": _machine(out), "data_dir": str(data_dir),
        "wall_s": time.perf_counter() - t_start, "thread_count_finding": finding, "notes": notes,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg()}}
    busy = max(load_start[0], results["meta"]["loadavg_end"][0])
    if busy > (os.cpu_count() or 1):
        notes.append(f"1-min load average reached {busy:.1f} on {os.cpu_count()} CPUs: other processes shared "
                     "the cores during this run, so absolute times are inflated and no core was truly spare; "
                     "ratios are paired within rounds to limit the damage.")
    results["meta"]["verdicts"] = _verdicts(rows)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = render_markdown(results)
    (out / "results.md").write_text(md)
    if _plot(results, out / "plot.png"):
        results["meta"]["plot"] = str(out / "plot.png")
    else:
        notes.append("plot.png not written: matplotlib is not installed (pip install matplotlib).")
        md = render_markdown(results)
        (out / "results.md").write_text(md)
    print(md)
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    # Run through the importable module so that spawned ranks pickle ``benchmarks.bench_save.*``.
    from benchmarks.bench_save import main as _main

    sys.exit(_main())
