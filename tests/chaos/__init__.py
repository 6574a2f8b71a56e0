"""Chaos test: SIGKILL a training job at random instants inside checkpoint saves, restart, check.

A correctness harness (not a benchmark). Usage (from the repository root)::

    python -m tests.chaos --kills 30 --out runs/chaos            # ~5 min on 2 cores
    python -m tests.chaos --kills 5 --out /tmp/chaos             # the CI size, ~1 min

With the memory tier on (``python -m tests.chaos --memory --kills 4``, ``tests/chaos/nodes.py``):
one elastic job of two simulated nodes, random worker crashes and node losses (agent, workers
and memory directory), each recovered from memory; see that module's docstring.

Library code: ``from tests.chaos import main; main([...]) -> int`` (0 when every
requirement holds, 1 when one fails, 2 on bad arguments). Modules: ``aim`` (where to kill,
what a kill hit), ``runner`` (one segment: start, tail the event log, kill), ``report``
(parameter comparison, requirements, ``report.json``), ``driver`` (the command line and the
run), ``nodes`` (the ``--memory`` run). ``tests/chaos/report.json`` is the report of the 30-kill
run quoted in README.

What it runs (every job is ``torchrun --standalone -m launch.train`` under a timeout, with a small
model, a checkpoint every ``--interval`` steps, ``keep_last=--keep-last`` so retention deletes
happen, and a corpus cut to ``--epoch-steps`` steps per epoch so epochs are crossed):

1. ``reference``: one uninterrupted job at ``--ref-world-size`` ranks to step ``T``, keeping
   every checkpoint, so any checkpoint of the chaos root can be compared with the same step.
2. ``chaos``: segments sharing one checkpoint root. Segment ``i`` is SIGKILLed as a whole
   (torchrun and every worker: ``launch.jobs.kill_job``) at an instant drawn from a seeded RNG
   and aimed at one phase of a save (``stage``, ``write``, ``manifest``, ``rename``,
   ``latest``, ``retention``; rarely ``train``, between saves), then segment ``i + 1``
   restarts, the first ``--fixed-kills`` restarts at the reference world size, later ones
   sometimes at another of ``--world-sizes`` (the global batch stays ``--global-batch``).
   After ``--kills`` kills a last segment trains to ``T`` undisturbed.

Aiming. distckpt appends a JSON line ``{"phase", "rank", "step", "t"}`` to
``$DISTCKPT_EVENT_LOG`` just before each phase acts (``distckpt._save.transaction.PHASES``). The
killer tails that file (1 ms poll); on the aimed rank-0 event (the first or second one of the
segment) it waits a random offset inside the phase's window and kills. Most transitions take
well under a millisecond here, so killed segments run with ``LAUNCH_CHAOS_PAUSE_S=--pause-ms``:
``launch/train.py`` then passes ``CheckpointManager(on_phase=chaos_pause_hook())``, the
supported phase hook, which sleeps that long before each phase acts, so every intermediate
on-disk state lasts long enough to be hit (``tests/distributed/test_phase_hook.py`` fails if a
phase is never reached through it). Timing only; no bytes change.

What a kill hit is read from the disk right after it (``phase_hit``): no pending directory yet
-> ``stage``; pending without DCP's ``.metadata`` -> ``write``; with ``.metadata`` but without
the manifest -> ``manifest``; with the manifest -> ``rename``; renamed but ``latest`` still
names the previous one -> ``latest``; a retention victim still present (whole, or already
without its manifest) -> ``retention``; else ``train``.

Checks (``DIR/report.json``; the process exits 1 when one fails):

* ``wrong_resumes``: each restart must resume the newest committed checkpoint present at the
  kill (``distckpt._storage.commit.find_committed`` right after the kill; ``resumed`` in the next
  segment's ``events.jsonl``), or start fresh when there was none.
* ``corrupt_loads``: a restart whose load failed, or a resume from a checkpoint that fails a
  full hash verification (``distckpt._storage.commit.verify``) at the kill.
* ``lost_committed_checkpoints``: a checkpoint valid at one inspection and gone at the next
  without ``--keep-last`` newer valid ones (the only reason retention deletes).
* ``duplicated_samples``, ``skipped_samples``: the demo's accounting (``launch.jobs``) over
  the kept history of the final segment. Sample ids come from ``presave.rank*.jsonl``, written
  before each save (``LAUNCH_CHAOS_PRESAVE_SAMPLES``): ``samples.rank*.jsonl`` is written
  after it, and a kill between the commit and that record would lose a kept step's ids.
* parameters: every checkpoint found at an inspection is compared with the reference's
  checkpoint of the same step (model tensors read in this process with distckpt's safe
  reader, ``dcp.load(no_dist=True)``). Bitwise (``0.0``) where every segment in its lineage
  ran at the reference world size, ``<= --tolerance`` otherwise. ``max_abs_param_diff`` is the
  final step's; ``max_abs_param_diff_same_world_size`` / ``_changed_world_size`` the maxima
  over all compared checkpoints of each kind.
* every killed segment was killed by us, the last one exited 0 at step ``T``, and ``kills``
  reached ``--kills``.

Reported, not required: ``orphaned_checkpoint_dirs`` (``step-*`` directories without a
manifest at the end; a retention delete first renames the checkpoint ``.deleting-step-*``,
which the next start removes, so none are expected) and ``leftover_entries`` (other names in
the root, e.g. a ``latest`` tmp file).
"""

from __future__ import annotations

from tests.chaos.aim import classify_phase, lost_checkpoints
from tests.chaos.driver import main
from tests.chaos.report import load_model_tensors, param_diff
from tests.chaos.runner import JsonlTail

__all__ = ["main", "classify_phase", "lost_checkpoints", "load_model_tensors", "param_diff", "JsonlTail"]
