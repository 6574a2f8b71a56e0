"""Resilience demo: kill a 2-rank job, resume it on 2 and on 4 ranks, compare with a clean run.

``python -m launch.demo --out runs/demo`` (``make demo``) runs seven ``torchrun`` jobs of
``launch/train.py`` one after another, each under a timeout, all to the same ``N`` steps, all
but g with the same global batch:

a. ``baseline``     2 ranks, uninterrupted.
b. ``killed``       2 ranks; the whole job (torchrun and every worker) is SIGKILLed like a
                    failed node, at a step strictly between two checkpoints after at least one
                    commit (decided by watching its ``metrics.jsonl``).
c. ``resume_2to2``  2 ranks, resumes b's newest checkpoint from b's checkpoint root.
d. ``resume_2to4``  4 ranks, resumes the same checkpoint (from a copy of b's root).
e. ``resume_4to2``  2 ranks, resumes a checkpoint d wrote after its resume.
f. ``resume_4to4``  4 ranks, resumes that same checkpoint; compared with d itself, which
                    trained on from it uninterrupted (same-world exactness at 4 ranks).
g. ``resume_2to4_local``  4 ranks, resumes b's checkpoint (from another copy of b's root) with
                    the per-rank batch kept: global batch ``G * 4 / 2``,
                    ``checkpoint.elastic.batch_policy=keep_local_batch`` (``step_rule`` keep). Its
                    losses are not compared (another global batch trains another trajectory);
                    its samples are: none duplicated or skipped, epochs laid out at the new ``G``
                    from the saved sample position on.

By default the corpus is cut so that an epoch is ``--epoch-steps`` steps, so the runs cross
epoch boundaries before and after the restarts. The demo prints a table, writes
``<out>/summary.json`` (``{"runs": [...], "requirements": [...], ...}``) and exits 1 when a
requirement is missed: same world size ``max_abs_loss_diff == 0.0`` (against the baseline, or
for f against d); changed world size
``<= --tolerance``; no duplicated or skipped samples anywhere; g resumed 2 -> 4 ranks with the
global batch doubled and its step kept.

Sample accounting (kept history, duplicated and skipped samples): see ``launch/jobs.py``.

``--storage s3`` runs the same jobs with every checkpoint root on S3 (a SeaweedFS server the demo
starts on loopback and stops at the end); ``summary.json`` then says ``"storage": "s3"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `launch` is a folder, not an installed package
    sys.path.insert(0, str(REPO))

from distckpt import ConfigError  # noqa: E402
from launch.config import load_job_config  # noqa: E402
from launch.jobs import Run, committed_steps, kept_history, launch, sample_accounting  # noqa: E402
from launch.s3_server import committed_locations, copy_root  # noqa: E402

__all__ = ["main"]


# ---------------------------------------------------------------- analysis
def summarize(run: Run, baseline: Run, info: dict[str, Any], steps: int) -> dict[str, Any]:
    """The summary row of one run."""
    history = kept_history(run)
    # A killed run reached the last step every rank recorded; the others must reach N.
    last = max(run.samples, default=0) if run.killed else steps
    dup, skip = sample_accounting(history, last, info)
    resumed = run.event("resumed")
    c = run.resumed_from
    row: dict[str, Any] = {
        "name": run.name,
        "world_size": run.nproc,
        "saved_world_size": resumed["saved_world_size"] if resumed else None,
        "resumed_from_step": c,
        "steps_replayed": (run.parent.last_step - c) if (run.parent and c is not None) else None,
        "max_abs_loss_diff": None,
        "duplicated_samples": dup,
        "skipped_samples": skip,
        "save_seconds_total": round(sum(m["checkpoint_seconds"] for m in run.metrics.values()), 4),
        "last_step": run.last_step,
        "killed": run.killed,
        "wall_seconds": round(run.wall_seconds, 2),
        "returncode": run.returncode,
        "checkpoint_path": resumed["checkpoint_path"] if resumed else None,
        # The loss probe (a fixed batch) at the save and after the load: proves what was restored.
        "probe_loss_saved": resumed.get("probe_loss_saved") if resumed else None,
        "probe_loss_loaded": resumed.get("probe_loss_loaded") if resumed else None,
        "samples_match_baseline": all(history.get(s) == baseline.samples.get(s) for s in range(1, last + 1)),
        "global_batch_before": info["global_batch_size"],
        "global_batch_after": info["global_batch_size"],
    }
    change = (resumed or {}).get("batch_change")
    if change is not None:  # resumed with another global batch (batch_policy keep_local_batch)
        row.update(
            {k: change[k] for k in ("global_batch_before", "global_batch_after", "step_before", "step_after")},
            samples_match_baseline=None,
            compared_with=None,
            compared_steps=0,
            loss_note="not compared: the global batch changed, so does the trajectory",
        )
        return row
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
    req(
        "killed after a commit, strictly between two checkpoints",
        killed["killed"] and c is not None and c < killed["last_step"] < c + interval,
        {"checkpoint": c, "killed_after_step": killed["last_step"]},
    )
    for r in rows:
        if r["name"] != "killed":
            req(
                f"{r['name']}: exit 0 and reached step {steps}",
                r["returncode"] == 0 and r["last_step"] == steps,
                {"returncode": r["returncode"], "last_step": r["last_step"]},
            )
        req(
            f"{r['name']}: no duplicated or skipped samples",
            r["duplicated_samples"] == 0 and r["skipped_samples"] == 0,
            [r["duplicated_samples"], r["skipped_samples"]],
        )
    for name, saved, now in (
        ("resume_2to2", 2, 2),
        ("resume_2to4", 2, 4),
        ("resume_4to2", 4, 2),
        ("resume_4to4", 4, 4),
    ):
        r = by[name]
        req(
            f"{name}: resumed a checkpoint of {saved} ranks on {now}",
            r["saved_world_size"] == saved and r["world_size"] == now and r["resumed_from_step"] is not None,
            [r["saved_world_size"], r["world_size"], r["resumed_from_step"]],
        )
        saved_probe, loaded_probe = r["probe_loss_saved"], r["probe_loss_loaded"]
        req(
            f"{name}: probe loss after the load within 1% of the saved one",
            saved_probe is not None
            and loaded_probe is not None
            and abs(loaded_probe - saved_probe) <= 0.01 * abs(saved_probe),
            [saved_probe, loaded_probe],
        )
    for name in ("killed", "resume_2to2", "resume_4to4"):
        req(
            f"{name}: loss bitwise equal to {by[name]['compared_with']}",
            by[name]["max_abs_loss_diff"] == 0.0,
            by[name]["max_abs_loss_diff"],
        )
    for name in ("resume_2to4", "resume_4to2"):
        d = by[name]["max_abs_loss_diff"]
        req(f"{name}: |loss - baseline| <= {tolerance:g}", d is not None and d <= tolerance, d)
    r = by["resume_2to4_local"]
    g = by["baseline"]["global_batch_after"]
    req(
        "resume_2to4_local: resumed a checkpoint of 2 ranks on 4 with the per-rank batch kept (global batch "
        "doubled, step kept)",
        r["saved_world_size"] == 2
        and r["world_size"] == 4
        and r.get("global_batch_before") == g
        and r.get("global_batch_after") == 2 * g
        and r.get("step_before") == r.get("step_after") == c,
        {
            k: r.get(k)
            for k in (
                "saved_world_size",
                "world_size",
                "global_batch_before",
                "global_batch_after",
                "step_before",
                "step_after",
            )
        },
    )
    return reqs


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("run", "name"),
        ("ranks", None),
        ("resumed", "resumed_from_step"),
        ("replayed", "steps_replayed"),
        ("G", "G"),
        ("max|dloss|", "max_abs_loss_diff"),
        ("dup", "duplicated_samples"),
        ("skip", "skipped_samples"),
        ("save s", "save_seconds_total"),
        ("wall s", "wall_seconds"),
    ]

    def cell(r: dict[str, Any], key: str | None) -> str:
        if key is None:
            return f"{r['saved_world_size']}->{r['world_size']}" if r["saved_world_size"] else str(r["world_size"])
        if key == "G":
            before, after = r["global_batch_before"], r["global_batch_after"]
            return str(after) if before == after else f"{before}->{after}"
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
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m launch.demo --out runs/demo --steps 40 --set model.d_model=64",
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--config", default="launch/configs/ddp.yaml", help="job YAML for every run")
    p.add_argument("--steps", type=int, default=60, help="N: steps every run reaches (default 60)")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps (default 10)")
    p.add_argument(
        "--epoch-steps",
        type=int,
        default=25,
        help="cut the corpus to this many steps per epoch; 0 keeps the config's (default 25)",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks of runs a, b, c, e (default 2)")
    p.add_argument("--nproc-alt", type=int, default=4, help="ranks of run d (default 4)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="section.key=value",
        help="extra override for every run (repeatable), e.g. --set model.d_model=64",
    )
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |loss diff| after a world-size change")
    p.add_argument("--run-timeout-s", type=float, default=240.0, help="timeout of each torchrun job")
    p.add_argument(
        "--storage",
        choices=("posix", "s3"),
        default="posix",
        help="s3: every checkpoint root is s3://distckpt-demo/<run> on a SeaweedFS server the demo "
        "starts on loopback (launch/s3_server.py; needs the s3 extra)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every requirement holds, else 1."""
    args = _parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    n, interval = args.steps, args.interval
    if not 0 < 2 * interval < n:
        raise SystemExit(f"--interval {interval} must leave room for two checkpoints before --steps {n}")
    overrides = [
        f"train.steps={n}",
        f"train.warmup_steps={n // 6}",
        f"checkpoint.schedule.interval_steps={interval}",
        "train.log_every=10",
        *args.overrides,
    ]  # --set comes last: it wins
    try:
        cfg = load_job_config(REPO / args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.epoch_steps:
        g, window = cfg.data.global_batch_size, cfg.data.seq_len + 1
        overrides.insert(0, f"data.max_bytes={args.epoch_steps * g * window}")
    server = None
    if args.storage == "s3":  # one fresh server for the whole demo; torchrun's workers inherit its env
        from launch.s3_server import S3Server

        server = S3Server().start()
        server.create_bucket("distckpt-demo")
        os.environ.update(server.env())
    roots: dict[str, Any] = {name: out / name / "checkpoints" for name in ("baseline", "resume_4to2", "resume_4to4")}
    roots.update(
        ckpt_killed=out / "ckpt_killed",
        ckpt_killed_copy=out / "ckpt_killed_copy",
        ckpt_killed_copy_local=out / "ckpt_killed_copy_local",
    )
    if server is not None:
        roots = {name: f"s3://distckpt-demo/{name}" for name in roots}
    shared = roots["ckpt_killed"]
    runs = {
        "baseline": Run("baseline", args.nproc, out / "baseline", roots["baseline"]),
        "killed": Run("killed", args.nproc, out / "killed", shared),
    }
    runs["resume_2to2"] = Run("resume_2to2", args.nproc, out / "resume_2to2", shared, parent=runs["killed"])
    runs["resume_2to4"] = Run(
        "resume_2to4", args.nproc_alt, out / "resume_2to4", roots["ckpt_killed_copy"], parent=runs["killed"]
    )
    runs["resume_4to2"] = Run(
        "resume_4to2", args.nproc, out / "resume_4to2", roots["resume_4to2"], parent=runs["resume_2to4"]
    )
    runs["resume_4to4"] = Run(
        "resume_4to4",
        args.nproc_alt,
        out / "resume_4to4",
        roots["resume_4to4"],
        parent=runs["resume_2to4"],
        reference=runs["resume_2to4"],
    )
    runs["resume_2to4_local"] = Run(
        "resume_2to4_local",
        args.nproc_alt,
        out / "resume_2to4_local",
        roots["ckpt_killed_copy_local"],
        parent=runs["killed"],
    )
    g_local = cfg.data.global_batch_size * args.nproc_alt // args.nproc  # the per-rank batch kept
    extra = {
        "resume_2to4_local": [f"data.global_batch_size={g_local}", "checkpoint.elastic.batch_policy=keep_local_batch"]
    }
    for path in [r.out for r in runs.values()] + [shared, out / "ckpt_killed_copy", out / "ckpt_killed_copy_local"]:
        shutil.rmtree(path, ignore_errors=True)  # only what an earlier demo in --out made
    (out / "summary.json").unlink(missing_ok=True)
    config = str(REPO / args.config)

    def go(run: Run, **kw: Any) -> None:
        print(f"[demo] {run.name}: {run.nproc} ranks ...", flush=True)
        launch(run, config, overrides + extra.get(run.name, []), args.run_timeout_s, **kw)
        status = "killed" if run.killed else f"exit {run.returncode}"
        resumed = f", resumed from step {run.resumed_from}" if run.resumed_from is not None else ""
        print(f"[demo] {run.name}: {status} at step {run.last_step}{resumed} ({run.wall_seconds:.1f} s)", flush=True)
        if run.returncode not in (0, None) and not run.killed:
            print((run.out / "torchrun.log").read_text()[-4000:], file=sys.stderr)

    kill_after = interval + max(1, interval // 2)

    def should_kill(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
        committed = any(e["event"] == "checkpoint" for e in events)
        return committed and bool(metrics) and metrics[-1]["step"] >= kill_after

    try:
        go(runs["baseline"])
        go(runs["killed"], kill_when=should_kill)
        if server is None:
            shutil.copytree(shared, out / "ckpt_killed_copy")  # d resumes the same checkpoint as c
            shutil.copytree(shared, out / "ckpt_killed_copy_local")  # and so does g
        else:
            copy_root(server, shared, roots["ckpt_killed_copy"])
            copy_root(server, shared, roots["ckpt_killed_copy_local"])
        go(runs["resume_2to2"])
        go(runs["resume_2to4"])
        d = runs["resume_2to4"]
        where: dict[int, Path | str] = (
            dict(committed_locations(str(d.ckpt_root)))
            if server is not None
            else {s: Path(d.ckpt_root) / f"step-{s:09d}" for s in committed_steps(Path(d.ckpt_root))}
        )
        later = [s for s in sorted(where) if (d.resumed_from or 0) < s < n]
        if later:  # the oldest checkpoint the 4 ranks wrote after their resume
            for name in ("resume_4to2", "resume_4to4"):
                runs[name].load_path = where[later[0]]
                go(runs[name])
        go(runs["resume_2to4_local"])
    except (TimeoutError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()

    base_start = runs["baseline"].event("start") or {}
    info = {
        "global_batch_size": cfg.data.global_batch_size,
        "sampler_seed": cfg.data.seed,
        "dataset_len": base_start.get("dataset_len", 0),
        "steps_per_epoch": base_start.get("steps_per_epoch", 1),
    }
    rows = [summarize(r, runs["baseline"], info, n) for r in runs.values() if r.returncode is not None]
    reqs = (
        check(rows, n, interval, args.tolerance)
        if len(rows) == len(runs)
        else [{"what": "every run ran", "ok": False, "value": [r["name"] for r in rows]}]
    )
    total = time.monotonic() - t_start
    summary = {
        "runs": rows,
        "requirements": reqs,
        "steps": n,
        "interval_steps": interval,
        "global_batch_size": info["global_batch_size"],
        "steps_per_epoch": info["steps_per_epoch"],
        "tolerance": args.tolerance,
        "total_seconds": round(total, 1),
        "config": args.config,
        "overrides": overrides,
        "storage": args.storage,
    }
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
