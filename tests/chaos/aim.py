"""Aiming and classification: where to kill a segment, and what a kill hit, read from the disk.

Pure functions of a seeded RNG and of a checkpoint root's listing; no processes.
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distckpt._ondisk.layout import LATEST, MANIFEST, checkpoint_name, is_deleting, is_pending, parse_step
from distckpt._ondisk.manifest import Manifest
from distckpt._storage.commit import find_committed

__all__ = [
    "PHASE_WEIGHTS",
    "Aim",
    "choose_aim",
    "next_world_size",
    "inspect_root",
    "inspect_s3_root",
    "classify_phase",
    "lost_checkpoints",
    "describe_disk",
]

# Aiming weights: mostly inside a save, the commit transitions as often as the long write.
PHASE_WEIGHTS = {
    "stage": 1.0,
    "write": 2.0,
    "manifest": 1.5,
    "rename": 1.5,
    "latest": 1.5,
    "retention": 2.0,
    "train": 0.5,
}


@dataclass
class Aim:
    """Where to kill a segment.

    Attributes:
        phase: aimed phase (a key of :data:`PHASE_WEIGHTS`).
        event: the rank-0 distckpt event that opens the window (``committed`` for ``train``).
        occurrence: kill at the ``occurrence``-th such event of the segment (1-based).
        offset_s: seconds after the event's timestamp.
    """

    phase: str
    event: str
    occurrence: int
    offset_s: float


def choose_aim(
    rng: random.Random,
    resume: int | None,
    steps: int,
    interval: int,
    pause: float,
    write_s: float,
    step_s: float,
    weights: dict[str, float] = PHASE_WEIGHTS,
) -> Aim | None:
    """Draw phase, occurrence and offset; ``None`` when no save is left before ``steps``.

    Args:
        rng: the run's seeded RNG.
        resume: the step the segment resumes from (``None``: fresh).
        steps: the target step ``T``.
        interval: checkpoint interval (steps).
        pause: ``LAUNCH_CHAOS_PAUSE_S`` of killed segments (seconds).
        write_s: typical write phase (seconds, pause excluded).
        step_s: typical training step (seconds).
    """
    start = resume or 0
    saves_left = (steps - start + interval - 1) // interval  # the save at `steps` included
    if saves_left < 1:
        return None
    phases = [p for p in weights if p != "train" or saves_left >= 2]
    phase = rng.choices(phases, weights=[weights[p] for p in phases])[0]
    limit = saves_left - 1 if phase == "train" else saves_left
    occurrence = 2 if limit >= 2 and rng.random() < 0.25 else 1
    u = rng.random()
    if phase == "write":  # the pause, then DCP writes for ~write_s
        offset, event = pause + u * write_s, "write"
    elif phase == "retention":  # before the delete, then after its .deleting- rename
        offset, event = u * 2 * pause, "retention"
    elif phase == "train":  # the steps after a commit, before the next save
        offset, event = u * max(0.005, (interval - 1) * step_s), "committed"
    else:
        offset, event = u * pause, phase
    return Aim(phase=phase, event=event, occurrence=occurrence, offset_s=offset)


def next_world_size(
    rng: random.Random, restart: int, prev: int, args: argparse.Namespace, changed_so_far: bool, last: bool
) -> int:
    """The reference world size for the first ``fixed_kills`` restarts, then sometimes another;
    the last segment changes it if no restart has (so every run covers resharding)."""
    others = [w for w in args.world_sizes if w != prev]
    if restart <= args.fixed_kills or not others:
        return prev
    if rng.random() < args.change_prob or (last and not changed_so_far):
        return rng.choice(others)
    return prev


def inspect_root(root: Path) -> dict[str, Any]:
    """What a checkpoint root holds now.

    Returns:
        ``{"valid": [steps], "invalid": {step: reason}, "pending": [{name, step, files,
        metadata, manifest, manifest_tmp}], "latest": name or None, "other": [names],
        "deleting": [steps of .deleting- directories]}``;
        ``valid`` per :func:`distckpt._storage.commit.find_committed` (manifest readable, every listed
        file present with its size).
    """
    valid, invalid = [], {}
    for step, _, result in find_committed(root):
        if isinstance(result, Manifest):
            valid.append(step)
        else:
            invalid[step] = str(result)[:200]
    pending, other, deleting = [], [], []
    if root.is_dir():
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_dir() and is_deleting(entry.name):  # a retention delete in progress
                deleting.append(int(entry.name.split("-")[2]))
            elif entry.is_dir() and is_pending(entry.name):
                names = set(os.listdir(entry.path))
                pending.append(
                    {
                        "name": entry.name,
                        "step": int(entry.name.split("-")[2]),
                        "files": len(names),
                        "metadata": ".metadata" in names,
                        "manifest": MANIFEST in names,
                        "manifest_tmp": any(n.startswith(f".{MANIFEST}.tmp") for n in names),
                    }
                )
            elif parse_step(entry.name) is None and entry.name not in (LATEST, ".lock"):
                other.append(entry.name)
    latest = None
    try:
        latest = (root / LATEST).read_text().strip()
    except OSError:
        pass
    return {
        "valid": sorted(valid),
        "invalid": invalid,
        "pending": pending,
        "latest": latest,
        "other": other,
        "deleting": deleting,
    }


def inspect_s3_root(root: str) -> dict[str, Any]:
    """:func:`inspect_root` of an ``s3://`` root: ``valid``/``invalid`` by manifest, ``pending``
    = data prefixes no manifest references (``manifest``: always false, the manifest is the
    commit), ``deleting``: none (retention deletes the manifest first)."""
    from distckpt._storage import find_committed as find_in_store
    from distckpt._storage import open_store

    store: Any = open_store(root)
    valid, invalid = [], {}
    for step, _, result in find_in_store(store):
        if isinstance(result, Manifest):
            valid.append(step)
        else:
            invalid[step] = str(result)[:200]
    pending = []
    for rel in store.unreferenced():
        names = set(store.object_sizes(store.location(rel)))
        pending.append(
            {
                "name": rel.rsplit("/", 1)[-1],
                "step": int(rel.split("-")[1]),
                "files": len(names),
                "metadata": ".metadata" in names,
                "manifest": False,
                "manifest_tmp": False,
            }
        )
    return {
        "valid": sorted(valid),
        "invalid": invalid,
        "pending": pending,
        "latest": store.others().latest,
        "other": [],
        "deleting": [],
    }


def classify_phase(
    disk: dict[str, Any], save_step: int | None, last_event: tuple[str, int | None] | None, keep_last: int
) -> str:
    """The save phase a kill interrupted, read from the disk (see the package docstring).

    Args:
        disk: :func:`inspect_root` right after the kill.
        save_step: step of the save in flight (its last rank-0 ``stage``/``write`` event), or
            ``None`` when no save had started in the segment.
        last_event: ``(phase, step)`` of the last rank-0 event before the kill.
        keep_last: the retention setting.
    """
    if save_step is None:
        return "train"
    pending = [s for s in disk["pending"] if s["step"] == save_step]
    if save_step not in disk["valid"]:
        if not pending:
            return "stage"  # state gathered in memory; nothing on disk yet
        s = pending[0]
        if s["manifest"]:
            return "rename"
        if s["manifest_tmp"] or s["metadata"]:  # DCP writes .metadata after every rank's data
            return "manifest"
        return "write"
    if disk["latest"] != checkpoint_name(save_step):
        return "latest"
    if last_event is not None and last_event[0] == "retention" and last_event[1] is not None:
        victim = last_event[1]
        if victim in disk["valid"] or victim in disk["invalid"] or victim in disk.get("deleting", ()):
            return "retention"  # before the delete, or renamed .deleting- and files still there
    if len([v for v in disk["valid"] if v <= save_step]) > keep_last:
        return "retention"  # latest replaced, retention has more to delete
    return "train"


def lost_checkpoints(before: list[int], after: list[int], keep_last: int) -> list[int]:
    """Valid steps of ``before`` missing from ``after`` that retention had no right to delete.

    Retention deletes a checkpoint only when ``keep_last`` newer committed ones exist.
    """
    now = set(after)
    return sorted(s for s in set(before) - now if sum(1 for t in now if t > s) < keep_last)


def describe_disk(disk: dict[str, Any]) -> str:
    """One line for the printed table."""
    parts = [f"valid={disk['valid']}"]
    if disk["invalid"]:
        parts.append(f"invalid={sorted(disk['invalid'])}")
    for s in disk["pending"]:
        parts.append(
            f"pending@{s['step']}({s['files']} files{', .metadata' if s['metadata'] else ''}"
            f"{', manifest' if s['manifest'] else ''}{', manifest.tmp' if s['manifest_tmp'] else ''})"
        )
    parts.append(f"latest={disk['latest']}")
    return " ".join(parts)
