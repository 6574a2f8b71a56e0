"""Copies of the state that run while the next step computes (issue 34, item 2): the memory tier's
snapshot and async background staging. The training loop pays only for starting the copy, and
``optimizer.step()`` waits for it by itself, so a snapshot or a checkpoint never mixes two steps,
with no call from the user."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from distckpt import CheckpointConfig, CheckpointManager, DistCkptError
from distckpt._engine import AsyncWriter
from distckpt._memory import tier as tier_module
from distckpt._state.packing import Packed
from tests.distributed.trainer import build, crash, full_optim, full_params, optimizer_step, release_workers

SLOW_S = 0.4  # a background copy this slow: the next optimizer step would overtake it


def _manager(tmp_path, **sections):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, **sections)
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    return manager, (model, optimizer, scheduler, scaler, loader)


def test_the_snapshot_copy_runs_off_the_step_and_optimizer_step_waits_for_it(tmp_path, slow_memory_copy):
    slow_memory_copy(SLOW_S)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0}
    manager, (model, optimizer, scheduler, scaler, loader) = _manager(tmp_path, memory=memory)
    it = iter(loader)
    for step in (1, 2, 3):
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
    stall = manager.memory.last_stall_s
    expected = {"params": copy.deepcopy(full_params(model)), "optim": copy.deepcopy(full_optim(model, optimizer))}
    t0 = time.perf_counter()
    optimizer_step(model, optimizer, scheduler, scaler, next(it))  # step 4, not snapshotted: waits for the copy
    waited = time.perf_counter() - t0
    manager.memory.wait()
    assert stall < SLOW_S / 2, stall  # the step paid for starting the copy, not for the copy
    assert waited > SLOW_S / 2, waited  # optimizer.step() held back until the copy was done
    crash(manager)  # the snapshots stay for the restart

    restarted, (model2, optimizer2, *_rest, loader2) = _manager(tmp_path, memory=memory)
    state = restarted.load()
    assert state is not None and state.step == 3 and restarted.loader.tier == "memory"
    got = {"params": full_params(model2), "optim": full_optim(model2, optimizer2)}
    for k, v in expected["params"].items():
        assert torch.equal(got["params"][k], v), k  # step 3's values, not step 4's
    assert str(got["optim"]) == str(expected["optim"])
    restarted.close()
    release_workers(loader)
    release_workers(loader2)


def test_wait_staged_waits_for_the_snapshot_copy_before_a_hand_edit(tmp_path, slow_memory_copy):
    slow_memory_copy(SLOW_S)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0}
    manager, (model, optimizer, scheduler, scaler, loader) = _manager(tmp_path, memory=memory)
    it = iter(loader)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.maybe_save(1)
    expected = copy.deepcopy(full_params(model))
    manager.wait_staged()  # as docs/async.md says: before changing a parameter by hand
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    manager.memory.wait()
    crash(manager)

    restarted, (model2, *_rest, loader2) = _manager(tmp_path, memory=memory)
    state = restarted.load()
    assert state is not None and state.step == 1 and restarted.loader.tier == "memory"
    got = full_params(model2)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k  # step 1's values, not the doubled ones
    restarted.close()
    release_workers(loader)
    release_workers(loader2)


@pytest.mark.timeout(120)
def test_background_staging_needs_no_wait_staged_call(tmp_path, monkeypatch):
    waits = []
    real = AsyncWriter.wait_staged

    def counting(self) -> None:
        waits.append(time.perf_counter())
        real(self)

    monkeypatch.setattr(AsyncWriter, "wait_staged", counting)  # before the manager's guard takes it
    manager, (model, optimizer, scheduler, scaler, loader) = _manager(
        tmp_path, async_save={"mode": "thread", "background_staging": True}
    )
    assert manager.async_writer is not None
    it = iter(loader)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.save(1)
    expected = copy.deepcopy(full_params(model))
    before = len(waits)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))  # no manager.wait_staged() here
    assert len(waits) > before  # optimizer.step() waited for the staging by itself
    manager.close()
    release_workers(loader)

    restarted, (model2, *_rest, loader2) = _manager(tmp_path)
    state = restarted.load()
    assert state is not None and state.step == 1
    for k, v in expected.items():
        assert torch.equal(full_params(model2)[k], v), k
    restarted.close()
    release_workers(loader2)


def test_a_snapshot_after_the_state_dict_changes_shape_holds_the_new_state(tmp_path):
    """The tier reuses its snapshot plan while the state_dict's structure repeats: the optimizer's
    state appearing at the first step (new keys) makes a new plan, so the restore has the new
    tensors, bitwise (with the first plan reused, the optimizer state is missing)."""
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    manager, (model, optimizer, scheduler, scaler, loader) = _manager(tmp_path, memory=memory)
    it = iter(loader)
    manager.maybe_save(1)  # before any optimizer step: no optimizer state yet
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.maybe_save(2)
    manager.memory.wait()
    expected = {"params": copy.deepcopy(full_params(model)), "optim": copy.deepcopy(full_optim(model, optimizer))}
    assert expected["optim"]["state"]  # the structure did change between the two snapshots
    crash(manager)  # the snapshots stay for the restart

    restarted, (model2, optimizer2, *_rest, loader2) = _manager(tmp_path, memory=memory)
    state = restarted.load()
    assert state is not None and state.step == 2 and restarted.loader.tier == "memory"
    for k, v in expected["params"].items():
        assert torch.equal(full_params(model2)[k], v), k
    assert str(full_optim(model2, optimizer2)) == str(expected["optim"])
    restarted.close()
    release_workers(loader)
    release_workers(loader2)


class _Counts:
    """Extra state the mutation guard does not protect: a tensor and a list the loop changes in place."""

    def __init__(self) -> None:
        self.seen, self.ids = torch.zeros(3), [1, 2]

    def state_dict(self) -> dict:
        return {"seen": self.seen, "ids": self.ids}

    def load_state_dict(self, sd: dict) -> None:
        self.seen, self.ids = sd["seen"].clone(), list(sd["ids"])


def test_what_the_guard_does_not_protect_is_taken_at_the_snapshot_before_the_loop_changes_it(tmp_path, monkeypatch):
    # The worker lays the snapshot out after maybe_save returned; held back here until the loop
    # has changed the unguarded values in place, it must still write the snapshot's.
    import threading

    go = threading.Event()
    real = tier_module.MemoryTier._lay_out

    def held(self, *args, **kwargs):
        assert go.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tier_module.MemoryTier, "_lay_out", held)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    counts = _Counts()
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    manager = CheckpointManager(config, model=model, optimizer=optimizer, extra_state={"counts": counts})
    optimizer_step(model, optimizer, scheduler, scaler, next(iter(loader)))
    manager.maybe_save(1)
    counts.seen.add_(5.0)  # the next step changes them before the worker reads them
    counts.ids.append(3)
    go.set()
    manager.memory.wait()
    crash(manager)

    again = _Counts()
    model2, optimizer2, *_ = build(0, 1, {})
    restarted = CheckpointManager(config, model=model2, optimizer=optimizer2, extra_state={"counts": again})
    assert restarted.load().step == 1 and restarted.loader.tier == "memory"
    assert torch.equal(again.seen, torch.zeros(3)) and again.ids == [1, 2]
    restarted.close()
    release_workers(loader)


def test_small_values_are_taken_at_the_snapshot_and_serialized_on_the_worker(tmp_path, monkeypatch):
    # A plain extra value, the loader's position and the RNG are serialized by the worker, after
    # maybe_save returned and the loop went on (held here until it changed them): the snapshot
    # must hold the step's values, taken at maybe_save.
    import threading

    go = threading.Event()
    packed_on: list[str] = []
    real_lay_out, real_bytes = tier_module.MemoryTier._lay_out, Packed.bytes

    def held(self, *args, **kwargs):
        assert go.wait(30)
        return real_lay_out(self, *args, **kwargs)

    def recorded(self):
        packed_on.append(threading.current_thread().name)
        return real_bytes(self)

    monkeypatch.setattr(tier_module.MemoryTier, "_lay_out", held)
    monkeypatch.setattr(Packed, "bytes", recorded)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    history = {"ids": [1, 2]}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, dataloader=loader, extra_state={"history": history}
    )
    it = iter(loader)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.maybe_save(1)
    expected_rng = torch.get_rng_state()
    history["ids"].append(3)  # the next step changes them before the worker reads them
    batch_2 = next(it)
    torch.rand(7)
    go.set()
    manager.memory.wait()
    assert packed_on and set(packed_on) == {"distckpt-memory"}, packed_on  # off the training thread
    crash(manager)

    model2, optimizer2, _, _, loader2 = build(0, 1, {})
    again = {"ids": []}
    restarted = CheckpointManager(
        config, model=model2, optimizer=optimizer2, dataloader=loader2, extra_state={"history": again}
    )
    assert restarted.load().step == 1 and restarted.loader.tier == "memory"
    assert restarted.state.extra_state["history"] == {"ids": [1, 2]}  # not [1, 2, 3]
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert torch.equal(next(iter(loader2))["id"], batch_2["id"])  # the loader resumes at batch 2
    restarted.close()
    release_workers(loader)
    release_workers(loader2)


def test_a_value_load_could_not_read_is_refused_at_the_snapshot(tmp_path):
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    manager = CheckpointManager(config, model=model, optimizer=optimizer, extra_state={"bad": {"x": object()}})
    optimizer_step(model, optimizer, scheduler, scaler, next(iter(loader)))
    with pytest.raises(TypeError, match=r"extra_state\['bad'\]\['x'\]"):
        manager.maybe_save(1)
    manager.close()
    release_workers(loader)


def test_the_worker_flattens_the_model_and_optimizer_parts_as_they_were_at_the_snapshot(tmp_path, monkeypatch):
    # The model and optimizer parts are handed to the worker unflattened; held here until the loop
    # has set a new learning rate (as a manual warmup does before optimizer.step()), the snapshot
    # must still hold the step's param groups and optimizer state.
    import threading

    go = threading.Event()
    flattened_on: list[str] = []

    class Held(tier_module.LeanSavePlanner):
        def set_up_planner(self, *args, **kwargs):
            assert go.wait(30)
            flattened_on.append(threading.current_thread().name)
            return super().set_up_planner(*args, **kwargs)

    monkeypatch.setattr(tier_module, "LeanSavePlanner", Held)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    manager, (model, optimizer, scheduler, scaler, loader) = _manager(tmp_path, memory=memory)
    it = iter(loader)
    for step in (1, 2):
        if step == 2:
            go.set()
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
    assert manager.state.model_optim.live  # the parts were handed over as they are
    manager.memory.wait()
    go.clear()
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.maybe_save(3)
    expected = {"params": copy.deepcopy(full_params(model)), "optim": copy.deepcopy(full_optim(model, optimizer))}
    lr = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 123.0
    go.set()
    manager.memory.wait()
    assert set(flattened_on) == {"distckpt-memory"}, flattened_on
    crash(manager)

    restarted, (model2, optimizer2, *_rest) = _manager(tmp_path, memory=memory)
    assert restarted.load().step == 3 and restarted.loader.tier == "memory"
    assert [g["lr"] for g in optimizer2.param_groups] == lr  # not 123.0
    got = {"params": full_params(model2), "optim": full_optim(model2, optimizer2)}
    for k, v in expected["params"].items():
        assert torch.equal(got["params"][k], v), k
    assert str(got["optim"]) == str(expected["optim"])
    restarted.close()
    release_workers(loader)
    release_workers(_rest[-1])


def test_a_tensor_learning_rate_changed_before_the_next_optimizer_step_is_the_steps(tmp_path, slow_memory_copy):
    # The param groups are taken on the training thread: a scheduler that steps before the next
    # optimizer.step() (a GradScaler skipping it) changes a tensor lr in place, unguarded.
    slow_memory_copy(SLOW_S)
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return CheckpointManager(config, model=model, optimizer=opt, lr_scheduler=sched), model, opt, sched

    manager, model, opt, sched = make()
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        manager.maybe_save(step)
    lr = float(opt.param_groups[0]["lr"])
    sched.step()  # step 4: no optimizer step, the scheduler's in-place fill_ of the lr
    manager.memory.wait()
    crash(manager)
    restarted, _, opt2, sched2 = make()
    assert restarted.load().step == 3 and restarted.loader.tier == "memory"
    assert float(opt2.param_groups[0]["lr"]) == lr == float(torch.tensor(0.0125))  # not step 4's 0.00625
    assert sched2.last_epoch == 3
    restarted.close()


def test_a_non_leaf_tensor_in_an_extra_value_is_snapshotted(tmp_path):
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    w = torch.ones(2, requires_grad=True)
    stats = {"last": w * 3.0}  # has a grad_fn: copy.deepcopy refuses it, torch.save takes it
    manager = CheckpointManager(config, model=model, optimizer=optimizer, extra_state={"stats": stats})
    optimizer_step(model, optimizer, scheduler, scaler, next(iter(loader)))
    manager.maybe_save(1)
    manager.memory.wait()
    crash(manager)
    model2, optimizer2, *_ = build(0, 1, {})
    restarted = CheckpointManager(config, model=model2, optimizer=optimizer2, extra_state={"stats": {}})
    assert restarted.load().step == 1 and restarted.loader.tier == "memory"
    assert torch.equal(restarted.state.extra_state["stats"]["last"], torch.full((2,), 3.0))
    restarted.close()
    release_workers(loader)


def test_a_value_the_worker_cannot_serialize_is_raised_at_the_next_snapshot(tmp_path):
    memory = {"enabled": True, "dir": str(tmp_path / "mem"), "replicas": 0, "interval_steps": 1}
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(root=str(tmp_path / "root"), schedule={"interval_steps": 1000}, memory=memory)
    t = torch.ones(2)
    t.hook = lambda: 1  # passes the weights-only check and deepcopy; pickle refuses the lambda
    manager = CheckpointManager(config, model=model, optimizer=optimizer, extra_state={"x": {"t": t}})
    it = iter(loader)
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    manager.maybe_save(1)  # serialized on the worker: the snapshot of step 1 is skipped
    optimizer_step(model, optimizer, scheduler, scaler, next(it))
    with pytest.raises(
        DistCkptError, match=r"snapshot of step 1 was skipped: extra_state\['x'\]: cannot be saved"
    ) as e:
        manager.maybe_save(2)
    assert isinstance(e.value, TypeError)
    manager.close()
    release_workers(loader)
