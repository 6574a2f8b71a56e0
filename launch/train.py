"""torchrun entry point: train the byte-level GPT with DDP or FSDP2 and checkpoint via distckpt.

Usage (from the repository root)::

    torchrun --nproc-per-node 2 launch/train.py --config launch/configs/ddp.yaml train.steps=40
    torchrun --nproc-per-node 2 -m launch.train --config launch/configs/fsdp2.yaml

A run resumes from the newest committed checkpoint in ``checkpoint.root`` (or from
``checkpoint.load.path``) and trains up to ``train.steps`` optimizer steps. Outputs in
``train.out``, appended to (one line per record, flushed at once so a killed run keeps them;
a run resumed into the same ``out`` appends the steps it replays again):

* ``metrics.jsonl`` (rank 0): ``step, loss, lr, grad_norm, global_samples_seen, world_size,
  step_seconds, checkpoint_seconds, epoch`` per step; ``loss`` is the global mean over all
  ranks' samples, so it is comparable across world sizes.
* ``samples.rank<r>.jsonl`` (every rank): ``{"step", "ids"}``, the sample ids rank ``r``
  trained on at that step.
* ``events.jsonl`` (rank 0): ``start``, ``resumed``, ``checkpoint``, ``preempted``, ``end``.

Recovery timing (``launch/elastic_demo.py``, ``benchmarks/bench_recovery.py``): every metrics
record also carries ``time`` (wall clock, ``time.time()`` s), ``worker_start`` (when this worker
process started: it names the worker round) and, with the memory tier on, ``snapshot_stall_s``
(``manager.memory.last_stall_s``). ``resumed`` carries ``tier`` (``"memory"`` or ``"durable"``),
``bytes_read_from_root`` (memory: 0; durable: the size of the loaded checkpoint's files, which a
full load reads once over all ranks -- a proxy, distckpt does not expose its reader's count),
``bytes_between_nodes`` (a memory restore: bytes all ranks received from other nodes) and the
wall times ``worker_start``, ``group_ready`` (``init_process_group`` returned), ``load_start``
and ``load_end`` (around ``manager.load()``).

SIGTERM (preemption, with ``checkpoint.preemption.enabled`` on and ``preemption.exit`` off as in
the shipped configs): every rank saves at the next step boundary, records it and exits 0.

World-size invariance: the global batch ``G`` is fixed (unless ``checkpoint.elastic.batch_policy`` is
``keep_local_batch``: then a resume may change ``G``, the position carries over in samples and
losses are no longer comparable to a run at the old ``G``), and dropout masks come from
per-sample seeds drawn from one stream shared by all ranks (``launch.model.SampleSeedStream``,
saved in the checkpoint), so a step computes the same function of the same samples at any
world size, up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script path: make the `launch` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from distckpt import CheckpointManager, ConfigError, DistCkptError
from launch.config import load_job_config
from launch.data import corpus_fingerprint
from launch.job import Job, build_job, global_mean, train_step

__all__ = ["main", "Job", "build_job", "train"]

logger = logging.getLogger("launch.train")


def process_start_time(pid: int | str = "self") -> float:
    """When process ``pid`` started, wall clock (s; Linux, ~10 ms resolution): its start time in
    clock ticks after boot (``/proc/<pid>/stat``, field 22) plus the boot's wall time (now minus
    ``/proc/uptime``; ``/proc/stat``'s ``btime`` has whole seconds only)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


# When this worker process started and its process group was ready (wall clock, s): a restart's
# detection phase ends at the first, its rendezvous phase spans both (docs/memory.md, "Measured").
TIMES: dict[str, float] = {"worker_start": process_start_time()}

# Chaos-testing hooks (tests/chaos); both are off unless their variable is set.
CHAOS_PAUSE_ENV = "LAUNCH_CHAOS_PAUSE_S"
CHAOS_PRESAVE_ENV = "LAUNCH_CHAOS_PRESAVE_SAMPLES"


def chaos_pause_hook() -> Callable[..., None] | None:
    """With ``$LAUNCH_CHAOS_PAUSE_S`` > 0, a ``CheckpointManager(on_phase=...)`` hook that widens
    every intermediate on-disk state of a save: it sleeps that long before each phase acts
    (stage, write, manifest, rename, latest, each retention delete, committed), so the state
    the previous phase left lasts long enough for an outside SIGKILL to land in it. Timing
    only: what is written and trained is unchanged. ``None`` when the variable is unset."""
    pause = float(os.environ.get(CHAOS_PAUSE_ENV) or 0)
    if pause <= 0:
        return None

    def pause_before(phase: str, step: int, rank: int) -> None:
        time.sleep(pause)  # the manager calls it before each phase only

    return pause_before


def _chaos_presave_file(out: str | os.PathLike, rank: int) -> Any:
    """``<out>/presave.rank<r>.jsonl`` (line-buffered) when ``$LAUNCH_CHAOS_PRESAVE_SAMPLES=1``.

    ``samples.rank<r>.jsonl`` is written after ``maybe_save``: a kill after the commit but
    before that record would lose the ids of a step the checkpoint contains. This file gets
    the same ``{"step", "ids"}`` record before the save.
    """
    if os.environ.get(CHAOS_PRESAVE_ENV) != "1":
        return None
    return open(Path(out) / f"presave.rank{rank}.jsonl", "a", buffering=1, encoding="utf-8")


class Records:
    """Append-only JSONL outputs of one rank (see the module docstring)."""

    def __init__(self, out: str | os.PathLike, rank: int) -> None:
        self.out, self.rank = Path(out), rank
        self.out.mkdir(parents=True, exist_ok=True)
        # Line-buffered: every record reaches the OS at once, so a SIGKILL loses none.
        self._samples = open(self.out / f"samples.rank{rank}.jsonl", "a", buffering=1, encoding="utf-8")
        self._metrics = self._events = None
        if rank == 0:
            self._metrics = open(self.out / "metrics.jsonl", "a", buffering=1, encoding="utf-8")
            self._events = open(self.out / "events.jsonl", "a", buffering=1, encoding="utf-8")

    def samples(self, step: int, ids: list[int]) -> None:
        self._samples.write(json.dumps({"step": step, "ids": ids}) + "\n")

    def metrics(self, **record: Any) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")

    def event(self, name: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"event": name, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        for f in (self._samples, self._metrics, self._events):
            if f is not None:
                f.close()


def train(job: Job) -> int:
    """Resume if a checkpoint exists, then train to ``train.steps``; returns the last step.

    Every rank calls this; it issues the same collectives in the same order on each.
    """
    cfg, g = job.cfg, job.cfg.data.global_batch_size
    records = Records(cfg.train.out, job.rank)
    presave = _chaos_presave_file(cfg.train.out, job.rank)
    job_info = {
        "corpus_fingerprint": corpus_fingerprint(job.dataset),
        "global_batch_size": g,
        "seq_len": cfg.data.seq_len,
    }
    hparams = {k: v for k, v in cfg.to_dict().items() if k in ("model", "data", "train")}
    hparams["train"] = {k: v for k, v in hparams["train"].items() if k != "out"}  # a path, not a hyper-parameter
    manager = CheckpointManager(
        cfg.checkpoint,
        model=job.model,
        optimizer=job.optimizer,
        lr_scheduler=job.scheduler,
        grad_scaler=job.scaler,
        dataloader=job.loader,
        extra_state={"sample_seeds": job.seed_stream, "job": job_info, "hparams": hparams},
        on_phase=chaos_pause_hook(),
        probe=probe_on_fixed_batch(job),
    )
    records.event(
        "start",
        world_size=job.world_size,
        dataset_len=len(job.dataset),
        steps_per_epoch=job.steps_per_epoch,
        num_parameters=job.num_parameters,
        config=cfg.to_dict(),
        **job_info,
    )
    t_start = time.perf_counter()
    load_start = time.time()
    state = manager.load()
    load_end = time.time()
    step = samples = epoch = 0
    if state is not None:
        _check_resumable(
            manager.extra_state["job"],
            job_info,
            state.global_samples_seen,
            state.step,
            keep_local_batch=cfg.checkpoint.elastic.batch_policy == "keep_local_batch",
        )
        step, samples, epoch = state.step, state.global_samples_seen, state.epoch
        logger.info(
            "resumed from step %d (%s, saved by %s ranks, now %d ranks)",
            step,
            state.checkpoint_path,
            state.saved_world_size,
            job.world_size,
        )
        records.event(
            "resumed",
            step=step,
            checkpoint_path=state.checkpoint_path,
            saved_world_size=state.saved_world_size,
            world_size=job.world_size,
            probe_loss_saved=state.probe_loss,
            probe_loss_loaded=state.probe_loss_loaded,
            batch_change=state.batch_change,
            **_recovery_fields(manager, state.checkpoint_path, load_start, load_end),
        )
    if step >= cfg.train.steps:
        logger.info("checkpoint step %d >= train.steps=%d: nothing to train", step, cfg.train.steps)
    job.model.train()
    t_prev = time.perf_counter()
    while step < cfg.train.steps:
        pass_start = step  # a pass over the loader runs to the end of the current epoch
        for batch in job.loader:
            seeds = job.seed_stream.draw(g, rank=job.rank, world_size=job.world_size)
            local_loss, grad_norm, lr = train_step(job, batch, seeds)
            loss = global_mean(local_loss, job.world_size)
            step, samples = step + 1, samples + g
            step_seconds = time.perf_counter() - t_prev
            if presave is not None:
                presave.write(json.dumps({"step": step, "ids": batch["sample_id"].tolist()}) + "\n")
            # epoch, batch_in_epoch and global_samples_seen: derived from the sampler's position
            saved = manager.maybe_save(
                step, loss=loss, last_step=step == cfg.train.steps, global_tokens_seen=samples * cfg.data.seq_len
            )
            ckpt_seconds = manager.last_save_seconds if saved else 0.0
            if saved:
                records.event("checkpoint", step=step, seconds=ckpt_seconds)
            records.samples(step, batch["sample_id"].tolist())
            records.metrics(
                step=step,
                loss=loss,
                lr=lr,
                grad_norm=grad_norm,
                global_samples_seen=samples,
                world_size=job.world_size,
                step_seconds=step_seconds,
                checkpoint_seconds=ckpt_seconds,
                epoch=epoch,
                time=time.time(),
                worker_start=TIMES["worker_start"],
                **({} if manager.memory is None else {"snapshot_stall_s": manager.memory.last_stall_s}),
            )
            if step % cfg.train.log_every == 0 or step == cfg.train.steps or step == pass_start + 1:
                logger.info(
                    "step %5d/%d  loss %.4f  lr %.2e  |g| %s  %.0f ms/step  ckpt %.2f s  epoch %d",
                    step,
                    cfg.train.steps,
                    loss,
                    lr,
                    "-" if grad_norm is None else f"{grad_norm:.3f}",
                    1000 * step_seconds,
                    ckpt_seconds,
                    epoch,
                )
            t_prev = time.perf_counter()
            if manager.preempted:  # SIGTERM on some rank: all ranks saved this step and stop
                logger.warning("preempted: checkpoint of step %d committed, stopping", step)
                records.event("preempted", step=step)
                break
            if step >= cfg.train.steps:
                break
        else:
            epoch += 1  # the pass ran to the epoch's end: the next one is the next epoch's
        if manager.preempted:
            break
        if step == pass_start:
            raise RuntimeError("the dataloader yielded no batch: dataset smaller than one global batch?")
    manager.close()
    records.event("end", step=step, seconds=time.perf_counter() - t_start)
    records.close()
    if presave is not None:
        presave.close()
    return step


def _recovery_fields(
    manager: CheckpointManager, path: str | None, load_start: float, load_end: float
) -> dict[str, Any]:
    """The ``resumed`` event's recovery fields (module doc). Collective when a memory restore served
    (every rank then has ``manager.loader.restored``): the ranks' received bytes are summed."""
    tier, restored = manager.loader.tier, manager.loader.restored
    between = None
    if tier == "memory" and restored is not None:
        received = torch.tensor([restored.bytes_received], dtype=torch.int64)
        dist.all_reduce(received)
        between = int(received.item())
    from_root = 0 if tier == "memory" else _checkpoint_bytes(path)
    return {
        "tier": tier,
        "bytes_read_from_root": from_root,
        "bytes_between_nodes": between,
        "worker_start": TIMES["worker_start"],
        "group_ready": TIMES.get("group_ready"),
        "load_start": load_start,
        "load_end": load_end,
    }


def _checkpoint_bytes(path: str | None) -> int | None:
    """Bytes of the files of the checkpoint directory ``path`` (``None``: not a local directory)."""
    if path is None or not os.path.isdir(path):
        return None
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def probe_on_fixed_batch(job: Job, windows: int = 8) -> Callable[[nn.Module], torch.Tensor]:
    """distckpt's loss probe: the mean loss on ``windows`` windows spread evenly over the dataset
    (the same batch on every rank and world size; distckpt runs it in eval mode, no grad)."""
    n = len(job.dataset)
    items = [job.dataset[i * n // windows] for i in range(windows)]
    x = torch.stack([item["input_ids"] for item in items]).to(job.device)
    y = torch.stack([item["targets"] for item in items]).to(job.device)

    def probe(model: nn.Module) -> torch.Tensor:
        # The uncompiled module (the same parameters, already in eval mode): an eval-mode call of
        # the compiled one would compile a second graph.
        return job.wrapped(x, y)[1]

    return probe


def _check_resumable(
    saved: dict[str, Any], live: dict[str, Any], samples_seen: int, step: int, *, keep_local_batch: bool = False
) -> None:
    """Refuse to continue on different data: the sample order would silently change. With
    ``keep_local_batch`` the global batch may differ (distckpt carries the position over in samples)."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
        for k, v in live.items()
        if saved.get(k) != v and not (keep_local_batch and k == "global_batch_size")
    ]
    if diffs:
        raise ConfigError(
            "the checkpoint was written by a run on different data or batching ("
            + "; ".join(diffs)
            + "); resume with the same data.* settings or start "
            "from a fresh checkpoint.root"
        )
    if not keep_local_batch and samples_seen != step * live["global_batch_size"]:
        raise ConfigError(
            f"checkpoint at step {step} saw {samples_seen} samples, expected "
            f"{step} * global_batch_size={step * live['global_batch_size']}"
        )


def _init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the torchrun process group: NCCL on this rank's GPU when CUDA is there, else gloo."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "launch/train.py is a torchrun entry point: torchrun --nproc-per-node N "
            "launch/train.py --config launch/configs/ddp.yaml"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def _setup_logging(rank: int) -> None:
    # torchdata 0.11 calls a deprecated torch API on every iterator; the warning is noise here.
    warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
    # Rank 0 tells the story; other ranks speak up only for warnings and errors.
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: torchrun --nproc-per-node 2 launch/train.py --config "
        "launch/configs/ddp.yaml train.steps=40 checkpoint.root=/tmp/ckpt",
    )
    parser.add_argument("--config", required=True, help="job YAML (launch/configs/*.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, e.g. train.steps=40 checkpoint.schedule.interval_steps=10",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point on every rank; returns the process exit code."""
    args = _parse_args(argv)
    try:
        cfg = load_job_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, world_size, device = _init_distributed(cfg.train.dist_timeout_s)
    TIMES["group_ready"] = time.time()
    _setup_logging(rank)
    try:
        job = build_job(cfg, rank, world_size, device)
        if rank == 0:
            logger.info(
                "%s on %d ranks (%s): %.2f M parameters, %d samples of %d bytes, G=%d, %d steps/epoch",
                cfg.train.wrapper + ("+compile" if cfg.train.compile else ""),
                world_size,
                device.type,
                job.num_parameters / 1e6,
                len(job.dataset),
                cfg.data.seq_len,
                cfg.data.global_batch_size,
                job.steps_per_epoch,
            )
        train(job)
    except (ConfigError, DistCkptError) as e:
        logger.error("rank %d: %s", rank, e)
        dist.destroy_process_group()
        return 1
    except Exception:
        # A peer died (a crash, a lost node): torchrun restarts the workers once this one exits. A
        # normal exit tears the process groups down, which waits until dist_timeout_s for sends
        # still queued to the dead peer (the memory tier's replication round); leave at once.
        logger.exception("rank %d: training failed; exiting now so that torchrun restarts the workers", rank)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Every rank got here: leave together (a gloo group torn down while a peer still uses it, or
    # left to the interpreter's exit, has aborted a rank with -6 here).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
