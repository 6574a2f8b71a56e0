"""Large DCP files on S3: uploaded while written in multipart parts, hashed from the bytes
written, read back verified; a failed part leaves no object."""

from __future__ import annotations

import pytest
import torch

from distckpt._engine.blocking import dcp_save, run_load
from distckpt._ondisk.integrity import new_hasher
from distckpt._storage import open_store
from distckpt._storage.s3_dcp import PART_BYTES
from tests.s3.faults import Fault, uninstall_all
from tests.s3.test_s3_single import get, keys

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


def test_a_large_file_streams_up_in_parts_and_loads_back_verified(s3_server, s3_root):
    store = open_store(s3_root)
    sd = {"big": torch.randn((2 * PART_BYTES + 12345) // 4), "small": torch.arange(10)}  # > 2 parts
    location = store.pending_location(1, "00aa")
    written = dcp_save(
        sd, location, process_group=None, writer=store.dcp_writer(location, thread_count=1, write_timeout_s=None)
    )
    files = store.list_files(location, written)
    name = next(f for f in files if f.path.endswith(".distcp"))
    data = get(s3_server, s3_root, f"{location[len(s3_root) + 1 :]}/{name.path}")
    hasher = new_hasher()
    hasher.update(data)
    assert name.size_bytes == len(data) > 2 * PART_BYTES and name.hash == hasher.hexdigest()
    head = s3_server.client().head_object(
        Bucket="distckpt-tests",
        Key=f"{s3_root[len('s3://distckpt-tests/') :]}/{location[len(s3_root) + 1 :]}/{name.path}",
    )
    assert head["ETag"].strip('"').endswith("-3")  # a multipart object of 3 parts
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    run_load(
        target,
        store.dcp_reader(
            location, expected_files={f.path: (f.size_bytes, f.hash) for f in files}, fast=True, thread_count=2
        ),
        process_group=None,
        directory=location,
    )
    assert all(torch.equal(target[k], sd[k]) for k in sd)


def test_a_failed_part_fails_the_write_and_leaves_no_object(s3_server, s3_root, monkeypatch):
    from distckpt import StorageError
    from distckpt._storage import s3_client

    monkeypatch.setattr(s3_client, "MAX_ATTEMPTS", 2)
    Fault(("UploadPart",), "partNumber=2", 500, "InternalError").install()
    try:
        store = open_store(s3_root)
        location = store.pending_location(1, "00bb")
        with pytest.raises(BaseException) as e:  # DCP wraps it in its CheckpointException
            dcp_save(
                {"big": torch.randn((2 * PART_BYTES) // 4)},
                location,
                process_group=None,
                writer=store.dcp_writer(location, thread_count=1, write_timeout_s=None),
            )
        assert "part 2" in str(e.value) or any(isinstance(x, StorageError) for x in _chain(e.value))
    finally:
        uninstall_all()
    assert not [k for k in keys(s3_server, s3_root) if k.endswith(".distcp")]
    uploads = s3_server.client().list_multipart_uploads(Bucket="distckpt-tests").get("Uploads", [])
    assert not [u for u in uploads if u["Key"].startswith(s3_root[len("s3://distckpt-tests/") :])]


def _chain(e: BaseException) -> list[BaseException]:
    out = [e]
    for pair in (getattr(e, "failures", None) or {}).values():
        out.append(pair[0] if isinstance(pair, tuple) else pair)
    return out
