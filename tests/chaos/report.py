"""The chaos run's verdict: parameters compared with the reference, the requirements, the
report (``DIR/report.json``) and its printed summary (see the package docstring)."""

from __future__ import annotations

import argparse
import math
import os
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distckpt._engine import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from distckpt._ondisk.manifest import Manifest
from launch.jobs import kept_history, sample_accounting
from tests.chaos.runner import KillRecord, Segment

__all__ = ["load_model_tensors", "param_diff", "build_report", "print_summary"]


def load_model_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a committed checkpoint, FULL, read in this process.

    Uses distckpt's safe reader (allow-list metadata unpickler, manifest size + hash check of
    each file read) with ``dcp.load(..., no_dist=True)``: no process group needed.
    """
    if str(path).startswith("s3://"):  # an S3 checkpoint (its data prefix): the tools' reader
        from distckpt._tools.reader import CheckpointReader

        reader_s3 = CheckpointReader(str(path))
        return reader_s3.read([k for k in reader_s3.keys("model") if reader_s3.items[k].kind == "tensor"])
    path = Path(path)
    metadata = read_dcp_metadata(path)
    target = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    manifest = Manifest.read(path)
    reader = SafeFileSystemReader(path, expected_files={f.path: (f.size_bytes, f.hash) for f in manifest.files})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return target


def param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max |a - b|`` over all tensors (float64); ``inf`` when keys or shapes differ."""
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def build_report(
    args: argparse.Namespace,
    *,
    segments: list[Segment],
    kills: list[KillRecord],
    diffs: list[dict[str, Any]],
    lost_total: list[int],
    verify_failed_steps: set[int],
    lineage_of: dict[int, frozenset[int]],
    steps: int,
    info: dict[str, Any],
    settings: dict[str, Any],
    end_disk: dict[str, Any],
    reference: dict[str, Any],
    wall_seconds: float,
) -> dict[str, Any]:
    """Check every requirement and assemble ``report.json``.

    Args:
        args: the command line (``kills``, ``ref_world_size``, ``tolerance``).
        segments, kills: every segment run and every kill made, in order.
        diffs: one ``{"step", "segment", "lineage", "bitwise_expected", "max_abs_param_diff",
            "error"}`` per checkpoint compared with the reference.
        lost_total: committed steps lost without retention's reason.
        verify_failed_steps: newest checkpoints that failed a full hash check at an inspection.
        lineage_of: committed step -> world sizes in its history.
        steps: the target step ``T``.
        info: ``global_batch_size``, ``steps_per_epoch``, ``dataset_len``, ``sampler_seed``.
        settings, end_disk, reference: copied into the report as they are.
        wall_seconds: the whole run.

    Returns:
        The report; ``report["ok"]`` is whether every requirement holds.
    """
    n = args.kills
    final = segments[-1]
    final_ok = (
        not final.run.killed and final.run.returncode == 0 and final.run.last_step == steps and final.error is None
    )
    dup, skip = sample_accounting(kept_history(final.run), steps, info) if final_ok else (-1, -1)
    resumes = sum(1 for s in segments if s.run.resumed_from is not None)
    wrong_resumes = sum(1 for s in segments if s.run.resumed_from != s.expected_resume)
    failed_runs = sum(1 for s in segments if s.error is not None)
    # A restart that should have resumed, did not get to log it, and was not killed by us.
    load_failed = sum(
        1 for s in segments if not s.run.killed and s.expected_resume is not None and s.run.resumed_from is None
    )
    corrupt_resumes = sum(1 for s in segments if s.run.resumed_from in verify_failed_steps)
    corrupt_loads = load_failed + corrupt_resumes
    final_diff = None
    if final_ok and steps in lineage_of:
        final_diff = next(d["max_abs_param_diff"] for d in diffs if d["step"] == steps)
    same = [d["max_abs_param_diff"] for d in diffs if d["bitwise_expected"]]
    other = [d["max_abs_param_diff"] for d in diffs if not d["bitwise_expected"]]
    final_bitwise = final.lineage == frozenset({args.ref_world_size})
    ws_changes = sum(1 for a, b in zip(segments, segments[1:]) if a.world_size != b.world_size)
    reqs: list[dict[str, Any]] = []

    def req(what: str, ok: bool, value: Any) -> None:
        reqs.append({"what": what, "ok": bool(ok), "value": value})

    req(f"kills >= {n}", len(kills) >= n, len(kills))
    req(
        f"final segment exited 0 at step {steps}",
        final_ok,
        {"returncode": final.run.returncode, "last_step": final.run.last_step, "error": final.error},
    )
    req("failed_runs == 0 (every job either finished or was killed by us)", failed_runs == 0, failed_runs)
    req(
        "wrong_resumes == 0 (resumed the newest committed checkpoint present at the kill)",
        wrong_resumes == 0,
        wrong_resumes,
    )
    req("corrupt_loads == 0", corrupt_loads == 0, corrupt_loads)
    req("lost_committed_checkpoints == 0", not lost_total, len(lost_total))
    req("duplicated_samples == 0", dup == 0, dup)
    req("skipped_samples == 0", skip == 0, skip)
    req(
        "same world size lineage: params bitwise equal to the reference",
        all(d == 0.0 for d in same),
        max(same, default=None),
    )
    req(
        f"changed world size lineage: |params - reference| <= {args.tolerance:g}",
        all(d <= args.tolerance for d in other),
        max(other, default=None),
    )
    req(
        f"final params {'bitwise' if final_bitwise else f'within {args.tolerance:g}'} of the reference",
        final_diff is not None and (final_diff == 0.0 if final_bitwise else final_diff <= args.tolerance),
        final_diff,
    )
    return {
        "kills": len(kills),
        "resumes": resumes,
        "corrupt_loads": corrupt_loads,
        "lost_committed_checkpoints": len(lost_total),
        "duplicated_samples": dup,
        "skipped_samples": skip,
        "max_abs_param_diff": final_diff,
        "final_bitwise_expected": final_bitwise,
        "max_abs_param_diff_same_world_size": max(same, default=None),
        "max_abs_param_diff_changed_world_size": max(other, default=None),
        "checkpoints_compared": len(diffs),
        "wrong_resumes": wrong_resumes,
        "failed_runs": failed_runs,
        "world_size_changes": ws_changes,
        "segments": len(segments),
        # Not requirements: what kills left behind that nothing cleans up (see the package doc).
        "orphaned_checkpoint_dirs": sorted(end_disk["invalid"]),
        "leftover_entries": end_disk["other"],
        "phases_aimed": dict(Counter(k.phase_aimed for k in kills)),
        "phases_hit": dict(Counter(k.phase_hit for k in kills)),
        "ok": all(r["ok"] for r in reqs),
        "requirements": reqs,
        "wall_seconds": round(wall_seconds, 1),
        "settings": settings,
        "end_of_run_disk": end_disk,
        "per_kill": [asdict(k) for k in kills],
        "per_segment": [
            {
                "segment": s.index,
                "world_size": s.world_size,
                "expected_resume": s.expected_resume,
                "resumed_from": s.run.resumed_from,
                "killed": s.run.killed,
                "returncode": s.run.returncode,
                "last_step": s.run.last_step,
                "lineage": sorted(s.lineage),
                "wall_seconds": round(s.run.wall_seconds, 2),
                "error": s.error,
            }
            for s in segments
        ],
        "param_diffs": diffs,
        "reference": reference,
    }


def print_summary(report: dict[str, Any]) -> None:
    """The per-kill table, the headline figures and each requirement, on stdout."""
    print()
    head = ["kill", "seg", "ranks", "aimed", "hit", "save", "+ms", "newest", "resumed", "ok"]
    rows = [head]
    for k in report["per_kill"]:
        rows.append(
            [
                str(k["kill"]),
                str(k["segment"]),
                f"{k['world_size_before']}->{k['world_size_after']}",
                k["phase_aimed"],
                k["phase_hit"],
                str(k["save_step"]),
                "-" if k["offset_actual_s"] is None else f"{k['offset_actual_s'] * 1e3:.0f}",
                str(k["newest_committed"]),
                str(k["resumed_from"]),
                "ok" if k["resume_ok"] else "NO",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    keys = [
        "kills",
        "resumes",
        "corrupt_loads",
        "lost_committed_checkpoints",
        "duplicated_samples",
        "skipped_samples",
        "max_abs_param_diff",
        "max_abs_param_diff_same_world_size",
        "max_abs_param_diff_changed_world_size",
        "wrong_resumes",
        "world_size_changes",
    ]
    print("  ".join(f"{k}={report[k]}" for k in keys))
    print(f"phases aimed: {report['phases_aimed']}")
    print(f"phases hit:   {report['phases_hit']}")
    if report["orphaned_checkpoint_dirs"] or report["leftover_entries"]:
        print(
            f"  [warn] left in the root at the end: step dirs without a manifest "
            f"{report['orphaned_checkpoint_dirs']}, other entries {report['leftover_entries']}"
        )
    for r in report["requirements"]:
        print(f"  [{'ok' if r['ok'] else 'FAIL'}] {r['what']}: {r['value']}")
