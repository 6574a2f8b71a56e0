"""The memory tier's background thread: idle daemon workers reused from snapshot to snapshot."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["in_background"]


def in_background(fn: Callable[..., None], *args: Any) -> Future:
    """Run ``fn(*args)`` on an idle daemon worker thread (a new one when none is idle: one blocked on
    a dead peer never holds up the exit, nor a later snapshot of another tier). Reusing the worker
    keeps a thread start (a few hundred microseconds) off the training thread at each snapshot."""
    future: Future = Future()
    try:
        worker = _IDLE.get_nowait()
    except queue.Empty:
        worker = _Worker()
    worker.tasks.put((fn, args, future))
    return future


class _Worker:
    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="distckpt-memory", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, args, future = self.tasks.get()
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                _IDLE.put(self)
                future.set_exception(e)
            else:
                _IDLE.put(self)
                future.set_result(None)


_IDLE: queue.SimpleQueue = queue.SimpleQueue()
