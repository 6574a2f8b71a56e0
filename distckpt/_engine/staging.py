"""Staging that reuses the previous save's staged state_dict: from the second save on, only
the tensor copies remain.

DCP's ``DefaultStager`` reuses its CPU buffers across saves (cached per source storage), but it
still rebuilds the staged state_dict object by object on every save: a new tensor per leaf
(``new_empty`` + ``set_``) and, for a ``DTensor``, a ``copy.deepcopy``-style reconstruction of
the wrapper and its spec. With a few hundred leaves that Python work costs about as much as the
copy itself, and it runs inside the training loop's stall (or, with background staging, holds
the GIL against the training thread). :class:`ReusingStager` lets ``DefaultStager`` stage the
first save (and any save whose structure changed), remembers which staged tensor each leaf
landed in, and on later saves copies each source tensor straight into that tensor.

A leaf is reused when its path in the state_dict and its layout match the previous save:
type, dtype, shape, stride, storage offset, device type, and for a ``DTensor`` also its mesh,
placements and global shape; and leaves that shared one staged buffer at the first save (tied
weights) must still come from one source storage. Any mismatch (a new parameter group, a
resized tensor, weights untied, an object the walk does not know) stages the whole save through
``DefaultStager`` again. A leaf a save no longer has releases its buffer. Non-tensor leaves
(counters, loader state, strings) are deep-copied on every save.

Reusing the staged objects is safe because at most one save is in flight: the next save starts
only after the previous write finished (``CheckpointManager.save`` waits for it).
"""

from __future__ import annotations

import collections
import contextlib
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

__all__ = ["ReusingStager"]

# A leaf's path in the nested state_dict: the keys / indices from the root.
_Path = tuple[Any, ...]
# Per leaf path: (source layout, staged leaf as returned, its local tensor that receives the copy).
_Target = tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]
# Containers rebuilt as their own type; any other subclass goes to DefaultStager.
_MAPPINGS = (dict, collections.OrderedDict)


def _layout(t: torch.Tensor) -> tuple[tuple[Any, ...], torch.Tensor]:
    """``(what must match for a staged tensor to receive this tensor's bytes again, the local
    tensor whose bytes are copied)``; call under ``no_grad`` (``to_local`` is then free)."""
    if isinstance(t, DTensor):
        key, local = _layout(t.to_local())
        return (DTensor, t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride(), key), local
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device.type), t


class _Miss(Exception):
    """The state_dict no longer matches the cached staged one (raised inside the fast walk)."""


class ReusingStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that keeps the staged state_dict between saves.

    Args:
        options: as for DCP's ``DefaultStager`` (pinned memory and non-blocking copies on CUDA,
            shared memory for the process executor, ``use_async_staging`` for a background
            copy). The first save, and any save whose structure changed, is staged by a
            ``DefaultStager`` built with these options.

    ``stage`` returns the staged state_dict, or with ``use_async_staging`` a ``Future`` of it
    (``dcp.async_save`` then reports it as ``AsyncSaveResponse.staging_completion``). Errors of
    the copy are raised from ``stage`` or set on that future.
    """

    _synchronize_after_execute = False

    def __init__(self, options: StagingOptions) -> None:
        self.options = options
        self._inner = DefaultStager(options)
        self._staged: Any = None  # the last staged state_dict, reused by the next save
        self._targets: dict[_Path, _Target] = {}
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="distckpt-stage")
            if options.use_async_staging
            else None
        )
        # Made on the caller's thread (as DefaultStager does): a background copy must not run
        # on the training thread's current stream.
        self._stream = torch.Stream() if options.use_async_staging and options.use_non_blocking_copy else None
        self.reused_saves = 0  # saves staged into the previous save's tensors (tests, logs)

    # ------------------------------------------------------------------ AsyncStager
    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        """Stage ``state_dict`` (a copy safe from later in-place updates); see the class doc."""
        if self._staged is not None and self._executor is not None:
            return self._executor.submit(self._reuse_or_restage, state_dict)
        if self._staged is not None:
            return self._reuse_or_restage(state_dict)
        return self._restage(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: completion is the future ``stage`` returns (DCP's non-deprecated contract)."""

    def close(self) -> None:
        """Release the staged buffers and the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._staged, self._targets = None, {}
        self._inner.close()

    # ------------------------------------------------------------------ internals
    def _restage(self, state_dict: Any) -> Any:
        """Stage through ``DefaultStager`` and remember where every tensor leaf landed."""
        result = self._inner.stage(state_dict)
        if not isinstance(result, Future):
            self._remember(state_dict, result)
            return result
        out: Future = Future()

        def done(f: Future) -> None:
            try:
                staged = f.result()
                self._remember(state_dict, staged)
                out.set_result(staged)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                out.set_exception(e)

        result.add_done_callback(done)
        return out

    @torch.no_grad()
    def _remember(self, source: Any, staged: Any) -> None:
        targets: dict[_Path, _Target] = {}
        try:
            self._walk_pairs(source, staged, (), targets)
        except _Miss:  # a shape the walk does not follow: no reuse, DefaultStager every time
            self._staged, self._targets = None, {}
            return
        self._staged, self._targets = staged, targets

    def _walk_pairs(self, src: Any, dst: Any, path: _Path, out: dict[_Path, _Target]) -> None:
        if isinstance(src, torch.Tensor):
            if not isinstance(dst, torch.Tensor):
                raise _Miss(path)
            key, _ = _layout(src)
            out[path] = (key, dst, _layout(dst)[1])
        elif type(src) in _MAPPINGS:
            if not isinstance(dst, dict) or src.keys() != dst.keys():
                raise _Miss(path)
            for k, v in src.items():
                self._walk_pairs(v, dst[k], path + (k,), out)
        elif type(src) in (list, tuple):
            if type(dst) is not type(src) or len(dst) != len(src):
                raise _Miss(path)
            for i, v in enumerate(src):
                self._walk_pairs(v, dst[i], path + (i,), out)

    @torch.no_grad()
    def _reuse_or_restage(self, state_dict: Any) -> Any:
        try:
            copies: list[tuple[_Path, torch.Tensor, torch.Tensor]] = []
            staged = self._rebuild(state_dict, (), copies, {})
        except _Miss:
            self._staged, self._targets = None, {}
            staged = self._inner_stage_sync(state_dict)
            return staged
        self._copy([(dst, src) for _, dst, src in copies])
        # Leaves this save no longer has release their buffers (one that comes back is restaged).
        kept = {path for path, _, _ in copies}
        self._staged, self._targets = staged, {p: t for p, t in self._targets.items() if p in kept}
        self.reused_saves += 1
        return staged

    def _inner_stage_sync(self, state_dict: Any) -> Any:
        result = self._restage(state_dict)
        return result.result() if isinstance(result, Future) else result

    def _rebuild(self, src: Any, path: _Path, copies: list, sources: dict[int, int]) -> Any:
        """The staged state_dict for ``src``: the remembered staged tensors, fresh non-tensor
        leaves. ``sources`` maps each staged storage to the source storage copied into it."""
        if isinstance(src, torch.Tensor):
            entry = self._targets.get(path)
            key, local = _layout(src)
            if entry is None or entry[0] != key:
                raise _Miss(path)
            # Paths that shared a staged storage (tied weights at the first save) may take
            # their bytes from one source storage only: untied, the last copy would win.
            staged_ptr, source_ptr = entry[2].untyped_storage().data_ptr(), local.untyped_storage().data_ptr()
            if sources.setdefault(staged_ptr, source_ptr) != source_ptr:
                raise _Miss(path)
            copies.append((path, entry[2], local))
            return entry[1]
        if type(src) in _MAPPINGS:
            return type(src)((k, self._rebuild(v, path + (k,), copies, sources)) for k, v in src.items())
        if type(src) in (list, tuple):
            items = [self._rebuild(v, path + (i,), copies, sources) for i, v in enumerate(src)]
            return items if isinstance(src, list) else type(src)(items)
        if isinstance(src, (int, float, str, bytes, bool, type(None))):
            return src
        if isinstance(src, (dict, list, tuple)) or _holds_tensor(src):
            raise _Miss(path)  # a container subclass or an object with tensors: DefaultStager's job
        return copy.deepcopy(src)

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        non_blocking = self.options.use_non_blocking_copy
        with self._stream if self._stream is not None else contextlib.nullcontext():
            for dst, src in copies:
                dst.copy_(src, non_blocking=non_blocking)
        if non_blocking:  # the copies were only queued
            self._stream.synchronize() if self._stream is not None else torch.accelerator.synchronize()


def _holds_tensor(obj: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in getattr(obj, "__dict__", {}).values())
