"""Deterministic distributed sampler whose position survives a world-size change.

Layout. With ``G = global_batch_size`` and ``B = dataset_len // G`` (the tail of
``dataset_len % G`` samples is dropped), epoch ``e`` shuffles ``range(dataset_len)``
with a ``torch.Generator`` seeded with ``(seed * 1_000_003 + e) % 2**63``. Global
batch ``k`` (``0 <= k < B``) is ``perm[k*G : (k+1)*G]``. Rank ``r`` of ``W`` yields
the contiguous slice ``perm[k*G + r*G/W : k*G + (r+1)*G/W]`` for ``k = 0, 1, ...``,
so it must be batched with ``batch_size = G // W``; concatenating the rank slices in
rank order gives the global batch for any ``W`` that divides ``G``.

State. ``state_dict()`` is ``{"seed", "epoch", "samples_consumed",
"global_batch_size", "dataset_len", "batch_offset", "samples_before_epoch"}`` where
``samples_consumed`` counts the global samples of complete global batches handed out in
``epoch`` (a multiple of ``G``, plus ``batch_offset``), and ``samples_before_epoch`` those of
all earlier epochs. It is identical on every rank and independent of rank and world size.
Handing out the last batch of an epoch moves the position to ``(epoch + 1, 0)``.

A different ``G`` (``batch_policy="keep_local_batch"``; the last two keys are optional, for
states saved before them). Saved at ``c`` samples of epoch ``e``, the epoch goes on at
``perm[c:]`` in global batches of the new ``G`` (``batch_offset = c % G``) for as long as a
whole one fits; the fewer than ``G`` samples left are the epoch's dropped tail, as ``N % G``
is in every epoch. Nothing consumed is handed out again and nothing is rounded away: the
epoch hands out ``perm[:c + k*G]``, each sample once. The next epoch starts at 0 again.

Same world size (per-rank loader state, ``torchdata`` ``StatefulDataLoader``)::

    sd = loader.state_dict()                       # save, on each rank
    sampler = ReshardableSampler(n, global_batch_size=G, rank=r, world_size=W, seed=s)
    loader = make_stateful_dataloader(dataset, sampler, num_workers=k)
    loader.load_state_dict(sd)                     # next batches continue exactly

World-size change (rebuild from the global state; the old per-rank loader state is
NOT loaded)::

    gsd = global_state_from_loader_state(loader.state_dict())   # any old rank
    sampler = ReshardableSampler(n, global_batch_size=G, rank=r_new,
                                 world_size=W_new, seed=s)
    sampler.load_state_dict(gsd)
    loader = make_stateful_dataloader(dataset, sampler, num_workers=k)

A new iterator of the loader (``iter(loader)`` again after a partial epoch: a peek, a warm-up,
a ``break``) goes on from the last batch the loader's previous iterator returned, not from
where its workers' prefetch had moved the sampler, when the sampler is attached to the loader
(:meth:`ReshardableSampler.attach_loader`; ``make_stateful_dataloader`` and
``CheckpointManager(dataloader=...)`` do it). A batch that ``next()`` returned counts as
consumed, wherever it went; nothing prefetched and not returned is skipped.

Why read the loader state rather than ``sampler.state_dict()``: with
``num_workers > 0`` the loader draws ``prefetch_factor * num_workers`` batches ahead,
so the sampler's own position runs ahead of what training consumed. The loader
records the sampler state right after drawing each batch and keeps the one of the
last consumed batch, which ``global_state_from_loader_state`` reads. With ``num_workers == 0``
nothing is prefetched and ``sampler.global_state()`` is the same value.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from .workers import SigtermSafeWorkerInit

_KEYS = ("seed", "epoch", "samples_consumed", "global_batch_size", "dataset_len")  # required; optional:
# "batch_offset" (0) and "samples_before_epoch" (epoch * whole-batch samples per epoch), added with batch_policy


def epoch_seed(seed: int, epoch: int) -> int:
    """Generator seed of ``epoch``: ``(seed * 1_000_003 + epoch) % 2**63``."""
    return (seed * 1_000_003 + epoch) % 2**63


def check_world_size(global_batch_size: int, world_size: int) -> int:
    """Return the per-rank batch size ``global_batch_size // world_size``.

    Raises:
        ValueError: if either is not positive, or ``world_size`` does not divide
            ``global_batch_size``; the message lists the world sizes that do.
    """
    if global_batch_size <= 0 or world_size <= 0:
        raise ValueError(f"global_batch_size ({global_batch_size}) and world_size ({world_size}) must be positive")
    if global_batch_size % world_size:
        ok = [w for w in range(1, global_batch_size + 1) if global_batch_size % w == 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}; "
            f"world sizes that divide it: {ok}"
        )
    return global_batch_size // world_size


class ReshardableSampler(Sampler[int]):
    """Per-rank view of a seeded, epoch-wise global order of whole global batches.

    Args:
        dataset_len: number of samples in the dataset (``>= global_batch_size``).
        global_batch_size: ``G``, samples per optimizer step summed over all ranks.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ``W``; must divide ``G``.
        seed: base seed; see :func:`epoch_seed`.

    Raises:
        ValueError: on a bad world size (see :func:`check_world_size`), rank, or
            ``dataset_len < global_batch_size`` (an epoch would be empty).
    """

    def __init__(self, dataset_len: int, *, global_batch_size: int, rank: int, world_size: int, seed: int = 0) -> None:
        self.local_batch_size = check_world_size(global_batch_size, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        if dataset_len < global_batch_size:
            raise ValueError(
                f"dataset_len={dataset_len} < global_batch_size={global_batch_size}: "
                "an epoch would hold no global batch"
            )
        self.dataset_len, self.global_batch_size = dataset_len, global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_global_batches = dataset_len // global_batch_size
        self._epoch, self._consumed = 0, 0
        self._offset, self._before = 0, 0  # this epoch's batch grid start; samples of earlier epochs
        self._live: Optional[_RankIterator] = None  # the only iterator allowed to move the position
        self._loader: Optional[weakref.ReferenceType] = None  # attach_loader(): a new iterator rewinds to it

    epoch = property(lambda self: self._epoch, doc="Current epoch.")
    samples_consumed = property(
        lambda self: self._consumed, doc="Global samples of whole global batches handed out this epoch."
    )
    samples_seen = property(
        lambda self: self._before + self._consumed,
        doc="Global samples handed out since epoch 0 (all epochs, whatever their G).",
    )

    def permutation(self, epoch: int) -> torch.Tensor:
        """Global order of ``epoch``: int64 tensor of shape ``(dataset_len,)``."""
        g = torch.Generator()
        g.manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=g)

    def rank_indices(self, epoch: int, start_batch: int = 0) -> List[int]:
        """This rank's indices of global batches ``start_batch..B-1`` of ``epoch``, in order."""
        return self.rank_indices_from(epoch, start_batch * self.global_batch_size)

    def rank_indices_from(self, epoch: int, start: int) -> List[int]:
        """This rank's indices of the global batches ``perm[start + k*G : start + (k+1)*G]`` of
        ``epoch`` that fit in it (``start`` in samples, any value in ``[0, dataset_len]``)."""
        g, b = self.global_batch_size, self.local_batch_size
        n = (self.dataset_len - start) // g
        grid = self.permutation(epoch)[start : start + n * g].reshape(n, g)
        return grid[:, self.rank * b : (self.rank + 1) * b].reshape(-1).tolist()

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the epoch.

        Attached to a loader whose previous iterator is unfinished, the position is first moved
        back to the last batch that iterator returned (its workers drew further ahead).
        """
        self._rewind_to_delivered()
        it = _RankIterator(self)
        self._live = it
        return it

    def attach_loader(self, loader: Any) -> None:
        """Let new iterators of ``loader`` (a torchdata ``StatefulDataLoader`` over this sampler)
        start at the last batch its previous, unfinished iterator returned. Keeps a weak reference.
        """
        self._loader = weakref.ref(loader)

    def _rewind_to_delivered(self) -> None:
        loader = self._loader() if self._loader is not None else None
        old = getattr(loader, "_iterator", None)  # torchdata 0.11: the loader's last iterator
        # _live is None after set_epoch / load_state_dict: the position was set explicitly, keep it.
        if (
            old is None
            or self._live is None
            or getattr(old, "_finished", True)
            or not callable(getattr(old, "state_dict", None))
        ):
            return
        try:
            delivered = global_state_from_loader_state(old.state_dict())
        except ValueError:  # the loader does not record this sampler's state (a custom batch_sampler)
            return
        self.load_state_dict(delivered)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_loader": None}  # a weak reference does not pickle

    def __len__(self) -> int:
        """Per-rank samples in a full epoch, ``B * G / W`` (not the remainder after a resume).

        A constant keeps ``len(loader)`` stable while prefetch moves the position.
        """
        return self.num_global_batches * self.local_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Jump to ``(epoch, 0)``; a no-op if already in ``epoch`` (so a resume keeps its place)."""
        if epoch != self._epoch:
            self._move(epoch, 0, before=epoch * self.num_global_batches * self.global_batch_size)

    def state_dict(self) -> Dict[str, Any]:
        """Global position; identical on every rank. See the module docstring for keys."""
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "samples_consumed": self._consumed,
            "global_batch_size": self.global_batch_size,
            "dataset_len": self.dataset_len,
            "batch_offset": self._offset,
            "samples_before_epoch": self._before,
        }

    def global_state(self) -> Dict[str, Any]:
        """Same as :meth:`state_dict`: what was handed out, which is what was consumed
        only without prefetch (``num_workers == 0``); else use
        :func:`global_state_from_loader_state`."""
        return self.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any], *, batch_policy: str = "keep_global_batch") -> None:
        """Restore a position saved under any rank / world size; the next ``__iter__``
        starts there. A position at the end of an epoch means the next epoch.

        Args:
            state_dict: from :meth:`state_dict` or :func:`global_state_from_loader_state`.
            batch_policy: ``"keep_local_batch"`` accepts a state saved with another
                ``global_batch_size`` and carries its position over in samples (module docstring).

        Raises:
            ValueError: missing keys, ``dataset_len``/``seed`` differing from this sampler,
                ``global_batch_size`` differing without ``keep_local_batch``, or
                ``samples_consumed`` not ``batch_offset`` plus a multiple of the saved ``G``
                in ``[0, dataset_len]`` (so not a whole number of per-rank batches).
        """
        if any(k not in state_dict for k in _KEYS):
            raise ValueError(f"sampler state {sorted(state_dict)} is missing keys of {list(_KEYS)}")
        keys = (
            ("dataset_len", "seed")
            if batch_policy == "keep_local_batch"
            else ("global_batch_size", "dataset_len", "seed")
        )
        for key in keys:
            if state_dict[key] != getattr(self, key):
                hint = (
                    " (batch_policy='keep_local_batch' carries the position over to another global batch)"
                    if key == "global_batch_size"
                    else ""
                )
                raise ValueError(
                    f"cannot load sampler state: saved {key}={state_dict[key]}, "
                    f"this sampler has {key}={getattr(self, key)}{hint}"
                )
        saved_g, consumed, epoch = state_dict["global_batch_size"], state_dict["samples_consumed"], state_dict["epoch"]
        offset = state_dict.get("batch_offset", 0)
        if (
            not 0 <= offset < saved_g
            or (consumed - offset) % saved_g
            or not 0 <= consumed <= self.dataset_len
            or epoch < 0
        ):
            raise ValueError(
                f"samples_consumed={consumed} (epoch={epoch}, batch_offset={offset}) is not a whole number "
                f"of global batches of {saved_g} in [0, {self.dataset_len}], so it cannot be split into "
                f"per-rank batches of {self.local_batch_size} for world_size={self.world_size}"
            )
        before = state_dict.get("samples_before_epoch", epoch * (self.dataset_len // saved_g) * saved_g)
        if consumed + self.global_batch_size > self.dataset_len:  # no whole batch left: the epoch's end
            epoch, before, consumed = epoch + 1, before + consumed, 0
        self._move(epoch, consumed, before=before)

    def _move(self, epoch: int, consumed: int, *, before: int) -> None:
        self._epoch, self._consumed, self._before = epoch, consumed, before
        self._offset = consumed % self.global_batch_size  # 0 unless a changed G left the grid off it
        self._live = None  # iterators already handed out no longer describe the position


class _RankIterator(Iterator[int]):
    """Iterator over one epoch's remainder; advances the sampler per whole batch."""

    def __init__(self, sampler: ReshardableSampler) -> None:
        self._s = sampler
        self._epoch, self._start, self._before = sampler.epoch, sampler.samples_consumed, sampler._before
        self._indices: Optional[List[int]] = None  # built lazily: loaders often discard the first iter
        self._i = 0

    def __iter__(self) -> "_RankIterator":
        return self

    def __next__(self) -> int:
        s = self._s
        if self._indices is None:
            self._indices = s.rank_indices_from(self._epoch, self._start)
        if self._i >= len(self._indices):
            raise StopIteration
        idx = self._indices[self._i]
        self._i += 1
        # Move the position before returning a batch's last index: the loader snapshots
        # the sampler right after drawing a batch, so the snapshot must include it.
        if self._i % s.local_batch_size == 0 and s._live is self:
            consumed = self._start + self._i // s.local_batch_size * s.global_batch_size
            if consumed + s.global_batch_size > s.dataset_len:  # no whole batch left: next epoch
                s._epoch, s._consumed, s._offset, s._before = self._epoch + 1, 0, 0, self._before + consumed
            else:
                s._consumed = consumed
        return idx


def global_state_from_loader_state(loader_state: Dict[str, Any]) -> Dict[str, Any]:
    """Global sampler position of the last batch a ``StatefulDataLoader`` returned.

    Args:
        loader_state: ``loader.state_dict()`` of a torchdata 0.11 ``StatefulDataLoader``
            built with ``sampler=ReshardableSampler`` and ``batch_size=G // W``, any
            ``num_workers`` and ``snapshot_every_n_steps``.

    Returns:
        A dict for :meth:`ReshardableSampler.load_state_dict` (any world size).

    Raises:
        ValueError: if the loader state holds no sampler state.
    """
    if "_snapshot" in loader_state:  # num_workers > 0: snapshot of the main process + steps after
        main = loader_state["_snapshot"]["_main_snapshot"]
        steps = loader_state.get("_steps_since_snapshot", 0)
    else:  # num_workers == 0: no prefetch, the live state is the consumed state
        main, steps = loader_state, 0
    sd = (main.get("_sampler_iter_state") or {}).get("sampler_state")
    if not isinstance(sd, dict) or any(k not in sd for k in _KEYS):
        raise ValueError(
            "loader state holds no ReshardableSampler state; build the loader with "
            "sampler=ReshardableSampler(...) and batch_size=G // W"
        )
    sd = dict(sd)
    g, n = sd["global_batch_size"], sd["dataset_len"]
    sd.setdefault("batch_offset", 0)
    sd.setdefault("samples_before_epoch", sd["epoch"] * (n // g) * g)
    consumed = sd["samples_consumed"] + steps * g  # batches returned since the snapshot
    if consumed + g > n:  # they finished the epoch
        sd["samples_before_epoch"] += consumed
        sd["epoch"], sd["batch_offset"], consumed = sd["epoch"] + 1, 0, 0
    sd["samples_consumed"] = consumed
    return sd


def make_stateful_dataloader(
    dataset: Dataset, sampler: ReshardableSampler, num_workers: int = 0, **kwargs: Any
) -> StatefulDataLoader:
    """``StatefulDataLoader`` with ``batch_size = G // W`` for ``sampler``; ``kwargs`` pass through.

    With ``num_workers > 0`` the workers ignore SIGTERM (``SigtermSafeWorkerInit`` wraps any
    ``worker_init_fn`` given): a SIGTERM to the process group, as torchrun sends it, leaves
    them alive until the preemption save is done and the loader shuts them down. The sampler
    is attached to the loader (:meth:`ReshardableSampler.attach_loader`).
    """
    if num_workers > 0:
        kwargs["worker_init_fn"] = SigtermSafeWorkerInit(kwargs.get("worker_init_fn"))
    with warnings.catch_warnings():  # torchdata 0.11's constructor calls torch 2.13's deprecated set_vital
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        loader = StatefulDataLoader(
            dataset, batch_size=sampler.local_batch_size, sampler=sampler, num_workers=num_workers, **kwargs
        )
    sampler.attach_loader(loader)
    return loader
