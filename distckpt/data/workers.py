"""DataLoader workers that outlive a SIGTERM to the process group, so the preemption save runs.

torchrun (and most schedulers) deliver SIGTERM to each worker's whole process group. A
``DataLoader`` worker process dies of it at once, and the main process then fails with
"DataLoader worker (pid ...) is killed by signal: Terminated" at its next batch, before
distckpt's preemption save at the step boundary (measured with torch 2.13, ``num_workers=2``,
``kill -TERM`` on torchrun). A worker that ignores SIGTERM lives on until the main process
finishes the save and shuts its loader down (the workers also exit on their own when the main
process dies, and the launcher's SIGKILL after its grace period still ends everything).
"""

from __future__ import annotations

import signal
from typing import Callable

__all__ = ["SigtermSafeWorkerInit", "ignore_sigterm_in_worker"]


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """``worker_init_fn`` for a ``DataLoader``/``StatefulDataLoader``: ignore SIGTERM in this worker.

    Args:
        worker_id: the worker's index (unused; the DataLoader passes it).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SigtermSafeWorkerInit:
    """Picklable ``worker_init_fn``: ignore SIGTERM, then call ``user_fn(worker_id)`` if given.

    Args:
        user_fn: the caller's own ``worker_init_fn``, or ``None``.
    """

    def __init__(self, user_fn: Callable[[int], None] | None = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        ignore_sigterm_in_worker(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)
