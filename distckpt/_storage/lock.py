"""One writer per checkpoint root: ``<root>/.lock`` holds the writer's host, pid, job id and lease.

Created atomically with ``O_CREAT | O_EXCL``. An existing lock is taken over, with a warning, when

* its holder is a dead process on this host (a crashed or killed job);
* it was written by the same scheduler job (``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID`` other than
  torchrun's default ``none``, ``JOB_ID``), on any host, unless by another live process on
  this host: the job's workers were restarted, possibly on another node (an elastic restart
  moves rank 0), and the old writer is gone;
* its lease expired: a holder that renews (the manager's rank 0 rewrites ``renewed`` every
  ``lease_s / 3`` seconds) and has not renewed for ``lease_s`` (the larger of the holder's and
  ours) is dead or cut off. Host clocks must agree to well within the lease.

Otherwise (a live process on this host, or another host's lock with a live lease or none at
all) :class:`~distckpt._errors.CheckpointLockedError` names the holder. Within one process, a lock
still held by an open ``RootLock`` (a manager not closed yet) is refused the same way; the lock of
one that was released or garbage-collected without release is taken over, with a warning.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from typing_extensions import override

from .._errors import CheckpointLockedError
from .base import LockFile

__all__ = ["RootLock", "PosixLockFile", "job_id"]

logger = logging.getLogger(__name__)
LOCK_NAME = ".lock"

_OPEN: dict[str, tuple[int, weakref.ref]] = {}  # {lock location: (pid, the RootLock holding it)}
_OPEN_MUTEX = threading.Lock()


def job_id() -> str:
    """Scheduler job id when there is one (SLURM, torchrun, SGE), else ``""``.

    torchrun's ``TORCHELASTIC_RUN_ID`` is its ``--rdzv-id`` (the same on every node and across
    restarts; a fresh one with ``--standalone``); its default ``none`` names no job.
    """
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID"):
        value = os.environ.get(var)
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            return f"{var}={value}"
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class PosixLockFile(LockFile):
    """``<root>/.lock`` on a POSIX file system (see :class:`distckpt._storage.base.LockFile`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.where = str(self.path)

    @override
    def create_exclusive(self, text: str) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True

    @override
    def read(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    @override
    def replace(self, text: str) -> None:
        tmp = self.path.with_name(f"{self.path.name}.renew-{os.getpid()}")  # one per file: the lock's and others
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    @override
    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class RootLock:
    """The write lock of one checkpoint root. Rank 0 acquires it; all ranks learn the outcome.

    Args:
        root: checkpoint root directory (must exist).
        lease_s: a lock not renewed for this long (seconds) is taken over by another job.
        renew: renew the lease from a background thread every ``lease_s / 3`` while held
            (the manager does; short-lived holders such as ``distckpt prune`` need not).
        lock_file: the lock object of a non-POSIX root (a store's ``root_file(".lock")``); default
            ``<root>/.lock``.
    """

    def __init__(
        self, root: str | os.PathLike, *, lease_s: float = 300.0, renew: bool = False, lock_file: Any = None
    ) -> None:
        self.file = lock_file if lock_file is not None else PosixLockFile(Path(root) / LOCK_NAME)
        self.root = str(root)
        self.path = self.file.where
        now = time.time()
        self.lease_s = float(lease_s)
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job_id": job_id(),
            "since": now,
            "renewed": now,
            "lease_s": self.lease_s,
        }
        self.held = False
        self._key = self.path if "://" in self.path else os.path.realpath(self.path)  # one per location
        self._renew = renew
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @classmethod
    def of(cls, store: Any, *, lease_s: float = 300.0, renew: bool = False) -> "RootLock":
        """The lock of a :class:`~distckpt._storage.base.CheckpointStore`'s root (its ``root_file(".lock")``)."""
        return cls(store.root, lease_s=lease_s, renew=renew, lock_file=store.root_file(LOCK_NAME))

    def acquire(self) -> None:
        """Take the lock, or take over a stale one.

        Raises:
            CheckpointLockedError: another live process (or another host) holds it, or another
                open ``RootLock`` of this process (a manager on the same root not closed yet).
        """
        self._check_not_open_here()
        for _ in range(3):
            self.me["renewed"] = time.time()
            if not self.file.create_exclusive(json.dumps(self.me)):
                holder = self._holder()
                if holder is None:
                    continue  # vanished or half-written: retry
                why = self._takeover_reason(holder)
                if why is None:
                    raise CheckpointLockedError(
                        f"{self.path}: checkpoint root is locked by host={holder.get('host')} "
                        f"pid={holder.get('pid')} job={holder.get('job_id') or '-'}{self._lease_text(holder)}. "
                        "Two jobs must not write one root: use another CheckpointConfig.root, stop the "
                        f"other job, wait for its lease to expire, or, if that job is gone, delete {self.path}."
                    )
                logger.warning(
                    "taking over checkpoint lock %s of pid %s on %s (job %s): %s",
                    self.path,
                    holder.get("pid"),
                    holder.get("host"),
                    holder.get("job_id") or "-",
                    why,
                )
                self.file.remove()
                continue
            self.held = True
            with _OPEN_MUTEX:
                _OPEN[self._key] = (os.getpid(), weakref.ref(self))
            if self._renew:
                self._stop.clear()
                self._renewer = threading.Thread(
                    target=_renew_loop,
                    args=(weakref.ref(self), self._stop, self.lease_s / 3),
                    name="distckpt-lock-lease",
                    daemon=True,
                )
                self._renewer.start()
            return
        raise CheckpointLockedError(f"{self.path}: could not acquire the checkpoint lock (contended)")

    def _check_not_open_here(self) -> None:
        """``CheckpointLockedError`` when another ``RootLock`` of this process holds this root's lock
        and was not released (an open manager); one only garbage left by a dropped manager is collected."""
        for attempt in range(2):
            with _OPEN_MUTEX:
                pid, ref = _OPEN.get(self._key, (None, None))
                other = ref() if ref is not None and pid == os.getpid() else None  # a forked child holds nothing
            if other is None or other is self or not other.held:
                return
            del other
            if attempt == 0:
                gc.collect()  # a manager dropped without close() may only wait for the cycle collector
        raise CheckpointLockedError(
            f"{self.path}: checkpoint root {self.root} is locked by another CheckpointManager of this process "
            f"(pid {os.getpid()}) that is still open. Close it first (manager.close(), or build it in a `with` "
            "block), or use one manager for this root."
        )

    def _holder(self) -> dict | None:
        try:
            text = self.file.read()
            return None if text is None else json.loads(text)
        except ValueError:
            return None

    def _takeover_reason(self, holder: dict) -> str | None:
        """Why ``holder``'s lock may be taken over, or ``None`` when it must be respected."""
        here = holder.get("host") == self.me["host"]
        if here and holder.get("pid") == self.me["pid"]:
            return "an earlier lock of this process, no longer open (a manager collected unclosed, or a failed release)"
        alive_here = here and _pid_alive(int(holder.get("pid", -1)))
        if here and not alive_here:
            return "the process is dead"
        if self.me["job_id"] and holder.get("job_id") == self.me["job_id"] and not alive_here:
            return f"the same scheduler job ({self.me['job_id']}) restarted its workers"
        if not here and self._lease_expired(holder):
            return f"its lease expired{self._lease_text(holder)}"
        return None

    def _lease_expired(self, holder: dict) -> bool:
        renewed = holder.get("renewed")
        if not isinstance(renewed, (int, float)):
            return False  # a holder that never renews (older distckpt): no lease to expire
        lease = max(self.lease_s, float(holder.get("lease_s") or 0))
        return time.time() - renewed > lease

    def _lease_text(self, holder: dict) -> str:
        renewed = holder.get("renewed")
        if not isinstance(renewed, (int, float)):
            return ""
        lease = max(self.lease_s, float(holder.get("lease_s") or 0))
        return f" (lease renewed {time.time() - renewed:.0f} s ago, expires after {lease:g} s)"

    def renew(self) -> bool:
        """Rewrite ``renewed`` in the lock file if this process still holds it (atomic replace).

        Returns:
            Whether the lease was renewed (false: the lock is not ours any more; logged).
        """
        holder = self._holder()
        if holder is None or holder.get("pid") != self.me["pid"] or holder.get("host") != self.me["host"]:
            logger.error(
                "checkpoint lock %s is no longer held by this process (now: %s); not renewing", self.path, holder
            )
            return False
        self.me["renewed"] = time.time()
        try:
            self.file.replace(json.dumps(self.me))
        except OSError as e:
            logger.warning("could not renew the checkpoint lock lease %s: %s", self.path, e)
            return False
        return True

    def release(self) -> None:
        """Stop renewing; remove the lock if this process holds it.

        Called while another exception propagates (a ``finally`` or ``with`` exit after a failed
        save), a failure to reach the lock is logged, not raised, so that exception surfaces.

        Raises:
            OSError: (e.g. :class:`~distckpt._errors.StorageError`) the lock could not be read or
                removed, when no other exception is propagating.
        """
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if not self.held:
            return
        propagating = sys.exc_info()[1]
        try:
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.file.remove()
        except OSError as e:
            if propagating is None:
                raise
            logger.warning(
                "could not release the checkpoint lock of root %s (%s) after %s; it is taken over "
                "once this process is gone or its lease (%g s) expired",
                self.root,
                type(e).__name__,
                type(propagating).__name__,
                self.lease_s,
            )
        finally:
            self.held = False
            with _OPEN_MUTEX:
                entry = _OPEN.get(self._key)
                if entry is not None and entry[1]() in (None, self):
                    del _OPEN[self._key]


def _renew_loop(ref: "weakref.ref[RootLock]", stop: threading.Event, period: float) -> None:
    """The renewer thread: renews while the lock is held and its ``RootLock`` is alive (a weak
    reference, so a manager dropped without ``close()`` is collected and its lock can be taken over)."""
    while not stop.wait(period):
        lock = ref()
        if lock is None or not lock.renew():
            return
        del lock  # no strong reference while waiting
