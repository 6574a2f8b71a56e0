"""Checkpoints on a real S3 server (SeaweedFS), one process: the commit protocol, discovery,
retention, leftovers, the lock, plain-DCP readability and construction errors."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from distckpt import (
    AsyncSaveConfig,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointSaveError,
    ConfigError,
    CoordinationConfig,
    LoadConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
)
from distckpt._storage import open_store
from tests.distributed.trainer import build, full_params, train_steps

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


def manager_for(root: str, **kw):
    model, optimizer, scheduler, scaler, loader = build(0, 1, kw.pop("build", {}))
    on_phase = kw.pop("on_phase", None)
    cfg = CheckpointConfig(root=root, schedule=ScheduleConfig(interval_steps=None), **kw)
    return (
        CheckpointManager(
            cfg,
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            grad_scaler=scaler,
            dataloader=loader,
            on_phase=on_phase,
        ),
        (model, optimizer, scheduler, scaler, loader),
    )


def keys(server, root: str) -> list[str]:
    bucket, _, prefix = root[len("s3://") :].partition("/")
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out += [o["Key"][len(prefix) + 1 :] for o in page.get("Contents", [])]
    return sorted(out)


def get(server, root: str, rel: str) -> bytes:
    bucket, _, prefix = root[len("s3://") :].partition("/")
    return server.client().get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read()


def put(server, root: str, rel: str, body: bytes) -> None:
    bucket, _, prefix = root[len("s3://") :].partition("/")
    server.client().put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=body)


def test_save_commits_manifest_last_and_load_restores_bitwise(s3_server, s3_root):
    manager, objs = manager_for(s3_root, retention=RetentionConfig(keep_last=2))
    for step in (3, 6, 9):
        train_steps(*objs, 3)
        location = manager.save(step)
    expected = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.close()
    assert isinstance(location, str) and location.startswith(f"{s3_root}/data/step-000000009-")
    names = keys(s3_server, s3_root)
    # retention kept 2: manifests and data of steps 6 and 9 only; no .lock after close
    assert [n for n in names if n.startswith("manifests/")] == [
        "manifests/step-000000006.json",
        "manifests/step-000000009.json",
    ]
    data = sorted({n.split("/")[1] for n in names if n.startswith("data/")})
    assert [d.rsplit("-", 1)[0] for d in data] == ["step-000000006", "step-000000009"]
    assert get(s3_server, s3_root, "latest") == b"step-000000009\n"
    assert ".lock" not in names
    manifest = json.loads(get(s3_server, s3_root, "manifests/step-000000009.json"))
    assert manifest["data_prefix"] == location[len(s3_root) + 1 :]
    # items of a few KiB: one file, written by one thread (record_writer.parallel_pays)
    assert {f["path"] for f in manifest["files"]} == {".metadata", "__0_0.distcp"}
    assert all(len(f["hash"]) == 32 for f in manifest["files"])  # xxh3-128 from the write path
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in json.dumps(manifest)

    fresh, (model, *_) = manager_for(s3_root)
    state = fresh.load()
    fresh.close()
    assert state is not None and state.step == 9 and state.checkpoint_path == location
    for k, v in full_params(model).items():
        assert torch.equal(v, expected[k]), k


def test_plain_dcp_load_with_fsspec_reader_reads_a_committed_checkpoint(s3_server, s3_root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # where torch 2.13 keeps it

    manager, objs = manager_for(s3_root)
    train_steps(*objs, 2)
    location = manager.save(2)
    manager.close()
    sd = {"model": {k: torch.zeros_like(v) for k, v in objs[0].state_dict().items()}}
    dcp.load(sd, storage_reader=FsspecReader(location, endpoint_url=s3_server.endpoint_url), no_dist=True)
    for k, v in objs[0].state_dict().items():
        assert torch.equal(sd["model"][k], v), k


def test_a_stale_writer_cannot_replace_a_newer_commit(s3_server, s3_root):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)
    committed = get(s3_server, s3_root, "manifests/step-000000003.json")
    manager.close()
    # A job that lost the root (no lock: it thinks it still owns it) saves the same step again.
    stale, objs2 = manager_for(s3_root, coordination=CoordinationConfig(lock=False), load=LoadConfig(enabled=True))
    stale.load()
    train_steps(*objs2, 1)
    with pytest.raises(CheckpointSaveError, match="manifests/step-000000003.json already exists"):
        stale.save(3)
    stale.close()
    assert get(s3_server, s3_root, "manifests/step-000000003.json") == committed
    data = sorted({n.split("/")[1] for n in keys(s3_server, s3_root) if n.startswith("data/")})
    assert len(data) == 1  # the stale save's objects were removed by its abort


def test_interrupted_save_leftovers_are_removed_at_start_and_nothing_else(s3_server, s3_root):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)
    manager.close()
    put(s3_server, s3_root, "data/step-000000006-0123abcd/__0_0.distcp", b"half a save")  # no manifest
    put(s3_server, s3_root, "data/notours/x", b"someone else's")
    put(s3_server, s3_root, "other/y", b"someone else's")
    fresh, _ = manager_for(s3_root)
    assert fresh.load().step == 3
    fresh.close()
    names = keys(s3_server, s3_root)
    assert not any("step-000000006" in n for n in names)
    assert "data/notours/x" in names and "other/y" in names


def test_flipped_byte_fails_the_load_naming_the_object(s3_server, s3_root):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    location = manager.save(3)
    manager.close()
    rel = location[len(s3_root) + 1 :] + "/__0_0.distcp"
    body = bytearray(get(s3_server, s3_root, rel))
    body[len(body) // 2] ^= 0x01
    put(s3_server, s3_root, rel, bytes(body))
    fresh, _ = manager_for(s3_root)
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp: xxh3_128 .* does not match"):
        fresh.load()
    fresh.close()
    assert [str(e) for e in open_store(s3_root).verify(location)][0].startswith(f"{location}/__0_0.distcp")


@pytest.mark.parametrize("edit", ["manifest", "unlisted object"])
def test_an_edited_s3_checkpoint_is_refused_by_ls_and_load_as_by_verify(s3_server, s3_root, edit, capsys, caplog):
    # Issue 24 item 5 on S3: verify's checks, not fewer, decide what ls lists and a load takes.
    from distckpt._cli import main

    manager, objs = manager_for(s3_root, retention=RetentionConfig(keep_last=None))
    locations = {}
    for step in (3, 6):
        train_steps(*objs, 3)
        locations[step] = manager.save(step)
    manager.close()
    if edit == "manifest":
        data = json.loads(get(s3_server, s3_root, "manifests/step-000000006.json"))
        put(s3_server, s3_root, "manifests/step-000000006.json", json.dumps(dict(data, step=9, loss=0.001)).encode())
        reason, named = "does not describe step-000000006 (step 9", "manifests/step-000000006.json"
    else:
        put(s3_server, s3_root, locations[6][len(s3_root) + 1 :] + "/notes.txt", b"added after the commit")
        reason, named = "notes.txt: file not listed in the manifest", "notes.txt"
    assert main(["verify", s3_root]) == 1 and named in capsys.readouterr().out
    assert main(["ls", s3_root, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"] if r["step"] is not None}
    assert rows[6]["status"] == "corrupt" and reason in rows[6]["reason"] and rows[3]["status"] == "committed"
    fresh, _ = manager_for(s3_root)
    with pytest.raises(CheckpointCorruptError, match=re.escape(reason)):
        fresh.load()
    fresh.close()
    expected, (model1, *_) = manager_for(s3_root, load=LoadConfig(path=locations[3]))
    expected.load()
    expected.close()
    fallback, (model2, *_) = manager_for(s3_root, load=LoadConfig(fallback_to_older=True))
    with caplog.at_level("WARNING"):
        assert fallback.load().step == 3
    fallback.close()
    assert reason in caplog.text and "falling back to" in caplog.text
    want = full_params(model1)
    assert all(torch.equal(v, want[k]) for k, v in full_params(model2).items())


def test_the_lock_refuses_a_second_manager_on_the_same_root(s3_server, s3_root):
    from distckpt import CheckpointLockedError

    first, _ = manager_for(s3_root)
    assert json.loads(get(s3_server, s3_root, ".lock"))["pid"] == os.getpid()
    with pytest.raises(CheckpointLockedError, match="another CheckpointManager of this process .* still open"):
        manager_for(s3_root)  # this process's first manager is open
    # another host's live lease: the lock is not the first manager's any more
    record = json.loads(get(s3_server, s3_root, ".lock"))
    put(s3_server, s3_root, ".lock", json.dumps(dict(record, host="elsewhere", pid=1)).encode())
    first.lock.held = False
    with pytest.raises(CheckpointLockedError, match=".lock: checkpoint root is locked by host=elsewhere"):
        manager_for(s3_root)
    first.close()


def test_missing_bucket_is_a_config_error_naming_the_bucket(s3_server):
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-xyz' does not exist") as e:
        manager_for("s3://no-such-bucket-xyz/run")
    assert os.environ["AWS_ACCESS_KEY_ID"] not in str(e.value)


def test_bad_credentials_are_a_config_error_naming_the_bucket_not_the_keys(s3_server, s3_root, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONG-KEY-ID-123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-456")
    with pytest.raises(ConfigError, match="access to bucket 'distckpt-tests' .* was denied") as e:
        manager_for(s3_root)
    assert "WRONG-KEY-ID-123" not in str(e.value) and "wrong-secret-456" not in str(e.value)


def test_async_save_and_event_log_on_s3(s3_server, s3_root, tmp_path):
    log = tmp_path / "events.jsonl"
    manager, objs = manager_for(
        s3_root, async_save=AsyncSaveConfig(mode="thread"), coordination=CoordinationConfig(event_log=str(log))
    )
    train_steps(*objs, 3)
    location = manager.save(3)  # returns once staged; uploads and commits in the background
    expected = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.wait()
    manager.close()
    phases = [json.loads(line)["phase"] for line in log.read_text().splitlines()]
    assert phases == ["stage", "write", "manifest", "latest", "committed"]  # no rename on S3
    assert open_store(s3_root).others().latest == "step-000000003"
    fresh, (model, *_) = manager_for(s3_root)
    assert fresh.load().checkpoint_path == location
    fresh.close()
    for k, v in full_params(model).items():
        assert torch.equal(v, expected[k]), k


def test_process_async_mode_is_refused_on_s3():
    with pytest.raises(ConfigError, match="async_save.mode='process' is not supported on s3:// roots"):
        CheckpointConfig(root="s3://bucket/run", async_save=AsyncSaveConfig(mode="process"))


def test_load_path_may_name_a_checkpoint_of_another_s3_root(s3_server, s3_root):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    location = manager.save(3)
    expected = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.close()
    other, objs2 = manager_for(f"{s3_root}-other", load=LoadConfig(path=location))
    state = other.load()
    train_steps(*objs2, 1)
    other.save(4)  # commits into its own root; the source root is untouched
    other.close()
    assert state.step == 3 and state.checkpoint_path == location
    assert [n for n in keys(s3_server, f"{s3_root}-other") if n.startswith("manifests/")] == [
        "manifests/step-000000004.json"
    ]
    assert [n for n in keys(s3_server, s3_root) if n.startswith("manifests/")] == ["manifests/step-000000003.json"]
    fresh, (model2, *_) = manager_for(s3_root)
    fresh.load()
    fresh.close()
    for k, v in full_params(model2).items():
        assert torch.equal(v, expected[k]), k


def test_a_fresh_run_in_a_used_s3_root_refuses_or_archives(s3_server, s3_root):
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)
    manager.close()
    with pytest.raises(ConfigError, match="already holds 1 checkpoint\\(s\\), newest step-000000003"):
        manager_for(s3_root, load=LoadConfig(enabled=False))
    archived, _ = manager_for(s3_root, load=LoadConfig(enabled=False, on_existing="archive"))
    archived.close()
    names = keys(s3_server, s3_root)
    assert "manifests/archived-step-000000003-0.json" in names and "manifests/step-000000003.json" not in names
    assert any(n.startswith("data/step-000000003-") for n in names)  # nothing deleted
    fresh, _ = manager_for(s3_root)
    assert fresh.load() is None  # an archived checkpoint is never loaded
    fresh.close()
    assert any(n.startswith("data/step-000000003-") for n in keys(s3_server, s3_root))  # nor removed as leftover


def test_rollback_on_s3_sets_newer_checkpoints_aside_at_the_first_save(s3_server, s3_root, caplog):
    manager, objs = manager_for(s3_root)
    locations = {}
    for step in (3, 6):
        train_steps(*objs, 3)
        locations[step] = manager.save(step)
    manager.close()
    rollback, objs2 = manager_for(s3_root, load=LoadConfig(path=locations[3]))
    assert rollback.load().step == 3
    assert "manifests/step-000000006.json" in keys(s3_server, s3_root)  # only loading changes nothing
    train_steps(*objs2, 1)
    rollback.save(4)
    rollback.close()
    names = keys(s3_server, s3_root)
    assert [n for n in names if n.startswith("manifests/")] == [
        "manifests/rolledback-step-000000006-0.json",
        "manifests/step-000000003.json",
        "manifests/step-000000004.json",
    ]
    assert get(s3_server, s3_root, "latest") == b"step-000000004\n"
    expected = full_params(objs2[0])
    fresh, _ = manager_for(s3_root)
    assert fresh.load().step == 4
    fresh.close()
    # Issue 24 item 6: restarted with its unchanged config, the rolled-back run resumes its own commit.
    with caplog.at_level("INFO", logger="distckpt"):
        restarted, (model3, *_) = manager_for(s3_root, load=LoadConfig(path=locations[3]))
        assert restarted.load().step == 4  # used to roll back to step 3 again
    restarted.close()
    assert "restart:" in caplog.text and "step-000000004, committed by this run" in caplog.text
    assert all(torch.equal(v, expected[k]) for k, v in full_params(model3).items())
    assert [n for n in keys(s3_server, s3_root) if n.startswith("manifests/")] == [
        "manifests/rolledback-step-000000006-0.json",
        "manifests/step-000000003.json",
        "manifests/step-000000004.json",
    ]


def test_a_read_only_manager_writes_no_object_to_an_s3_root(s3_server, s3_root):
    # Issue 24 item 14 on S3: no .lock, no leftover removal, no set-aside; load works.
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 3)
    manager.save(3)
    manager.close()
    expected = full_params(objs[0])
    put(s3_server, s3_root, "data/step-000000009-abc123/__0_0.distcp", b"an interrupted save")
    before = {k: get(s3_server, s3_root, k) for k in keys(s3_server, s3_root)}
    evaluation, (model, *_) = manager_for(s3_root, save=SaveConfig(enabled=False), load=LoadConfig(step=3))
    assert evaluation.load().step == 3 and evaluation.lock is None
    with pytest.raises(ConfigError, match="save.enabled=false"):
        evaluation.save(4)
    evaluation.close()
    assert {k: get(s3_server, s3_root, k) for k in keys(s3_server, s3_root)} == before
    assert all(torch.equal(v, expected[k]) for k, v in full_params(model).items())


def test_debug_logging_of_a_save_and_load_never_shows_the_keys(s3_server, s3_root, caplog):
    """With every logger at DEBUG (``logging.basicConfig(level=DEBUG)``), botocore logs each
    request's headers: the access key id (in ``Authorization: ... Credential=<id>/...``) must be
    redacted from every line, and so must the secret."""
    from launch.s3_server import ACCESS_KEY, SECRET_KEY

    caplog.set_level(logging.DEBUG)
    manager, objs = manager_for(s3_root)
    train_steps(*objs, 2)
    manager.save(2)
    expected = {k: v.clone() for k, v in full_params(objs[0]).items()}
    manager.close()
    manager, objs = manager_for(s3_root)
    assert manager.load().step == 2
    manager.close()
    assert all(torch.equal(v, expected[k]) for k, v in full_params(objs[0]).items())
    lines = [caplog.handler.format(r) for r in caplog.records]
    botocore_lines = [line for r, line in zip(caplog.records, lines) if r.name.startswith("botocore")]
    assert sum("Authorization" in line for line in botocore_lines) > 10  # the requests were logged
    leaked = [line for line in lines if ACCESS_KEY in line or SECRET_KEY in line]
    assert leaked == [], f"{len(leaked)} log line(s) show a key, e.g. {leaked[0][:300]}"
