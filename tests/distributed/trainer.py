"""A tiny but complete training job used by the distributed tests.

Dropout, AdamW, warmup+cosine LambdaLR, a GradScaler, and a StatefulDataLoader over a
ReshardableSampler: everything whose state a resume must restore exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from distckpt import (
    CheckpointConfig,
    CheckpointManager,
    LoadConfig,
    ReshardableSampler,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
)


class Net(nn.Module):
    def __init__(self, width: int = 16, dtype: torch.dtype = torch.float32, rename: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width, dtype=dtype)
        self.drop = nn.Dropout(0.2)
        setattr(self, "hidden2" if rename else "hidden", nn.Linear(width, width, dtype=dtype))
        self.out = nn.Linear(width, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden2 if hasattr(self, "hidden2") else self.hidden
        return self.out(self.drop(torch.relu(hidden(self.drop(torch.relu(self.inp(x)))))))


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "id": torch.tensor(i)}


def build(rank: int, world_size: int, opts: dict[str, Any]):
    """Model (wrapped per ``opts['wrapper']``), optimizer, scheduler, scaler, loader.

    ``opts['device'] == 'cuda'``: the model on this rank's current GPU (the harness's
    ``backend='nccl'`` sets it), deterministic algorithms on, a CUDA GradScaler.
    """
    torch.manual_seed(0)
    device = torch.device(opts.get("device", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.use_deterministic_algorithms(True)
    model = Net(
        width=opts.get("width", 16), rename=opts.get("rename", False), dtype=opts.get("dtype", torch.float32)
    ).to(device)
    wrapper = opts.get("wrapper", "plain")
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=opts.get("ddp_fixed_buckets", False),
        )
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.inp, model.out):
            fully_shard(layer)
        fully_shard(model)
    elif wrapper == "fsdp1":  # needs an accelerator in torch 2.13
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=device, use_orig_params=True)
    if opts.get("compile"):
        model = torch.compile(model, backend=opts.get("compile_backend", "eager"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    total = 40
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    scaler = torch.amp.GradScaler(device.type, init_scale=opts.get("init_scale", 2.0**8), growth_interval=2)
    dataset = Points()
    G = opts.get("global_batch_size", 8)
    sampler = ReshardableSampler(len(dataset), global_batch_size=G, rank=rank, world_size=world_size, seed=7)
    loader = StatefulDataLoader(
        dataset, batch_size=G // world_size, sampler=sampler, num_workers=opts.get("num_workers", 0)
    )
    return model, optimizer, scheduler, scaler, loader


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    batch: dict[str, torch.Tensor],
    amp: bool = False,
) -> torch.Tensor:
    """One step on ``batch`` (MSE, GradScaler, optimizer, scheduler); returns the loss (0-d float32).

    The batch goes to the model's device; ``amp``: the forward under fp16 autocast (CUDA).
    """
    device = next(model.parameters()).device
    x, y = batch["x"].to(device), batch["y"].to(device)
    with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    scheduler.step()
    return loss


def train(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Resume if possible, train until ``opts['until']`` steps; return losses, ids and params.

    ``opts``: root, until, interval_steps, wrapper, compile, keep_last, plus ``build`` options.
    """
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=opts.get("interval_steps", 3)),
        retention=RetentionConfig(keep_last=opts.get("keep_last", 3), keep_every_steps=opts.get("keep_every_steps")),
        save=SaveConfig(state_dict_type=opts.get("state_dict_type", "sharded")),
        load=LoadConfig(
            fast_reader=opts.get("fast_load", LoadConfig.fast_reader),
            fallback_to_older=opts.get("fallback_to_older", False),
            path=opts.get("load_path"),
        ),
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    state = manager.load()
    step = state.step if state else 0
    losses, ids, scales = {}, {}, {}
    model.train()
    while step < opts["until"]:
        for batch in loader:
            loss = optimizer_step(model, optimizer, scheduler, scaler, batch, amp=opts.get("amp", False))
            step += 1
            global_loss = loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(global_loss)
                global_loss /= world_size
            losses[step] = global_loss.item()
            ids[step] = batch["id"].tolist()
            scales[step] = scaler.get_scale()
            manager.maybe_save(step, loss=losses[step], last_step=step == opts["until"])
            if step == opts["until"] or step == opts.get("crash_at"):
                break
        if step == opts.get("crash_at"):
            break
    manager.close()
    release_workers(loader)
    return {
        "losses": losses,
        "ids": ids,
        "resumed_from": state.step if state else None,
        "params": full_params(model),
        "scale": scaler.get_scale(),
        "scales": scales,
        "lr": scheduler.get_last_lr(),
    }


def crash(manager: Any) -> None:
    """The process "dies" here without ``close()``: its files stay (memory snapshots, slots) and the
    manager lets go of the root, as a dead process does, so the next manager of this process on the
    root is the restarted job's (an open manager's root is refused: ``CheckpointLockedError``). Leaving
    a ``with`` block by an exception does the same."""
    manager.__exit__(RuntimeError, RuntimeError("crashed"), None)


def release_workers(loader: StatefulDataLoader) -> None:
    """Shut down the loader's worker processes now. Tests run several jobs in one process; a
    loader and its iterator form a reference cycle, and an iterator the cyclic GC collects
    waits 5 s per worker for a shutdown message its finalized queue never delivers
    (torchdata 0.11 internals; a training process keeps its loader to the end)."""
    shut_down = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
    if callable(shut_down):
        shut_down()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optim(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def with_sections(config: CheckpointConfig, sections: dict[str, dict[str, Any]]) -> CheckpointConfig:
    """``config`` with the fields ``sections`` names (``{"retention": {"keep_last": 1}}``) replaced."""
    return dataclasses.replace(
        config, **{name: dataclasses.replace(getattr(config, name), **fields) for name, fields in sections.items()}
    )


def make_manager(rank: int, world_size: int, opts: dict[str, Any]):
    model, optimizer, scheduler, scaler, loader = build(rank, world_size, opts)
    config = CheckpointConfig(
        root=opts["root"],
        schedule=ScheduleConfig(interval_steps=None),
        save=SaveConfig(state_dict_type=opts.get("state_dict_type", "sharded")),
        load=LoadConfig(
            fast_reader=opts.get("fast_load", LoadConfig.fast_reader),
            fallback_to_older=opts.get("fallback_to_older", False),
            path=opts.get("load_path"),
        ),
    )
    config = with_sections(config, opts.get("config", {}))
    manager = CheckpointManager(
        config,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader if opts.get("with_loader", True) else None,
    )
    return manager, model, optimizer, scheduler, scaler, loader


def train_steps(model, optimizer, scheduler, scaler, loader, n: int) -> list[float]:
    losses = []
    it = iter(loader)
    for _ in range(n):
        batch = next(it)
        loss = optimizer_step(model, optimizer, scheduler, scaler, batch)
        losses.append(loss.item())
    return losses


def save_after(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Train ``opts['steps']`` steps, save, return full params and optimizer state."""
    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    train_steps(model, optimizer, scheduler, scaler, loader, opts.get("steps", 3))
    manager.save(opts.get("steps", 3))
    manager.close()
    return {"params": full_params(model), "optim": full_optim(model, optimizer)}


def load_report(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Load, return full params/optimizer state and the loaded TrainState."""
    manager, model, optimizer, scheduler, scaler, loader = make_manager(rank, world_size, opts)
    state = manager.load()
    out = {
        "state": state,
        "params": full_params(model),
        "optim": full_optim(model, optimizer),
        "lr": scheduler.get_last_lr(),
        "scale": scaler.get_scale(),
    }
    manager.close()
    return out
