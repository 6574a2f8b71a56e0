"""The whole training state as one DCP state_dict, and its restoration (docs/design.md, section 5).

Layout of the DCP state_dict (top-level keys; nested dicts are flattened by DCP with dots)::

    model          {fqn: Tensor | DTensor}                  via get_state_dict (clean keys)
    optim          {"state": {fqn: {...}}, "param_groups"}  via get_state_dict
    lr_scheduler   bytes   (all ranks equal; DCP keeps one copy)
    grad_scaler    bytes
    extra          {name: Stateful.state_dict() | bytes}
    extra_empty_dicts  bytes  {name: [path, ...]}: the empty dicts of those state_dicts, saved as None
                   (DCP would drop them); absent when there are none
    train_state    bytes   rank 0 only: counters + bounded loss history
    rank_state     {"rank<r>": {"rng": bytes, "dataloader": bytes}}   each rank its own key

Non-tensor values are packed with ``torch.save`` into ``bytes`` leaves so that DCP treats them
as opaque items (their inner structure may change between save and load) and they are read
back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .._adapters import (
    ModelOptimState,
    put_empty_dicts,
    specs_of,
    with_saved_keys,
    with_saved_optim_keys,
    without_empty_dicts,
)
from .._config import LOADABLE, ElasticConfig
from .._data.reshard import DataLoaderState
from .._engine.torch_format.flatten import flatten_state_dict
from .._errors import IncompatibleCheckpointError
from .._ondisk.manifest import TensorSpec, is_extra_state
from .._ondisk.safe_values import check_loadable
from .guard import MutationGuard
from .packing import Packed, pack, take, unpack
from .rebatch import apply_step_rule
from .rng import capture_rng, derive_rng, restore_rng
from .train_state import TrainState

__all__ = ["CheckpointState", "GUARDED_PARTS", "WEIGHTS_ONLY_KEY"]

GUARDED_PARTS = ("model", "optim.state")
"""The parts of :meth:`CheckpointState.for_save`'s state_dict (a top-level key, or ``key.subkey``)
that hold the model's state and the optimizer's per-parameter state: only tensors the mutation
guard protects, in dicts only ``optimizer.step()`` changes, when ``model_optim.live`` (the param
groups are not among them: a scheduler may change a tensor learning rate in place before it)."""

WEIGHTS_ONLY_KEY = "imported"
"""Key that ``distckpt import`` writes: the checkpoint holds model weights and counters only."""

EMPTY_DICTS_KEY = "extra_empty_dicts"  # {extra_state name: [path, ...]}: the empty dicts of a Stateful's state

logger = logging.getLogger(__name__)


class CheckpointState:
    """Builds the DCP state_dict to save and the target to load into, then restores.

    Args:
        model, optimizer, lr_scheduler, grad_scaler, dataloader: live training objects
            (``None`` where absent); ``dataloader`` must have ``state_dict``/``load_state_dict``
            (torchdata ``StatefulDataLoader``).
        extra_state: ``{name: Stateful | plain value}``; plain values must be made of
            containers, primitives and tensors.
        rank, world_size: of the training process group.
        elastic: ``CheckpointConfig.elastic``: ``seed`` (base seed for ranks that have no saved RNG
            state), ``batch_policy`` and ``step_rule`` (a resume with another global batch).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Stateful | None = None,
        grad_scaler: Stateful | None = None,
        dataloader: Stateful | None = None,
        extra_state: dict[str, Any] | None = None,
        rank: int,
        world_size: int,
        elastic: ElasticConfig | None = None,
    ) -> None:
        self.model_optim = ModelOptimState(model, optimizer)
        self.guard = MutationGuard(model, optimizer)  # copies in flight end before the state they copy changes
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.data = DataLoaderState(dataloader, rank=rank) if dataloader is not None else None
        self.extra_state = dict(extra_state or {})
        self.rank, self.world_size = rank, world_size
        self.imported: dict[str, Any] | None = None  # distckpt import's source: saved as WEIGHTS_ONLY_KEY
        elastic = elastic if elastic is not None else ElasticConfig()
        self.seed, self.batch_policy, self.step_rule = elastic.seed, elastic.batch_policy, elastic.step_rule
        self.weights_only = False  # set by for_load: an imported checkpoint (model weights only)
        self.select: frozenset[str] = frozenset(LOADABLE)  # set by for_load: the parts to restore
        self._live_model_sd: dict[str, Any] = {}  # optimizer-only load: the model's own state
        self.tied_from: dict[str, str] = {}  # set by for_load: {tied key the checkpoint lacks: twin}
        # set by for_save: the flat keys whose replicated copy must be rank 0's (DDP's broadcast buffers)
        self.rank0_items: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ save
    def for_save(
        self,
        train_state: TrainState,
        *,
        full_state_dict: bool,
        defer: bool = False,
        loader_state: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The state_dict every rank passes to ``dcp.save``. Collective under FSDP.

        Args:
            full_state_dict: FULL model/optimizer gathered to rank 0 instead of SHARDED.
            defer: the non-tensor values as :class:`~distckpt._state.packing.Packed` (checked and
                taken now, serialized by whoever writes them) instead of ``bytes``: a memory-tier
                snapshot serializes them on its worker thread.
            loader_state: the data loader's ``state_dict()`` when the caller already read it at
                this step (:meth:`loader_state`); read here otherwise.

        A DDP wrapper that broadcasts rank 0's buffers at each forward makes rank 0's the state:
        the other ranks leave those buffers out of a durable save's state_dict, so DCP writes rank
        0's; a memory snapshot keeps them on every rank (its placement must see the same items
        everywhere) and :attr:`rank0_items` names them for it.

        Raises:
            TypeError: a value that ``load()`` could not read back (named, with its type).
        """

        def value(obj: Any, what: str = "value", *, check: bool = True, fresh: bool = False) -> bytes | Packed:
            return take(obj, what, check=check, fresh=fresh) if defer else pack(obj, what, check=check)

        model_sd, optim_sd = self.model_optim.state_dict_for_save(full_state_dict=full_state_dict)
        self.guard.hold_forward = self.model_optim.buffered  # a copy of buffers may be in flight after this
        rank0 = self.model_optim.rank0_keys(model_sd) if not full_state_dict and self.world_size > 1 else ()
        self.rank0_items = frozenset(f"model.{k}" for k in rank0)
        if rank0 and self.rank != 0 and not defer:  # DCP writes each replicated item once, from a rank holding it
            model_sd = {k: v for k, v in model_sd.items() if k not in rank0}
        sd: dict[str, Any] = {"model": model_sd}
        if self.model_optim.optimizer is not None:
            sd["optim"] = optim_sd
        sd.update(self._global_parts(for_load=False, select=frozenset(LOADABLE), value=value))
        if self.data is not None and loader_state is None:
            loader_state = self.data.local_state()
        if self.rank == 0:
            # numbers and strings (record()), in new containers
            sd["train_state"] = value(train_state.to_saved(), check=False, fresh=True)
            if self.imported is not None:  # weights only: a load restores the model alone
                sd[WEIGHTS_ONLY_KEY] = value(self.imported, check=False)
            if self.data is not None:
                sd["data"] = value(self.data.global_state(loader_state), "dataloader")
        own = {"rng": value(capture_rng(), check=False, fresh=True)}
        if self.data is not None:
            own["dataloader"] = value(loader_state, "dataloader")
        sd["rank_state"] = {f"rank{self.rank}": own}
        return sd

    def loader_state(self) -> dict[str, Any] | None:
        """The data loader's ``state_dict()`` now (``None`` without a loader): read once per save and
        passed to :meth:`derive_counters` and :meth:`for_save`."""
        return None if self.data is None else self.data.local_state()

    def _global_parts(
        self, *, for_load: bool, select: frozenset[str], value: Callable[..., bytes | Packed] = pack
    ) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        if self.lr_scheduler is not None and "lr_scheduler" in select:
            sd["lr_scheduler"] = b"" if for_load else value(self.lr_scheduler.state_dict(), "lr_scheduler")
        if self.grad_scaler is not None and "grad_scaler" in select:
            sd["grad_scaler"] = b"" if for_load else value(self.grad_scaler.state_dict(), "grad_scaler")
        if self.extra_state and "extra_state" in select:
            sd["extra"], empty = {}, {}
            for name, obj in self.extra_state.items():
                what = f"extra_state[{name!r}]"
                if isinstance(obj, Stateful):  # DCP saves its non-tensor leaves; load() must read them
                    sd["extra"][name] = obj.state_dict()
                    if not for_load:
                        check_loadable(sd["extra"][name], f"{what}.state_dict()")
                        sd["extra"][name], paths = without_empty_dicts(sd["extra"][name], f"{what}.state_dict()")
                        if paths:
                            empty[name] = paths
                else:
                    sd["extra"][name] = b"" if for_load else value(obj, what)
            if empty:
                sd[EMPTY_DICTS_KEY] = value(empty, check=False, fresh=True)  # str and int paths
        return sd

    def derive_counters(
        self, train_state: TrainState, *, explicit: set[str], loader_state: dict[str, Any] | None = None
    ) -> None:
        """Set ``epoch``, ``batch_in_epoch`` and ``global_samples_seen`` of ``train_state`` from
        the loader's consumed :class:`~distckpt.data.ReshardableSampler` position (in
        ``loader_state`` when given: :meth:`loader_state`), except those in ``explicit`` (passed
        by the caller). No-op without a ReshardableSampler.

        Never raises: a loader whose state cannot be read fails in :meth:`for_save`, where the
        failure is gathered from every rank.
        """
        if self.data is None or self.data.sampler() is None:
            return
        try:
            counters = self.data.counters(loader_state) or {}
        except Exception as e:  # noqa: BLE001 - reported by for_save on every rank
            logger.debug("counters not derived from the sampler: %s", e)
            return
        for name, value in counters.items():
            if name not in explicit:
                setattr(train_state, name, value)

    # ------------------------------------------------------------------ load
    def for_load(
        self,
        checkpoint_keys: set[str],
        saved_world_size: int,
        select: frozenset[str] = frozenset(LOADABLE),
        *,
        metadata: Any = None,
        fits: Callable[[dict[str, TensorSpec]], None] = lambda live: None,
    ) -> dict[str, Any]:
        """Target state_dict for ``dcp.load``; call inside ``self.model_optim.load_context()``.

        Args:
            checkpoint_keys: flattened keys in the checkpoint's DCP metadata.
            saved_world_size: world size recorded in the manifest.
            select: the parts to read and restore (:data:`~distckpt._config.LOADABLE`); the
                others are neither read nor required in the checkpoint, and keep their live state.
            metadata: the checkpoint's DCP ``Metadata``: each ``Stateful`` in ``extra_state`` is
                read with every key saved under its name, also those its fresh ``state_dict()``
                lacks (an EMA's shadow filled at its first update); tensors among them are read
                onto the model's device, full size.
            fits: called with ``{fqn: TensorSpec}`` of the live model (global shapes and dtypes)
                before any key is checked; raises where the checkpoint does not fit it.

        Raises:
            IncompatibleCheckpointError: what ``fits`` raises; live optimizer/components the checkpoint lacks,
                optimizer state in the checkpoint for parameters the live optimizer lacks, or
                keys saved under a ``Stateful`` that cannot be read back (``metadata`` absent).
        """
        self.weights_only = WEIGHTS_ONLY_KEY in checkpoint_keys
        self.select, self.tied_from = select, {}
        if self.weights_only:
            sd: dict[str, Any] = {"model": self.model_optim.model_target_for_load(), "train_state": b""}
            fits(specs_of(sd["model"]))
            self._read_tied_from_twins(sd["model"], checkpoint_keys)
            _check_keys(sd, checkpoint_keys, rank=self.rank)
            return sd
        load_data = self.data is not None and "dataloader" in select
        if load_data:
            assert self.data is not None
            self.data.check_no_live_iterator(self.rank)
        load_optim = self.model_optim.optimizer is not None and "optimizer" in select
        # Without the optimizer, DCP's get_state_dict would give it state (a dummy step): skip it.
        model_sd, optim_sd = (
            self.model_optim.target_for_load() if load_optim else (self.model_optim.model_target_for_load(), {})
        )
        fits(specs_of(model_sd))  # the layout of the target itself: no state_dict of its own
        sd = {}
        if "model" in select:
            self._read_tied_from_twins(model_sd, checkpoint_keys)
            self.model_optim.extra_state_as_saved(model_sd, metadata)
            sd["model"] = model_sd
        else:
            self._live_model_sd = model_sd
        if load_optim:
            _prune_uninitialised_optim_state(optim_sd, checkpoint_keys)
            if metadata is not None:  # group keys added in training, state a fresh optimizer lacks
                with_saved_optim_keys(optim_sd, metadata, self.model_optim.device())
            sd["optim"] = optim_sd
        sd.update(self._global_parts(for_load=True, select=select))
        if "extra" in sd and EMPTY_DICTS_KEY in checkpoint_keys:
            sd[EMPTY_DICTS_KEY] = b""
        stateful = [name for name, obj in self.extra_state.items() if isinstance(obj, Stateful) and "extra" in sd]
        for name in stateful if metadata is not None else ():  # also the keys its fresh state_dict() lacks
            sd["extra"][name] = with_saved_keys(sd["extra"][name], ("extra", name), metadata, self.model_optim.device())
        if "counters" in select:
            sd["train_state"] = b""
        same_world = saved_world_size == self.world_size
        if load_data and "data" in checkpoint_keys:  # also for a num_workers change
            sd["data"] = b""
        if self.rank < saved_world_size:
            own: dict[str, Any] = {"rng": b""} if "rng" in select else {}
            if load_data and same_world:
                own["dataloader"] = b""
            if own:
                sd["rank_state"] = {f"rank{self.rank}": own}
        _check_keys(sd, checkpoint_keys, rank=self.rank, stateful=tuple(f"extra.{name}." for name in stateful))
        return sd

    def _read_tied_from_twins(self, model_sd: dict[str, Any], checkpoint_keys: set[str]) -> None:
        """Drop from the load target each tied key the checkpoint lacks when it has the key's
        twin (Hugging Face ``save_pretrained`` writes ``lm_head.weight`` only as the embedding):
        both names are one tensor, so reading the twin fills it. :meth:`restore` puts it back."""
        self.tied_from = {}
        for key in list(model_sd):
            if f"model.{key}" in checkpoint_keys:
                continue
            twin = next((t for t in self.model_optim.ties.get(key, []) if f"model.{t}" in checkpoint_keys), None)
            if twin is not None and twin in model_sd:
                del model_sd[key]
                self.tied_from[key] = twin
        if self.tied_from and self.rank == 0:
            logger.info(
                "tied weights absent from the checkpoint, read from their twin: %s",
                ", ".join(f"{k} <- {t}" for k, t in self.tied_from.items()),
            )

    def restore(self, sd: dict[str, Any], *, saved_world_size: int) -> TrainState:
        """Apply a loaded state_dict to the live objects; call inside ``load_context()``."""
        for key, twin in self.tied_from.items():  # the same tensor under both names (strict apply)
            sd["model"][key] = sd["model"][twin]
        if self.weights_only:
            return self._restore_weights_only(sd)
        if "model" in sd or "optim" in sd:
            self.model_optim.apply(sd.get("model", self._live_model_sd), sd.get("optim"))
        self._live_model_sd = {}
        if "lr_scheduler" in sd:
            assert self.lr_scheduler is not None
            self.lr_scheduler.load_state_dict(unpack(sd["lr_scheduler"]))
        if "grad_scaler" in sd:
            assert self.grad_scaler is not None
            self.grad_scaler.load_state_dict(unpack(sd["grad_scaler"]))
        empty = unpack(sd[EMPTY_DICTS_KEY]) if EMPTY_DICTS_KEY in sd else {}
        for name, obj in self.extra_state.items() if "extra" in sd else ():
            value = sd["extra"][name]
            if isinstance(obj, Stateful):
                put_empty_dicts(value, empty.get(name, []))
                obj.load_state_dict(value)
            else:
                self.extra_state[name] = unpack(value)
        train_state = TrainState(**unpack(sd["train_state"])) if "train_state" in sd else TrainState()
        train_state.loss_history = [(step, loss) for step, loss in train_state.loss_history]  # lists once saved
        own = sd.get("rank_state", {}).get(f"rank{self.rank}")
        batch_change = None
        if self.data is not None and "dataloader" in self.select:
            local = unpack(own["dataloader"]) if own is not None and "dataloader" in own else None
            global_ = unpack(sd["data"]) if "data" in sd else None
            batch_change = self.data.restore(
                local,
                global_,
                rank=self.rank,
                world_size=self.world_size,
                saved_world_size=saved_world_size,
                batch_policy=self.batch_policy,
            )
        # RNG last: nothing above may consume random numbers after it.
        if "rng" not in self.select:
            pass  # the live RNG stays (the selection is logged by the loader)
        elif own is not None:
            restore_rng(unpack(own["rng"]))
        else:
            derived = derive_rng(self.seed, self.rank, train_state.step)
            logger.warning(
                "rank %d did not exist at save (saved world size %d): RNG derived from "
                "(seed=%d, rank=%d, step=%d) -> %d",
                *(self.rank, saved_world_size, self.seed, self.rank, train_state.step, derived),
            )
        if batch_change is not None:  # after the RNG: moving the scheduler draws no random numbers
            train_state.batch_change = apply_step_rule(
                train_state,
                self.lr_scheduler,
                global_batch=batch_change,
                world_size=(saved_world_size, self.world_size),
                batch_policy=self.batch_policy,
                step_rule=self.step_rule,
                rank=self.rank,
            )
        return train_state

    def _restore_weights_only(self, sd: dict[str, Any]) -> TrainState:
        self.model_optim.apply(sd["model"], None)
        train_state = TrainState(**unpack(sd["train_state"]))
        train_state.loss_history = [(step, loss) for step, loss in train_state.loss_history]  # lists once saved
        derived = derive_rng(self.seed, self.rank, train_state.step)
        parts = (
            ("optimizer", self.model_optim.optimizer),
            ("lr_scheduler", self.lr_scheduler),
            ("grad_scaler", self.grad_scaler),
            ("dataloader", self.data),
        )
        fresh = [name for name, obj in parts if obj is not None]
        fresh += [f"extra_state[{name!r}]" for name in self.extra_state]
        logger.warning(
            "rank %d: checkpoint holds model weights only (made by `distckpt import`): %s start "
            "fresh; RNG derived from (seed=%d, rank=%d, step=%d) -> %d",
            self.rank,
            ", ".join(fresh) or "nothing else",
            self.seed,
            self.rank,
            train_state.step,
            derived,
        )
        return train_state


def _prune_uninitialised_optim_state(optim_sd: dict[str, Any], checkpoint_keys: set[str]) -> None:
    """Drop optimizer state the checkpoint does not have: DCP's dummy-step initialisation of
    parameters that had no state at save (saved before their first update)."""
    state = optim_sd.get("state", {})
    for fqn in list(state):
        if not any(f"optim.state.{fqn}.{name}" in checkpoint_keys for name in state[fqn]):
            del state[fqn]


def _check_keys(
    target: dict[str, Any], checkpoint_keys: set[str], *, rank: int, stateful: tuple[str, ...] = ()
) -> None:
    flat, _ = flatten_state_dict(target)
    missing = sorted(k for k in flat if k not in checkpoint_keys)
    unexpected = sorted(
        k for k in checkpoint_keys if k.startswith("optim.state.") and k not in flat and "optim" in target
    )
    unread = sorted(k for k in checkpoint_keys if k.startswith(stateful) and k not in flat)
    extra = sorted(k for k in checkpoint_keys if k.startswith("model.") and is_extra_state(k) and k not in flat)
    extra = extra if "model" in target else []
    if missing or unexpected or unread or extra:
        lines = [f"checkpoint does not match the live training state (rank {rank}):"]
        lines += [f"  missing in checkpoint: {k}" for k in missing[:50]]
        lines += [
            f"  in checkpoint, not in the live optimizer (parameter frozen or not optimized?): {k}"
            for k in unexpected[:50]
        ]
        lines += [f"  in checkpoint, not in the extra_state object's state_dict(): {k}" for k in unread[:50]]
        lines += [f"  in checkpoint, not in the live model (a module's get_extra_state()): {k}" for k in extra[:50]]
        lines.append(
            "Pass the same components (optimizer, lr_scheduler, grad_scaler, dataloader, "
            "extra_state) as the run that saved, or start from a fresh root."
        )
        raise IncompatibleCheckpointError("\n".join(lines), missing=missing, unexpected=unexpected + unread + extra)
