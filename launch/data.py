"""Byte-level training data from text nobody here wrote: the interpreter's stdlib sources.

Nothing is downloaded. The corpus is the concatenation of the standard
library's ``.py`` files of the running interpreter, so it is real, varied text
that is always available offline and is identical across ranks on one machine
image (check with :func:`corpus_fingerprint`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EXCLUDED_DIR_NAMES",
    "EXCLUDED_TOP_LEVEL",
    "stdlib_source_files",
    "ByteWindowDataset",
    "corpus_fingerprint",
]

#: Default cap on the corpus size: 4 MiB builds in well under a second and gives
#: ~32k windows of 129 bytes, plenty for the demonstration job.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

#: Directory names skipped at any depth (tests are huge and repetitive; caches are binary).
EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})

#: Top-level stdlib packages skipped (GUI / deprecated tooling, not representative code).
EXCLUDED_TOP_LEVEL = frozenset({"idlelib", "lib2to3", "tkinter", "turtledemo"})


def _stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(max_files: int | None = None) -> list[pathlib.Path]:
    """List the interpreter's standard-library ``.py`` files, deterministically.

    Rule: every regular file ending in ``.py`` under
    ``sysconfig.get_paths()["stdlib"]``, except those with any directory
    component in :data:`EXCLUDED_DIR_NAMES` (``site-packages``,
    ``dist-packages``, ``test``, ``tests``, ``__pycache__``) or whose first
    component is in :data:`EXCLUDED_TOP_LEVEL` (``idlelib``, ``lib2to3``,
    ``tkinter``, ``turtledemo``), and except files that cannot be opened for
    reading. Results are sorted by path relative to the stdlib root in POSIX
    form, then truncated to ``max_files``.

    Args:
        max_files: Keep only the first ``max_files`` files after sorting;
            ``None`` keeps all.

    Returns:
        Absolute paths, sorted by relative POSIX path.
    """
    root = _stdlib_root()
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        # Prune excluded directories in place so os.walk does not descend into them.
        dirnames[:] = [
            d
            for d in dirnames
            if d not in EXCLUDED_DIR_NAMES and not (rel_dir == pathlib.Path(".") and d in EXCLUDED_TOP_LEVEL)
        ]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = pathlib.Path(dirpath) / name
            if not path.is_file() or not os.access(path, os.R_OK):
                continue
            found.append(((rel_dir / name).as_posix(), path))
    found.sort(key=lambda t: t[0])
    paths = [p for _, p in found]
    return paths if max_files is None else paths[:max_files]


def _concat_files(files: Sequence[os.PathLike | str], max_bytes: int | None) -> tuple[bytes, list[pathlib.Path]]:
    """Concatenate file bytes in the given order, separated by ``b"\\n"``, up to ``max_bytes``.

    Unreadable files are skipped. Reading stops once the cap is reached, so a
    small cap stays fast however many files are listed.
    """
    parts: list[bytes] = []
    used: list[pathlib.Path] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            data = pathlib.Path(f).read_bytes()
        except OSError:
            continue
        if parts:
            parts.append(b"\n")
            total += 1
        parts.append(data)
        used.append(pathlib.Path(f))
        total += len(data)
    blob = b"".join(parts)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    return blob, used


class ByteWindowDataset(Dataset):
    """Non-overlapping byte windows over a corpus, for next-byte prediction.

    The corpus is ``b"\\n".join(file bytes)`` over ``files`` in the given order
    (pass :func:`stdlib_source_files` output, which is sorted), truncated to
    ``max_bytes``. It is split into ``len(corpus) // (seq_len + 1)`` consecutive
    windows of ``seq_len + 1`` bytes; any remainder is dropped. Window ``i``
    yields inputs ``w[:-1]`` and targets ``w[1:]``.

    The corpus is held as a numpy ``uint8`` array, so the dataset pickles
    cheaply for DataLoader workers and checkpoints need only store sample ids.

    Attributes:
        corpus: ``np.ndarray`` of dtype ``uint8``, shape ``[num_bytes]``.
        seq_len: Model sequence length ``T``.
        files: The files that contributed bytes (empty if built from bytes).
    """

    def __init__(
        self,
        source: Sequence[os.PathLike | str] | bytes | bytearray | memoryview | None = None,
        *,
        seq_len: int = 128,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
    ) -> None:
        """Build the dataset.

        Args:
            source: A list of files, a bytes-like corpus, or ``None`` for
                ``stdlib_source_files()``.
            seq_len: Tokens per sample ``T``; each window spans ``T + 1`` bytes.
            max_bytes: Cap on the corpus size in bytes (default 4 MiB);
                ``None`` means no cap.

        Raises:
            ValueError: If ``seq_len < 1`` or the corpus is shorter than one window.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if source is None:
            source = stdlib_source_files()
        if isinstance(source, (bytes, bytearray, memoryview)):
            blob = bytes(source)
            if max_bytes is not None:
                blob = blob[:max_bytes]
            self.files: list[pathlib.Path] = []
        else:
            blob, self.files = _concat_files(list(source), max_bytes)
        # Copy into an owned array (frombuffer is read-only and tied to the bytes object).
        self.corpus: np.ndarray = np.frombuffer(blob, dtype=np.uint8).copy()
        self.seq_len = seq_len
        self._window = seq_len + 1
        self._n = len(self.corpus) // self._window
        if self._n == 0:
            raise ValueError(f"corpus of {len(self.corpus)} bytes is shorter than one window of {self._window}")

    def __len__(self) -> int:
        """Number of windows, ``num_bytes // (seq_len + 1)``."""
        return self._n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Return window ``i``.

        Args:
            i: Window index in ``[-len, len)``.

        Returns:
            ``{"input_ids": int64 [seq_len], "targets": int64 [seq_len],
            "sample_id": int64 scalar}`` where ``targets[t] == input_ids[t+1]``
            for ``t < seq_len - 1`` and ``sample_id`` is the non-negative index.

        Raises:
            IndexError: If ``i`` is out of range.
        """
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"window index out of range for {self._n} windows")
        start = i * self._window
        w = torch.from_numpy(self.corpus[start : start + self._window].astype(np.int64))
        return {
            "input_ids": w[:-1],
            "targets": w[1:],
            "sample_id": torch.tensor(i, dtype=torch.long),
        }


def corpus_fingerprint(ds: ByteWindowDataset) -> str:
    """Short content hash of a dataset's corpus, to log which data a run used.

    Args:
        ds: The dataset.

    Returns:
        The first 16 hex digits of the sha256 of the corpus bytes (independent
        of ``seq_len``).
    """
    return hashlib.sha256(ds.corpus.tobytes()).hexdigest()[:16]
