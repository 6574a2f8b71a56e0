"""The incremental benchmark runs end to end at a tiny size and writes complete, sane results."""

import json

import pytest

from benchmarks import bench_incremental

pytestmark = pytest.mark.timeout(240)


def test_bench_incremental_tiny_run(tmp_path):
    out = tmp_path / "bench"
    rc = bench_incremental.main(
        ["--out", str(out), "--size-mib", "4", "--tensors", "10", "--rounds", "1", "--cost-rounds", "1"]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    rows = {r["frozen_fraction"]: r for r in results["results"]}
    assert set(rows) == {0.0, 0.5, 0.9}
    for r in rows.values():
        assert r["bitwise_equal"] is True and r["plain_dcp_load_ok"] is True
        assert r["save_time_ratio"] > 0
    # Only the changed tensors' bytes are written again (plus metadata and records).
    assert rows[0.0]["bytes_written_ratio"] > 0.95
    assert 0.4 < rows[0.5]["bytes_written_ratio"] < 0.6
    assert rows[0.9]["bytes_written_ratio"] < 0.15
    cost = results["cost_nothing_frozen"]
    assert len(cost["on_s"]) == len(cost["off_s"]) == 1
    md = (out / "results.md").read_text()
    assert "| 90% |" in md and "goal at 90% frozen" in md
