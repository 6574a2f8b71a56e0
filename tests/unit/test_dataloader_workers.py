"""DataLoader workers built by distckpt ignore SIGTERM and still run the caller's worker_init_fn."""

from __future__ import annotations

import signal

import pytest
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


@pytest.mark.multiprocess
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


_LAUNCHED = """
import multiprocessing, sys, time
import torch
import torch.multiprocessing
from torchdata.stateful_dataloader import StatefulDataLoader
from distckpt import CheckpointConfig, CheckpointManager
from distckpt.data import ReshardableSampler, make_stateful_dataloader

class Ids(torch.utils.data.Dataset):
    def __len__(self): return 256
    def __getitem__(self, i): return i

KEEP = []  # what a script's module-level loop keeps: the loader and its unfinished iterator

def trainer(rank=0):
    sampler = ReshardableSampler(256, global_batch_size=4, rank=0, world_size=1, seed=0)
    manager = None
    if sys.argv[2] == "make":
        loader = make_stateful_dataloader(Ids(), sampler, num_workers=2)
    else:  # a plain StatefulDataLoader, protected by the manager
        loader = StatefulDataLoader(Ids(), batch_size=4, sampler=sampler, num_workers=2)
        manager = CheckpointManager(CheckpointConfig(root=sys.argv[3]), model=torch.nn.Linear(1, 1),
                                    optimizer=None, dataloader=loader)
    for step, batch in enumerate(loader):
        if step == 3:
            break  # mid-epoch
    if manager is not None:
        manager.close()
    KEEP.append(loader)
    print("returned", time.time(), flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "python":
        trainer()
    elif sys.argv[1] == "mp.Process":
        p = multiprocessing.Process(target=trainer)
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
    else:
        torch.multiprocessing.spawn(trainer, nprocs=1)
    print("exited", time.time(), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher,loader",
    [("python", "make"), ("mp.Process", "make"), ("torch.multiprocessing.spawn", "make"), ("mp.Process", "manager")],
)
def test_a_trainer_that_leaves_its_loop_mid_epoch_exits_under_every_launcher(tmp_path, launcher, loader) -> None:
    """Issue 24, item 8: a multiprocessing child never runs atexit hooks; its exit must still end
    the SIGTERM-proof workers (it terminates and joins them) instead of hanging."""
    import subprocess
    import sys

    script = tmp_path / "launched.py"
    script.write_text(_LAUNCHED)
    proc = subprocess.run(
        [sys.executable, str(script), launcher, loader, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = dict(line.split() for line in proc.stdout.splitlines())
    assert set(times) == {"returned", "exited"}, proc.stdout
    assert float(times["exited"]) - float(times["returned"]) < 20.0  # seconds; it hung for good before
    assert "killed by signal" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_manager_protects_a_plain_loaders_workers_or_refuses_running_ones(tmp_path) -> None:
    """Issue 24, item 7: the manager wraps the worker_init_fn of the loader it is given; workers
    already started unprotected (an iterator made before the manager) are refused with the fix."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from distckpt import CheckpointConfig, CheckpointManager, ConfigError

    def manager(loader, root):
        return CheckpointManager(
            CheckpointConfig(root=str(tmp_path / root)), model=torch.nn.Linear(1, 1), optimizer=None, dataloader=loader
        )

    loader = StatefulDataLoader(_Ids(), batch_size=4, num_workers=2, worker_init_fn=_record)
    manager(loader, "a").close()
    assert isinstance(loader.worker_init_fn, SigtermSafeWorkerInit) and loader.worker_init_fn.user_fn is _record
    assert all(b["ignores_sigterm"].all() for b in loader)
    manager(loader, "b").close()  # already protected: kept, not wrapped twice
    assert loader.worker_init_fn.user_fn is _record
    late = StatefulDataLoader(_Ids(), batch_size=4, num_workers=1)
    it = iter(late)
    next(it)
    with pytest.raises(ConfigError, match="already started 1 worker process.*make_stateful_dataloader"):
        manager(late, "c")
    del it
