"""A tiny Hugging Face ``Trainer`` job for the integration tests and the side-by-side measurement
(``benchmarks/bench_hf_resume.py``): a 2-layer GPT-2 built from a config (random weights, nothing
downloaded) trained on random token sequences, under ``torchrun`` on CPU (gloo).

``--mode distckpt`` runs :class:`distckpt.integrations.hf.DistckptTrainer`; ``--mode hf`` the
stock ``transformers.Trainer`` with its own checkpoints and ``resume_from_checkpoint=True`` when
``--resume``. Every rank appends one JSON line per micro-batch to ``<out>/records-rank<r>.jsonl``:
``{"step": the optimizer step it belongs to, "ids": sample ids, "loss": local loss, "world": W,
"run": torchrun's run id}``;
rank 0 writes ``<out>/timing-<pid>.json`` (seconds from ``train()`` to the first step) and, at the
end, ``<out>/final.pt`` (the model's parameters). ``--kill-at-step N``: rank 0 SIGKILLs itself at
the start of step ``N`` (torchrun then stops the other ranks).

Usage::

    torchrun --standalone --nproc-per-node 2 launch/hf_job.py --out runs/hf --max-steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, N_SAMPLES = 97, 16, 96


class TokenDataset(torch.utils.data.Dataset):
    """``N_SAMPLES`` random token sequences (fixed seed), each with its ``sample_id``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i], "sample_id": i}


def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack the sequences; keep the sample ids beside them (popped before the forward)."""
    return {
        "input_ids": torch.stack([f["input_ids"] for f in features]),
        "labels": torch.stack([f["labels"] for f in features]),
        "sample_ids": [int(f["sample_id"]) for f in features],
    }


def build_model() -> torch.nn.Module:
    """A 2-layer GPT-2 of width 32 from a config, seeded (same weights on every rank), without
    dropout: its masks are drawn per rank, so a run at another world size would draw others."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def trainer_class(base: type) -> type:
    """``base`` (a Trainer class) recording each micro-batch's sample ids and loss."""

    class Recording(base):
        _kill_at: int | None = None  # set by main()
        _first_step_at: float | None = None
        _records: Path

        def compute_loss(self, model, inputs, *args, **kwargs):
            ids = inputs.pop("sample_ids")
            step = self.state.global_step + 1
            if self._kill_at == step and self.args.process_index == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if self._first_step_at is None:
                self._first_step_at = time.perf_counter()
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            record = {"step": step, "ids": ids, "loss": float(loss.item()), "world": self.args.world_size}
            record["run"] = os.environ.get("TORCHELASTIC_RUN_ID", "")
            with open(self._records, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            return loss

    return Recording


def run_job(out: Path, nproc: int, *args: str, timeout_s: float = 300.0) -> tuple[int, float]:
    """Run this job under ``torchrun --standalone`` (``nproc`` ranks, no restarts) with ``args``;
    ``(return code, wall seconds)``. Raises ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["--max-restarts=0", str(Path(__file__).resolve()), "--out", str(out), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path]))
    t0 = time.perf_counter()
    with open(Path(out).parent / f"{Path(out).name}-torchrun.log", "a", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    return proc.returncode, time.perf_counter() - t0


def trajectory(out: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """``{step: {rank: record}}`` of the run as it finally happened: a step recorded by several
    launches (done again after a kill) counts as the last launch did it."""
    order: list[str] = []  # launches, in the order rank 0 saw them
    records = []
    for path in sorted(Path(out).glob("records-rank*.jsonl")):
        rank = int(path.stem[len("records-rank") :])
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a torn last line of a killed rank
                continue
            rec["rank"] = rank
            records.append(rec)
            if rec["run"] not in order:
                order.append(rec["run"])
    final: dict[int, tuple[str, dict[int, dict[str, Any]]]] = {}
    for rec in records:
        run, ranks = final.get(rec["step"], (rec["run"], {}))
        if order.index(rec["run"]) > order.index(run):
            run, ranks = rec["run"], {}
        if rec["run"] == run:
            ranks[rec["rank"]] = rec
        final[rec["step"]] = (run, ranks)
    return {step: ranks for step, (_run, ranks) in sorted(final.items())}


def global_loss(ranks: dict[int, dict[str, Any]]) -> float:
    """The step's loss over the global batch: the mean of the ranks' (equal-sized) local losses."""
    return sum(r["loss"] for r in ranks.values()) / len(ranks)


def sample_order(traj: dict[int, dict[int, dict[str, Any]]]) -> list[int]:
    """The sample ids in global order: step by step, ranks in order (each rank's contiguous slice)."""
    return [i for step in sorted(traj) for rank in sorted(traj[step]) for i in traj[step][rank]["ids"]]


def duplicates_and_skips(order: list[int], n: int = N_SAMPLES) -> tuple[int, int]:
    """Over the complete epochs of ``order`` (``n`` samples each): samples seen more than once
    within their epoch (extra sightings) and samples an epoch missed."""
    dups = skips = 0
    for start in range(0, len(order) - n + 1, n):
        epoch = order[start : start + n]
        dups += len(epoch) - len(set(epoch))
        skips += n - len(set(epoch))
    return dups, skips


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and run the job on this rank."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="output directory (records, checkpoints, final.pt)")
    p.add_argument("--mode", choices=["distckpt", "hf"], default="distckpt")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--per-device", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="hf mode: resume_from_checkpoint=True")
    p.add_argument("--async-save", action="store_true", help="distckpt mode: async_save.mode thread")
    args = p.parse_args(argv)

    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    training_args = TrainingArguments(
        output_dir=str(out / "ckpt"),
        use_cpu=True,
        per_device_train_batch_size=args.per_device,
        max_steps=args.max_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=5,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        seed=7,
        report_to=[],
        remove_unused_columns=False,
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    model = build_model()
    kwargs: dict[str, Any] = dict(model=model, args=training_args, train_dataset=TokenDataset(), data_collator=collate)
    if args.mode == "distckpt":
        from distckpt import AsyncSaveConfig, CheckpointConfig, ScheduleConfig
        from distckpt.integrations.hf import DistckptTrainer

        config = CheckpointConfig(
            root=str(out / "ckpt" / "distckpt"),
            schedule=ScheduleConfig(interval_steps=None),
            async_save=AsyncSaveConfig(mode="thread" if args.async_save else "off"),
        )
        trainer = trainer_class(DistckptTrainer)(checkpoint_config=config, **kwargs)
    else:
        trainer = trainer_class(Trainer)(**kwargs)
    rank = training_args.process_index
    trainer._kill_at = args.kill_at_step
    trainer._first_step_at = None
    trainer._records = out / f"records-rank{rank}.jsonl"
    started = time.perf_counter()
    if args.mode == "hf":
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    else:
        trainer.train()
    if rank == 0:
        timing = {"to_first_step_s": trainer._first_step_at - started, "world": training_args.world_size}
        (out / f"timing-{os.getpid()}.json").write_text(json.dumps(timing))
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(params, out / "final.pt")
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
