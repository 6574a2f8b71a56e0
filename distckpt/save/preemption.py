"""Preemption: SIGTERM on any rank -> every rank saves at the same step boundary.

The signal handler only sets a flag. At each step boundary the ranks all-reduce (MAX) the flag on
distckpt's gloo group, so a signal that reached one rank (as torchrun or SLURM may deliver it)
stops all ranks at the same step and no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PreemptionWatcher"]

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Installs a SIGTERM handler (main thread only) and agrees on preemption across ranks.

    Args:
        group: the gloo group of the training ranks, or ``None`` without a process group.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.requested = False
        self.signal_time: float | None = None  # time.monotonic() of the first SIGTERM here
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self.installed = True
        else:
            self.installed = False
            logger.warning("not in the main thread: SIGTERM preemption handling is disabled")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self.signal_time is None:
            self.signal_time = time.monotonic()

    def seconds_since_signal(self) -> float:
        """Seconds since this rank's first SIGTERM (0 when it got none)."""
        return 0.0 if self.signal_time is None else time.monotonic() - self.signal_time

    def agreed(self) -> bool:
        """Whether any rank was asked to stop. Collective: all ranks call it at each step."""
        if self.group is None:
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def uninstall(self) -> None:
        """Put back the SIGTERM handler found at construction (no-op when it installed none, or when called again)."""
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False
