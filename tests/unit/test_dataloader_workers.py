"""DataLoader workers built by distckpt ignore SIGTERM and still run the caller's worker_init_fn."""

from __future__ import annotations

import signal

import torch

from distckpt.data import ReshardableSampler, SigtermSafeWorkerInit, make_stateful_dataloader


class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        # What the worker's SIGTERM disposition is, seen from inside the worker.
        handler = signal.getsignal(signal.SIGTERM)
        return {"id": i, "ignores_sigterm": callable(handler) and handler not in (signal.SIG_DFL, signal.SIG_IGN)}


def _record(worker_id: int) -> None:
    """A caller's own worker_init_fn (module level: picklable)."""


def test_worker_init_installs_the_handler_then_calls_user_fn() -> None:
    seen = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        SigtermSafeWorkerInit(seen.append)(3)
        assert seen == [3] and signal.getsignal(signal.SIGTERM) not in (previous, signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, previous)


_SCRIPT = """
import os, signal, sys, time
import torch
from distckpt.data import ReshardableSampler, make_stateful_dataloader

class Slow(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return i

sampler = ReshardableSampler(64, global_batch_size=4, rank=0, world_size=1, seed=0)
loader = make_stateful_dataloader(Slow(), sampler, num_workers=2)
it = iter(loader)
next(it)
pids = [w.pid for w in it._workers]
for pid in pids:  # a launcher's SIGTERM reaches the workers: they must live on
    os.kill(pid, signal.SIGTERM)
time.sleep(0.5)
got = [next(it).tolist() for _ in range(3)]
print("alive", all(os.path.exists(f"/proc/{p}") for p in pids), len(got), flush=True)
# leave with the iterator unfinished: interpreter exit must end the workers, not hang
"""


def test_workers_survive_a_launcher_sigterm_and_the_script_still_exits(tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "alive True 3"
    assert "killed by signal" not in proc.stderr  # the workers left cleanly at exit


def test_make_stateful_dataloader_workers_ignore_sigterm() -> None:
    sampler = ReshardableSampler(16, global_batch_size=4, rank=0, world_size=1, seed=0)
    loader = make_stateful_dataloader(_Ids(), sampler, num_workers=2)
    batches = list(loader)
    assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(16))
    assert all(b["ignores_sigterm"].all() for b in batches)
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # the main process is untouched
    loader = make_stateful_dataloader(_Ids(), sampler, num_workers=1, worker_init_fn=_record)
    assert isinstance(loader.worker_init_fn, SigtermSafeWorkerInit) and loader.worker_init_fn.user_fn is _record
    assert all(b["ignores_sigterm"].all() for b in loader)
