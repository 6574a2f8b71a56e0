"""Retention's file removal off the save's critical path (rank 0).

Retention decides synchronously, inside the commit: a deleted checkpoint is renamed
``.deleting-<name>-<id>`` durably before the save returns (:func:`distckpt._storage.commit.delete_checkpoint`),
so it is no longer a checkpoint. Only the removal of that directory's files is handed to a
:class:`Purger`: one daemon worker, first in first out. A crash mid-removal leaves the
``.deleting-`` directory, which the next start removes (:func:`distckpt._storage.commit.remove_leftovers`).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
from pathlib import Path

__all__ = ["Purger", "remove_tree"]

logger = logging.getLogger(__name__)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory and everything under it.

    Raises:
        OSError: a file or directory could not be removed (what could be was).
    """
    try:
        shutil.rmtree(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)  # remove what can be, report the first failure
        raise


class Purger:
    """Removes ``.deleting-*`` directories on one background daemon thread, in submission order.

    The thread starts with the first :meth:`submit` and ends when the queue is empty, so a
    rank that never deletes never starts one. Failures never raise: :meth:`join` logs each
    as a warning (the directory is distckpt's deletion, never a checkpoint; the next start
    removes what is left).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[Path] = collections.deque()
        self._thread: threading.Thread | None = None
        self._failures: list[tuple[Path, BaseException]] = []

    def submit(self, path: str | os.PathLike) -> None:
        """Queue a directory (already renamed ``.deleting-*``) for removal; returns at once."""
        with self._lock:
            self._queue.append(Path(path))
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="distckpt-purge", daemon=True)
            try:
                self._thread.start()
                return
            except RuntimeError:  # no thread to be had (resource limits): remove it here, as before
                self._thread = None
                self._queue.pop()
        shutil.rmtree(path, ignore_errors=True)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                path = self._queue[0]
            try:
                remove_tree(path)
            except BaseException as e:  # noqa: BLE001 - join() reports it; the worker never dies with work queued
                with self._lock:
                    self._failures.append((path, e))
            with self._lock:
                self._queue.popleft()  # after the removal: pending() counts the one in progress

    def pending(self) -> int:
        """Directories queued or being removed."""
        with self._lock:
            return len(self._queue)

    def join(self) -> list[tuple[Path, BaseException]]:
        """Wait until every submitted directory is removed (or failed); log each failure as a
        warning. Never raises.

        Returns:
            ``(directory, error)`` of each removal that failed since the last ``join``.
        """
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                break
            thread.join()
        with self._lock:
            failures, self._failures = self._failures, []
        for path, e in failures:
            logger.warning(
                "retention: could not remove all of %s (%s); it is no longer a checkpoint, "
                "and the next start removes what is left",
                path,
                e,
            )
        return failures
