"""The public API is the list below and nothing else (issue 36).

The public names are the ones README.md and docs/ tell users to import. Every other module lives
under a private (underscore) path, so ``from distckpt.<anything else> import ...`` is visibly a
reach into internals that may change without notice. The check is static (the module files),
then at run time (what an ``import`` of each public module really exposes).
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "distckpt"
ERRORS = [
    "DistCkptError", "StorageError", "ConfigError", "CheckpointNotFoundError",
    "CheckpointCorruptError", "IncompatibleCheckpointError", "CheckpointLockedError", "ManagerClosedError",
    "CheckpointSaveError", "CollectiveMismatchError", "RankLostError", "ReaderInvariantError",
]  # fmt: skip
SECTIONS = [
    "ScheduleConfig", "RetentionConfig", "KeepBest", "SaveConfig", "AsyncSaveConfig",
    "LoadConfig", "ElasticConfig", "PreemptionConfig", "CoordinationConfig", "StorageConfig",
    "MemoryConfig",
]  # fmt: skip
PUBLIC: dict[str, set[str]] = {
    "distckpt": {
        "__version__", "CheckpointConfig", *SECTIONS, "CheckpointManager", "TrainState",
        "ReshardableSampler", *ERRORS,
    },
    "distckpt.data": {"make_stateful_dataloader", "ReshardableSampler", "SigtermSafeWorkerInit"},
    "distckpt.dcp": {"FileSystemReader", "FileSystemWriter"},
    "distckpt.tools": {
        "CheckpointReader", "audit_checkpoint", "diff_checkpoints", "export_checkpoint",
        "import_weights", "load_weights", "release_checkpoint",
    },
    "distckpt.integrations": set(),
    "distckpt.integrations.torchtitan": {"DistckptCheckpointManager"},
    "distckpt.integrations.hf": {"DistckptTrainer"},
}  # fmt: skip
OPTIONAL = {"distckpt.integrations.torchtitan": "torchtitan", "distckpt.integrations.hf": "transformers"}


def module_files() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def is_public_path(dotted: str) -> bool:
    return not any(p.startswith("_") for p in dotted.split("."))


def bound_names(path: Path) -> set[str]:
    """The top-level names a module binds (imports, defs, classes, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names - {"annotations", "__all__"}  # `from __future__ import annotations`


def test_public_names_at_most_60():
    assert sum(len(v) for v in PUBLIC.values()) <= 60


def test_only_the_public_modules_have_public_paths():
    public_paths = {m for m in module_files() if is_public_path(m)}
    assert public_paths == set(PUBLIC), "move internals under an underscore package"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_module_binds_only_public_names(module):
    path = module_files()[module]
    extra = {n for n in bound_names(path) if not n.startswith("_")} - PUBLIC[module]
    assert not extra, f"{path.relative_to(REPO)} exposes {sorted(extra)}: not in the public API"
    tree = ast.parse(path.read_text())
    all_ = [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"]
    declared = set(ast.literal_eval(all_[0].value)) if all_ else set()
    assert declared == PUBLIC[module], "__all__ must list the public names"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_importing_a_public_module_exposes_only_public_names(module):
    if module in OPTIONAL:
        pytest.importorskip(OPTIONAL[module])
    mod = importlib.import_module(module)
    seen = {n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert seen == PUBLIC[module] - {"__version__"}


def test_docs_import_only_public_names():
    """Every ``from distckpt... import X`` in README.md and docs/ names a public module and name."""
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in re.finditer(r"from (distckpt[\w.]*) import ([\w, ]+)", doc.read_text()):
            names = {n.strip() for n in m.group(2).split(",") if n.strip()}
            if m.group(1) not in PUBLIC or not names <= PUBLIC[m.group(1)]:
                bad.append(f"{doc.name}: {m.group(0)}")
    assert not bad, bad


def test_the_check_sees_a_leak(tmp_path):
    leaky = tmp_path / "mod.py"
    leaky.write_text("from ._x import helper\nimport os\n_ok = 1\ndef util(): pass\n")
    assert bound_names(leaky) == {"helper", "os", "_ok", "util"}
    assert not is_public_path("distckpt._storage.posix") and is_public_path("distckpt.storage.posix")
