"""The CLI on ``s3://`` roots against the real server: ls, inspect, verify (catches a flipped
byte in an object), diff, export, prune."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from distckpt import RetentionConfig
from distckpt._cli import main
from distckpt._tools.reader import CheckpointReader
from tests.distributed.trainer import full_params, train_steps
from tests.s3.test_s3_single import get, keys, manager_for, put

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


def test_cli_ls_inspect_diff_export_prune_and_verify_on_s3(s3_server, s3_root, tmp_path, capsys):
    manager, objs = manager_for(s3_root, retention=RetentionConfig(keep_last=None))
    locations = {}
    for step in (2, 4, 6):
        train_steps(*objs, 2)
        locations[step] = manager.save(step)
    params = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.close()
    capsys.readouterr()

    assert main(["ls", s3_root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["status"], r["latest"]) for r in rows] == [
        (2, "committed", False),
        (4, "committed", False),
        (6, "committed", True),
    ]

    assert main(["inspect", s3_root, "--json"]) == 0  # a root: its newest checkpoint
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == locations[6] and out["manifest"]["step"] == 6

    assert main(["diff", locations[4], locations[6], "--group", "model", "--json"]) == 1  # they differ
    diff = json.loads(capsys.readouterr().out)
    assert diff["a"] == locations[4] and not diff["identical"] and diff["common"][0]["max_abs_diff"] > 0

    assert main(["export", s3_root, str(tmp_path / "w.safetensors"), "--model-only", "--no-progress"]) == 0
    exported = load_file(tmp_path / "w.safetensors")
    for k, v in params.items():
        assert torch.equal(exported[k], v), k

    capsys.readouterr()
    # import the exported weights into a fresh S3 root: a committed step-7 checkpoint holding them
    assert main(["import", str(tmp_path / "w.safetensors"), f"{s3_root}-imported", "--step", "7", "--json"]) == 0
    imported = json.loads(capsys.readouterr().out)
    assert imported["checkpoint"].startswith(f"{s3_root}-imported/data/step-000000007-") and imported["step"] == 7
    reader = CheckpointReader(imported["checkpoint"])
    for k, v in reader.read([f"model.{k}" for k in params]).items():
        assert torch.equal(v, params[k[len("model.") :]]), k

    capsys.readouterr()
    assert main(["prune", s3_root, "--keep-last", "2", "--dry-run"]) == 0  # names what is really there
    assert f"would delete  {locations[2]}\n" in capsys.readouterr().out
    assert main(["prune", s3_root, "--keep-last", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == ["step-000000002"]
    assert not any("step-000000002" in n for n in keys(s3_server, s3_root))

    assert main(["verify", s3_root]) == 0
    capsys.readouterr()
    rel = locations[6][len(s3_root) + 1 :] + "/__0_0.distcp"
    body = bytearray(get(s3_server, s3_root, rel))
    body[-100] ^= 0x10  # one bit of one object
    put(s3_server, s3_root, rel, bytes(body))
    assert main(["verify", s3_root]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT  {locations[6]}" in out and f"ok       {locations[4]}" in out
    assert f"{locations[6]}/__0_0.distcp: xxh3_128" in out and "does not match the manifest" in out


def test_retention_leaves_no_pending_rows_and_ls_shows_metrics(s3_server, s3_root, caplog, capsys):
    # SeaweedFS keeps a data prefix after retention deletes its objects: not an unfinished save.
    manager, objs = manager_for(s3_root, retention=RetentionConfig(keep_last=1))
    for step in (1, 2, 3):
        train_steps(*objs, 1)
        manager.save(step, loss=0.5, metrics={"acc": 0.25})
    manager.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="distckpt"):
        manager, _ = manager_for(s3_root, retention=RetentionConfig(keep_last=1))
        assert manager.load().step == 3  # rank 0 removes leftovers here
        manager.close()
    assert not [r for r in caplog.records if "left by" in r.getMessage()]
    capsys.readouterr()
    assert main(["ls", s3_root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [(3, "committed")]
    assert rows[0]["metrics"] == {"acc": 0.25}
    assert main(["verify", s3_root]) == 0
    assert "skipped" not in capsys.readouterr().out


def test_cli_with_bad_credentials_names_the_cause_not_retries(s3_server, s3_root, capsys, monkeypatch):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 1)
    manager.save(1)
    manager.close()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONG-KEY-ID-123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-456")
    code = main(["verify", s3_root])
    err = capsys.readouterr().err
    assert code != 0 and "failed after 1 attempt(s)" in err and "AWS_ACCESS_KEY_ID" in err
    assert "WRONG-KEY-ID-123" not in err and "wrong-secret-456" not in err
