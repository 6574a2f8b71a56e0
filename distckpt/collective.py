"""Agreement between ranks on distckpt's own gloo process group.

All ranks agree or all ranks raise: :func:`Collective.agree` runs a step on every rank, gathers
the outcomes and raises the same typed error everywhere if any rank failed, so no rank is left
waiting in a later collective. Without an initialised process group it degrades to one rank.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from . import errors

__all__ = ["Collective"]

T = TypeVar("T")


class Collective:
    """Object collectives over a dedicated gloo group (works beside an NCCL training group).

    Args:
        process_group: the training group whose ranks take part; ``None`` = default group.
        timeout_s: timeout of the gloo group's collectives (seconds).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, *, timeout_s: float) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        if not self.enabled:
            self.group, self.rank, self.world_size = None, 0, 1
            return
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        # new_group is collective over the default group: every process calls it.
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, fn: Callable[[], T], *, what: str,
              error_type: type[errors.DistCkptError] = errors.DistCkptError) -> T:
        """Run ``fn`` on every rank; if it raised anywhere, raise on every rank.

        A :class:`~distckpt.errors.DistCkptError` keeps its type on every rank; any other
        exception becomes ``error_type``. The message names the failing rank(s).
        """
        result: T | None = None
        outcome: tuple[str, str] | None = None
        local_exc: BaseException | None = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_exc = e
            outcome = (type(e).__name__, f"{type(e).__name__}: {e}")
        outcomes = self.all_gather(outcome)
        failed = {r: o for r, o in enumerate(outcomes) if o is not None}
        if not failed:
            return result  # type: ignore[return-value]
        first_rank, (type_name, message) = next(iter(failed.items()))
        if first_rank == self.rank and isinstance(local_exc, errors.DistCkptError) and self.world_size == 1:
            raise local_exc
        cls = getattr(errors, type_name, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.DistCkptError)):
            cls = error_type
        others = f" (failed on ranks {sorted(failed)})" if len(failed) > 1 else ""
        exc = cls(f"{what} failed on rank {first_rank}{others}: {message}")
        if local_exc is not None:
            raise exc from local_exc
        raise exc
