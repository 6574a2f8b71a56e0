"""A resume with a different global batch size: the step rule and the LR scheduler.

With ``CheckpointConfig.elastic.batch_policy = "keep_local_batch"`` the data position is carried over
in samples by :class:`~distckpt.data.ReshardableSampler`; this module applies
``CheckpointConfig.elastic.step_rule`` to the step counter and the LR scheduler, and describes what
was done (one INFO line on rank 0, and ``TrainState.batch_change``, which the manifests of the
run's next saves record):

* ``keep``: step and scheduler are left as saved.
* ``rescale``: ``step = global_samples_seen // new_global_batch`` (MiniMind's
  ``s * W_saved // W_now``, generalised to samples), and the scheduler is moved by the same
  number of steps: forward by calling ``step()`` that many times, backward by replaying it
  from its start (``initial_lr``, ``last_epoch = -1``). With one ``scheduler.step()`` per
  optimizer step (``last_epoch == step``) its LR is then what an uninterrupted run with the
  same scheduler has after the new step count. The optimizer's own state (AdamW's per-parameter
  step) is not touched.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from .._errors import IncompatibleCheckpointError

__all__ = ["apply_step_rule", "move_scheduler"]

logger = logging.getLogger(__name__)


def apply_step_rule(
    train_state: Any,
    scheduler: Any,
    *,
    global_batch: tuple[int, int],
    world_size: tuple[int, int],
    batch_policy: str,
    step_rule: str,
    rank: int,
) -> dict[str, Any]:
    """Apply ``step_rule`` after the data position was carried over to another global batch.

    Args:
        train_state: the restored :class:`~distckpt._state.train_state.TrainState` (its ``step`` may change).
        scheduler: the live LR scheduler (already loaded), or ``None``.
        global_batch: ``(saved, now)`` global batch sizes.
        world_size: ``(saved, now)`` world sizes.
        batch_policy, step_rule: from the config.
        rank: this rank (rank 0 logs).

    Returns:
        The record for the log and the manifest: ``batch_policy``, ``step_rule``,
        ``global_batch_before/after``, ``world_size_before/after``, ``step_before/after``,
        ``global_samples_seen``.

    Raises:
        IncompatibleCheckpointError: ``rescale`` with a scheduler that cannot be moved (see
            :func:`move_scheduler`).
    """
    before = train_state.step
    after = train_state.global_samples_seen // global_batch[1] if step_rule == "rescale" else before
    if after != before and scheduler is not None:
        move_scheduler(scheduler, after - before)
    train_state.step = after
    record = {
        "batch_policy": batch_policy,
        "step_rule": step_rule,
        "global_batch_before": global_batch[0],
        "global_batch_after": global_batch[1],
        "world_size_before": world_size[0],
        "world_size_after": world_size[1],
        "step_before": before,
        "step_after": after,
        "global_samples_seen": train_state.global_samples_seen,
    }
    if rank == 0:
        how = (
            f"floor({train_state.global_samples_seen} samples / {global_batch[1]})"
            if step_rule == "rescale"
            else "kept"
        )
        lr = (
            f", LR scheduler moved {after - before:+d} steps (lr {scheduler.get_last_lr()[0]:.6g})"
            if after != before and scheduler is not None and hasattr(scheduler, "get_last_lr")
            else ""
        )
        logger.info(
            "batch_policy=%s: global batch %d -> %d (world size %d -> %d), data position carried over "
            "in samples (%d seen); step_rule=%s: step %d -> %d (%s)%s",
            batch_policy,
            global_batch[0],
            global_batch[1],
            world_size[0],
            world_size[1],
            train_state.global_samples_seen,
            step_rule,
            before,
            after,
            how,
            lr,
        )
    return record


def move_scheduler(scheduler: Any, delta: int) -> None:
    """Move ``scheduler`` by ``delta`` steps, as if ``step()`` had been called ``delta`` more (or,
    when negative, fewer) times since its construction.

    Forward: ``step()`` ``delta`` times (any scheduler whose LR depends on the count of calls).
    Backward: every group's ``lr`` back to its ``initial_lr``, ``last_epoch = -1``, the
    constructor's initial step, then ``step()`` ``last_epoch + delta`` times: what the
    constructor and the training loop did.

    Raises:
        IncompatibleCheckpointError: moving backward a scheduler that replay cannot rebuild:
            not a ``torch.optim.lr_scheduler.LRScheduler``, ``ReduceLROnPlateau`` (its LR follows
            the metrics), ``SequentialLR``/``ChainedScheduler`` (their children hold state), or a
            target before its first step.
    """
    lrs = torch.optim.lr_scheduler
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        if delta >= 0:
            for _ in range(delta):
                scheduler.step()
            return
        target = getattr(scheduler, "last_epoch", -1) + delta
        if (
            not isinstance(scheduler, lrs.LRScheduler)
            or target < 0
            or isinstance(scheduler, (lrs.ReduceLROnPlateau, lrs.SequentialLR, lrs.ChainedScheduler))
        ):
            raise IncompatibleCheckpointError(
                f"step_rule='rescale' moves the step counter back by {-delta} steps, but the LR scheduler "
                f"{type(scheduler).__name__} (last_epoch={getattr(scheduler, 'last_epoch', None)}) cannot be "
                "replayed to that step. Use step_rule: keep, or a torch LRScheduler other than "
                "ReduceLROnPlateau, SequentialLR and ChainedScheduler"
            )
        for group in scheduler.optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        scheduler.last_epoch = -1
        # What the constructor does (torch 2.13): its first step() in "initial" mode, in which
        # recursive schedulers (ExponentialLR, ...) keep the initial LR.
        scheduler._initial_step()
        for _ in range(target):
            scheduler.step()
