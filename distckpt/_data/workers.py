"""DataLoader workers that outlive a SIGTERM to the process group, so the preemption save runs.

torchrun (and most schedulers) deliver SIGTERM to each worker's whole process group. A
``DataLoader`` worker process dies of it at once, and the main process then fails with
"DataLoader worker (pid ...) is killed by signal: Terminated" at its next batch, before
distckpt's preemption save at the step boundary (measured with torch 2.13, ``num_workers=2``,
``kill -TERM`` on torchrun). So a worker set up by :class:`SigtermSafeWorkerInit` ignores
SIGTERM while the main process runs.

It must not ignore the SIGTERM the main process itself sends when it exits: Python's
``multiprocessing`` ends daemonic children at exit with ``terminate()`` (SIGTERM) and then joins
them, so a worker that ignored it would hang the exit of every script that leaves a loop before
its loader's iterator is exhausted. That happens in ``multiprocessing.util._exit_function``,
which a plain ``python`` (or torchrun) process runs as an ``atexit`` hook and a
``multiprocessing`` child (``mp.Process``, ``torch.multiprocessing.spawn``) calls itself before
``os._exit()``, so ``atexit`` hooks never run there. The main process therefore sets a shared
"exiting" flag from a ``multiprocessing.util.Finalize`` with an exit priority, which that
function runs before it terminates the children, under every launcher. A SIGTERM that arrives
once the flag is set ends the worker at once (with exit code 0: the main process's DataLoader
SIGCHLD handler reports a worker killed by a signal as an error).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing import util
from typing import Any, Callable

from .._errors import ConfigError

__all__ = ["SigtermSafeWorkerInit", "protect_workers"]

_EXIT_PRIORITY = 100  # above multiprocessing's own finalizers (queues: 10): set before anything else
_exiting: dict[int, tuple[Any, Any]] = {}  # pid -> (shared flag set at that process's exit, its Finalize)


def _set(flag: Any) -> None:
    flag.value = 1


def _process_exit_flag() -> Any:
    """This process's "exiting" flag (a byte of shared memory), created and hooked to its exit on
    first use. Shared memory rather than an Event: no semaphore to track or leak, no lock taken in
    the workers' signal handler, and it pickles for workers started by spawn or forkserver too."""
    pid = os.getpid()  # a forked child has its own: the parent's hook does not run there
    flag, finalizer = _exiting.get(pid, (None, None))
    if flag is None:
        flag = multiprocessing.RawValue("b", 0)
    if finalizer is None or not finalizer.still_active():  # a child's bootstrap clears the registry
        finalizer = util.Finalize(None, _set, (flag,), exitpriority=_EXIT_PRIORITY)
    _exiting[pid] = (flag, finalizer)
    return flag


class SigtermSafeWorkerInit:
    """Picklable ``worker_init_fn``: the worker ignores SIGTERM until the process that runs its
    loader exits, then calls ``user_fn(worker_id)`` if given. ``make_stateful_dataloader`` and
    ``CheckpointManager(dataloader=...)`` (:func:`protect_workers`) install it.

    The exit of the process that built it, or of any ``multiprocessing`` child it was passed to
    (forked or spawned), ends the workers: each such process adds its own exit flag.

    Args:
        user_fn: the caller's own ``worker_init_fn``, or ``None``.
    """

    def __init__(self, user_fn: Callable[[int], None] | None = None) -> None:
        self.user_fn = user_fn
        self.exit_flags: tuple[Any, ...] = (_process_exit_flag(),)
        util.register_after_fork(self, SigtermSafeWorkerInit._add_own_exit_flag)

    def _add_own_exit_flag(self) -> None:
        # In a multiprocessing child, after its bootstrap cleared the finalizers it inherited
        # (its DataLoader workers too, where the flag is unused).
        flag = _process_exit_flag()
        if all(f is not flag for f in self.exit_flags):
            self.exit_flags = (*self.exit_flags, flag)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in a spawned child before its bootstrap: the flag is added after it.
        self.__dict__.update(state)
        util.register_after_fork(self, SigtermSafeWorkerInit._add_own_exit_flag)

    def __call__(self, worker_id: int) -> None:
        """Worker ``worker_id``'s init: from now on a SIGTERM ends the worker (exit code 0) only when the
        process that built this is exiting, and is ignored otherwise (a launcher's SIGTERM to the
        process group: the main process saves, then ends its workers); then the caller's own
        ``worker_init_fn``."""
        flags = self.exit_flags

        def on_sigterm(signum: int, frame: Any) -> None:
            if any(f.value for f in flags):  # the main process is exiting and ends its workers
                os._exit(0)  # exit code 0: torch's SIGCHLD check reports a signal death as an error
            # else: a launcher's SIGTERM to the process group; the main process saves, then exits

        signal.signal(signal.SIGTERM, on_sigterm)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def protect_workers(dataloader: Any, *, rank: int) -> None:
    """Make the workers of ``dataloader``'s future iterators outlive a launcher's SIGTERM: wrap its
    ``worker_init_fn`` in :class:`SigtermSafeWorkerInit` (kept if it already is one of this
    process). No-op without workers (``num_workers == 0``) or ``worker_init_fn`` attribute.

    Args:
        dataloader: a ``torch.utils.data.DataLoader`` (torchdata ``StatefulDataLoader``).
        rank: for the error message.

    Raises:
        ConfigError: the loader already has an iterator whose worker processes run unprotected
            (``iter(loader)`` or ``loader.state_dict()`` was called first): they would die of a
            SIGTERM before the preemption save.
    """
    if getattr(dataloader, "num_workers", 0) <= 0 or not hasattr(dataloader, "worker_init_fn"):
        return
    current = dataloader.worker_init_fn
    own = _process_exit_flag()
    if not (isinstance(current, SigtermSafeWorkerInit) and any(f is own for f in current.exit_flags)):
        user_fn = current.user_fn if isinstance(current, SigtermSafeWorkerInit) else current
        dataloader.worker_init_fn = SigtermSafeWorkerInit(user_fn)
    it = getattr(dataloader, "_iterator", None)  # torchdata 0.11: the iterator iter(loader) returns next
    workers = getattr(it, "_workers", None) or []
    if (
        not getattr(it, "_shutdown", True)
        and any(w.is_alive() for w in workers)
        and not isinstance(getattr(it, "_worker_init_fn", None), SigtermSafeWorkerInit)
    ):
        raise ConfigError(
            f"rank {rank}: the dataloader already started {len(workers)} worker process(es) (iter(loader) or "
            "loader.state_dict() before CheckpointManager(...)); a SIGTERM to the process group (torchrun, "
            "SLURM) would kill them before the preemption save. Build the CheckpointManager before the "
            "loader's first iterator, or build the loader with distckpt.data.make_stateful_dataloader(...) "
            "or StatefulDataLoader(..., worker_init_fn=distckpt.data.SigtermSafeWorkerInit(your_fn))"
        )
