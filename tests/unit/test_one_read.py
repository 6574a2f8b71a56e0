"""Every load reads through one function (issue 36): a durable checkpoint and a memory snapshot differ
only in their source (how the stored state is obtained); the fit check, the load target, DCP's read
and the restore of the training state are :func:`distckpt._load.read.read_checkpoint`'s alone."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import distckpt._load.loading as loading
from distckpt import CheckpointConfig, CheckpointManager
from tests.distributed.trainer import build, crash, full_params, optimizer_step, release_workers

PKG = Path(__file__).resolve().parents[2] / "distckpt"
# The steps of a read into the training state: the fit check, the load target, DCP's read, the restore.
READ_STEPS = ("check_model_fits", "for_load", "run_load", "restore")


def _outer_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The module's functions and its classes' methods; a nested function's calls are its encloser's."""
    out = []
    for node in tree.body:
        body = node.body if isinstance(node, ast.ClassDef) else [node]
        out += [fn for fn in body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def _on_state(func: ast.expr) -> bool:
    """``state.x(...)`` or ``<...>.state.x(...)``: a call on the training state."""
    receiver = getattr(func, "value", None)
    return (isinstance(receiver, ast.Name) and receiver.id == "state") or (
        isinstance(receiver, ast.Attribute) and receiver.attr == "state"
    )


def _callers(step: str) -> set[str]:
    """``{"<module path>::<function>"}`` of every call of ``step`` outside ``engine/`` (which defines ``run_load``)."""
    out = set()
    for f in sorted(PKG.rglob("*.py")):
        if f.relative_to(PKG).parts[0] == "_engine":
            continue
        for fn in _outer_functions(ast.parse(f.read_text())):
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name != step:
                    continue
                if step == "restore" and not _on_state(func):
                    continue  # CheckpointState.restore only (not the data loader's)
                out.add(f"{f.relative_to(PKG.parent)}::{fn.name}")
    return out


def test_only_the_one_read_plans_reads_and_restores_a_checkpoint():
    where = {step: _callers(step) for step in READ_STEPS}
    assert where == {step: {"distckpt/_load/read.py::read_checkpoint"} for step in READ_STEPS}, where


def _manager(root: Path, mem: Path, *, memory: bool):
    model, optimizer, scheduler, scaler, loader = build(0, 1, {})
    config = CheckpointConfig(
        root=str(root), schedule={"interval_steps": 3}, memory={"enabled": memory, "dir": str(mem)}
    )
    manager = CheckpointManager(
        config, model=model, optimizer=optimizer, lr_scheduler=scheduler, grad_scaler=scaler, dataloader=loader
    )
    return manager, model, optimizer, scheduler, scaler, loader


def test_a_durable_load_and_a_memory_restore_both_go_through_read_checkpoint(tmp_path, monkeypatch):
    root, mem = tmp_path / "root", tmp_path / "mem"
    manager, model, optimizer, scheduler, scaler, loader = _manager(root, mem, memory=True)
    it, at = iter(loader), {}
    for step in range(1, 6):  # durable step 3, memory step 5
        optimizer_step(model, optimizer, scheduler, scaler, next(it))
        manager.maybe_save(step)
        at[step] = {k: v.clone() for k, v in full_params(model).items()}
    manager.memory.wait()
    crash(manager)  # the process "dies": no close(), the snapshots stay
    release_workers(loader)

    sources: list[tuple[str, str, int]] = []
    real = loading.read_checkpoint

    def recording(source, **kwargs):
        train_state, manifest = real(source, **kwargs)
        sources.append((type(source).__name__, source.location, train_state.step))
        return train_state, manifest

    monkeypatch.setattr(loading, "read_checkpoint", recording)
    for memory, want in ((True, 5), (False, 3)):
        manager, model, *_, loader = _manager(root, mem, memory=memory)
        state = manager.load()
        assert state is not None and state.step == want
        assert manager.loader.tier == ("memory" if memory else "durable")
        got = full_params(model)
        assert got.keys() == at[want].keys() and all(torch.equal(got[k], at[want][k]) for k in got)  # bitwise
        if memory:
            manager.memory.wait()
            crash(manager)  # leave the snapshots for the durable-only manager's root check
        else:
            manager.close()
        release_workers(loader)
    assert [(kind, step) for kind, _, step in sources] == [("MemorySource", 5), ("StoreSource", 3)]
    assert sources[0][1].startswith("memory://") and sources[0][1].endswith("/step-5")
    assert sources[1][1] == str(root / "step-000000003")
