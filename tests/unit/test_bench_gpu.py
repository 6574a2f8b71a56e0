"""benchmarks.bench_gpu without a GPU: the no-CUDA path exits 0 and writes nothing, the dry run
lists every cell, and the whole pipeline runs end to end on CPU at a tiny size (``--device cpu``)."""

import json

import pytest
import torch

from benchmarks import bench_gpu

pytestmark = pytest.mark.timeout(180)


def test_without_cuda_nothing_is_measured_or_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu"
    assert bench_gpu.main(["--out", str(out)]) == 0
    assert "no CUDA: nothing measured" in capsys.readouterr().out
    assert not out.exists()


def test_dry_run_lists_the_cells_of_the_default_run(capsys):
    assert bench_gpu.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "kind=copy size_gib=1.0"
    for size in (1.0, 4.0):
        for mode in bench_gpu.SAVE_MODES:
            assert f"kind=save size_gib={size} mode={mode}" in lines
        for reader in bench_gpu.LOAD_READERS:
            assert f"kind=load size_gib={size} reader={reader}" in lines
    assert len(lines) == 1 + 2 * (len(bench_gpu.SAVE_MODES) + 1 + len(bench_gpu.LOAD_READERS))


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_gpu.main(["--sizes-gib", "0", "--dry-run"])


@pytest.mark.multiprocess
def test_tiny_cpu_run_writes_every_row_and_ratio(tmp_path):
    out = tmp_path / "gpu"
    rc = bench_gpu.main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--sizes-gib",
            "0.004",
            "--repeats",
            "1",
            "--step-compute-s",
            "0.05",
            "--timeout-s",
            "120",
        ]
    )
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert not [r for r in rows if "error" in r]
    saves = {r["mode"]: r for r in rows if r["kind"] == "save"}
    assert set(saves) == set(bench_gpu.SAVE_MODES)
    for mode, r in saves.items():
        assert 0 < r["stall_s"] <= r["end_to_end_s"] + 1e-6 and r["stall_share"] > 0, r
        assert ("staging_of_pinned" in r) == (mode in bench_gpu.STAGED_MODES), r
    loads = {r["reader"]: r for r in rows if r["kind"] == "load"}
    assert set(loads) == set(bench_gpu.LOAD_READERS)
    assert all(r["cold_bad"] == [] and r["warm_bad"] == [] for r in loads.values())
    assert loads["fast"]["cold_speedup_vs_stock"] > 0
    md = (out / "results.md").read_text()
    assert "| 0.004 | async_thread_bgstage |" in md and "| 0.004 | fast |" in md
    assert not (out / "data").exists()


def test_cells_past_the_budget_are_listed_not_run(tmp_path):
    out = tmp_path / "gpu"
    assert bench_gpu.main(["--out", str(out), "--device", "cpu", "--budget-s", "0"]) == 1
    results = json.loads((out / "results.json").read_text())
    cells = 1 + 2 * (len(bench_gpu.SAVE_MODES) + 1 + len(bench_gpu.LOAD_READERS))
    assert results["results"] == [] and len(results["meta"]["skipped_cells"]) == cells
    md = (out / "results.md").read_text()
    assert "(no results)" in md and "not run (past --budget-s): kind=copy" in md
