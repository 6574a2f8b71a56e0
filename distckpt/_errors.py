"""Typed errors. Every error distckpt raises derives from :class:`DistCkptError`.

All derive from ``Exception`` (never ``BaseException``), so ``except Exception`` in a training
loop catches them; DCP's own ``CheckpointException`` derives from ``BaseException`` and is
converted to :class:`CheckpointSaveError` / :class:`CheckpointCorruptError` at the boundary.
"""

from __future__ import annotations

__all__ = [
    "DistCkptError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "IncompatibleCheckpointError",
    "CheckpointLockedError",
    "ManagerClosedError",
    "CheckpointSaveError",
    "CollectiveMismatchError",
    "RankLostError",
    "StorageError",
    "ReaderInvariantError",
]


class DistCkptError(Exception):
    """Root of every distckpt error."""


class ConfigError(DistCkptError, ValueError):
    """A configuration value is invalid; the message names the field and the valid values."""


class CheckpointNotFoundError(DistCkptError, FileNotFoundError):
    """No committed checkpoint where one was required (a named path or step that is absent)."""


class CheckpointCorruptError(DistCkptError, ValueError):
    """A checkpoint's files do not match its manifest (missing, truncated, bad manifest).

    Attributes:
        path: the offending file or directory.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class IncompatibleCheckpointError(DistCkptError, ValueError):
    """The checkpoint does not fit the live training state.

    Attributes:
        missing: keys the live model has and the checkpoint lacks.
        unexpected: keys the checkpoint has and the live model lacks.
        mismatched: ``(key, what, checkpoint value, live value)`` for shape/dtype differences.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[tuple[str, str, str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []


class CheckpointLockedError(DistCkptError, RuntimeError):
    """Another job holds the write lock of this checkpoint root."""


class ManagerClosedError(DistCkptError, RuntimeError):
    """A :class:`~distckpt.CheckpointManager` was used after ``close()`` (or its ``with`` block)."""


class CheckpointSaveError(DistCkptError, RuntimeError):
    """A save failed on at least one rank; nothing was committed.

    Attributes:
        failures: ``{rank: "ExceptionType: message"}`` for every rank that failed.
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class CollectiveMismatchError(DistCkptError, RuntimeError):
    """Not every rank entered the same collective ``CheckpointManager`` call (``save``,
    ``load``): a rank made it with another step or made another call (raised within about a second
    of both calls), or skipped it (raised after ``CheckpointConfig.coordination.arrival_timeout_s``).
    distckpt's process groups are not used by the check, but the ranks are out of step: end the
    job and fix the calling code.

    Attributes:
        call: the call this rank made, e.g. ``"save(step=10)"``.
        missing_ranks: global ranks that did not reach any call at this point.
        other_calls: ``{global rank: call}`` of ranks that made a different call instead.
    """

    def __init__(
        self,
        message: str,
        *,
        call: str = "",
        missing_ranks: list[int] | None = None,
        other_calls: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.call = call
        self.missing_ranks = missing_ranks or []
        self.other_calls = other_calls or {}


class RankLostError(CollectiveMismatchError):
    """A rank missing from a collective ``CheckpointManager`` call (``save``, ``load``) shows no
    sign of life: its liveness counter on the default group's store stood still for
    ``CheckpointConfig.coordination.liveness_timeout_s`` seconds (its node lost, its worker killed
    or exited, or it held the GIL that long), so the waiting ranks raise this after about that long
    instead of waiting ``coordination.arrival_timeout_s``. The job cannot go on without the rank:
    end it and restart it (torchrun restarts its workers up to ``--max-restarts``; ``load()``
    then resumes from the newest checkpoint).

    Attributes:
        lost_ranks: global ranks taken for lost (also in ``missing_ranks``).
    """

    def __init__(
        self,
        message: str,
        *,
        call: str = "",
        missing_ranks: list[int] | None = None,
        other_calls: dict[int, str] | None = None,
        lost_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(message, call=call, missing_ranks=missing_ranks, other_calls=other_calls)
        self.lost_ranks = lost_ranks or []


class StorageError(DistCkptError, OSError):
    """A request to object storage failed after its retries (server unreachable, access
    revoked, an error status): says nothing about the checkpoint, so it is never counted as
    corruption (no fallback, nothing set aside). The message names the URL and the error code,
    never the credentials."""


class ReaderInvariantError(DistCkptError, RuntimeError):
    """The fast reader's own bookkeeping went wrong (bytes hashed out of order, a block read in
    part, an item never read): a bug in distckpt, not a property of the checkpoint, so it is
    never counted as corruption (nothing set aside, no fallback). Set ``load.fast_reader: false`` to
    load with DCP's own reader, and report the message."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message} (a distckpt reader bug, not a damaged checkpoint: set load.fast_reader: false "
            "to load with DCP's reader, and report this)"
        )
