"""A torchtitan checkpointer backend on distckpt (docs/integrations.md, "torchtitan").

torchtitan (0.3) picks its checkpointer by config class: ``Trainer.Config.checkpoint`` is a
``BaseCheckpointManager.Config``, and ``config.checkpoint.build(dataloader=, model_parts=,
optimizers=, lr_schedulers=, states=, sd_adapter=, base_folder=)`` constructs the class that
declares it (``torchtitan/components/checkpointer/base.py``). Setting it to
``DistckptCheckpointManager.Config(...)`` makes the job checkpoint through a
:class:`~distckpt.CheckpointManager`: atomic commits, hashes checked on load, resharding to
another world size, async saves, SIGTERM saves.

What maps onto what:

=====================  ====================================================================
torchtitan             distckpt
=====================  ====================================================================
MODEL                  ``model`` (the one model part; FSDP2 / DDP / plain / compiled)
OPTIMIZER              ``optimizer`` (the container's one torch optimizer)
LR_SCHEDULER           ``lr_scheduler`` (the ``LRSchedulersContainer``, a ``Stateful``)
DATALOADER             ``dataloader`` when it is a ``StatefulDataLoader``; else ``extra_state``
TRAIN_STATE, states    ``extra_state`` (``{"train_state": trainer}``: step, tokens seen)
folder                 ``root = base_folder/folder``
interval               ``schedule.interval_steps`` (``save`` is ``maybe_save``)
keep_latest_k          ``retention.keep_last`` (0: keep all)
load_step              ``load.step`` (``load(step)``'s argument wins)
initial_load_path      ``load.path`` (applies at the run's first start only)
initial_load_model_only  ``load.only: [model]`` with ``initial_load_path``
exclude_from_loading   ``load.exclude`` (a key of ``states``: all of ``extra_state``)
load_only              ``save.enabled: false`` (``save`` saves nothing)
=====================  ====================================================================

``last_save_model_only`` (torchtitan's default ``True``) is not honoured: the last checkpoint
holds the whole state like every other (``distckpt export`` writes model-only weights);
``last_save_in_hf``, ``initial_load_in_hf`` and ``create_seed_checkpoint`` are refused.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer.base import BaseCheckpointManager

from .._config import CheckpointConfig
from .._config_sections import AsyncSaveConfig, LoadConfig, RetentionConfig, SaveConfig, ScheduleConfig
from .._errors import ConfigError
from .._manager import CheckpointManager

__all__ = ["DistckptCheckpointManager"]

_BUILT_IN = {"optimizer": "optimizer", "lr_scheduler": "lr_scheduler", "dataloader": "dataloader"}


class DistckptCheckpointManager(BaseCheckpointManager):
    """torchtitan ``BaseCheckpointManager`` whose saves and loads go through distckpt (module
    docstring). Built by ``DistckptCheckpointManager.Config(...).build(...)`` on every rank, after
    ``init_process_group``, as torchtitan builds its own.

    Args:
        config: the :class:`Config` (torchtitan's checkpoint fields plus distckpt's).
        dataloader: torchtitan's data loader (``BaseDataLoader``), a ``StatefulDataLoader`` (a
            :class:`~distckpt.ReshardableSampler` makes its position reshardable), or ``None``.
        model_parts: the model, as one part (pipeline parallelism is refused).
        optimizers: an ``OptimizersContainer`` holding one optimizer, or a torch optimizer.
        lr_schedulers: an ``LRSchedulersContainer`` (any object with ``state_dict`` /
            ``load_state_dict``), or ``None``.
        states: further ``Stateful`` objects by name (torchtitan passes ``{"train_state": trainer}``).
        sd_adapter: torchtitan's Hugging Face state-dict adapter; unused (HF formats are refused).
        base_folder: torchtitan's dump folder; the root is ``base_folder/config.folder``.

    Raises:
        ConfigError: more than one model part or optimizer; from ``save``/``load``: as
            :class:`~distckpt.CheckpointManager`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint options plus distckpt's (each documented in place)."""

        async_mode: Literal["off", "thread", "process"] = "off"
        """distckpt's ``async_save.mode``: ``"off"`` (blocking), ``"thread"`` or ``"process"``."""

        background_staging: bool = False
        """distckpt's ``async_save.background_staging`` (the loop's ``maybe_wait_for_staging``
        before ``optimizers.step()`` is then required; torchtitan's trainer calls it)."""

        fallback_to_older: bool = False
        """distckpt's ``load.fallback_to_older``: a corrupt newest checkpoint falls back to the
        next older one (a warning names it) instead of raising."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            refused = [
                name
                for name in ("last_save_in_hf", "initial_load_in_hf", "create_seed_checkpoint")
                if getattr(self, name)
            ]
            if refused:
                raise ConfigError(
                    f"checkpoint.{', '.join(refused)}: not supported by the distckpt backend (Hugging Face "
                    "formats: `distckpt export`; seed checkpoints: torchtitan's own CheckpointManager)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.root = os.path.join(base_folder, config.folder) if base_folder else config.folder
        if len(model_parts) != 1:
            raise ConfigError(
                f"the distckpt checkpointer takes one model part, got {len(model_parts)} (pipeline parallelism "
                "is not supported): use torchtitan's CheckpointManager"
            )
        optimizer_list = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(optimizer_list) != 1:
            raise ConfigError(
                f"the distckpt checkpointer takes one optimizer, got {len(optimizer_list)} (one per model part "
                "or per optimizer name in optimizer.param_groups): use one"
            )
        self.model, self.optimizer, self.lr_schedulers = model_parts[0], optimizer_list[0], lr_schedulers
        self.extra_state = dict(states)
        self.dataloader = dataloader if isinstance(dataloader, StatefulDataLoader) else None
        if dataloader is not None and self.dataloader is None:
            self.extra_state["dataloader"] = dataloader  # a Stateful of its own
        self.manager: CheckpointManager | None = None
        self._load_step: int | None = None

    def checkpoint_config(self, step: int = -1) -> CheckpointConfig:
        """The :class:`~distckpt.CheckpointConfig` this backend runs (``step``: ``load``'s argument)."""
        c = self.config
        step = c.load_step if step is None or step < 0 else step
        exclude = sorted({_BUILT_IN.get(k, "extra_state") for k in c.exclude_from_loading}) or None
        only = ["model"] if c.initial_load_path and c.initial_load_model_only else None
        load = LoadConfig(
            step=step if step >= 0 else None,
            path=c.initial_load_path,
            only=only,
            exclude=None if only else exclude,
            fallback_to_older=c.fallback_to_older,
        )
        return CheckpointConfig(
            root=self.root,
            schedule=ScheduleConfig(interval_steps=c.interval),
            retention=RetentionConfig(keep_last=c.keep_latest_k or None),
            save=SaveConfig(enabled=not c.load_only),
            load=load,
            async_save=AsyncSaveConfig(mode=c.async_mode, background_staging=c.background_staging),
        )

    def _open(self, step: int) -> CheckpointManager:
        if self.manager is None:
            self.manager = CheckpointManager(
                self.checkpoint_config(step),
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_schedulers,
                dataloader=self.dataloader,
                extra_state=self.extra_state,
            )
            self._load_step = step
        elif step >= 0 and step != self._load_step:
            raise ConfigError(f"load(step={step}) after the checkpointer was opened for step {self._load_step}")
        return self.manager

    def _load(self, step: int = -1) -> bool:
        """Resume from the newest checkpoint of the root (``step`` >= 0: that step); ``False``
        when there is none. Every rank calls it."""
        return self._open(step).load() is not None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save when the schedule says (every ``interval`` steps, the last step, a SIGTERM, the
        first step with ``enable_first_step_checkpoint``); ``True`` when a save started."""
        if self.config.load_only:
            return False
        manager = self._open(-1)
        if self.config.enable_first_step_checkpoint and curr_step == 1:
            manager.save(curr_step)
            saved = True
        else:
            saved = manager.maybe_save(curr_step, last_step=last_step)
        if saved and self.config.async_mode != "off":
            self.save_future = Future()  # in flight until maybe_wait_for_saving
        return saved

    def _wait_for_saving(self) -> None:
        assert self.manager is not None
        try:
            self.manager.wait()
        finally:
            self.save_future = None

    def _maybe_wait_for_staging(self) -> None:
        if self.manager is not None:
            self.manager.wait_staged()

    def _close(self) -> None:
        manager, self.manager = self.manager, None
        self.save_future = None
        if manager is not None:
            manager.close()
