"""Agreement between ranks on distckpt's own gloo process group.

All ranks agree or all ranks raise: :func:`Collective.agree` runs a step on every rank, gathers
the outcomes and raises the same typed error everywhere if any rank failed, so no rank is left
waiting in a later collective. Without an initialised process group it degrades to one rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
import weakref
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from .. import _errors as errors
from .._engine.blocking import describe_exception
from .._engine.torch_format.internals import default_store
from .liveness import Heartbeat, LivenessWatch

__all__ = ["Collective"]

T = TypeVar("T")

# Added to an arrival counter by a rank that stopped waiting: any later arrival sees it.
_GAVE_UP = 1 << 40
POLL_S = 1.0
"""Seconds between a waiting rank's looks for a rank that made a different call."""
LOG_EVERY_S = 30.0
"""Seconds between rank 0's log lines naming the ranks an entry check still waits for."""
_log = logging.getLogger(__name__)


def _check_single_process(process_group: dist.ProcessGroup | None) -> None:
    """Refuse a one-process setup that is really one rank of many (``torchrun`` without
    ``init_process_group``): each rank would write its own "world size 1" checkpoints."""
    if process_group is not None:
        raise errors.ConfigError(
            "a process_group was passed but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before building the CheckpointManager"
        )
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world_size > 1:
        raise errors.ConfigError(
            f"WORLD_SIZE={world_size} in the environment (rank {os.environ.get('RANK', '?')}, as "
            "torchrun sets it) but torch.distributed is not initialised, so every rank would act as "
            "a separate one-process job writing its own checkpoints. Call "
            "torch.distributed.init_process_group() before building the CheckpointManager (or pass "
            "process_group=...); unset WORLD_SIZE for a single-process run."
        )


class Collective:
    """Object collectives over a dedicated gloo group (works beside an NCCL training group).

    Args:
        process_group: the training group whose ranks take part; ``None`` = default group.
        timeout_s: timeout of the gloo group's collectives (seconds).
        liveness_s: ``coordination.liveness_timeout_s`` (seconds): with several ranks, start this
            rank's :class:`~distckpt._coord.liveness.Heartbeat` and let :meth:`arrive` stop
            waiting for a missing rank whose heartbeat stood still that long; ``None``: neither.

    Raises:
        ConfigError: ``torch.distributed`` is not initialised but the environment says this is
            one of several ranks (``WORLD_SIZE > 1``, as set by ``torchrun``), or a
            ``process_group`` is passed without an initialised default group.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None, *, timeout_s: float, liveness_s: float | None = None
    ) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self._arrivals = 0  # entry checks made so far (see arrive)
        self._calls: dict[int, str] = {}  # recent entry checks' calls, for removing their keys
        self.liveness_s = liveness_s
        self.heartbeat: Heartbeat | None = None
        if not self.enabled:
            _check_single_process(process_group)
            self.group, self.rank, self.world_size = None, 0, 1
            return
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        # new_group is collective over the default group: every process calls it.
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if liveness_s is not None and self.world_size > 1 and (store := self._store()) is not None:
            self.heartbeat = Heartbeat(store, self.rank, liveness_timeout_s=liveness_s)
            weakref.finalize(self, self.heartbeat.stop)  # dropped unclosed: this rank will not arrive again

    def _store(self) -> Any:
        """The store of the entry checks (under ``distckpt/<group name>/``), ``None`` without one."""
        assert self.group is not None  # enabled
        try:  # no public accessor for the default store in torch 2.13; new_group uses the same one
            store_of_group = default_store()
        except (RuntimeError, ValueError):  # a group without a store: the collectives' timeout applies
            return None
        return dist.PrefixStore(f"distckpt/{self.group.group_name}/", store_of_group)  # stubs lack append

    def arrive(self, call: str, *, timeout_s: float) -> None:
        """Entry check of a collective call: every rank must make the same ``call`` (e.g.
        ``"save(step=10)"``) at this point.

        A rank that is merely late is waited for up to ``timeout_s`` seconds (rank 0 logs the
        ranks still missing every :data:`LOG_EVERY_S` seconds); a rank that made a different
        call at this point (another step, ``save`` vs ``load``) makes every rank raise within
        about :data:`POLL_S` seconds of both having arrived, whatever ``timeout_s`` is; with
        ``liveness_s``, a missing rank whose heartbeat stood still for ``liveness_s`` seconds
        (its process gone) makes every waiting rank raise within about ``POLL_S`` of that.

        Protocol, on the default group's key-value store (not a process group, so a rank that
        never comes costs the others ``timeout_s`` and leaves every process group usable): the
        ``gen``-th check of each rank appends ``<r> <call>`` to ``gen/ranks`` and puts its call into
        ``gen/call`` with compare-and-set; the first call there is the reference and a rank
        whose call differs sets ``gen/mismatch`` and raises. The others count themselves into
        ``gen/<call>/arrived`` and wait for ``gen/<call>/done`` (set by the last to arrive) in
        slices of ``POLL_S``, looking for ``gen/mismatch`` between slices and, once they waited
        one heartbeat period, at the missing ranks' heartbeats (``liveness.LivenessWatch``); a
        rank that finds one lost records it in the arrival counter as a timeout does, writes the
        lost ranks to ``gen/lost`` and sets ``gen/mismatch``, which wakes the others. Cost when
        all ranks arrive together: five small store requests per rank, plus two per ``POLL_S``
        waited (three past the first heartbeat period, and two once); a failing check adds one
        per rank (reading ``gen/ranks``; one more, looking for ``gen/lost``, when no rank made
        another call): O(W) requests in all.

        Raises:
            CollectiveMismatchError: some rank made a different call (within ``POLL_S`` of
                both calls), or some rank made no call within ``timeout_s``; names the ranks
                that made no call and the calls the others made instead (on every rank that
                waited; a rank arriving after the others gave up raises at once).
            RankLostError: (a ``CollectiveMismatchError``) a rank that made no call was taken
                for lost, its heartbeat still for ``liveness_s`` seconds; names it.
        """
        if not self.enabled or self.world_size == 1:
            return
        if (store := self._store()) is None:
            return
        gen, self._arrivals = self._arrivals, self._arrivals + 1
        self._calls[gen] = call
        store.append(f"{gen}/ranks", f"{self.rank} {call}\n")
        if store.compare_set(f"{gen}/call", "", call).decode() != call:
            store.set(f"{gen}/mismatch", "")  # the ranks waiting on the first call see it
            raise self._mismatch(store, gen, call, timeout_s)
        arrived = store.add(f"{gen}/{call}/arrived", 1)
        if arrived == self.world_size:
            store.set(f"{gen}/{call}/done", "")
        elif arrived < _GAVE_UP:
            arrived = self._wait(store, gen, call, timeout_s)
        if arrived >= _GAVE_UP:
            raise self._mismatch(store, gen, call, timeout_s)
        if gen >= 2:  # every rank is past call gen - 1, so past gen - 2: its keys are unused
            old = gen - 2
            old_call = self._calls.pop(old)
            if self.rank == 0:
                for key in ("ranks", "call", "mismatch", "lost", f"{old_call}/arrived", f"{old_call}/done"):
                    store.delete_key(f"{old}/{key}")

    def _wait(self, store: Any, gen: int, call: str, timeout_s: float) -> int:
        """Wait for the last rank of ``call``: 0 once every rank made it, ``>= _GAVE_UP`` on a
        mismatch or after ``timeout_s`` (then recorded in the arrival counter, atomically with
        the arrivals, so a rank arriving later raises at once)."""
        start = time.monotonic()
        next_log = start + LOG_EVERY_S
        watch = None
        if self.liveness_s is not None and self.liveness_s < timeout_s:  # else the arrival timeout ends it first
            watch = LivenessWatch(store, self.liveness_s, lambda: self._ranks_without(store, gen, group=True))
        lost: list[int] = []
        while not lost and (left := start + timeout_s - time.monotonic()) > 0:
            try:
                store.wait([f"{gen}/{call}/done"], datetime.timedelta(seconds=min(POLL_S, left)))
                return 0
            except RuntimeError:  # DistStoreError: "Wait timeout"
                pass
            if store.check([f"{gen}/mismatch"]):
                return _GAVE_UP
            if watch is not None and (stale := watch.poll()):
                absent = self._ranks_without(store, gen, group=True)  # a stale rank that arrived: not lost here
                watch.forget([r for r in stale if r not in absent])
                lost = [r for r in stale if r in absent]
            if self.rank == 0 and time.monotonic() >= next_log:
                next_log += LOG_EVERY_S
                missing = self._ranks_without(store, gen)
                _log.warning(
                    "%s: waited %.0f s of coordination.arrival_timeout_s=%g s for rank(s) %s to make the same call",
                    call,
                    time.monotonic() - start,
                    timeout_s,
                    missing,
                )
        if lost:  # before giving up: a rank arriving after that reads it (unread if the last comes in time)
            assert watch is not None  # only a watch finds lost ranks
            still = max(watch.stood_still_s(r) for r in lost)
            store.set(f"{gen}/lost", f"{still:.0f} " + " ".join(map(str, lost)))
        arrived = store.add(f"{gen}/{call}/arrived", _GAVE_UP)
        if arrived % _GAVE_UP == self.world_size:
            return 0  # the last came just in time
        if lost:
            store.set(f"{gen}/mismatch", "")  # the other waiting ranks raise within POLL_S
        return arrived

    @staticmethod
    def _calls_made(store: Any, gen: int) -> dict[int, str]:
        """``{group rank: call}`` of the ranks that made their ``gen``-th entry check (one request)."""
        made: dict[int, str] = {}
        for line in store.get(f"{gen}/ranks").decode().splitlines():
            rank, _, theirs = line.partition(" ")
            made[int(rank)] = theirs
        return made

    def _ranks_without(self, store: Any, gen: int, *, group: bool = False) -> list[int]:
        """Global ranks (group ranks with ``group``) that have not made their ``gen``-th entry check yet."""
        assert self.group is not None  # enabled
        made = self._calls_made(store, gen)
        missing = [r for r in range(self.world_size) if r not in made]
        return missing if group else [dist.get_global_rank(self.group, r) for r in missing]

    def _mismatch(self, store: Any, gen: int, call: str, timeout_s: float) -> errors.CollectiveMismatchError:
        assert self.group is not None  # only arrive() calls it, when enabled
        missing, others = [], {}
        made = self._calls_made(store, gen)  # this rank's own line is there: the key exists
        for r in range(self.world_size):
            theirs = made.get(r)
            global_rank = dist.get_global_rank(self.group, r)
            if theirs is None:
                missing.append(global_rank)
            elif theirs != call:
                others[global_rank] = theirs
        me = dist.get_global_rank(self.group, self.rank)
        if not others and store.check([f"{gen}/lost"]):  # a waiting rank took missing ranks for lost (_wait)
            return self._lost(store.get(f"{gen}/lost").decode(), call, me, missing, others)
        parts = []
        if others:
            parts.append("; ".join(f"rank {r} called {c} instead" for r, c in sorted(others.items())))
        if missing:
            when = "yet" if others else f"within coordination.arrival_timeout_s={timeout_s:g} s"
            parts.append(f"rank(s) {missing} did not make this call (nor any other manager call) {when}")
        if not parts:
            parts.append(f"the others gave up waiting for it after coordination.arrival_timeout_s={timeout_s:g} s")
        return errors.CollectiveMismatchError(
            f"rank {me} called CheckpointManager.{call}, but "
            + ", ".join(parts)
            + ". Every rank must call the manager's collective methods (save, load, "
            "maybe_save, wait, close) in the same order with the same step; a rank that is only "
            "slow is waited for coordination.arrival_timeout_s (default: coordination.timeout_s). "
            "The ranks are now out of step: end the job.",
            call=call,
            missing_ranks=missing,
            other_calls=others,
        )

    def _lost(
        self, record: str, call: str, me: int, missing: list[int], others: dict[int, str]
    ) -> errors.RankLostError:
        """The error of an entry check that a waiting rank ended on lost ranks (``record``:
        ``gen/lost``, "<seconds their heartbeats stood still> <group rank>...")."""
        assert self.group is not None  # only arrive() calls it, when enabled
        still, *ranks = record.split()
        lost = [dist.get_global_rank(self.group, int(r)) for r in ranks]
        setting = f"coordination.liveness_timeout_s={self.liveness_s:g} s" if self.liveness_s else "liveness_timeout_s"
        if me in lost:  # it was alive after all: slow in one call holding the GIL, or its heartbeat stopped
            text = (
                f"rank {me} called CheckpointManager.{call} after the other ranks had taken it for lost: its "
                f"liveness heartbeat had not moved for {still} s ({setting}), as when a single call holds the "
                "GIL that long. The ranks are now out of step: end the job (raise coordination.liveness_timeout_s "
                "if a rank is that slow)."
            )
        else:
            text = (
                f"rank {me} called CheckpointManager.{call}, but rank(s) {lost} are lost: they did not make "
                f"this call and their liveness heartbeat stood still for {still} s ({setting}), so their "
                "process is gone (a lost node, a killed or exited worker) or held the GIL that long. The job "
                "cannot go on without them: end it and restart it (torchrun restarts its workers up to "
                "--max-restarts; load() then resumes from the newest checkpoint)."
            )
        return errors.RankLostError(text, call=call, missing_ranks=missing, other_calls=others, lost_ranks=lost)

    def barrier(self) -> None:
        """Return once every rank of the group has called it (no-op on one process)."""
        if self.enabled:
            dist.barrier(group=self.group)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        assert self.group is not None  # enabled
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in the group's rank order (``[obj]`` on one process)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in the group's rank order (``None`` on the other ranks,
        which receive nothing; ``[obj]`` on one process)."""
        if not self.enabled:
            return [obj]
        assert self.group is not None  # enabled
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def lead(
        self, fn: Callable[[], T], *, what: str, error_type: type[errors.DistCkptError] = errors.DistCkptError
    ) -> T:
        """Run ``fn`` on rank 0 only and hand its result to every rank (one broadcast); if it
        raised, raise on every rank, as :meth:`agree` does (a ``DistCkptError`` keeps its type,
        anything else becomes ``error_type``)."""
        result: T | None = None
        outcome: tuple[str, str, dict[str, Any]] | None = None
        local_exc: BaseException | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                local_exc = e
                outcome = (type(e).__name__, f"{type(e).__name__}: {e}", _attributes(e))
        if self.world_size == 1:
            if local_exc is not None and isinstance(local_exc, errors.DistCkptError):
                raise local_exc
        else:
            result, outcome = self.broadcast((result, outcome))
        if outcome is None:
            return result  # type: ignore[return-value]
        type_name, message, attributes = outcome
        exc = _rebuilt(type_name, f"{what} failed on rank 0: {message}", attributes, error_type)
        if local_exc is not None:
            raise exc from local_exc
        raise exc

    def agree(
        self, fn: Callable[[], T], *, what: str, error_type: type[errors.DistCkptError] = errors.DistCkptError
    ) -> T:
        """Run ``fn`` on every rank; if it raised anywhere, raise on every rank.

        A :class:`~distckpt._errors.DistCkptError` keeps its type on every rank; any other
        exception becomes ``error_type``. The message names the failing rank(s).
        """
        return self._agree(fn, what=what, error_type=error_type, share=None)[0]

    def agree_and_share(
        self,
        fn: Callable[[], T],
        share: Callable[[T], Any],
        *,
        what: str,
        error_type: type[errors.DistCkptError] = errors.DistCkptError,
    ) -> tuple[T, list[Any]]:
        """:meth:`agree`, and in the same exchange every rank's ``share(result)``: ``(this rank's
        result, [share of each rank, in rank order])``. One collective where two would do."""
        return self._agree(fn, what=what, error_type=error_type, share=share)

    def _agree(
        self, fn: Callable[[], Any], *, what: str, error_type: type[errors.DistCkptError], share: Any
    ) -> tuple[Any, list[Any]]:
        result: Any = None
        outcome: tuple[str, str, dict[str, Any]] | None = None
        local_exc: BaseException | None = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_exc = e
            outcome = (type(e).__name__, f"{type(e).__name__}: {e}", _attributes(e))
        shared = share(result) if share is not None and local_exc is None else None
        gathered = self.all_gather((outcome, shared))
        outcomes = [o for o, _ in gathered]
        failed = {r: o for r, o in enumerate(outcomes) if o is not None}
        if not failed:
            return result, [s for _, s in gathered]
        first_rank, (type_name, message, attributes) = next(iter(failed.items()))
        if first_rank == self.rank and isinstance(local_exc, errors.DistCkptError) and self.world_size == 1:
            raise local_exc
        others = f" (failed on ranks {sorted(failed)})" if len(failed) > 1 else ""
        exc = _rebuilt(type_name, f"{what} failed on rank {first_rank}{others}: {message}", attributes, error_type)
        if local_exc is not None:
            raise exc from local_exc
        raise exc

    def close(self) -> None:
        """Destroy this gloo group after a barrier; every rank of the group calls it (the
        manager's ``close``). gloo groups left to the interpreter's exit have aborted a rank
        here ("terminate called without an active exception", exit code -6) after a clean
        save. Idempotent; a failure is logged, never raised: nothing is left to agree on."""
        self.stop_heartbeat()
        if not self.enabled or self.group is None:
            return
        group, self.group, self.enabled = self.group, None, False
        try:
            dist.barrier(group=group)
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - closing; the caller goes on either way
            logging.getLogger(__name__).warning("destroying distckpt's process group failed: %s", describe_exception(e))

    def stop_heartbeat(self) -> None:
        """Stop this rank's liveness heartbeat (:meth:`close`; the manager left by an exception):
        a rank waiting for this one in :meth:`arrive` then raises ``RankLostError`` after
        ``liveness_s`` seconds. Idempotent; never raises."""
        heartbeat, self.heartbeat = self.heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()

    def tear_down_for_exit(self) -> None:
        """Every rank is leaving together (a preemption exit): :meth:`close` (its barrier on
        distckpt's gloo group tells each rank that every rank is past its last collective),
        then destroy the default group too, for the reason :meth:`close` gives. No barrier on the
        default group: it may be NCCL, whose barrier without a device guesses one. A failure is
        logged, never raised: the caller exits anyway."""
        self.close()
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; exiting anyway
            logging.getLogger(__name__).warning(
                "process group teardown before the preemption exit failed: %s", describe_exception(e)
            )


def _attributes(e: BaseException) -> dict[str, Any]:
    """The public attributes of a :class:`~distckpt._errors.DistCkptError` (a corrupt file's
    ``path``, a misfit's ``missing`` and ``unexpected`` keys), carried to every rank so a handler
    reads the same error everywhere; ``{}`` for another exception or values that do not pickle."""
    if not isinstance(e, errors.DistCkptError):
        return {}
    attributes = {k: v for k, v in vars(e).items() if not k.startswith("_")}
    try:
        pickle.dumps(attributes)
    except Exception:  # noqa: BLE001 - the message still says what failed
        return {}
    return attributes


def _rebuilt(
    type_name: str, message: str, attributes: dict[str, Any], error_type: type[errors.DistCkptError]
) -> errors.DistCkptError:
    """The error a rank raised, as every rank raises it: its own type when it is a
    :class:`~distckpt._errors.DistCkptError` (else ``error_type``), with its attributes."""
    cls = getattr(errors, type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DistCkptError)):
        cls, attributes = error_type, {}
    exc = cls(message)
    vars(exc).update(attributes)
    return exc
