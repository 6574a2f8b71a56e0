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
    "CheckpointSaveError",
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


class CheckpointSaveError(DistCkptError, RuntimeError):
    """A save failed on at least one rank; nothing was committed.

    Attributes:
        failures: ``{rank: "ExceptionType: message"}`` for every rank that failed.
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}
