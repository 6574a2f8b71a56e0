"""The save benchmark runs end to end at a tiny size and writes complete, sane results."""

import json
import math

import pytest

from benchmarks import _save_ranks, bench_save

pytestmark = pytest.mark.timeout(180)

WORLD_SIZES = (1, 2)


@pytest.mark.multiprocess
def test_bench_save_tiny_run_writes_a_row_per_mode_size_and_world_size(tmp_path):
    out = tmp_path / "bench"
    rc = bench_save.main(
        [
            "--sizes-mib",
            "4",
            "--world-sizes",
            *map(str, WORLD_SIZES),
            "--repeats",
            "1",
            "--no-train",
            "--no-thread-count",
            "--step-compute-s",
            "0.05",
            "--timeout-s",
            "120",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    rows = [r for r in results["results"] if r["experiment"] == "save"]
    keys = {(r["mode"], r["size_bytes"], r["world_size"]) for r in rows}
    assert keys == {(m, 4 << 20, ws) for m in bench_save.SAVE_MODES for ws in WORLD_SIZES}
    assert len(rows) == len(keys)
    for r in rows:
        assert "error" not in r, r
        for field in (
            "stall_s",
            "end_to_end_s",
            "write_gbps",
            "disk_write_gbps",
            "peak_rss_bytes",
            "first_save_s",
            "state_bytes",
            "local_state_bytes",
        ):
            assert isinstance(r[field], (int, float)) and math.isfinite(r[field]) and r[field] > 0, (field, r)
        assert r["repeats"] == 1
        # The synthetic state is the requested size (within one layer row) for the whole job.
        assert 0.99 * r["size_bytes"] < r["state_bytes"] <= 1.01 * r["size_bytes"]
        assert r["stall_s"] <= r["end_to_end_s"] + 1e-6
        if r["mode"] in bench_save.ASYNC_MODES:
            assert r["stall_over_blocking_e2e"] > 0 and r["e2e_over_blocking_e2e"] > 0
            # The staging copy's limit, measured in the same run: stall cannot beat it by much.
            assert 0 < r["copy_limit_s"] < r["end_to_end_s"] and r["stall_over_copy_limit"] > 0.5
    meta = results["meta"]
    assert meta["torch_version"] and meta["machine"]["cpu_count"] >= 1 and meta["verdicts"]
    md = (out / "results.md").read_text()
    assert "| async_thread_bgstage |" in md and "## Goals" in md
    assert not (out / "data").exists()  # checkpoint data removed
    try:
        import matplotlib  # noqa: F401 - optional (the bench extra)
    except ImportError:
        assert "matplotlib is not installed" in md
    else:
        assert (out / "plot.png").stat().st_size > 0


def test_render_markdown_without_results_does_not_crash():
    meta = {
        "date": "d",
        "machine": {"cpu_count": 2, "mem_total_gib": 1.0},
        "torch_version": "t",
        "distckpt_version": "v",
        "data_dir": "/x",
        "wall_s": 1.0,
        "argv": [],
        "loadavg_start": (0, 0, 0),
        "loadavg_end": (0, 0, 0),
        "verdicts": bench_save._verdicts([]),
    }
    md = bench_save.render_markdown({"results": [], "meta": meta})
    assert "no save results" in md


def test_layer_rows_match_requested_size():
    for mib in (4, 256, 1024):
        width, rows = _save_ranks._layer_rows(mib << 20)
        numel = width * sum(rows)
        assert abs(numel * 12 - (mib << 20)) < width * 12


def test_plot_is_skipped_without_matplotlib(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench_save._plot({"results": []}, tmp_path / "plot.png") is False
    assert not (tmp_path / "plot.png").exists()
