"""Resilience demo: kill a 2-rank job, resume it on 2 and on 4 ranks, compare with a clean run.

``python -m launch.demo --out runs/demo`` (``make demo``) runs five ``torchrun`` jobs of
``launch/train.py`` one after another, each under a timeout, all to the same ``N`` steps with
the same global batch:

a. ``baseline``     2 ranks, uninterrupted.
b. ``killed``       2 ranks; the whole job (torchrun and every worker) is SIGKILLed like a
                    failed node, at a step strictly between two checkpoints after at least one
                    commit (decided by watching its ``metrics.jsonl``).
c. ``resume_2to2``  2 ranks, resumes b's newest checkpoint from b's checkpoint root.
d. ``resume_2to4``  4 ranks, resumes the same checkpoint (from a copy of b's root).
e. ``resume_4to2``  2 ranks, resumes a checkpoint d wrote after its resume.
f. ``resume_4to4``  4 ranks, resumes that same checkpoint; compared with d itself, which
                    trained on from it uninterrupted (same-world exactness at 4 ranks).

By default the corpus is cut so that an epoch is ``--epoch-steps`` steps, so the runs cross
epoch boundaries before and after the restarts. The demo prints a table, writes
``<out>/summary.json`` (``{"runs": [...], "requirements": [...], ...}``) and exits 1 when a
requirement is missed: same world size ``max_abs_loss_diff == 0.0`` (against the baseline, or
for f against d); changed world size
``<= --tolerance``; no duplicated or skipped samples anywhere.

Sample accounting. The *kept history* of a run is what its final model was trained on: for a
resumed run, the kept history of the run that wrote its checkpoint up to the checkpoint step,
then its own steps; for a run without a parent, its own steps (those recorded by every rank).
Steps a killed or earlier run executed past the checkpoint are replayed, not kept. For every
epoch ``e`` the kept history reaches, let ``k_e`` be the number of its global batches in steps
``1..last`` and ``E_e`` the first ``k_e * G`` sample ids of the sampler's epoch-``e``
permutation (``distckpt.data.ReshardableSampler.permutation``: batch ``k`` is
``perm[k*G:(k+1)*G]``), i.e. every sample the epoch hands out up to the position reached.
With ``c_e(i)`` the number of times sample ``i`` appears in the kept steps of epoch ``e``:

* ``duplicated_samples = sum_e sum_i max(0, c_e(i) - 1)``
* ``skipped_samples = sum_e |E_e - {i : c_e(i) > 0}|`` (a step missing from the history
  counts its samples as skipped).

Both are 0 exactly when every sample of each epoch was seen once, up to the position reached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `launch` is a folder, not an installed package
    sys.path.insert(0, str(REPO))

from distckpt import ConfigError  # noqa: E402
from distckpt.data import ReshardableSampler  # noqa: E402
from launch.config import load_job_config  # noqa: E402

__all__ = ["main"]


@dataclass
class Run:
    """One torchrun job of the demo and what it left on disk."""

    name: str
    nproc: int
    out: Path
    ckpt_root: Path
    parent: "Run | None" = None  # the run whose checkpoint this one resumes
    reference: "Run | None" = None  # whose losses it must reproduce (default: the baseline)
    load_path: Path | None = None
    returncode: int | None = None
    wall_seconds: float = 0.0
    killed: bool = False
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[int, list[int]] = field(default_factory=dict)  # complete steps only

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == name), None)

    @property
    def resumed_from(self) -> int | None:
        e = self.event("resumed")
        return None if e is None else e["step"]

    @property
    def last_step(self) -> int:
        return max(self.metrics, default=0)


# ---------------------------------------------------------------- processes
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (the writer was killed) is ignored."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants, from ``/proc`` (Linux)."""
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


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun job as a whole, like a node failure, and wait until it is gone.

    torchrun starts each worker in a session of its own, so ``os.killpg`` of torchrun's group
    alone would leave the workers running: every process group in the tree is killed.
    """
    tree = _process_tree(proc.pid)
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
    while any(_alive(p) for p in tree[1:]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {tree[1:]} survived SIGKILL")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


KillWhen = Callable[[list[dict[str, Any]], list[dict[str, Any]]], bool]


def start_train(run: Run, args: list[str], **env: str) -> subprocess.Popen:
    """Start ``launch.train`` under torchrun for ``run`` (``args`` then ``train.out`` and
    ``checkpoint.root``), in its own session so :func:`kill_job` reaches every rank; output
    goes to ``run.out/torchrun.log``; ``env`` is added to this process's environment."""
    run.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.nproc}",
           "-m", "launch.train", *args, f"train.out={run.out}", f"checkpoint.root={run.ckpt_root}"]
    with open(run.out / "torchrun.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def check_timeout(proc: subprocess.Popen, run: Run, t0: float, timeout_s: float) -> None:
    """Kill the job and raise ``TimeoutError`` once ``timeout_s`` passed since ``t0`` (monotonic)."""
    if time.monotonic() - t0 > timeout_s:
        kill_job(proc)
        raise TimeoutError(f"{run.name}: still running after {timeout_s:.0f} s; log: {run.out / 'torchrun.log'}")


def launch(run: Run, config: str, overrides: list[str], timeout_s: float,
           kill_when: KillWhen | None = None) -> None:
    """Run ``torchrun launch/train.py`` for ``run``; output goes to ``<run.out>/torchrun.log``.

    Args:
        run: the run; its records are read back into it afterwards.
        config: job YAML.
        overrides: ``section.key=value`` for every run; run-specific ones are added here.
        timeout_s: the job is killed (whole tree) and ``TimeoutError`` raised past this.
        kill_when: ``f(metrics, events) -> bool`` polled while the job runs; when true the
            job is SIGKILLed as a whole.
    """
    args = ["--config", config, *overrides]
    if run.load_path is not None:
        args.append(f"checkpoint.load_path={run.load_path}")
    t0 = time.monotonic()
    proc = start_train(run, args)
    try:
        while proc.poll() is None:
            check_timeout(proc, run, t0, timeout_s)
            if kill_when is not None and kill_when(read_jsonl(run.out / "metrics.jsonl"),
                                                   read_jsonl(run.out / "events.jsonl")):
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
    run.metrics = {m["step"]: m for m in read_jsonl(run.out / "metrics.jsonl")}
    run.events = read_jsonl(run.out / "events.jsonl")
    per_rank = [{r["step"]: r["ids"] for r in read_jsonl(run.out / f"samples.rank{rank}.jsonl")}
                for rank in range(run.nproc)]
    complete = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    run.samples = {s: [i for p in per_rank for i in p[s]] for s in sorted(complete)}


# ---------------------------------------------------------------- analysis
def kept_history(run: Run) -> dict[int, list[int]]:
    """Global sample ids per step of what the run's final state was trained on (see module doc)."""
    if run.parent is None or run.resumed_from is None:
        return dict(run.samples)
    c = run.resumed_from
    history = {s: ids for s, ids in kept_history(run.parent).items() if s <= c}
    history.update({s: ids for s, ids in run.samples.items() if s > c})
    return history


def sample_accounting(history: dict[int, list[int]], last_step: int, info: dict[str, Any]) -> tuple[int, int]:
    """``(duplicated_samples, skipped_samples)`` of steps ``1..last_step`` (see module doc)."""
    g, per_epoch = info["global_batch_size"], info["steps_per_epoch"]
    sampler = ReshardableSampler(info["dataset_len"], global_batch_size=g, rank=0, world_size=1,
                                 seed=info["sampler_seed"])
    seen: dict[int, Counter] = {}
    for step, ids in history.items():
        if 1 <= step <= last_step:
            seen.setdefault((step - 1) // per_epoch, Counter()).update(ids)
    duplicated = skipped = 0
    for epoch in range((last_step - 1) // per_epoch + 1 if last_step else 0):
        batches = min(per_epoch, last_step - epoch * per_epoch)
        expected = set(sampler.permutation(epoch)[: batches * g].tolist())
        counts = seen.get(epoch, Counter())
        duplicated += sum(n - 1 for n in counts.values() if n > 1)
        skipped += len(expected - set(counts))
    return duplicated, skipped


def summarize(run: Run, baseline: Run, info: dict[str, Any], steps: int) -> dict[str, Any]:
    """The summary row of one run."""
    history = kept_history(run)
    # A killed run reached the last step every rank recorded; the others must reach N.
    last = max(run.samples, default=0) if run.killed else steps
    dup, skip = sample_accounting(history, last, info)
    resumed = run.event("resumed")
    c = run.resumed_from
    row: dict[str, Any] = {
        "name": run.name, "world_size": run.nproc,
        "saved_world_size": resumed["saved_world_size"] if resumed else None,
        "resumed_from_step": c,
        "steps_replayed": (run.parent.last_step - c) if (run.parent and c is not None) else None,
        "max_abs_loss_diff": None, "duplicated_samples": dup, "skipped_samples": skip,
        "save_seconds_total": round(sum(m["checkpoint_seconds"] for m in run.metrics.values()), 4),
        "last_step": run.last_step, "killed": run.killed, "wall_seconds": round(run.wall_seconds, 2),
        "returncode": run.returncode, "checkpoint_path": resumed["checkpoint_path"] if resumed else None,
        "samples_match_baseline": all(history.get(s) == baseline.samples.get(s) for s in range(1, last + 1)),
    }
    if run is not baseline:
        ref = run.reference or baseline
        own = [s for s in run.metrics if c is None or s > c]
        diffs = [abs(run.metrics[s]["loss"] - ref.metrics[s]["loss"]) for s in own if s in ref.metrics]
        row["compared_with"] = ref.name
        row["max_abs_loss_diff"] = max(diffs) if diffs else None
        row["compared_steps"] = len(diffs)
    return row


def check(rows: list[dict[str, Any]], steps: int, interval: int, tolerance: float) -> list[dict[str, Any]]:
    """The demo's requirements, each ``{"what", "ok", "value"}``."""
    by = {r["name"]: r for r in rows}
    killed, reqs = by["killed"], []

    def req(what: str, ok: bool, value: Any) -> None:
        reqs.append({"what": what, "ok": bool(ok), "value": value})

    c = by["resume_2to2"]["resumed_from_step"]
    req("killed after a commit, strictly between two checkpoints",
        killed["killed"] and c is not None and c < killed["last_step"] < c + interval,
        {"checkpoint": c, "killed_after_step": killed["last_step"]})
    for r in rows:
        if r["name"] != "killed":
            req(f"{r['name']}: exit 0 and reached step {steps}", r["returncode"] == 0 and r["last_step"] == steps,
                {"returncode": r["returncode"], "last_step": r["last_step"]})
        req(f"{r['name']}: no duplicated or skipped samples",
            r["duplicated_samples"] == 0 and r["skipped_samples"] == 0,
            [r["duplicated_samples"], r["skipped_samples"]])
    for name, saved, now in (("resume_2to2", 2, 2), ("resume_2to4", 2, 4), ("resume_4to2", 4, 2),
                             ("resume_4to4", 4, 4)):
        r = by[name]
        req(f"{name}: resumed a checkpoint of {saved} ranks on {now}",
            r["saved_world_size"] == saved and r["world_size"] == now and r["resumed_from_step"] is not None,
            [r["saved_world_size"], r["world_size"], r["resumed_from_step"]])
    for name in ("killed", "resume_2to2", "resume_4to4"):
        req(f"{name}: loss bitwise equal to {by[name]['compared_with']}", by[name]["max_abs_loss_diff"] == 0.0,
            by[name]["max_abs_loss_diff"])
    for name in ("resume_2to4", "resume_4to2"):
        d = by[name]["max_abs_loss_diff"]
        req(f"{name}: |loss - baseline| <= {tolerance:g}", d is not None and d <= tolerance, d)
    return reqs


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("run", "name"), ("ranks", None), ("resumed", "resumed_from_step"), ("replayed", "steps_replayed"),
            ("max|dloss|", "max_abs_loss_diff"), ("dup", "duplicated_samples"), ("skip", "skipped_samples"),
            ("save s", "save_seconds_total"), ("wall s", "wall_seconds")]

    def cell(r: dict[str, Any], key: str | None) -> str:
        if key is None:
            return f"{r['saved_world_size']}->{r['world_size']}" if r["saved_world_size"] else str(r["world_size"])
        v = r[key]
        if v is None:
            return "-"
        if key == "max_abs_loss_diff":
            return "0.0" if v == 0 else f"{v:.2e}"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    table = [[h for h, _ in cols]] + [[cell(r, k) for _, k in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for n, row in enumerate(table):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


# ---------------------------------------------------------------- driver
def committed_steps(root: Path) -> list[int]:
    """Steps of committed checkpoints in ``root`` (a ``step-*`` directory with its manifest)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/distckpt.json"))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python -m launch.demo --out runs/demo --steps 40 "
                                       "--set model.d_model=64")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--config", default="launch/configs/ddp.yaml", help="job YAML for every run")
    p.add_argument("--steps", type=int, default=60, help="N: steps every run reaches (default 60)")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps (default 10)")
    p.add_argument("--epoch-steps", type=int, default=25,
                   help="cut the corpus to this many steps per epoch; 0 keeps the config's (default 25)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of runs a, b, c, e (default 2)")
    p.add_argument("--nproc-alt", type=int, default=4, help="ranks of run d (default 4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="extra override for every run (repeatable), e.g. --set model.d_model=64")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |loss diff| after a world-size change")
    p.add_argument("--run-timeout-s", type=float, default=240.0, help="timeout of each torchrun job")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every requirement holds, else 1."""
    args = _parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    n, interval = args.steps, args.interval
    if not 0 < 2 * interval < n:
        raise SystemExit(f"--interval {interval} must leave room for two checkpoints before --steps {n}")
    overrides = [f"train.steps={n}", f"train.warmup_steps={n // 6}", f"checkpoint.interval_steps={interval}",
                 "train.log_every=10", *args.overrides]  # --set comes last: it wins
    try:
        cfg = load_job_config(REPO / args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.epoch_steps:
        g, window = cfg.data.global_batch_size, cfg.data.seq_len + 1
        overrides.insert(0, f"data.max_bytes={args.epoch_steps * g * window}")
    shared = out / "ckpt_killed"
    runs = {
        "baseline": Run("baseline", args.nproc, out / "baseline", out / "baseline" / "checkpoints"),
        "killed": Run("killed", args.nproc, out / "killed", shared),
    }
    runs["resume_2to2"] = Run("resume_2to2", args.nproc, out / "resume_2to2", shared, parent=runs["killed"])
    runs["resume_2to4"] = Run("resume_2to4", args.nproc_alt, out / "resume_2to4", out / "ckpt_killed_copy",
                              parent=runs["killed"])
    runs["resume_4to2"] = Run("resume_4to2", args.nproc, out / "resume_4to2", out / "resume_4to2" / "checkpoints",
                              parent=runs["resume_2to4"])
    runs["resume_4to4"] = Run("resume_4to4", args.nproc_alt, out / "resume_4to4", out / "resume_4to4" / "checkpoints",
                              parent=runs["resume_2to4"], reference=runs["resume_2to4"])
    for path in [r.out for r in runs.values()] + [shared, out / "ckpt_killed_copy"]:
        shutil.rmtree(path, ignore_errors=True)  # only what an earlier demo in --out made
    (out / "summary.json").unlink(missing_ok=True)
    config = str(REPO / args.config)

    def go(run: Run, **kw: Any) -> None:
        print(f"[demo] {run.name}: {run.nproc} ranks ...", flush=True)
        launch(run, config, overrides, args.run_timeout_s, **kw)
        status = "killed" if run.killed else f"exit {run.returncode}"
        resumed = f", resumed from step {run.resumed_from}" if run.resumed_from is not None else ""
        print(f"[demo] {run.name}: {status} at step {run.last_step}{resumed} ({run.wall_seconds:.1f} s)",
              flush=True)
        if run.returncode not in (0, None) and not run.killed:
            print((run.out / "torchrun.log").read_text()[-4000:], file=sys.stderr)

    kill_after = interval + max(1, interval // 2)

    def should_kill(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
        committed = any(e["event"] == "checkpoint" for e in events)
        return committed and bool(metrics) and metrics[-1]["step"] >= kill_after

    try:
        go(runs["baseline"])
        go(runs["killed"], kill_when=should_kill)
        shutil.copytree(shared, out / "ckpt_killed_copy")  # d resumes the same checkpoint as c
        go(runs["resume_2to2"])
        go(runs["resume_2to4"])
        d = runs["resume_2to4"]
        later = [s for s in committed_steps(d.ckpt_root) if (d.resumed_from or 0) < s < n]
        if later:  # the oldest checkpoint the 4 ranks wrote after their resume
            for name in ("resume_4to2", "resume_4to4"):
                runs[name].load_path = d.ckpt_root / f"step-{later[0]:09d}"
                go(runs[name])
    except (TimeoutError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    base_start = runs["baseline"].event("start") or {}
    info = {"global_batch_size": cfg.data.global_batch_size, "sampler_seed": cfg.data.seed,
            "dataset_len": base_start.get("dataset_len", 0), "steps_per_epoch": base_start.get("steps_per_epoch", 1)}
    rows = [summarize(r, runs["baseline"], info, n) for r in runs.values() if r.returncode is not None]
    reqs = check(rows, n, interval, args.tolerance) if len(rows) == len(runs) else [
        {"what": "every run ran", "ok": False, "value": [r["name"] for r in rows]}]
    total = time.monotonic() - t_start
    summary = {"runs": rows, "requirements": reqs, "steps": n, "interval_steps": interval,
               "global_batch_size": info["global_batch_size"], "steps_per_epoch": info["steps_per_epoch"],
               "tolerance": args.tolerance, "total_seconds": round(total, 1), "config": args.config,
               "overrides": overrides}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print_table(rows)
    print()
    for r in reqs:
        print(f"  [{'ok' if r['ok'] else 'FAIL'}] {r['what']}: {r['value']}")
    ok = all(r["ok"] for r in reqs)
    print(f"\n{'PASS' if ok else 'FAIL'}: total {total:.1f} s; summary in {out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
