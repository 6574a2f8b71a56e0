"""Reclaiming the memory tier's files: at a job's end, this job's directory on every node the
process can reach, and for an operator (``distckpt memory ls|clean``) what no job reclaims, the
memory of a node that never came back (docs/memory.md, "Cleanup").

Only the tier's own file names (:func:`~distckpt._memory.snapfile.file_gen`) inside a directory
named like a job key (``job-<16 hex>``) are ever deleted; any other file is left, and with it
the directory. A user's names are escaped before any glob: they may hold ``[``, ``*``, ``?``.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import CheckpointCorruptError
from .placement import job_key, node_id
from .snapfile import file_gen, parse_name, read_header

__all__ = ["JobMemory", "clean", "open_files", "job_dirs", "reclaim_dir", "remove_if_empty", "scan"]

JOB_DIR = re.compile(r"^job-[0-9a-f]{16}$")


def remove_if_empty(directory: str) -> bool:
    """Remove ``directory`` when it is empty; ``False`` (nothing done) when it is not or is gone."""
    try:
        os.rmdir(directory)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            return False
        raise
    return True


def reclaim_dir(directory: str, *, keep_gen: str | None = None, partial_only: bool = False) -> int:
    """Delete the memory tier's own files in ``directory``: all of them, or all but generation
    ``keep_gen``'s; with ``partial_only``, only slots being written (``.partial``, never
    restorable). Other files are never touched. Returns the bytes freed (allocated sizes)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    freed = 0
    for name in names:
        gen = file_gen(name)
        if gen is None or gen == keep_gen or (partial_only and not name.endswith(".partial")):
            continue
        path = os.path.join(directory, name)
        try:
            freed += os.stat(path).st_blocks * 512
            os.unlink(path)
        except FileNotFoundError:
            pass
    return freed


def job_dirs(template: str, root: str) -> list[str]:
    """The directory of the job of ``root`` on every node this process can reach: ``template``
    (``memory.dir``) with ``{node}`` matching any name (only this node's without ``{node}``)."""
    pattern = "*".join(glob.escape(part) for part in template.split("{node}"))
    found = glob.glob(os.path.join(pattern, glob.escape(job_key(root))))
    return sorted(p for p in found if os.path.isdir(p) and not os.path.islink(p))


def open_files() -> list[tuple[int, str]]:
    """``(process id, path)`` of every file open on this machine, from ``/proc`` (empty without
    it; processes whose descriptors this user may not read are not seen)."""
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                out.append((int(pid), os.readlink(f"/proc/{pid}/fd/{fd}")))
            except OSError:
                continue
    return out


@dataclass
class JobMemory:
    """One job's memory directory on one node, as ``distckpt memory ls`` shows it.

    Attributes:
        path: the directory (``<memory dir>/job-<16 hex>``); node: the node it belongs to.
        steps: the steps of its complete snapshots; ranks: the ranks they hold (own and replicas).
        files, bytes: the tier's own files and their allocated size (bytes); foreign: other files.
        runs: the launches (``$TORCHELASTIC_RUN_ID``) that wrote the snapshots.
        changed: the last change in it (seconds since the epoch): every snapshot renames files.
        pids: processes holding its files open (a live job holds every slot file open).
    """

    path: str
    node: str
    steps: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    foreign: int = 0
    runs: list[str] = field(default_factory=list)
    changed: float = 0.0
    pids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``distckpt memory ... --json``)."""
        return asdict(self)


def scan(template: str) -> list[JobMemory]:
    """Every job directory under the memory directory ``template`` (``{node}``: every node's
    directory this machine reaches; the node is then the name it matched).

    Raises:
        FileNotFoundError: no directory matches ``template``.
    """
    if "{node}" in template:
        head, _, tail = template.partition("{node}")
        pattern = glob.escape(head) + "*" + glob.escape(tail.replace("{node}", "*"))
        nodes = {p: p[len(head) :].split(os.sep)[0] for p in glob.glob(pattern) if os.path.isdir(p)}
    else:
        nodes = {template: node_id()} if os.path.isdir(template) else {}
    if not nodes:
        raise FileNotFoundError(f"memory directory {template}: no such directory")
    out, held = [], open_files()
    for where, node in sorted(nodes.items()):
        for name in sorted(os.listdir(where)):
            path = os.path.join(where, name)
            if JOB_DIR.match(name) and os.path.isdir(path) and not os.path.islink(path):
                inside = os.path.realpath(path) + os.sep
                out.append(_describe(path, node, sorted({pid for pid, f in held if f.startswith(inside)})))
    return out


def _describe(path: str, node: str, pids: list[int]) -> JobMemory:
    job = JobMemory(path=path, node=node, changed=os.stat(path).st_mtime, pids=pids)
    steps, ranks, runs = set(), set(), set()
    for name in os.listdir(path):
        try:
            st = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        job.changed = max(job.changed, st.st_mtime)  # and the directory's: every snapshot renames in it
        if file_gen(name) is None:
            job.foreign += 1
            continue
        job.files += 1
        job.bytes += st.st_blocks * 512
        parsed = parse_name(name)
        if parsed:
            steps.add(parsed[0])
            ranks.add(parsed[1])
            try:
                runs.add(read_header(os.path.join(path, name), verify=False).run)
            except CheckpointCorruptError:
                pass
    job.steps, job.ranks, job.runs = sorted(steps), sorted(ranks), sorted(runs)
    return job


def clean(
    template: str, *, older_than_s: float, force: bool = False, job: str | None = None, dry_run: bool = False
) -> tuple[list[JobMemory], list[tuple[JobMemory, str]]]:
    """Remove the job directories under ``template`` (``job``: only that job key) that no process
    holds open and that have not changed in the last ``older_than_s`` seconds (``force``: whatever
    their state): the tier's own files, then the directory when nothing else is left in it.

    Returns:
        ``(removed, [(kept, why)])``; with ``dry_run``, ``removed`` is what would be removed.

    Raises:
        FileNotFoundError: no directory matches ``template``.
    """
    removed, kept = [], []
    now = time.time()
    for entry in scan(template):
        if job is not None and os.path.basename(entry.path) != job:
            continue
        why = ""
        if entry.pids and not force:
            why = f"in use by process(es) {entry.pids} (a live job); --force removes it anyway"
        elif now - entry.changed < older_than_s and not force:
            why = f"changed {now - entry.changed:.0f} s ago, less than --older-than {older_than_s:g} s"
        if why:
            kept.append((entry, why))
            continue
        if not dry_run:
            reclaim_dir(entry.path)
            if not remove_if_empty(entry.path):
                kept.append(
                    (
                        entry,
                        f"distckpt's files removed; the directory kept: {entry.foreign} file(s) in it not distckpt's",
                    )
                )
                continue
        removed.append(entry)
    return removed, kept
