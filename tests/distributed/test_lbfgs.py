"""torch.optim.LBFGS across ranks (issue 35, item 1): DDP resumes bitwise; FSDP is refused at save."""

import pytest

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def lbfgs_run(rank, world_size, opts):
    """DDP + LBFGS: the uninterrupted run's parameters after step 5, and those of a run saved at
    step 3 and resumed into a fresh model and optimizer. FSDP2: the first save's error."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from distckpt import CheckpointConfig, CheckpointManager, CheckpointSaveError
    from tests.distributed.trainer import Net

    def make(seed):
        torch.manual_seed(seed)
        model = Net()
        if opts["wrapper"] == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=2)

    def steps(model, opt, first, last):
        for step in range(first, last + 1):
            g = torch.Generator().manual_seed(step * world_size + rank)
            x = torch.randn(4, 8, generator=g)

            def closure(x=x):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)

    config = CheckpointConfig(root=opts["root"])
    model, opt = make(0)
    if opts["wrapper"] == "fsdp2":
        with CheckpointManager(config, model=model, optimizer=opt) as m:
            try:
                m.save(0)
            except CheckpointSaveError as e:
                return {"error": str(e)}
        return {"error": None}
    with CheckpointManager(config, model=model, optimizer=opt) as m:
        steps(model, opt, 1, 3)
        m.save(3)
    steps(model, opt, 4, 5)
    model2, opt2 = make(1)
    with CheckpointManager(config, model=model2, optimizer=opt2) as m:
        m.load()
    steps(model2, opt2, 4, 5)
    dist.barrier()
    return {
        "same": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values())),
        "n_iter": (opt.state_dict()["state"][0]["n_iter"], opt2.state_dict()["state"][0]["n_iter"]),
    }


def test_lbfgs_under_ddp_resumes_bitwise(tmp_path):
    for out in values(run_ranks(lbfgs_run, 2, {"root": str(tmp_path), "wrapper": "ddp"})):
        assert out["same"] and out["n_iter"][0] == out["n_iter"][1] > 0


def test_lbfgs_under_fsdp_is_refused_at_the_first_save(tmp_path):
    for out in values(run_ranks(lbfgs_run, 2, {"root": str(tmp_path), "wrapper": "fsdp2"})):
        assert "torch.optim.LBFGS under fsdp2 cannot be checkpointed" in out["error"]
    assert not list(tmp_path.glob("step-*"))
