"""DataLoader workers built by distckpt ignore SIGTERM and still run the caller's worker_init_fn."""

from __future__ import annotations

import pickle
import signal

import torch

from distckpt.data import ReshardableSampler, SigtermSafeWorkerInit, make_stateful_dataloader


class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        # What the worker's SIGTERM disposition is, seen from inside the worker.
        return {"id": i, "ignores_sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN}


def _record(worker_id: int) -> None:
    """A caller's own worker_init_fn (module level: picklable)."""


def test_worker_init_ignores_sigterm_then_calls_user_fn() -> None:
    seen = []
    init = pickle.loads(pickle.dumps(SigtermSafeWorkerInit()))  # picklable for spawn contexts
    previous = signal.getsignal(signal.SIGTERM)
    try:
        SigtermSafeWorkerInit(seen.append)(3)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and seen == [3]
        signal.signal(signal.SIGTERM, previous)
        init(0)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


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
