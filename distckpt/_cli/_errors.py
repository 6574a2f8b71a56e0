"""The CLI's one exception-to-message map (known errors -> one line on stderr + exit code).

Exit codes: 0 success; 1 a check found problems (``verify``) or checkpoints differ (``diff``);
2 an error (missing path, not a checkpoint, nothing to verify such as an unmanaged plain DCP
directory, unsafe or damaged metadata, bad arguments, I/O);
130 interrupted. ``--debug`` re-raises instead, showing the traceback.
"""

from __future__ import annotations

from .._errors import CheckpointLockedError, DistCkptError

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_ERROR", "EXIT_INTERRUPTED", "describe"]

EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130

# Most specific first; the message is prefixed with the kind when it helps the operator act.
_KNOWN: tuple[tuple[type[BaseException], str], ...] = (
    (CheckpointLockedError, "locked"),
    (DistCkptError, ""),
    (FileNotFoundError, "not found"),
    (PermissionError, "permission denied"),
    (OSError, ""),
    (ValueError, "invalid value"),
    (ImportError, "missing dependency"),
)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " | ".join(lines) if lines else type(exc).__name__


def describe(exc: BaseException) -> tuple[int, str] | None:
    """``(exit code, one-line message)`` for a known error, ``None`` for a bug (re-raised)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    for kind, label in _KNOWN:
        if isinstance(exc, kind):
            text = _one_line(exc)
            return EXIT_ERROR, f"{label}: {text}" if label and not text.startswith(label) else text
    return None
