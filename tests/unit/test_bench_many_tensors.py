"""The many-tensors benchmark runs end to end at a tiny size and writes complete results."""

import json

import pytest

from benchmarks import bench_many_tensors

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_bench_many_tensors_tiny_run(tmp_path):
    out = tmp_path / "bench"
    argv = ["--out", str(out), "--params", "60", "120", "--numel", "4", "--world-sizes", "1", "2"]
    assert bench_many_tensors.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["results"]
    # Per N: same world at 1 and 2, reshard 2 -> 1; each with both implementations.
    assert len(rows) == 2 * 3 * 2
    for r in rows:
        assert r["impl"] in ("distckpt", "stock") and r["tensors"] == 4 * r["params"] and r["bitwise"] is True
        assert r["load_s"] > 0 and (r["save_s"] is None) == (r["scenario"] == "reshard 2->1")
    # Fitted from N = 1,000 up: none here; the fit itself on known points.
    assert all(g == {"save_exponent": None, "load_exponent": None} for g in results["growth"].values())
    assert bench_many_tensors.growth_exponent([(1000, 2.0), (10_000, 20.0), (30_000, 60.0)]) == pytest.approx(1.0)
    assert "| 120 | 480 | 2 | same |" in (out / "results.md").read_text()
    assert (out / "plot.png").exists() or "matplotlib" in str(results["meta"].get("notes"))


@pytest.mark.parametrize("installed", [True, False])
def test_bench_many_tensors_peers_side_by_side(tmp_path, monkeypatch, installed):
    # --peers: torch.save/torch.load and the raw bytes always; torch-checkpointing (extra
    # bench-peers) when installed, else skipped with a note. Every load bitwise; best of 2 rounds.
    if installed:
        pytest.importorskip("torch_checkpointing")
    else:
        monkeypatch.setattr(bench_many_tensors, "peer_available", lambda impl: impl != "torch_checkpointing")
    out = tmp_path / "bench"
    argv = ["--out", str(out), "--params", "30", "--numel", "4", "--world-sizes", "1", "--peers", "--rounds", "2"]
    assert bench_many_tensors.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    impls = ["distckpt", "stock", "torch_save", "raw"] + (["torch_checkpointing"] if installed else [])
    assert sorted(r["impl"] for r in results["results"]) == sorted(impls)
    assert all(r["bitwise"] is True and r["save_s"] > 0 and r["load_s"] > 0 for r in results["results"])
    md = (out / "results.md").read_text()
    assert "| 30 | 120 | 1 | raw |" in md and "| 30 | 120 | 1 | torch_save |" in md
    assert ("| 30 | 120 | 1 | torch_checkpointing |" in md) == installed
    assert ("goal at N = 30, world size 1" in md) == installed
    assert ("torch-checkpointing not installed" in md) != installed
