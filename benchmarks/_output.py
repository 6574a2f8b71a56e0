"""Where a benchmark writes, and what it records about the machine: shared by ``bench_save``
and ``bench_load`` (``results.json`` + ``results.md`` + ``plot.png`` in ``--out``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["commit", "machine_info", "prepare_dirs", "pyplot", "write_outputs"]


def prepare_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    """Create ``args.out`` and the data directory (``args.data_dir`` or ``OUT/data``); put the
    repository root on ``sys.path`` (the ranks import ``benchmarks.*`` from it)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    repo_root = str(Path(__file__).resolve().parents[1])
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    return out, data_dir


def commit() -> str:
    """The checkout's short commit hash ("?" when git cannot tell): the code a result came from."""
    try:
        repo = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine_info(data_dir: Path) -> dict[str, Any]:
    """Platform, CPUs (count and model), memory (GiB) and the data directory's file system."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = int(f.readline().split()[1]) / (1 << 20)
    except OSError:
        info["mem_total_gib"] = float("nan")
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        df = subprocess.run(["df", "-PT", str(data_dir)], capture_output=True, text=True, timeout=10).stdout
        fields = df.splitlines()[-1].split()
        info["data_fs"] = f"{fields[1]} on {fields[0]}, {int(fields[4]) / (1 << 20):.0f} GiB free"
    except Exception:  # noqa: BLE001 - informative only
        pass
    return info


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` when matplotlib is
    not installed (the benchmarks then write no plot and say so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Any) -> None:
    """Lay out ``fig``, write it to ``path`` (PNG, 110 dpi, as every benchmark's plot) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    out: Path,
    results: dict[str, Any],
    render: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], bool],
) -> str:
    """Write ``results.json``, ``plot.png`` (when matplotlib is installed; otherwise a note in
    ``results["meta"]["notes"]``) and ``results.md``; print and return the markdown."""
    if plot(results, out / "plot.png"):
        results["meta"]["plot"] = str(out / "plot.png")
    else:
        results["meta"].setdefault("notes", []).append(
            "plot.png not written: matplotlib is not installed (pip install matplotlib)."
        )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = render(results)
    (out / "results.md").write_text(md)
    print(md)
    return md
