"""Process helpers shared by the demos and the chaos harness: run ``launch.train`` under
torchrun, kill a job as a whole, read its records back, and count its samples.

Used by ``launch/demo.py``, ``launch/elastic_demo.py``, ``tests/chaos`` and the integration
tests. Linux only (the process tree is read from ``/proc``).

Guarantees:

* :func:`start_train` starts torchrun in a session of its own, so :func:`kill_job` reaches it
  and every worker, and nothing of the caller's process group.
* :func:`kill_job` SIGKILLs every process group of the job's process tree (torchrun starts each
  worker in its own session) and returns only once every process of the tree is gone; it
  raises ``RuntimeError`` naming the survivors otherwise.
* :func:`check_timeout` and :func:`launch` never leave a job running: past the timeout, or on
  any exception in the caller's loop, the job is killed (:func:`kill_job`) before raising.
* :func:`read_jsonl` never fails on a record torn by a kill: the torn line is skipped.

Sample accounting. The *kept history* of a run is what its final model was trained on: for a
resumed run, the kept history of the run that wrote its checkpoint up to the checkpoint step,
then its own steps; for a run without a parent, its own steps (those recorded by every rank).
Steps a killed or earlier run executed past the checkpoint are replayed, not kept. The steps
``1..last`` are assigned to epochs in order, as the sampler lays them out: a step whose batch
(``len(ids)`` samples; ``G`` may change at a ``keep_local_batch`` resume) no longer fits in the
``dataset_len`` samples of the current epoch opens the next one. For every epoch ``e`` the kept
history reaches, let ``n_e`` be the samples of its steps and ``E_e`` the first ``n_e`` sample ids
of the sampler's epoch-``e`` permutation (``distckpt._data.ReshardableSampler.permutation``), i.e.
every sample the epoch hands out up to the position reached. With ``c_e(i)`` the number of
times sample ``i`` appears in the kept steps of epoch ``e``:

* ``duplicated_samples = sum_e sum_i max(0, c_e(i) - 1)``
* ``skipped_samples = sum_e |E_e - {i : c_e(i) > 0}|`` (a step missing from the history
  counts its samples as skipped).

Both are 0 exactly when every sample of each epoch was seen once, up to the position reached.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distckpt.data import ReshardableSampler

__all__ = [
    "REPO",
    "Run",
    "KillWhen",
    "read_jsonl",
    "process_tree",
    "alive",
    "kill_job",
    "start_train",
    "check_timeout",
    "launch",
    "load_records",
    "committed_steps",
    "kept_history",
    "sample_accounting",
]

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One torchrun job of ``launch.train`` and what it left on disk.

    Attributes:
        name: label in logs and reports.
        nproc: ranks (``--nproc-per-node``).
        out: ``train.out`` (records and ``torchrun.log``).
        ckpt_root: ``checkpoint.root`` (a directory, or an ``s3://`` URL as a ``str``).
        parent: the run whose checkpoint this one resumes (for :func:`kept_history`).
        reference: whose losses it must reproduce (the demo's default: its baseline).
        load_path: ``checkpoint.load.path`` when set.
        returncode, wall_seconds, killed: how the job ended.
        metrics, events, samples: its records (:func:`load_records`); ``samples`` holds only
            steps every rank recorded.
    """

    name: str
    nproc: int
    out: Path
    ckpt_root: Path | str
    parent: "Run | None" = None
    reference: "Run | None" = None
    load_path: Path | str | None = None
    returncode: int | None = None
    wall_seconds: float = 0.0
    killed: bool = False
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[int, list[int]] = field(default_factory=dict)  # complete steps only

    def event(self, name: str) -> dict[str, Any] | None:
        """The first ``events.jsonl`` record named ``name``, or ``None``."""
        return next((e for e in self.events if e["event"] == name), None)

    @property
    def resumed_from(self) -> int | None:
        """The step it resumed from (its ``resumed`` event), or ``None`` for a fresh start."""
        e = self.event("resumed")
        return None if e is None else e["step"]

    @property
    def last_step(self) -> int:
        """The last step rank 0 recorded in ``metrics.jsonl`` (0: none)."""
        return max(self.metrics, default=0)


# ---------------------------------------------------------------- processes
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file (``[]`` when missing); a torn line (the writer was killed) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants (parents before children), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun job as a whole, like a node failure, and wait until it is gone.

    torchrun starts each worker in a session of its own, so ``os.killpg`` of torchrun's group
    alone would leave the workers running: every process group in the tree is killed (never
    the caller's own), then ``proc`` is reaped and every descendant waited for (30 s each).

    Raises:
        RuntimeError: a process of the tree survived SIGKILL for 30 s.
        subprocess.TimeoutExpired: ``proc`` itself did not exit within 30 s.
    """
    tree = process_tree(proc.pid)
    own, groups = os.getpgid(0), []
    for pid in reversed(tree):  # workers' groups first, torchrun's last
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if pgid != own and pgid not in groups:  # never our own group
            groups.append(pgid)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()  # in case its group could not be signalled
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree[1:]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {tree[1:]} survived SIGKILL")
        time.sleep(0.05)


KillWhen = Callable[[list[dict[str, Any]], list[dict[str, Any]]], bool]
"""``f(metrics records, events records) -> bool``: when true, :func:`launch` kills the job."""


def start_train(run: Run, args: list[str], **env: str) -> subprocess.Popen:
    """Start ``launch.train`` under ``torchrun --standalone`` for ``run``.

    Args:
        run: ``nproc``, ``out`` (created; output goes to ``out/torchrun.log``) and ``ckpt_root``.
        args: ``--config`` and overrides; ``train.out`` and ``checkpoint.root`` are appended.
        env: added to this process's environment (with ``OMP_NUM_THREADS=1``).

    Returns:
        The torchrun process, in a session of its own so :func:`kill_job` reaches every rank.
    """
    run.out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={run.nproc}",
        "-m",
        "launch.train",
        *args,
        f"train.out={run.out}",
        f"checkpoint.root={run.ckpt_root}",
    ]
    with open(run.out / "torchrun.log", "w") as log:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1", **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def check_timeout(proc: subprocess.Popen, run: Run, t0: float, timeout_s: float) -> None:
    """Past ``timeout_s`` since ``t0`` (``time.monotonic()``): kill the job, then raise.

    Raises:
        TimeoutError: naming the run and its log, after :func:`kill_job`.
    """
    if time.monotonic() - t0 > timeout_s:
        kill_job(proc)
        raise TimeoutError(f"{run.name}: still running after {timeout_s:.0f} s; log: {run.out / 'torchrun.log'}")


def launch(run: Run, config: str, overrides: list[str], timeout_s: float, kill_when: KillWhen | None = None) -> None:
    """Run ``torchrun launch/train.py`` for ``run`` to its end; output goes to ``<run.out>/torchrun.log``.

    Args:
        run: the run; ``returncode``, ``wall_seconds``, ``killed`` and its records
            (:func:`load_records`) are set afterwards.
        config: job YAML.
        overrides: ``section.key=value`` for every run; ``checkpoint.load.path`` is added
            when ``run.load_path`` is set.
        timeout_s: the job is killed (whole tree) and ``TimeoutError`` raised past this.
        kill_when: polled every 10 ms while the job runs; when true the job is SIGKILLed as
            a whole and ``run.killed`` set.

    Raises:
        TimeoutError: past ``timeout_s``. On this or any other exception the job is killed first.
    """
    args = ["--config", config, *overrides]
    if run.load_path is not None:
        args.append(f"checkpoint.load.path={run.load_path}")
    t0 = time.monotonic()
    proc = start_train(run, args)
    try:
        while proc.poll() is None:
            check_timeout(proc, run, t0, timeout_s)
            if kill_when is not None and kill_when(
                read_jsonl(run.out / "metrics.jsonl"), read_jsonl(run.out / "events.jsonl")
            ):
                kill_job(proc)
                run.killed = True
                break
            time.sleep(0.01)
    except BaseException:
        if proc.poll() is None:
            kill_job(proc)
        raise
    run.returncode, run.wall_seconds = proc.returncode, time.monotonic() - t0
    load_records(run)


def load_records(run: Run) -> None:
    """Read ``metrics.jsonl``, ``events.jsonl`` and every rank's ``samples.rank<r>.jsonl`` into
    ``run``; ``run.samples`` keeps the steps all ``run.nproc`` ranks recorded, ids in rank order."""
    run.metrics = {m["step"]: m for m in read_jsonl(run.out / "metrics.jsonl")}
    run.events = read_jsonl(run.out / "events.jsonl")
    per_rank = [
        {r["step"]: r["ids"] for r in read_jsonl(run.out / f"samples.rank{rank}.jsonl")} for rank in range(run.nproc)
    ]
    complete = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    run.samples = {s: [i for p in per_rank for i in p[s]] for s in sorted(complete)}


def committed_steps(root: Path) -> list[int]:
    """Steps of committed checkpoints in ``root`` (a ``step-*`` directory with its manifest)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/distckpt.json"))


# ---------------------------------------------------------------- sample accounting
def kept_history(run: Run) -> dict[int, list[int]]:
    """Global sample ids per step of what the run's final state was trained on (module doc)."""
    if run.parent is None or run.resumed_from is None:
        return dict(run.samples)
    c = run.resumed_from
    history = {s: ids for s, ids in kept_history(run.parent).items() if s <= c}
    history.update({s: ids for s, ids in run.samples.items() if s > c})
    return history


def sample_accounting(history: dict[int, list[int]], last_step: int, info: dict[str, Any]) -> tuple[int, int]:
    """``(duplicated_samples, skipped_samples)`` of steps ``1..last_step`` (module doc).

    Args:
        history: global sample ids per step (:func:`kept_history`).
        last_step: the last step to account for.
        info: ``global_batch_size`` (of step 1), ``dataset_len``, ``sampler_seed``.
    """
    g, n = info["global_batch_size"], info["dataset_len"]
    sampler = ReshardableSampler(n, global_batch_size=g, rank=0, world_size=1, seed=info["sampler_seed"])
    seen: dict[int, Counter] = {}
    reached: dict[int, int] = {}  # epoch -> samples its steps hand out
    epoch = pos = 0
    size = g
    for step in range(1, last_step + 1):
        ids = history.get(step)
        size = len(ids) if ids else size  # a step missing from the history: the batch size in force
        if pos + size > n:  # no whole batch left: the epoch's tail is never handed out
            epoch, pos = epoch + 1, 0
        pos += size
        reached[epoch] = pos
        seen.setdefault(epoch, Counter()).update(ids or [])
    duplicated = skipped = 0
    for epoch, end in reached.items():
        expected = set(sampler.permutation(epoch)[:end].tolist())
        counts = seen.get(epoch, Counter())
        duplicated += sum(n - 1 for n in counts.values() if n > 1)
        skipped += len(expected - set(counts))
    return duplicated, skipped
