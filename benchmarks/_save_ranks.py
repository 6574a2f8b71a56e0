"""Rank side of ``bench_save``: the benchmark state (a model + AdamW of a given size), the savers
(naive ``torch.save``, distckpt blocking and async), the save and training workers, and their RSS
and commit watchers."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, Literal

SAVE_MODES = ("naive_torch_save", "blocking", "async_thread", "async_process", "async_thread_bgstage")
ASYNC_MODES = ("async_thread", "async_process", "async_thread_bgstage")
TRAIN_MODES = ("train_none", "train_async", "train_blocking")
_DISK = "disk"
# The copy-limit probe: the state copied into buffers it already owns, on every rank at once.
COPY_LIMIT = "copy_limit"
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
        self.final, self.enabled = final, enabled
        self.seen_at: float | None = None
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


def _build_state(size_bytes: int, world_size: int, device: str = "cpu"):
    """Synthetic model (FSDP2 at ``world_size > 1``) + AdamW stepped once, on ``device``
    (``"cuda"``: this rank's current GPU; ``bench_gpu``).

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
    model.to_empty(device=device)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    gen = torch.Generator(device=device).manual_seed(0)
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
            self.model, [self.optimizer], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
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
    from distckpt import (
        AsyncSaveConfig,
        CheckpointConfig,
        CheckpointManager,
        CoordinationConfig,
        LoadConfig,
        RetentionConfig,
        SaveConfig,
        ScheduleConfig,
    )

    modes: dict[str, Literal["off", "thread", "process"]] = {
        "blocking": "off",
        "async_thread": "thread",
        "async_process": "process",
        "async_thread_bgstage": "thread",
    }
    async_mode = modes[mode]
    config = CheckpointConfig(
        root=spec["root"],
        schedule=ScheduleConfig(interval_steps=None),
        retention=RetentionConfig(keep_last=2),
        load=LoadConfig(enabled=False),
        async_save=AsyncSaveConfig(mode=async_mode, background_staging=mode == "async_thread_bgstage"),
        save=SaveConfig(thread_count=spec["thread_count"]),
        coordination=CoordinationConfig(timeout_s=spec["timeout_s"]),
    )
    return CheckpointManager(config, model=model, optimizer=optimizer, process_group=None)


def _save_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one (mode, size, world size, round): warm-up save + measured saves."""
    import torch.distributed as dist

    baseline_rss = _rss_bytes()
    t_build = time.perf_counter()
    model, optimizer, local_bytes, global_bytes = _build_state(
        spec["size_bytes"], world_size, spec.get("device", "cpu")
    )
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
    return {
        "saves": saves,
        "timings_s": timings,
        "peak_rss_bytes": _peak_rss_bytes(),
        "baseline_rss_bytes": baseline_rss,
        "bg_peak_rss_bytes": children.peak_bytes,
        "local_state_bytes": local_bytes,
        "global_state_bytes": global_bytes,
        "build_s": t_build,
    }


def _copy_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The staging copy's physical limit: this rank's local state (parameters + optimizer
    state) copied tensor by tensor into buffers allocated and touched beforehand, every rank at
    the same time (as staging does). Runs in its own rank set so its buffers stay out of the
    save modes' RSS.

    Returns:
        ``{"copy_s": [seconds per copy, "copy_bytes": local state bytes}``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model, optimizer, local_bytes, _ = _build_state(spec["size_bytes"], world_size, spec.get("device", "cpu"))
    sources = [t.to_local() if isinstance(t, DTensor) else t for t in model.parameters()]
    for state in optimizer.state.values():
        sources += [
            v.to_local() if isinstance(v, DTensor) else v for v in state.values() if isinstance(v, torch.Tensor)
        ]
    buffers = [torch.empty_like(t, device="cpu") for t in sources]
    times = []
    with torch.no_grad():
        for i in range(1 + spec.get("copies", 3)):  # the first copy touches the buffers' pages
            dist.barrier()
            t0 = time.perf_counter()
            for dst, src in zip(buffers, sources):
                dst.copy_(src)
            if i:
                times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"copy_s": times, "copy_bytes": local_bytes}


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
        from distckpt import (
            AsyncSaveConfig,
            CheckpointConfig,
            CheckpointManager,
            CoordinationConfig,
            LoadConfig,
            RetentionConfig,
            SaveConfig,
            ScheduleConfig,
        )

        config = CheckpointConfig(
            root=spec["root"],
            schedule=ScheduleConfig(interval_steps=None),
            retention=RetentionConfig(keep_last=2),
            load=LoadConfig(enabled=False),
            async_save=AsyncSaveConfig(mode=spec["async_mode"] if mode == "train_async" else "off"),
            save=SaveConfig(thread_count=spec["thread_count"]),
            coordination=CoordinationConfig(timeout_s=spec["timeout_s"]),
        )
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
    return {
        "elapsed_s": elapsed,
        "steps": steps,
        "step_s": step_s,
        "stall_s": stalls,
        "inflight_step_s": inflight_s,
        "saves": save_step - (1 if manager else 0),
        "peak_rss_bytes": _peak_rss_bytes(),
    }
