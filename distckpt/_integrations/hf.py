"""The Hugging Face ``Trainer`` saving and resuming through distckpt (docs/integrations.md).

``DistckptTrainer`` is a ``transformers.Trainer`` whose checkpoints are distckpt's: every save the
Trainer decides on (``save_strategy`` / ``save_steps``, the last step) and every save distckpt's
own schedule or a SIGTERM asks for goes through a :class:`~distckpt.CheckpointManager` (atomic
commit, hashes, async with ``async_save.mode``), and ``train()`` resumes from the root's newest
checkpoint: model, optimizer, LR scheduler, every rank's RNG, the Trainer's state (step, epoch,
log history, best metric) and the data position.

Exact mid-epoch resume without replay. The Trainer's own resume re-creates the data loader and
skips the batches already trained on in the epoch (``accelerate.skip_first_batches``: each
skipped batch is loaded and collated again, a cost that grows with the position in the epoch;
measured exact on the default ``RandomSampler`` with the same global batch, docs/integrations.md).
Here the training loader is a ``StatefulDataLoader`` over a
:class:`~distckpt.ReshardableSampler` (global batch ``per_device_train_batch_size x world size``),
restored at its position: the first batch after a resume is the one the uninterrupted run takes,
and at another world size the global batches go on where they stopped (each sample once).

How the Trainer's loop is used (transformers 5.x): ``train()`` is called with
``resume_from_checkpoint=None`` underneath, so the Trainer neither loads its own checkpoint
files nor skips batches; ``on_train_begin`` (after the model is wrapped and the optimizer and
scheduler exist, before the first ``iter(loader)``) builds the manager and loads; ``on_step_end``
calls ``maybe_save``; ``_save_checkpoint`` saves through the manager; ``on_train_end`` closes it.
After a mid-epoch resume the Trainer's epoch counter restarts at 0 and its loop asks the
exhausted loader for the rest of that epoch (it gets nothing), so ``max_steps`` ends training
(set ``max_steps``; with ``num_train_epochs`` only, the Trainer's count sets the same
``max_steps``); ``state.epoch`` is set from the sampler at each step.

Not supported (``ConfigError`` at ``train()``): ``gradient_accumulation_steps > 1``, an
``IterableDataset``, DeepSpeed, and ``load_best_model_at_end`` (it reads the Trainer's own
checkpoint directories).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .._config import CheckpointConfig
from .._config_sections import LoadConfig, RetentionConfig, ScheduleConfig
from .._data import ReshardableSampler, make_stateful_dataloader
from .._errors import ConfigError
from .._manager import CheckpointManager

__all__ = ["DistckptTrainer", "TrainerStateAdapter"]

logger = logging.getLogger(__name__)

# TrainerState fields a resume takes from the checkpoint; the others (max_steps, logging/eval/
# save steps, batch size) are the resuming run's own.
_RESTORED: tuple[str, ...] = (
    "global_step",
    "epoch",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "num_input_tokens_seen",
    "stateful_callbacks",
)


class TrainerStateAdapter:
    """DCP ``Stateful`` view of a Trainer's ``TrainerState`` (saved as its JSON text).

    Args:
        trainer: the Trainer whose ``state`` is saved and restored in place.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """``{"json": TrainerState as JSON text}``."""
        return {"json": json.dumps(dataclasses.asdict(self.trainer.state), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the fields a resume takes from the checkpoint (``global_step``, ``epoch``,
        ``log_history``, best metric, ...) into the live ``TrainerState``."""
        saved = json.loads(state_dict["json"])
        for name in _RESTORED:
            if name in saved:
                setattr(self.trainer.state, name, saved[name])


class DistckptTrainer(Trainer):
    """``transformers.Trainer`` whose saves and resumes go through distckpt (module docstring).

    Every rank runs it under ``torchrun`` as it would run ``Trainer``.

    Args:
        *args, **kwargs: as ``Trainer``'s.
        checkpoint_config: distckpt's options (root, ``async_save``, retention, ...). ``None``:
            root ``<output_dir>/distckpt``, saves when the Trainer decides (``save_steps``,
            ``save_strategy``) and on SIGTERM, ``retention.keep_last = save_total_limit``.
        data_seed: seed of the :class:`~distckpt.ReshardableSampler`'s epoch permutations;
            ``None``: ``args.data_seed``, else ``args.seed``.

    Attributes:
        checkpoint_manager: the manager of the running ``train()`` (``None`` outside it).
        resumed_from: the ``TrainState`` the last ``train()`` resumed from, or ``None``.

    Raises:
        ConfigError: from ``train()``: an unsupported setting (module docstring), or
            distckpt's own configuration errors.
    """

    def __init__(
        self, *args: Any, checkpoint_config: CheckpointConfig | None = None, data_seed: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_config = checkpoint_config
        self.data_seed = data_seed
        self.checkpoint_manager: CheckpointManager | None = None
        self.resumed_from: Any = None
        self._resume_request: str | bool | None = None
        self.add_callback(_ManagerCallback(self))

    # ------------------------------------------------------------------ configuration
    def _config(self) -> CheckpointConfig:
        args = self.args
        config = self.checkpoint_config
        if config is None:
            retention = RetentionConfig(keep_last=args.save_total_limit) if args.save_total_limit else RetentionConfig()
            config = CheckpointConfig(
                root=os.path.join(args.output_dir or ".", "distckpt"),
                schedule=ScheduleConfig(interval_steps=None),
                retention=retention,
            )
        request = self._resume_request
        if isinstance(request, (str, os.PathLike)):  # a checkpoint of distckpt's, as load.path
            config = dataclasses.replace(config, load=dataclasses.replace(config.load, path=os.fspath(request)))
        elif request is False:
            config = dataclasses.replace(config, load=LoadConfig(enabled=False, on_existing=config.load.on_existing))
        return config

    def _check_supported(self) -> None:
        args = self.args
        problems = []
        if args.gradient_accumulation_steps != 1:
            problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} (needs 1)")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) or not hasattr(
            self.train_dataset, "__len__"
        ):
            problems.append("an IterableDataset or a dataset without __len__ (needs a map-style dataset)")
        if self.is_deepspeed_enabled:
            problems.append("DeepSpeed")
        if args.load_best_model_at_end:
            problems.append("load_best_model_at_end=True (it reads the Trainer's own checkpoint directories)")
        if problems:
            raise ConfigError(
                "DistckptTrainer does not support " + "; ".join(problems) + ": change these TrainingArguments, "
                "or use transformers.Trainer"
            )

    # ------------------------------------------------------------------ Trainer overrides
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As ``Trainer.train``; the checkpoint is distckpt's.

        Args:
            resume_from_checkpoint: ``None`` or ``True``: resume from the root's newest
                committed checkpoint if there is one (a restarted job resumes); a path: that
                checkpoint (``load.path``); ``False``: start fresh (``ConfigError`` when the root
                holds checkpoints, unless ``load.on_existing: archive``).

        Raises:
            ConfigError: an unsupported setting, or as :class:`~distckpt.CheckpointManager`.
            CheckpointCorruptError, IncompatibleCheckpointError: as ``CheckpointManager.load``.
        """
        self._check_supported()
        self._resume_request = resume_from_checkpoint
        try:
            return super().train(None, *args, **kwargs)
        except BaseException as e:
            # Local resources only (the lock, staging buffers, signal handlers): the other
            # ranks may not be here, so no collective teardown (CheckpointManager.__exit__).
            manager, self.checkpoint_manager = self.checkpoint_manager, None
            if manager is not None:
                try:
                    manager.__exit__(type(e), e, e.__traceback__)
                except Exception as cleanup:  # noqa: BLE001 - the training error is the one to raise
                    logger.warning("releasing the checkpoint manager after %r failed: %r", e, cleanup)
            raise

    def get_train_dataloader(self) -> Any:
        """A ``StatefulDataLoader`` over a :class:`~distckpt.ReshardableSampler` of the training
        set: ``per_device_train_batch_size`` per rank, the global order the same at every world
        size, the Trainer's collator (unused columns removed, as the Trainer does)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = self.args
        world_size, rank = max(args.world_size, 1), args.process_index
        seed = (
            self.data_seed
            if self.data_seed is not None
            else (args.data_seed if args.data_seed is not None else args.seed)
        )
        sampler = ReshardableSampler(
            len(self.train_dataset),  # type: ignore[arg-type]  # map-style: _check_supported
            global_batch_size=self._train_batch_size * world_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
        dataset = self.train_dataset
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        if type(dataset).__module__.startswith("datasets"):  # a datasets.Dataset: drop its unused columns
            dataset = self._remove_unused_columns(dataset, description="Training")
            collator = self.data_collator
        return make_stateful_dataloader(
            dataset,
            sampler,
            num_workers=args.dataloader_num_workers,
            collate_fn=collator,
            pin_memory=args.dataloader_pin_memory,
        )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        manager = self.checkpoint_manager
        if manager is None:
            raise ConfigError("DistckptTrainer: a save outside train() (no checkpoint manager is open)")
        step = self.state.global_step
        if manager.last_saved_step != step:  # maybe_save already saved this step
            manager.save(step)

    # ------------------------------------------------------------------ callback hooks
    def _open_manager(self, train_dataloader: Any) -> None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer
        manager = CheckpointManager(
            self._config(),
            model=self.model_wrapped,
            optimizer=optimizer,
            lr_scheduler=self.lr_scheduler,
            grad_scaler=getattr(self.accelerator, "scaler", None),
            dataloader=train_dataloader,
            extra_state={"hf_trainer_state": TrainerStateAdapter(self)},
        )
        self.checkpoint_manager = manager
        try:
            self.resumed_from = manager.load()
        except BaseException:
            manager.close()
            self.checkpoint_manager = None
            raise
        if self.resumed_from is not None:
            step = self.resumed_from.step
            self.state.global_step = step
            # Loss logging and the final train_loss count from the resumed step.
            self._globalstep_last_logged = self._initial_global_step = step

    def _after_step(self, state: TrainerState) -> None:
        manager = self.checkpoint_manager
        assert manager is not None
        manager.maybe_save(state.global_step)
        loader = self.callback_handler.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ReshardableSampler):  # the Trainer's epoch count restarts after a resume
            per_epoch = sampler.num_global_batches * sampler.global_batch_size
            state.epoch = sampler.epoch + sampler.samples_consumed / per_epoch

    def _close_manager(self) -> None:
        manager, self.checkpoint_manager = self.checkpoint_manager, None
        if manager is not None:
            manager.close()


class _ManagerCallback(TrainerCallback):
    """Calls :class:`DistckptTrainer`'s manager at the Trainer's events (every rank)."""

    def __init__(self, trainer: DistckptTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.trainer._open_manager(kw["train_dataloader"])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.trainer._after_step(state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.trainer._close_manager()
