"""torchrun entry for the preemption test: trains with the test trainer; at step ``--signal-at``
rank ``--victim`` receives SIGTERM (as a scheduler would deliver it to one rank); with
``--signal-group``, its whole process group does, from another process (its DataLoader workers
too, as torchrun's agent sends it: torch's workers ignore a SIGTERM from their own parent)."""

import argparse
import json
import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from distckpt import CheckpointConfig, CheckpointManager, RetentionConfig, ScheduleConfig  # noqa: E402
from tests.distributed.trainer import build, optimizer_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--until", type=int, default=12)
    p.add_argument("--signal-at", type=int, default=-1)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=0)  # a plain StatefulDataLoader's
    p.add_argument("--signal-group", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler, scaler, loader = build(
        rank, world_size, {"wrapper": "ddp", "num_workers": args.num_workers}
    )
    manager = CheckpointManager(
        CheckpointConfig(
            root=args.root, schedule=ScheduleConfig(interval_steps=100), retention=RetentionConfig(keep_last=3)
        ),
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        grad_scaler=scaler,
        dataloader=loader,
    )
    state = manager.load()
    step = state.step if state else 0
    log = open(f"{args.out}.rank{rank}.jsonl", "a")
    while step < args.until:
        for batch in loader:
            loss = optimizer_step(model, optimizer, scheduler, scaler, batch)
            step += 1
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
            if step == args.signal_at and rank == args.victim:
                if args.signal_group:  # from another process, as torchrun's agent sends it to the
                    # rank's process group (torchrun starts each rank in its own session)
                    kill = f"import os; os.killpg({os.getpgid(0)}, {int(signal.SIGTERM)})"
                    subprocess.run([sys.executable, "-c", kill], check=True, start_new_session=True)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)
            manager.maybe_save(step, last_step=step == args.until)  # SystemExit(0) on preemption
            if step == args.until:
                break
    manager.close()
    dist.barrier()  # nobody tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
