"""The scale benchmark runs end to end in ``--quick`` mode and writes complete results."""

import json

import pytest

from benchmarks import bench_scale
from benchmarks._scale_probes import manifest_probe, placement_probe

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_bench_scale_quick_run(tmp_path):
    out = tmp_path / "bench"
    assert bench_scale.main(["--quick", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [r["world_size"] for r in rows] == [2, 4]
    for r in rows:
        assert r["restore_tiers"] == ["memory"]  # every rank restored from the memory tier
        for _, key, _ in bench_scale.PHASES:
            if key != "startup_s":  # a difference of two timings: may be negative
                assert 0 < r[key]["rank0"] <= r[key]["max"] and r[key]["median"] <= r[key]["max"], key
        assert r["plain_s"] > 0
    assert set(results["growth"]) == {k for _, k, _ in bench_scale.PHASES} | set(bench_scale.PLAIN) | {"plain_s"}
    assert [p["world_size"] for p in results["placement"]] == [2, 64, 1024]
    assert [p["world_size"] for p in results["manifest"]] == [2, 16]
    md = (out / "results.md").read_text()
    assert "| maybe_save, nothing due (default) |" in md and "Goals (issue 34):" in md
    assert (out / "plot.png").exists() or "matplotlib" in str(results["meta"].get("notes"))


def test_growth_exponent_and_probes():
    assert bench_scale.growth_exponent([(2, 1.0), (4, 2.0), (32, 16.0)]) == pytest.approx(1.0)
    assert bench_scale.growth_exponent([(2, 3.0), (32, 3.0)]) == pytest.approx(0.0)
    assert bench_scale.growth_exponent([(2, 1.0)]) is None
    rows = placement_probe([8, 16], budget_s=60)
    assert [r["world_size"] for r in rows] == [8, 16] and all(r["sources_s"] > 0 for r in rows)
    small, big = manifest_probe([2, 8], bytes_per_rank=64 << 20)  # 8 blocks of 8 MiB per rank
    assert small["bytes_per_rank"] == 64 << 20
    # one data file per rank with its 8 block digests: the manifest grows with W
    assert big["manifest_bytes"] - small["manifest_bytes"] > 6 * 8 * 32
