"""Static checks of the scripts around the package (issue 36): ``benchmarks/`` and ``launch/`` use
distckpt the way a user does, through its public names only, and keep the package's module size.

The exception is the probe modules of ``bench_scale`` (``PROBES``): single-process measurements of
internal pure functions (replica placement, the manifest a save at W ranks commits) that no public
call exposes; each of their internal imports carries a comment saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_imports import MAX_LINES
from tests.unit.test_public_api import PUBLIC

REPO = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = ("benchmarks", "launch")
# The public API, module by module (issue 36): the one list, in test_public_api.
PROBES = {"benchmarks/_scale_probes.py", "benchmarks/manifest_size.py"}


def _scripts() -> list[Path]:
    return sorted(f for d in SCRIPT_DIRS for f in (REPO / d).rglob("*.py"))


def _distckpt_refs(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every distckpt name a module uses: each imported name, each
    ``import distckpt.x`` and each ``distckpt.x`` attribute read, wherever it is."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "distckpt":
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "distckpt"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "distckpt":
            out.append((node.lineno, f"distckpt.{node.attr}"))
    return out


def _is_public(dotted: str) -> bool:
    if dotted == "distckpt" or dotted in PUBLIC:  # `import distckpt`, `import distckpt.tools`
        return True
    module, _, name = dotted.rpartition(".")
    return name in PUBLIC.get(module, set())


def test_the_public_api_resolves():
    import importlib

    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert missing == [], f"{module} lacks {missing}"
        if module == "distckpt.tools":
            assert set(mod.__all__) == names


def test_scripts_use_only_public_names():
    bad = []
    for f in _scripts():
        rel = f.relative_to(REPO).as_posix()
        lines = f.read_text().splitlines()
        for line, dotted in _distckpt_refs(ast.parse(f.read_text(), filename=rel)):
            if _is_public(dotted):
                continue
            if rel not in PROBES:
                bad.append(f"{rel}:{line}: {dotted}")
            elif "#" not in lines[line - 1] and not lines[line - 2].lstrip().startswith("#"):
                bad.append(f"{rel}:{line}: {dotted} (a probe's internal import needs a comment saying why)")
    assert bad == [], "internal distckpt names outside the probe modules: " + "; ".join(bad)


def test_the_public_check_sees_internal_names():
    tree = ast.parse(
        "import distckpt\nfrom distckpt import CheckpointManager\nfrom distckpt._engine.blocking import dcp_save\n"
        "from distckpt.tools import audit_checkpoint\nx = distckpt._manager\nimport distckpt._ondisk.manifest\n"
    )
    bad = sorted(r for r in _distckpt_refs(tree) if not _is_public(r[1]))
    assert bad == [
        (3, "distckpt._engine.blocking.dcp_save"),
        (5, "distckpt._manager"),
        (6, "distckpt._ondisk.manifest"),
    ]


def test_no_script_over_the_line_cap():
    # Counted on the file as committed, which `make lint` (ruff format --check .) keeps formatted.
    over = {f.relative_to(REPO).as_posix(): n for f in _scripts() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines: {over}"
