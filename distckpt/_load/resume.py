"""What a manager adds to every save and checks after every load beyond the training state
itself: the experiment tracker's run id and the loss probe (docs/resume.md, "Resume options").

* ``run_id`` (the experiment tracker's run id; the only meaning of "run id" in distckpt): the one
  the user passes to ``CheckpointManager(run_id=...)`` (rank 0's); else the loaded checkpoint's;
  else 16 hex of the start id of the setup exchange (:func:`~distckpt._coord.topology.exchange_setup`).
  It is saved in every checkpoint (``train_state`` and the manifest) and returned by ``load()``, so a resumed job
  logs to the same tracker run.
* The probe: measured on every rank before each save (rank 0's value is recorded in the
  manifest), measured again after ``load()`` and compared with ``load.probe_tolerance``; a mismatch
  raises :class:`~distckpt._errors.IncompatibleCheckpointError` or warns (``load.probe_on_mismatch``).
"""

from __future__ import annotations

import logging

from torch import nn

from .._config import CheckpointConfig
from .._coord.collective import Collective
from .._coord.topology import JobSetup
from .._errors import ConfigError, IncompatibleCheckpointError
from .._ondisk.manifest import Manifest
from .._state.train_state import TrainState
from .probe import ProbeFn, relative_difference, run_probe

__all__ = ["ProbeFn", "RunIdAndProbe"]

logger = logging.getLogger(__name__)


class RunIdAndProbe:
    """The tracker run id and the loss probe of one manager. Every method but :meth:`agreed` is collective.

    Args:
        probe: ``probe(model) -> loss``, or ``None``.
        run_id: the tracker's run id, or ``None`` to keep the checkpoint's (or generate one).
        model: the live model (as passed to the manager).
        collective: the manager's process-group helper.
        config: ``load.probe_tolerance``, ``load.probe_on_mismatch``.
    """

    def __init__(
        self,
        *,
        probe: ProbeFn | None,
        run_id: str | None,
        model: nn.Module,
        collective: Collective,
        config: CheckpointConfig,
    ) -> None:
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ConfigError(
                f"CheckpointManager(run_id={run_id!r}): expected a non-empty string "
                "(the experiment tracker's run id) or None"
            )
        self.probe, self.model, self.collective, self.config = probe, model, collective, config
        self.explicit_run_id = run_id is not None
        self.run_id: str = run_id or ""  # agreed() sets rank 0's

    def agreed(self, setup: JobSetup) -> None:
        """Take the run id from the setup exchange: rank 0's passed one, else 16 hex of the start id."""
        self.run_id = setup.run_id or setup.start_id[16:]

    def measure(self) -> float | None:
        """The probe's loss (rank 0's, on every rank), or ``None`` without a probe."""
        if self.probe is None:
            return None
        return self.collective.broadcast(run_probe(self.probe, self.model))

    def before_save(self, train_state: TrainState) -> None:
        """Set the run id and the probe loss of the state about to be saved."""
        train_state.run_id = self.run_id
        train_state.probe_loss = self.measure()

    def after_load(
        self, train_state: TrainState, manifest: Manifest, path: str, *, wrapper: str, seconds: float
    ) -> None:
        """Set the loaded state's path, saved world size and run id, log the load (rank 0, with
        the live ``wrapper`` and the load's ``seconds``), and compare the probe with the value
        recorded at save.

        Raises:
            IncompatibleCheckpointError: with ``load.probe_on_mismatch: raise``, the probe loss after
                the load differs from the saved one by more than ``load.probe_tolerance`` (relative).
        """
        train_state.checkpoint_path, train_state.saved_world_size = str(path), manifest.world_size
        saved_id = train_state.run_id
        if saved_id is not None and not self.explicit_run_id:
            self.run_id = saved_id
        train_state.run_id = self.run_id
        if self.collective.rank == 0:
            logger.info(
                "loaded %s (step %d, saved by %d ranks as %s, now %d ranks as %s) in %.2f s; run_id %s (%s)",
                path,
                train_state.step,
                manifest.world_size,
                manifest.wrapper,
                self.collective.world_size,
                wrapper,
                seconds,
                self.run_id,
                "the checkpoint's"
                if saved_id == self.run_id
                else f"passed; the checkpoint's was {saved_id}"
                if self.explicit_run_id and saved_id
                else "passed"
                if self.explicit_run_id
                else "new: the checkpoint has none",
            )
        if self.probe is None:
            return
        loaded = self.measure()
        assert loaded is not None  # a probe is set
        train_state.probe_loss_loaded = loaded
        saved = manifest.probe_loss
        if "model" not in self.config.load.selection:  # fresh weights on purpose: nothing to compare
            if self.collective.rank == 0:
                logger.info(
                    "probe loss after loading %s: %.6g; the model was not loaded (load selection), "
                    "so it is not compared with the save's %s",
                    path,
                    loaded,
                    saved,
                )
            return
        if saved is None:
            if self.collective.rank == 0:
                logger.info(
                    "probe loss after loading %s: %.6g; none recorded at its save, nothing to compare", path, loaded
                )
            return
        diff, tol = relative_difference(saved, loaded), self.config.load.probe_tolerance
        if diff <= tol:
            if self.collective.rank == 0:
                logger.info(
                    "probe loss after loading %s: %.6g, at save %.6g (relative difference %.2e "
                    "<= load.probe_tolerance %g): restored",
                    path,
                    loaded,
                    saved,
                    diff,
                    tol,
                )
            return
        message = (
            f"probe loss after loading {path}: {loaded:.6g}, at save {saved:.6g} (relative difference "
            f"{diff:.3g} > load.probe_tolerance {tol:g}): the model does not compute what it computed at the "
            "save, so something it depends on was not restored (weights not loaded or changed after "
            "the load, a non-persistent buffer, a different probe batch or model code). Check the "
            "load selection and the model"
        )
        if self.config.load.probe_on_mismatch == "raise":
            raise IncompatibleCheckpointError(message + ", or set load.probe_on_mismatch: warn to continue anyway.")
        if self.collective.rank == 0:
            logger.warning("%s (load.probe_on_mismatch: warn: continuing)", message)
