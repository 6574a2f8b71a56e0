"""distckpt/_storage/commit.py on its own: the on-disk commit protocol, validation, leftovers, deletes.

Checkpoints here are hand-made directories of small files with a real manifest (sizes and
xxh3-128 hashes from :func:`distckpt._ondisk.integrity.hash_file`); no DCP, no process group.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import distckpt._storage.commit as commit_mod
from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk.integrity import hash_file
from distckpt._ondisk.layout import LATEST, MANIFEST, checkpoint_name, pending_name
from distckpt._ondisk.manifest import Manifest, TensorSpec, model_fingerprint
from distckpt._storage.commit import (
    commit,
    delete_checkpoint,
    find_committed,
    list_files,
    remove_leftovers,
    repair_latest,
    validate,
    verify,
)

FILES = {"__0_0.distcp": b"rank zero bytes " * 64, "__1_0.distcp": b"rank one" * 10, ".metadata": b"meta"}


def _manifest(step: int, files: list) -> Manifest:
    specs = {"w": TensorSpec(shape=[2, 3], dtype="torch.float32")}
    return Manifest(
        step=step,
        world_size=2,
        wrapper="ddp",
        state_dict_type="sharded",
        torch_version="2.x",
        distckpt_version="0",
        model=specs,
        model_fingerprint=model_fingerprint(specs),
        files=files,
    )


def _pending(root: Path, step: int) -> Path:
    pending = root / pending_name(step, "ab12")
    pending.mkdir(parents=True)
    for name, data in FILES.items():
        (pending / name).write_bytes(data)
    return pending


def _committed(root: Path, step: int) -> Path:
    """A checkpoint committed through :func:`commit`, hashes as the writers report them."""
    pending = _pending(root, step)
    hashes = {name: hash_file(pending / name) for name in FILES}
    final = root / checkpoint_name(step)
    commit(pending, final, _manifest(step, list_files(pending, hashes)))
    return final


def test_commit_writes_the_manifest_before_the_rename_then_updates_latest(tmp_path: Path) -> None:
    old = _committed(tmp_path, 10)
    pending = _pending(tmp_path, 20)
    final = tmp_path / checkpoint_name(20)
    manifest = _manifest(20, list_files(pending, {n: hash_file(pending / n) for n in FILES}))
    seen = []

    def on_phase(name: str) -> None:  # what the disk holds as each phase begins
        seen.append(
            (name, pending.is_dir(), (pending / MANIFEST).is_file(), final.is_dir(), (tmp_path / LATEST).read_text())
        )

    commit(pending, final, manifest, on_phase=on_phase)
    old_latest = old.name + "\n"
    assert seen == [
        ("manifest", True, False, False, old_latest),  # nothing of the new one yet
        ("rename", True, True, False, old_latest),  # manifest complete inside the pending directory
        ("latest", False, False, True, old_latest),
    ]  # renamed; latest still the old one
    assert (tmp_path / LATEST).read_text() == "step-000000020\n"
    assert not pending.exists()
    assert sorted(p.name for p in final.iterdir()) == sorted([*FILES, MANIFEST])
    assert Manifest.read(final) == manifest
    assert [e.path for e in manifest.files] == sorted(FILES)  # manifest excluded, sorted
    assert all(e.hash == hash_file(final / e.path)[1] and e.size_bytes == len(FILES[e.path]) for e in manifest.files)
    assert [n for n in os.listdir(tmp_path) if ".tmp" in n] == []


def test_commit_refuses_an_existing_final_directory(tmp_path: Path) -> None:
    final = _committed(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    pending = _pending(tmp_path, 10)
    with pytest.raises(FileExistsError, match="refusing to overwrite a committed checkpoint"):
        commit(pending, final, _manifest(10, list_files(pending)))
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert sorted(os.listdir(pending)) == sorted(FILES)  # left for cleanup, no manifest written

    user = tmp_path / checkpoint_name(30)  # e.g. a plain dcp.save: not distckpt's
    user.mkdir()
    (user / "mine.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a distckpt checkpoint"):
        commit(_pending(tmp_path, 30), user, _manifest(30, []))
    assert os.listdir(user) == ["mine.bin"]
    assert (tmp_path / LATEST).read_text() == "step-000000010\n"


def test_validate_and_verify_find_truncated_missing_and_flipped_files(tmp_path: Path) -> None:
    ckpt = _committed(tmp_path, 10)
    assert validate(ckpt, check_hashes=True).step == 10 and verify(ckpt) == []

    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[100] ^= 0x01  # one bit, same size
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    assert validate(ckpt).step == 10  # sizes only: a flipped bit passes
    with pytest.raises(CheckpointCorruptError, match="xxh3_128 .* does not match") as e:
        validate(ckpt, check_hashes=True)
    assert e.value.path == str(ckpt / "__0_0.distcp")

    (ckpt / "__1_0.distcp").write_bytes(FILES["__1_0.distcp"][:-3])
    with pytest.raises(CheckpointCorruptError, match="size 77 bytes, manifest expects 80 bytes") as e:
        validate(ckpt)
    assert e.value.path == str(ckpt / "__1_0.distcp")
    (ckpt / ".metadata").unlink()
    problems = verify(ckpt)  # every problem, not just the first
    assert sorted(p.path for p in problems) == sorted(str(ckpt / n) for n in FILES)
    assert any("missing" in str(p) for p in problems)

    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointCorruptError, match="manifest missing"):
        validate(ckpt)
    assert [str(p) for p in verify(ckpt)] == [f"{ckpt / MANIFEST}: manifest missing (uncommitted checkpoint)"]
    assert [(s, isinstance(r, Manifest)) for s, _, r in find_committed(tmp_path)] == [(10, False)]


def test_remove_leftovers_removes_only_what_distckpt_provably_wrote(tmp_path: Path) -> None:
    _committed(tmp_path, 10)
    ours = [
        tmp_path / pending_name(20, "ab12cd"),
        tmp_path / ".deleting-step-000000004-ef56",
        tmp_path / ".staging-step-000000015-77aa",
    ]  # the pending name of earlier versions
    for d in ours:
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / ".latest.tmp-4242").write_text("step-000000020\n")
    unmanaged = tmp_path / checkpoint_name(30)  # no manifest, not named by latest: not ours to delete
    unmanaged.mkdir()
    (unmanaged / "data.bin").write_bytes(b"user data")
    others = [tmp_path / ".staging-notes", tmp_path / "step-7", tmp_path / ".deleting-elsewhere"]
    for d in others:
        d.mkdir()
    (tmp_path / "README.txt").write_text("keep me")

    removed = remove_leftovers(tmp_path)
    assert sorted(removed) == sorted([d.name for d in ours] + [".latest.tmp-4242"])
    assert sorted(os.listdir(tmp_path)) == sorted(
        [LATEST, "step-000000010", "step-000000030", ".staging-notes", "step-7", ".deleting-elsewhere", "README.txt"]
    )
    assert (unmanaged / "data.bin").read_bytes() == b"user data"
    assert remove_leftovers(tmp_path) == []


def test_remove_leftovers_leaves_the_manifestless_checkpoint_latest_names(tmp_path: Path) -> None:
    ckpt = _committed(tmp_path, 10)
    (ckpt / MANIFEST).unlink()  # distckpt committed it (latest says so), then it lost its manifest
    assert remove_leftovers(tmp_path) == []  # the load judges it (fallback_to_older), not the cleanup
    assert sorted(os.listdir(ckpt)) == sorted(FILES)
    assert commit_mod.damaged_step_dirs(tmp_path) == [ckpt] and commit_mod.unmanaged_step_dirs(tmp_path) == []


def test_a_manifestless_step_dir_is_damaged_only_with_distckpts_own_files(tmp_path: Path) -> None:
    plain = tmp_path / checkpoint_name(5)  # a user's dcp.save (distckpt.dcp's sidecar included)
    plain.mkdir()
    for name in (".metadata", "__0_0.distcp", ".metadata.xxh3.json"):
        (plain / name).write_bytes(b"x")
    ours = tmp_path / checkpoint_name(7)  # distckpt's digest file, no manifest, latest elsewhere
    ours.mkdir()
    for name in (".metadata", "__0_0.distcp", ".digests-rank-00000.json"):
        (ours / name).write_bytes(b"x")
    assert commit_mod.unmanaged_step_dirs(tmp_path) == [plain]
    assert commit_mod.damaged_step_dirs(tmp_path) == [ours]
    assert remove_leftovers(tmp_path) == [] and plain.is_dir() and ours.is_dir()


def test_delete_checkpoint_renames_to_deleting_before_removing(tmp_path: Path, monkeypatch) -> None:
    ckpt = _committed(tmp_path, 10)
    keep = _committed(tmp_path, 20)
    real_rmtree, at_rmtree = shutil.rmtree, []

    def spy(path, *args, **kwargs):
        at_rmtree.append((Path(path).name, ckpt.exists(), sorted(os.listdir(path))))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(commit_mod.shutil, "rmtree", spy)
    delete_checkpoint(ckpt)
    ((name, original_still_there, contents),) = at_rmtree
    assert name.startswith(".deleting-step-000000010-") and not original_still_there
    assert contents == sorted([*FILES, MANIFEST])  # renamed whole, then removed
    assert sorted(os.listdir(tmp_path)) == [LATEST, keep.name]
    delete_checkpoint(ckpt)  # already gone: nothing to do
    assert len(at_rmtree) == 1


def test_repair_latest(tmp_path: Path) -> None:
    assert repair_latest(tmp_path) is None  # no latest: nothing to repair
    _committed(tmp_path, 10)
    newest = _committed(tmp_path, 20)
    assert repair_latest(tmp_path) == "step-000000020"  # already right: unchanged
    (tmp_path / LATEST).write_text("step-000000030\n")  # names a checkpoint set aside since
    assert repair_latest(tmp_path) == "step-000000020"
    assert (tmp_path / LATEST).read_text() == "step-000000020\n"
    (newest / MANIFEST).unlink()  # the newest is not valid any more: the next older one
    (tmp_path / LATEST).write_text("step-000000030\n")
    assert repair_latest(tmp_path) == "step-000000010"
    shutil.rmtree(tmp_path / "step-000000010")
    shutil.rmtree(newest)
    (tmp_path / LATEST).write_text("step-000000030\n")
    assert repair_latest(tmp_path) is None and not (tmp_path / LATEST).exists()


def test_the_manifest_json_holds_every_field_as_dataclasses_asdict_gives_it() -> None:
    import dataclasses
    import json

    from distckpt._ondisk.manifest import FileEntry

    files = [
        FileEntry(path="__0_0.distcp", size_bytes=5, hash="h0"),
        FileEntry(path=".metadata", size_bytes=4, hash="h1"),
    ]
    manifest = _manifest(7, files)
    manifest.hardware, manifest.metrics, manifest.timings_s = {"cpus": 2, "gpus": []}, {"loss": 1.5}, {"write": 0.1}
    want = json.loads(json.dumps(dataclasses.asdict(manifest)))
    for f in want["files"]:
        del f["block_ends"], f["block_hashes"]
    for name in ("data_prefix", "initial_load", "interval"):
        del want[name]
    got = json.loads(manifest.to_json())
    want["schema_version"] = got["schema_version"]
    assert got == want
