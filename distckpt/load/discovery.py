"""Which checkpoint of a root a run resumes, and what a run may do among the root's
checkpoints (rank 0's decisions; the manager broadcasts them).

* Resume discovery: the newest committed checkpoint (or ``load_path``), skipping directories
  distckpt did not write, falling back to older ones when allowed, never starting fresh over
  a run's unloadable checkpoints.
* Claims on the root: a run that does not resume from a root holding checkpoints is refused
  (or archives them with ``on_existing: archive``); a ``load_path`` naming ``step-N`` of the
  root is a rollback, whose newer checkpoints are set aside at its first commit.
* Restarts: a root holding a checkpoint committed with the config's initial-load options
  (``load_path``, ``load_step``, the selection) is this run's; the options then no longer apply
  (:mod:`distckpt.load.restart`).
* ``read_only``: nothing is written, claimed or set aside.

The model check (a checkpoint's model specs against the live model's) is
:func:`distckpt.ondisk.manifest.check_model_fits`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..config import CheckpointConfig
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from ..ondisk.layout import LATEST, MANIFEST, checkpoint_name, parse_set_aside, parse_step
from ..ondisk.manifest import Manifest
from ..storage import store_of
from ..storage.commit import (
    existing_checkpoints,
    find_committed,
    remove_leftovers,
    repair_latest,
    set_aside,
    unmanaged_step_dirs,
    validate,
)
from .restart import is_restart

__all__ = ["CheckpointDiscovery", "StoreDiscovery", "make_discovery", "read_manifest_or_none", "refuse_corrupt_only"]

logger = logging.getLogger(__name__)


class CheckpointDiscovery:
    """Rank 0's decisions about one checkpoint root; on other ranks every method is a no-op
    returning ``None`` / ``False``.

    Args:
        root: the checkpoint root.
        config: the manager's config (``load.enabled``, ``load.path``, ``load.on_existing``,
            ``load.fallback_to_older``).
        rank: this process's rank.
        locked: whether this job holds the root's lock: only then may it remove crash
            leftovers or rename (set aside) checkpoints.
    """

    def __init__(self, root: Path, config: CheckpointConfig, *, rank: int, locked: bool) -> None:
        self.root, self.config, self.rank, self.locked = root, config, rank, locked

    def prepare_root(self) -> None:
        """Rank 0: create the root and check that a file can be written in it (``read_only``:
        that it is a directory; nothing is written).

        Raises:
            ConfigError: the root cannot be created or written (names the OS error), or with
                ``read_only`` it is not a directory.
        """
        if self.rank != 0:
            return
        if self.config.load.read_only:
            if not self.root.is_dir():
                raise ConfigError(f"CheckpointConfig.root={str(self.root)!r} (load.read_only: true) is not a directory")
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"CheckpointConfig.root={str(self.root)!r} is not a writable directory: {e}") from e

    def check_existing(self) -> CheckpointConfig:
        """Rank 0: the config this start runs with: for a restart of the run that committed the
        root's checkpoints with this config's initial-load options, the config without them
        (:mod:`distckpt.load.restart`), else the config. A run that does not resume from the root
        must not write among the root's checkpoints (retention, ``latest`` and the next resume
        would mix two runs). Other ranks: the config (rank 0's is broadcast).

        Raises:
            ConfigError: such a run, without ``on_existing: archive`` (or without the lock).
        """
        if self.rank != 0 or self.config.load.read_only:  # a read-only manager writes nothing among them
            return self.config
        existing = existing_checkpoints(self.root)
        if self.config.initial_load is not None and is_restart(
                self.config, str(self.root), ((p.name, read_manifest_or_none(p)) for _, p in reversed(existing))):
            return self.config.for_restart()
        fresh = not self.config.load.enabled
        if not fresh and (self.config.resolved_load_path is None or self.rollback_step() is not None):
            return self.config  # resumes from the root
        if not existing:
            return self.config
        why = ("load.enabled: false" if fresh
               else f"load.path={self.config.load.path!r} is not a step-* directory of the root")
        if self.config.load.on_existing != "archive":
            raise ConfigError(
                f"CheckpointConfig.root={str(self.root)!r} already holds {len(existing)} checkpoint(s), "
                f"newest {existing[-1][1].name}, and this run does not resume from them ({why}; none was "
                "committed with this config's load options, which would make this start a restart). "
                "Choose: resume them (load.enabled: true, with no load.path or one naming a step-* of the "
                "root); load.on_existing: archive to rename them archived-step-N-<n> (nothing is deleted); "
                "or another root.")
        if not self.locked:
            raise ConfigError("CheckpointConfig.load.on_existing='archive' needs coordination.lock: true: it renames "
                              "checkpoints that another job could be writing")
        moved = [f"{p.name} -> {set_aside(p, 'archived').name}" for _, p in existing]
        repair_latest(self.root)
        logger.warning("on_existing=archive (%s): set aside the %d checkpoint(s) in %s, nothing deleted: %s",
                       why, len(moved), self.root, ", ".join(moved))
        return self.config


    def rollback_step(self, *, loaded_step: int | None = None, resumed_step: int | None = None) -> int | None:
        """N when ``load_path`` is ``<root>/step-N``: a resume from within this root; or
        ``resumed_step`` when below ``loaded_step`` (``step_rule: rescale`` moved the counter
        back, so the root's checkpoints above it are set aside like a rollback's)."""
        if resumed_step is not None and loaded_step is not None and resumed_step < loaded_step:
            return resumed_step
        if self.config.resolved_load_path is None:
            return None
        p = Path(self.config.resolved_load_path)
        step = parse_step(p.name)
        return step if step is not None and p.resolve().parent == self.root.resolve() else None


    def plan_rollback(self, step: int) -> bool:
        """Rank 0, after loading ``load_path`` = ``<root>/step-<step>``: the root's newer
        checkpoints are set aside at this run's first commit (:meth:`set_aside_newer`), not
        now, so a manager that only loads (an evaluation) changes nothing."""
        if self.rank != 0 or self.config.load.read_only:
            return False  # never commits: nothing to set aside
        newer = [p.name for s, p in existing_checkpoints(self.root) if s > step]
        if not newer:
            return False
        what = (f"load.path={self.config.resolved_load_path!r}" if self.config.resolved_load_path is not None
                else f"step_rule='rescale' (step {step})" if self.config.elastic.step_rule == "rescale"
                else f"the resumed step {step} (the load selection left out counters)")
        if not self.locked:
            raise ConfigError(f"{what} rolls back {self.root}, whose newer "
                              "checkpoints must be set aside before this run saves: that needs coordination.lock: true")
        logger.warning("rollback to %s: the root's %d newer checkpoint(s) (%s) will be renamed "
                       "rolledback-step-M-<n> at this run's first save (kept, never loaded or deleted)",
                       what, len(newer), ", ".join(newer))
        return True


    def set_aside_newer(self, step: int) -> None:
        """Rank 0, before the first commit after a rollback to ``step``: rename the root's newer
        checkpoints ``rolledback-step-M-<n>`` so this run's steps and ``latest`` are its own."""
        moved = [f"{p.name} -> {set_aside(p, 'rolledback').name}"
                 for s, p in existing_checkpoints(self.root) if s > step]
        repair_latest(self.root)
        if moved:
            again = ("This run's checkpoints record load.path/load.step: a restart with the same config resumes "
                     "them, not the rollback." if self.config.resolved_load_path is not None else "")
            logger.warning("rollback to %s: set aside %d newer checkpoint(s), kept: %s. %s",
                           checkpoint_name(step), len(moved), ", ".join(moved), again)


    def choose(self, rejected: list[str]) -> str | None:
        """Rank 0 picks the checkpoint; other ranks return ``None`` (then broadcast)."""
        if self.rank != 0:
            return None
        if self.locked:
            for name in remove_leftovers(self.root):
                logger.warning("removed %s left by an interrupted save or delete", self.root / name)
            repair_latest(self.root)
        for p in unmanaged_step_dirs(self.root):
            logger.warning("ignoring %s: it has no %s (not written by distckpt, e.g. a plain dcp.save); "
                           "distckpt never loads or deletes it, and a save of its step fails while it is "
                           "there. To use it: `distckpt import %s NEW_ROOT`", p, MANIFEST, p)
        if self.config.resolved_load_path is not None:
            p = Path(self.config.resolved_load_path)
            if self.config.load.step is not None:
                steps = [s for s, _ in existing_checkpoints(self.root)]
                if not p.is_dir():
                    raise CheckpointNotFoundError(
                        f"CheckpointConfig.load.step={self.config.load.step}: no {p.name} in {self.root} "
                        f"(its checkpoints: steps {steps or 'none'})")
                logger.info("load.step=%d: loading %s (the root's newest is step %s)", self.config.load.step,
                            p, max(steps) if steps else "-")
            if not p.is_dir():
                raise CheckpointNotFoundError(f"CheckpointConfig.load.path={str(p)!r} does not exist")
            if not (p / MANIFEST).exists() and (p / ".metadata").exists():
                raise CheckpointNotFoundError(
                    f"CheckpointConfig.load.path={str(p)!r} is a DCP directory without a distckpt "
                    f"manifest ({MANIFEST}), not a distckpt checkpoint. Import its model weights: "
                    f"`distckpt import {p} NEW_ROOT [--step N]`, then set root: NEW_ROOT (or "
                    "load.path: NEW_ROOT/step-...)")
            validate(p)
            return str(p)
        newest_error: CheckpointCorruptError | None = None
        for _step, p, result in find_committed(self.root):
            if not (p / MANIFEST).exists():
                continue  # not distckpt's: warned about above, never loaded
            if str(p) in rejected:
                result = CheckpointCorruptError(f"{p}: failed to load", path=str(p))
            elif isinstance(result, Manifest):
                if newest_error is not None:
                    logger.warning("newest checkpoint is corrupt (%s); falling back to %s "
                                   "(load.fallback_to_older=true)", newest_error, p)
                latest = self.root / LATEST
                last = latest.read_text().strip() if latest.is_file() else p.name
                if newest_error is None and last != p.name and (self.root / last / MANIFEST).is_file():
                    logger.warning("resuming from %s, the newest checkpoint in %s, although the last "
                                   "commit was %s (named by %s): the newer one is another run's or "
                                   "was saved without a load", p.name, self.root, last, LATEST)
                return str(p)
            if not self.config.load.fallback_to_older:
                raise CheckpointCorruptError(
                    f"{result} -- the newest checkpoint {p} is not loadable. Set "
                    "load.fallback_to_older: true to resume from the previous committed checkpoint, "
                    f"or remove {p}.", path=result.path)
            newest_error = newest_error or result
            if self.locked:  # the run will save this step again: move it out of the way
                logger.warning("set aside corrupt checkpoint %s as %s", p, set_aside(p))
                repair_latest(self.root)
        if newest_error is not None:  # never start fresh silently over a run's checkpoints
            raise CheckpointCorruptError(
                f"no committed checkpoint in {self.root} is loadable (newest problem: {newest_error}). "
                "Restore the files, point load.path at a good copy, or move the root away to start "
                "fresh.", path=newest_error.path)
        refuse_corrupt_only(str(self.root), [e.name for e in os.scandir(self.root)] if self.root.is_dir() else [])
        return None


def read_manifest_or_none(checkpoint_dir: Path) -> Manifest | None:
    """The manifest of a POSIX checkpoint directory, or ``None`` when it is unreadable."""
    try:
        return Manifest.read(checkpoint_dir)
    except CheckpointCorruptError:
        return None


def refuse_corrupt_only(root: str, names: list[str]) -> None:
    """A resume finding no committed checkpoint in ``root`` must not start fresh over the run's
    checkpoints set aside as corrupt (``corrupt-step-N-<n>``, e.g. by an earlier start's
    ``fallback_to_older``): a restart would otherwise train from step 0 into the run's root.

    Args:
        root: the checkpoint root (for the message).
        names: the root's entry names (set-aside names, possibly with a ``manifests/`` prefix).

    Raises:
        CheckpointCorruptError: names the corrupt checkpoints and what to do.
    """
    corrupt = sorted(n for n in names if (parsed := parse_set_aside(n.rsplit("/", 1)[-1])) and parsed[0] == "corrupt")
    if corrupt:
        raise CheckpointCorruptError(
            f"no committed checkpoint in {root}: it holds only checkpoints set aside as corrupt "
            f"({', '.join(corrupt)}). Restore one (rename it back to step-N after repairing its files), "
            "point load.path at a good copy, or move the root away (or set load.enabled: false) to start "
            "fresh deliberately.", path=root)


class StoreDiscovery:
    """:class:`CheckpointDiscovery` for a root on object storage (:mod:`distckpt.storage`): the
    same decisions through the store. Checkpoint locations are data-prefix URLs; a checkpoint
    set aside (corrupt, archived, rolled back) keeps its data and loses its ``step-N`` manifest
    name (:meth:`~distckpt.storage.s3.S3Store.set_aside`).

    Args:
        store: the root's store.
        config, rank, locked: as :class:`CheckpointDiscovery`.
    """

    def __init__(self, store: Any, config: CheckpointConfig, *, rank: int, locked: bool) -> None:
        self.store, self.config, self.rank, self.locked = store, config, rank, locked
        self.root = store.root

    def prepare_root(self) -> None:
        """Rank 0: the bucket exists and the credentials reach it (``ConfigError`` otherwise; a
        read, so ``read_only`` changes nothing here)."""
        if self.rank == 0:
            self.store.prepare()

    def _committed(self) -> list[tuple[int, str]]:
        return sorted((s, loc) for s, loc, _ in self.store.find_committed())

    def _load_location(self) -> str | None:
        """``load_path``, or the location of step ``load_step`` of this root (``None``: neither).

        Raises:
            CheckpointNotFoundError: no committed checkpoint of step ``load_step``.
        """
        if self.config.load.step is None:
            return self.config.load.path
        for step, location in self._committed():
            if step == self.config.load.step:
                return location
        raise CheckpointNotFoundError(f"CheckpointConfig.load.step={self.config.load.step}: no committed checkpoint "
                                      f"of that step in {self.root} (`distckpt ls {self.root}` lists them)")

    def check_existing(self) -> CheckpointConfig:
        """As :meth:`CheckpointDiscovery.check_existing`."""
        if self.rank != 0 or self.config.load.read_only:
            return self.config
        if self.config.initial_load is not None and is_restart(self.config, self.root, (
                (checkpoint_name(s), r if isinstance(r, Manifest) else self._manifest_or_none(loc))
                for s, loc, r in self.store.find_committed())):
            return self.config.for_restart()
        fresh = not self.config.load.enabled
        if not fresh and (self._load_location() is None or self.rollback_step() is not None):
            return self.config
        existing = self._committed()
        if not existing:
            return self.config
        if self.config.load.on_existing != "archive":
            raise ConfigError(
                f"CheckpointConfig.root={self.root!r} already holds {len(existing)} checkpoint(s), newest "
                f"{checkpoint_name(existing[-1][0])}, and this run does not resume from them (none was committed "
                "with this config's load options, which would make this start a restart). Resume them "
                "(load.enabled: true), set load.on_existing: archive (their manifests are renamed archived-step-N-<n>, "
                "nothing deleted), or use another root.")
        if not self.locked:
            raise ConfigError("CheckpointConfig.load.on_existing='archive' needs coordination.lock: true")
        moved = [self.store.set_aside(s, "archived") for s, _ in existing]
        self.store.repair_latest()
        logger.warning("on_existing=archive: set aside %d checkpoint(s) in %s, nothing deleted: %s",
                       len(moved), self.root, ", ".join(moved))
        return self.config

    def _manifest_or_none(self, location: str) -> Manifest | None:
        try:
            return self.store.read_manifest(location)
        except (CheckpointCorruptError, OSError):
            return None

    def rollback_step(self, *, loaded_step: int | None = None, resumed_step: int | None = None) -> int | None:
        """N when ``load_path`` is a committed checkpoint of this root (a rollback), or as
        :meth:`CheckpointDiscovery.rollback_step` after ``step_rule: rescale`` moved the step back."""
        if resumed_step is not None and loaded_step is not None and resumed_step < loaded_step:
            return resumed_step
        location = self._load_location()
        if location is None:
            return None
        try:
            return self.store.read_manifest(location).step
        except (CheckpointCorruptError, OSError):
            return None

    def plan_rollback(self, step: int) -> bool:
        """As :meth:`CheckpointDiscovery.plan_rollback`."""
        if self.rank != 0 or self.config.load.read_only:
            return False
        newer = [s for s, _ in self._committed() if s > step]
        if newer and not self.locked:
            raise ConfigError(f"load.path={self.config.load.path!r} rolls back {self.root}: that needs "
                              "coordination.lock: true")
        return bool(newer)

    def set_aside_newer(self, step: int) -> None:
        """As :meth:`CheckpointDiscovery.set_aside_newer`."""
        moved = [self.store.set_aside(s, "rolledback") for s, _ in self._committed() if s > step]
        self.store.repair_latest()
        if moved:
            logger.warning("rollback to %s: set aside %s (kept); this run's checkpoints record its load options, so "
                           "a restart with the same config resumes them", checkpoint_name(step), ", ".join(moved))

    def choose(self, rejected: list[str]) -> str | None:
        """As :meth:`CheckpointDiscovery.choose`: the location to load, or ``None``."""
        if self.rank != 0:
            return None
        if self.locked:
            for name in self.store.remove_leftovers():
                logger.warning("removed %s/%s left by an interrupted save or delete", self.root, name)
            self.store.repair_latest()
        location = self._load_location()
        if location is not None:
            try:  # load_path may be a checkpoint of another root
                store_of(location, self.store).validate(location)
            except CheckpointCorruptError as e:
                raise CheckpointNotFoundError(f"CheckpointConfig.load.path={location!r} is not a "
                                              f"loadable committed checkpoint: {e}") from e
            return location
        newest_error: CheckpointCorruptError | None = None
        for step, location, result in self.store.find_committed():
            if location in rejected:
                result = CheckpointCorruptError(f"{location}: failed to load", path=location)
            elif isinstance(result, Manifest):
                if newest_error is not None:
                    logger.warning("newest checkpoint is corrupt (%s); falling back to %s "
                                   "(load.fallback_to_older=true)", newest_error, location)
                return location
            if not self.config.load.fallback_to_older:
                raise CheckpointCorruptError(
                    f"{result} -- the newest checkpoint {location} is not loadable. Set load.fallback_to_older: "
                    "true to resume from the previous committed checkpoint.", path=result.path)
            newest_error = newest_error or result
            if self.locked:  # the run will save this step again: its manifest name must be free
                logger.warning("set aside corrupt checkpoint %s as %s", location, self.store.set_aside(step))
                self.store.repair_latest()
        if newest_error is not None:
            raise CheckpointCorruptError(
                f"no committed checkpoint in {self.root} is loadable (newest problem: {newest_error}).",
                path=newest_error.path)
        refuse_corrupt_only(self.root, [f"manifests/{n}" for n in self.store.set_aside_names()])
        return None


def make_discovery(store: Any, config: CheckpointConfig, *, rank: int,
                   locked: bool) -> CheckpointDiscovery | StoreDiscovery:
    """The discovery of ``store``'s root: :class:`CheckpointDiscovery` on POSIX (unchanged),
    :class:`StoreDiscovery` on object storage."""
    if store.kind == "posix":
        return CheckpointDiscovery(Path(store.root), config, rank=rank, locked=locked)
    return StoreDiscovery(store, config, rank=rank, locked=locked)
