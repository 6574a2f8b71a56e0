"""Which checkpoint of a root a run resumes, and what a run may do among the root's
checkpoints (rank 0's decisions; the manager broadcasts them).

* Resume discovery: the newest committed checkpoint (or ``load.path``), skipping directories
  distckpt did not write, falling back to older ones when allowed, never starting fresh over
  a run's unloadable checkpoints.
* Claims on the root: a run that does not resume from a root holding checkpoints is refused
  (or archives them with ``load.on_existing: archive``); a ``load.path`` naming ``step-N`` of the
  root is a rollback, whose newer checkpoints are set aside at its first commit.
* Restarts: a root holding a checkpoint committed with the config's initial-load options
  (``load.path``, ``load.step``, the selection) is this run's; the options then no longer apply
  (:mod:`distckpt._load.restart`).
* ``save.enabled: false``: nothing is written, claimed or set aside.

The model check (a checkpoint's model specs against the live model's) is
:func:`distckpt._ondisk.manifest.check_model_fits`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from .._config import CheckpointConfig
from .._errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from .._ondisk.layout import checkpoint_name, location_step, no_manifest_reason, parse_set_aside
from .._ondisk.manifest import Manifest
from .._storage import CheckpointStore, find_committed, step_of, store_of
from .._storage.claims import refuse_or_archive
from .restart import is_restart

__all__ = ["CheckpointDiscovery", "refuse_corrupt_only"]

logger = logging.getLogger(__name__)


class CheckpointDiscovery:
    """Rank 0's decisions about one checkpoint root, through its store (any backend: the
    decisions and messages are the same; only the names of locations differ). On other ranks
    every method is a no-op returning ``None`` / ``False`` / the config.

    Args:
        store: the root's store.
        config: the manager's config (its ``load`` section).
        rank: this process's rank.
        locked: whether this job holds the root's lock: only then may it remove crash
            leftovers or set checkpoints aside.
    """

    def __init__(self, store: CheckpointStore, config: CheckpointConfig, *, rank: int, locked: bool) -> None:
        self.store, self.config, self.rank, self.locked = store, config, rank, locked
        self.root = store.root

    def prepare_root(self) -> None:
        """Rank 0: create the root and check that it is writable (``save.enabled: false``: that it exists;
        nothing is written).

        Raises:
            ConfigError: the root cannot be created or written (names the OS error), the bucket
                is missing or not accessible, or with ``save.enabled: false`` the root is not a directory.
        """
        if self.rank == 0:
            self.store.prepare(read_only=not self.config.save.enabled)

    def _manifests(self) -> Iterator[tuple[str, Manifest | None]]:
        """``(name, manifest or None)`` of the root's checkpoints, newest first, read lazily."""
        for step in reversed(self.store.committed_steps()):
            try:
                manifest: Manifest | None = self.store.read_manifest(self.store.location_of(step))
            except (CheckpointCorruptError, OSError):
                manifest = None
            yield checkpoint_name(step), manifest

    def load_location(self) -> str | None:
        """``load.path``, or the location of step ``load.step`` of this root (``None``: neither).

        Raises:
            CheckpointNotFoundError: no committed checkpoint of step ``load.step``.
        """
        if self.config.load.step is None:
            return None if self.config.load.path is None else str(self.config.load.path)
        steps = self.store.committed_steps()
        if self.config.load.step not in steps:
            raise CheckpointNotFoundError(
                f"CheckpointConfig.load.step={self.config.load.step}: no {checkpoint_name(self.config.load.step)} "
                f"in {self.root} (its checkpoints: steps {steps or 'none'}; `distckpt ls {self.root}` lists them)"
            )
        return self.store.location_of(self.config.load.step)

    def check_existing(self) -> CheckpointConfig:
        """Rank 0: the config this start runs with: for a restart of the run that committed the
        root's checkpoints with this config's initial-load options, the config without them
        (:mod:`distckpt._load.restart`), else the config. A run that does not resume from the root
        must not write among the root's checkpoints (retention, ``latest`` and the next resume
        would mix two runs). Other ranks: the config (rank 0's is broadcast).

        Raises:
            ConfigError: such a run, without ``load.on_existing: archive`` (or without the lock).
        """
        if self.rank != 0 or not self.config.save.enabled:  # a read-only manager writes nothing among them
            return self.config
        if self.config.initial_load is not None and is_restart(self.config, self.root, self._manifests()):
            return self.config.for_restart()
        fresh = not self.config.load.enabled
        if not fresh and (
            self.config.load.step is not None or self.load_location() is None or self.rollback_step() is not None
        ):
            return self.config  # resumes from the root (load.step: a step of the root; load() checks it)
        why = (
            "load.enabled: false" if fresh else f"load.path={self.config.load.path!r} is not a checkpoint of this root"
        )
        refuse_or_archive(
            self.store,
            on_existing=self.config.load.on_existing,
            locked=self.locked,
            subject=f"CheckpointConfig.root={self.root!r}",
            why=f"this run does not resume from them ({why}; none was committed with this config's load "
            "options, which would make this start a restart)",
            choices="resume them (load.enabled: true, with no load.path or one naming a checkpoint of the root); "
            "load.on_existing: archive to set them aside as archived-step-N-<n> (nothing is deleted)",
        )
        return self.config

    def rollback_step(self, *, loaded_step: int | None = None, resumed_step: int | None = None) -> int | None:
        """N when the load location is this root's checkpoint of step N (a resume from within
        this root: its newer checkpoints are set aside at the first commit); or ``resumed_step``
        when below ``loaded_step`` (``step_rule: rescale`` moved the counter back, so the root's
        checkpoints above it are set aside like a rollback's)."""
        if resumed_step is not None and loaded_step is not None and resumed_step < loaded_step:
            return resumed_step
        location = self.load_location()
        return None if location is None else step_of(self.store, location)

    def plan_rollback(self, step: int) -> bool:
        """Rank 0, after loading ``load.path`` = this root's checkpoint of ``step``: the root's
        newer checkpoints are set aside at this run's first commit
        (:class:`~distckpt._save.transaction.Rollback`), not now, so a manager that only loads (an
        evaluation) changes nothing.

        Raises:
            ConfigError: there are newer checkpoints and this job does not hold the lock.
        """
        if self.rank != 0 or not self.config.save.enabled:
            return False  # never commits: nothing to set aside
        newer = [checkpoint_name(s) for s in self.store.committed_steps() if s > step]
        if not newer:
            return False
        location = self.load_location()
        what = (
            f"load.path={location!r}"
            if location is not None
            else f"step_rule='rescale' (step {step})"
            if self.config.elastic.step_rule == "rescale"
            else f"the resumed step {step} (the load selection left out counters)"
        )
        if not self.locked:
            raise ConfigError(
                f"{what} rolls back {self.root}, whose newer "
                "checkpoints must be set aside before this run saves: that needs coordination.lock: true"
            )
        logger.warning(
            "rollback to %s: the root's %d newer checkpoint(s) (%s) will be renamed "
            "rolledback-step-M-<n> at this run's first save (kept, never loaded or deleted)",
            what,
            len(newer),
            ", ".join(newer),
        )
        return True

    def _check_load_location(self, location: str) -> None:
        """``load.path`` / ``load.step`` names a loadable committed checkpoint.

        Raises:
            CheckpointNotFoundError: nothing there, or DCP files without a distckpt manifest.
            CheckpointCorruptError: the checkpoint is damaged.
        """
        store = store_of(location, self.store)  # load.path may be a checkpoint of another root
        if not store.exists(location):
            raise CheckpointNotFoundError(f"CheckpointConfig.load.path={location!r} does not exist")
        if store.is_plain_dcp(location):
            raise CheckpointNotFoundError(
                f"CheckpointConfig.load.path={location!r} is a DCP directory without a distckpt "
                "manifest, not a distckpt checkpoint. Import its model weights: "
                f"`distckpt import {location} NEW_ROOT [--step N]`, then set root: NEW_ROOT (or "
                "load.path: a checkpoint of NEW_ROOT)"
            )
        store.validate(location)

    def choose(self, rejected: list[str]) -> str | None:
        """Rank 0 picks the checkpoint to load (other ranks: ``None``; the manager broadcasts).

        Args:
            rejected: locations that failed to load in this call (``load.fallback_to_older`` then
                moves past them).

        Raises:
            CheckpointNotFoundError: ``load.path`` / ``load.step`` names nothing loadable.
            CheckpointCorruptError: the newest checkpoint is not loadable (without
                ``load.fallback_to_older``), none is, or the root holds only checkpoints set aside
                as corrupt (never a silent fresh start over a run's checkpoints).
        """
        if self.rank != 0:
            return None
        if self.locked:
            for name in self.store.remove_leftovers():
                logger.warning("removed %s/%s left by an interrupted save or delete", self.root, name)
        others = self.store.others()
        for ignored in others.unmanaged:
            logger.warning(
                "ignoring %s: it has no distckpt manifest (not written by distckpt, e.g. a plain "
                "dcp.save); distckpt never loads or deletes it, and a save of its step fails while "
                "it is there. To use it: `distckpt import %s NEW_ROOT`",
                ignored,
                ignored,
            )
        for damaged in others.damaged:
            logger.warning("skipping %s", no_manifest_reason(damaged))
        location = self.load_location()
        if location is not None:
            if self.config.load.step is not None:
                newest = max(self.store.committed_steps(), default=None)
                logger.info(
                    "load.step=%d: loading %s (the root's newest is step %s)",
                    self.config.load.step,
                    location,
                    "-" if newest is None else newest,
                )
            self._check_load_location(location)
            return location
        newest_error: CheckpointCorruptError | None = None
        found_all = list(find_committed(self.store))  # those with a manifest, then those without
        found_all += [
            (_step(loc), loc, CheckpointCorruptError(no_manifest_reason(loc), path=loc)) for loc in others.damaged
        ]
        seen: list[str] = []
        for step, found, result in sorted(found_all, key=lambda e: -e[0]):
            if found in rejected:
                result = CheckpointCorruptError(f"{found}: failed to load", path=found)
            elif isinstance(result, Manifest):
                if newest_error is not None:
                    logger.warning(
                        "newest checkpoint is corrupt (%s); falling back to %s (load.fallback_to_older=true)",
                        newest_error,
                        found,
                    )
                self._warn_if_latest_differs(checkpoint_name(step), newest_error, others.latest)
                return found
            if not self.config.load.fallback_to_older:
                raise CheckpointCorruptError(
                    f"{result} -- the newest checkpoint {found} is not loadable. Set "
                    "load.fallback_to_older: true to resume from the previous committed checkpoint, "
                    f"or remove {found}.",
                    path=result.path,
                )
            newest_error = newest_error or result
            seen.append(found)
            if self.locked:  # the run will save this step again: move it out of the way
                aside = self.store.set_aside(step)
                logger.warning("set aside corrupt checkpoint %s as %s", found, aside)
                seen[-1] += f" (set aside as {aside})"
        if newest_error is not None:  # never start fresh silently over a run's checkpoints
            raise CheckpointCorruptError(
                f"no committed checkpoint in {self.root} is loadable; found {', '.join(seen)} "
                + "".join(
                    f"; unmanaged {u} (no manifest, not distckpt's: `distckpt import` it)" for u in others.unmanaged
                )
                + f" (newest problem: {newest_error}). Restore the files (or the manifest), point "
                "load.path at a good copy, or move the root away to start fresh.",
                path=newest_error.path,
            )
        refuse_corrupt_only(self.root, others.set_aside)
        return None

    def _warn_if_latest_differs(
        self, name: str, newest_error: CheckpointCorruptError | None, latest: str | None
    ) -> None:
        """The newest checkpoint is not the one ``latest`` names: another run's, or a save
        without a load. Resuming the newest is right; the log says so."""
        last = latest or name
        if newest_error is None and last != name and last in {checkpoint_name(s) for s in self.store.committed_steps()}:
            logger.warning(
                "resuming from %s, the newest checkpoint in %s, although the last "
                "commit was %s (named by latest): the newer one is another run's or "
                "was saved without a load",
                name,
                self.root,
                last,
            )


def _step(location: str) -> int:
    return location_step(location) or 0


def refuse_corrupt_only(root: str, names: list[str]) -> None:
    """A resume finding no committed checkpoint in ``root`` must not start fresh over the run's
    checkpoints set aside as corrupt (``corrupt-step-N-<n>``, e.g. by an earlier start's
    ``load.fallback_to_older``): a restart would otherwise train from step 0 into the run's root.

    Args:
        root: the checkpoint root (for the message).
        names: the root's set-aside names, relative to the root (``manifests/...`` on S3).

    Raises:
        CheckpointCorruptError: names the corrupt checkpoints and what to do.
    """
    corrupt = sorted(n for n in names if (parsed := parse_set_aside(n.rsplit("/", 1)[-1])) and parsed[0] == "corrupt")
    if corrupt:
        raise CheckpointCorruptError(
            f"no committed checkpoint in {root}: it holds only checkpoints set aside as corrupt "
            f"({', '.join(corrupt)}). Restore one (rename it back to step-N after repairing its files), "
            "point load.path at a good copy, or move the root away (or set load.enabled: false) to start "
            "fresh deliberately.",
            path=root,
        )
