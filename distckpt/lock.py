"""One writer per checkpoint root: ``<root>/.lock`` holds the writer's host, pid and job id.

Created atomically with ``O_CREAT | O_EXCL``. A lock whose holder is a dead process on this host
(a crashed or killed job) is stale and is taken over with a warning; a lock of a live process,
or of another host (whose liveness cannot be checked from here), raises
:class:`~distckpt.errors.CheckpointLockedError` naming the holder.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from .errors import CheckpointLockedError

__all__ = ["RootLock", "job_id"]

logger = logging.getLogger(__name__)
LOCK_NAME = ".lock"


def job_id() -> str:
    """Scheduler job id when there is one (SLURM, torchrun), else ``""``."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RootLock:
    """The write lock of one checkpoint root. Rank 0 acquires it; all ranks learn the outcome.

    Args:
        root: checkpoint root directory (must exist).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.path = Path(root) / LOCK_NAME
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id(),
                   "since": time.time()}
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or take over a stale one.

        Raises:
            CheckpointLockedError: another live process (or another host) holds it.
        """
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # vanished or half-written: retry
                if not self._is_stale(holder):
                    raise CheckpointLockedError(
                        f"{self.path}: checkpoint root is locked by host={holder.get('host')} "
                        f"pid={holder.get('pid')} job={holder.get('job_id') or '-'}. Two jobs must "
                        "not write one root: use another CheckpointConfig.root, stop the other job, "
                        f"or, if that job is gone, delete {self.path}.")
                logger.warning("taking over stale checkpoint lock %s of dead process %s on %s",
                               self.path, holder.get("pid"), holder.get("host"))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise CheckpointLockedError(f"{self.path}: could not acquire the checkpoint lock (contended)")

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("host") != self.me["host"]:
            return False
        if holder.get("pid") == self.me["pid"]:
            return True  # this process: an earlier manager that was not closed
        return not _pid_alive(int(holder.get("pid", -1)))

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.path.unlink(missing_ok=True)
            self.held = False
