"""distckpt.dcp on a real S3 server (SeaweedFS): the drop-in writer uploads DCP's files and the
hash sidecar under an ``s3://`` URL; torch's FsspecReader and distckpt's reader read them back
bitwise; a changed object is named (issue 28, item 1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 200, generator=g), "ids": torch.arange(17), "extra": {"step": 9}}


def _zeros() -> dict:
    return {"w": torch.zeros(300, 200), "ids": torch.zeros(17, dtype=torch.long), "extra": {"step": 0}}


def _check(out: dict) -> None:
    sd = _state()
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["ids"], sd["ids"]) and out["extra"]["step"] == 9


def test_drop_in_classes_on_s3_both_ways_and_a_changed_object_named(s3_server, s3_root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # where torch 2.13 keeps it

    from distckpt import dcp as ddcp

    url = f"{s3_root}/ckpt"
    dcp.save(_state(), storage_writer=ddcp.FileSystemWriter(url, thread_count=2), no_dist=True)
    client = s3_server.client()
    bucket, _, prefix = url[len("s3://") :].partition("/")
    keys = sorted(o["Key"][len(prefix) + 1 :] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    assert keys == [".metadata", ".metadata.xxh3.json", "__0_0.distcp", "__0_1.distcp"]
    out = _zeros()
    dcp.load(out, storage_reader=FsspecReader(url, endpoint_url=s3_server.endpoint_url), no_dist=True)  # stock
    _check(out)
    out = _zeros()
    reader = ddcp.FileSystemReader(url)
    dcp.load(out, storage_reader=reader, no_dist=True)  # verified
    _check(out)
    assert reader.hashes is not None and set(reader.hashes) == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    # A stock writer's checkpoint (no sidecar) reads unverified.
    stock_url = f"{s3_root}/stock"
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(_state(), storage_writer=FsspecWriter(stock_url, endpoint_url=s3_server.endpoint_url), no_dist=True)
    out, reader = _zeros(), ddcp.FileSystemReader(stock_url)
    dcp.load(out, storage_reader=reader, no_dist=True)
    _check(out)
    assert reader.hashes is None
    # One object changed after the save.
    for name in ("__0_0.distcp", "__0_1.distcp"):
        body = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read())
        body[len(body) // 2] ^= 0x04
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes(body))
    with pytest.raises(BaseException) as info:
        dcp.load(_zeros(), storage_reader=ddcp.FileSystemReader(url), no_dist=True)
    assert f"{url}/__0_" in str(info.value) and "does not match" in str(info.value)
    assert "the hash sidecar's" in str(info.value) and "manifest" not in str(info.value)  # no manifest here
