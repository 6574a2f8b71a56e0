"""DataLoader workers that outlive a SIGTERM to the process group, so the preemption save runs.

torchrun (and most schedulers) deliver SIGTERM to each worker's whole process group. A
``DataLoader`` worker process dies of it at once, and the main process then fails with
"DataLoader worker (pid ...) is killed by signal: Terminated" at its next batch, before
distckpt's preemption save at the step boundary (measured with torch 2.13, ``num_workers=2``,
``kill -TERM`` on torchrun). So a worker set up by :class:`SigtermSafeWorkerInit` ignores
SIGTERM while the main process runs.

It must not ignore the SIGTERM the main process itself sends when it exits: Python's
``multiprocessing`` ends daemonic children at interpreter exit with ``terminate()`` (SIGTERM)
and then joins them, so a worker that ignored it would hang the exit of every script that
leaves a loop before its loader's iterator is exhausted. The main process therefore sets a
shared "exiting" event in an ``atexit`` hook, which runs before ``multiprocessing``'s own exit
handler (``atexit`` runs hooks last-registered first); a SIGTERM that arrives once the event is
set ends the worker at once (with exit code 0: the main process's DataLoader SIGCHLD handler
reports a worker killed by a signal as an error).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from typing import Any, Callable

__all__ = ["SigtermSafeWorkerInit"]

_exiting: Any = None  # multiprocessing.Event, created in the main process on first use


def _main_exiting_event() -> Any:
    global _exiting
    if _exiting is None:
        _exiting = multiprocessing.Event()
        atexit.register(_exiting.set)
    return _exiting


class SigtermSafeWorkerInit:
    """Picklable ``worker_init_fn``: the worker ignores SIGTERM until the main process exits,
    then calls ``user_fn(worker_id)`` if given. Build it in the main process (it creates the
    shared exit event there); ``make_stateful_dataloader`` does so for every loader with workers.

    Args:
        user_fn: the caller's own ``worker_init_fn``, or ``None``.
    """

    def __init__(self, user_fn: Callable[[int], None] | None = None) -> None:
        self.user_fn = user_fn
        self.main_exiting = _main_exiting_event()

    def __call__(self, worker_id: int) -> None:
        exiting = self.main_exiting

        def on_sigterm(signum: int, frame: Any) -> None:
            if exiting.is_set():  # the main process is exiting and ends its workers: leave now
                os._exit(0)  # exit code 0: torch's SIGCHLD check reports a signal death as an error
            # else: a launcher's SIGTERM to the process group; the main process saves, then exits

        signal.signal(signal.SIGTERM, on_sigterm)
        if self.user_fn is not None:
            self.user_fn(worker_id)
