"""One rank's training objects and one optimizer step of ``launch/train.py``: the wrapped model
(DDP or FSDP2, compiled when configured), AdamW with warmup + cosine, the fp16 scaler, the
reshardable data loader, the per-sample dropout seeds (:class:`Job`, :func:`build_job`), and
:func:`train_step` with gradient accumulation.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn

from distckpt import ConfigError
from distckpt.data import ReshardableSampler, make_stateful_dataloader
from launch.config import JobConfig
from launch.data import ByteWindowDataset
from launch.model import GPT, SampleSeedStream, lr_lambda_warmup_cosine, num_parameters

__all__ = ["Job", "build_job", "global_mean", "train_step"]

logger = logging.getLogger("launch.train")  # the entry point's logger: one stream for the job


@dataclass
class Job:
    """Everything one rank trains with.

    Attributes:
        cfg: the job config.
        rank, world_size: of the default process group.
        device: CPU, or this rank's CUDA device.
        model: what ``forward`` is called on (the wrapper, compiled when configured).
        wrapped: the DDP module or FSDP2 root (gradient-sync control for accumulation).
        optimizer, scheduler: AdamW and its LambdaLR (warmup + cosine).
        scaler: ``torch.amp.GradScaler`` for fp16 on CUDA, else ``None``.
        dataset, loader: the byte windows and a ``StatefulDataLoader`` over a
            :class:`~distckpt.data.ReshardableSampler`.
        seed_stream: per-sample dropout seeds, identical on every rank.
        num_parameters: parameters of the unwrapped model (tied weights once).
    """

    cfg: JobConfig
    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    dataset: ByteWindowDataset
    loader: Any
    seed_stream: SampleSeedStream
    num_parameters: int

    @property
    def local_batch_size(self) -> int:
        return self.cfg.data.global_batch_size // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (the sampler drops the ``len % G`` tail)."""
        return len(self.dataset) // self.cfg.data.global_batch_size


def build_job(cfg: JobConfig, rank: int, world_size: int, device: torch.device) -> Job:
    """Build model (wrapped), optimizer, scheduler, scaler, data and seed stream on this rank.

    Raises:
        ConfigError: ``G`` not divisible by ``world_size * grad_accum_steps``.
    """
    g, accum = cfg.data.global_batch_size, cfg.train.grad_accum_steps
    if g % world_size or (g // world_size) % accum:
        raise ConfigError(
            f"data.global_batch_size={g} must be divisible by world_size={world_size} "
            f"times train.grad_accum_steps={accum}"
        )
    torch.manual_seed(cfg.train.seed)  # same init on every rank (FSDP2 shards it as is)
    model = GPT(cfg.model).to(device)
    n_params = num_parameters(model)  # before FSDP2 turns parameters into local shards
    if cfg.train.wrapper == "ddp":
        # DDP rebuilds its buckets in gradient-ready order after a process's first iteration,
        # so a resumed process would reduce one step with a layout the uninterrupted run never
        # used; with 3+ ranks the sum order, and so the last bits, change. Turning the rebuild
        # off (find_unused_parameters) keeps one layout for the whole run.
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.train.ddp_fixed_buckets,
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the root group holds embeddings, tied head and final norm
        wrapped = model
    forward_model = wrapped
    if cfg.train.compile:  # an OptimizedModule, an nn.Module to the caller
        forward_model = cast(nn.Module, torch.compile(wrapped, backend=cfg.train.compile_backend))

    # No weight decay on biases and LayerNorm weights (1-D), the usual GPT recipe.
    params = [p for p in wrapped.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
    fn = lr_lambda_warmup_cosine(cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)

    def lr_of_next_step(completed: int) -> float:
        return fn(completed + 1)  # step k (1-based) trains at lr * fn(k): no wasted lr=0 step

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_of_next_step)
    scaler = None
    if cfg.train.amp == "fp16":
        if device.type == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        else:
            logger.warning("train.amp=fp16 does nothing on CPU: training in float32 without a GradScaler")

    dataset = ByteWindowDataset(seq_len=cfg.data.seq_len, max_bytes=cfg.data.max_bytes)
    sampler = ReshardableSampler(
        len(dataset), global_batch_size=g, rank=rank, world_size=world_size, seed=cfg.data.seed
    )
    loader = make_stateful_dataloader(
        dataset, sampler, num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda"
    )
    return Job(
        cfg=cfg,
        rank=rank,
        world_size=world_size,
        device=device,
        model=forward_model,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        dataset=dataset,
        loader=loader,
        seed_stream=SampleSeedStream(cfg.train.seed),
        num_parameters=n_params,
    )


@contextlib.contextmanager
def _grad_sync(wrapped: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else wrapped.no_sync():
            yield
    else:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(wrapped, FSDPModule), type(wrapped)
        wrapped.set_requires_gradient_sync(enabled)
        yield


def train_step(
    job: Job, batch: dict[str, torch.Tensor], seeds: torch.Tensor
) -> tuple[torch.Tensor, float | None, float]:
    """One optimizer step on this rank's ``G / W`` samples, split into micro-batches.

    Args:
        job: the rank's training objects.
        batch: ``input_ids``/``targets`` int64 ``[G/W, T]``.
        seeds: int64 ``[G/W]`` per-sample dropout seeds.

    Returns:
        ``(local_loss, grad_norm, lr)``: the mean loss over this rank's samples (float32
        scalar on ``job.device``, detached), the global gradient norm before clipping
        (``None`` without clipping) and the learning rate this step used.
    """
    accum, scaler = job.cfg.train.grad_accum_steps, job.scaler
    amp = scaler is not None
    inputs = batch["input_ids"].to(job.device, non_blocking=True).chunk(accum)
    targets = batch["targets"].to(job.device, non_blocking=True).chunk(accum)
    local_loss = torch.zeros((), device=job.device)
    for i, (x, y, s) in enumerate(zip(inputs, targets, seeds.chunk(accum))):
        with _grad_sync(job.wrapped, enabled=i == accum - 1), torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            _, loss = job.model(x, y, sample_seeds=s)
            scaled = loss / accum
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        local_loss += loss.detach().float() / accum
    grad_norm = None
    if job.cfg.train.grad_clip is not None:
        if scaler is not None:
            scaler.unscale_(job.optimizer)  # clip the true gradients
        norm = nn.utils.clip_grad_norm_(job.wrapped.parameters(), job.cfg.train.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = job.optimizer.param_groups[0]["lr"]
    if scaler is not None:
        scaler.step(job.optimizer)
        scaler.update()
    else:
        job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return local_loss, grad_norm, lr


def global_mean(value: torch.Tensor, world_size: int) -> float:
    """Mean of a scalar over all ranks, reduced in float64 (every rank has ``G/W`` samples)."""
    total = value.detach().double().clone()
    dist.all_reduce(total)
    return (total / world_size).item()
