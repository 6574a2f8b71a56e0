"""Named phase events of saves and loads, for logs and for tools that aim at a phase.

Every event goes to the ``distckpt._coord.events`` logger at DEBUG; when ``CheckpointConfig.coordination.event_log``
or the ``DISTCKPT_EVENT_LOG`` environment variable names a file, each event is also appended to
it as one JSON line ``{"phase", "rank", "step", "t" (unix seconds), ...}`` and flushed, so an
external observer (the chaos harness, ``tests/chaos``) sees it before the phase starts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from .._errors import ConfigError

__all__ = ["EventLog"]

logger = logging.getLogger("distckpt._coord.events")


class EventLog:
    """Appends phase events of one rank. Thread-safe (background commits emit too).

    Args:
        path: JSONL file, or ``None`` to use ``$DISTCKPT_EVENT_LOG`` (unset: log only).
        rank: this process's rank.
    """

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path or os.environ.get("DISTCKPT_EVENT_LOG") or None
        self.rank = rank
        self._lock = threading.Lock()

    def emit(self, phase: str, step: int | None = None, **fields: Any) -> None:
        """Record event ``phase`` of ``step`` (``None``: of no step) with ``fields``: logged at DEBUG and,
        with a log file, appended as one JSON line (with ``rank`` and ``t``, unix seconds) and flushed
        before it returns."""
        record = {"phase": phase, "rank": self.rank, "step": step, "t": time.time(), **fields}
        logger.debug("%s", record)
        if self.path is None:
            return
        line = json.dumps(record) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def check_appendable(self) -> None:
        """Fail early (at the manager's construction) when the log file cannot be appended to.

        Raises:
            ConfigError: naming the path and the OS error.
        """
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ConfigError(
                f"CheckpointConfig.coordination.event_log={self.path!r} (or $DISTCKPT_EVENT_LOG) "
                f"cannot be appended to: {e}"
            ) from e
