"""Which start of a run is its first: where the initial-load options apply.

``load.path``, ``load.step``, ``load.only`` and ``load.exclude``
(:data:`~distckpt._config.INITIAL_LOAD`) say how a run *starts*: from another run's checkpoint
(fine-tuning), from an older step of its own root (a rollback), with parts of the state fresh.
A preemptible job is restarted with the same config, so they apply only at its first start
(torchtitan's ``initial_load_path``). The rule:

* every checkpoint a run commits records its config's initial-load options, as written
  (manifest ``initial_load``);
* a start whose root holds a committed checkpoint (a ``step-N`` with a readable manifest)
  recording the same options is a *restart* of that run: the options are ignored and ``load()``
  resumes the root's newest checkpoint in full, as ``load.enabled: true`` without them would;
* otherwise they apply: the run's first start, or a start whose options were changed.

So a rollback (``load.path`` = ``<root>/step-N``) rolls back once: until the rolled-back run
commits, the root's newer checkpoints are the old run's and a restart rolls back again; its
first commit sets them aside and records the options, and from then on a restart resumes it.
A fine-tune (``load.path`` in another root) restarts from its own checkpoints, never refused
as "another run's" nor archived. Rolling back to the same checkpoint a second time therefore
needs a changed option (``load.step: N`` in place of ``load.path: <root>/step-N`` counts as
changed). A ``save.enabled: false`` manager never commits: for it the options always apply.
"""

from __future__ import annotations

import logging
from typing import Iterable

from .._config import CheckpointConfig
from .._ondisk.manifest import Manifest

__all__ = ["is_restart"]

logger = logging.getLogger(__name__)


def is_restart(config: CheckpointConfig, root: str, checkpoints: Iterable[tuple[str, Manifest | None]]) -> bool:
    """Rank 0: whether this start is a restart of the run that committed ``checkpoints`` with
    ``config``'s initial-load options (the module docstring has the rule). Logs one INFO line
    saying which, when the config sets any of them.

    Args:
        config: the manager's config as given.
        root: the checkpoint root (messages).
        checkpoints: ``(name, manifest or None when unreadable)`` of the root's committed
            checkpoints, newest first; read only until the first match.
    """
    options = config.initial_load
    if options is None or not config.save.enabled:
        return False
    given = ", ".join(f"{k}={v!r}" for k, v in options.items() if v is not None)
    for name, manifest in checkpoints:
        if manifest is not None and manifest.initial_load == options:
            logger.info(
                "restart: %s holds %s, committed by this run (started with %s): those options applied "
                "at its first start only; resuming the root's newest checkpoint, all of it",
                root,
                name,
                given,
            )
            return True
    logger.info(
        "%s apply: %s holds no checkpoint committed with them, so this is the run's first start. "
        "Every checkpoint it commits records them: a restart with the same config resumes those "
        "instead",
        given,
        root,
    )
    return False
