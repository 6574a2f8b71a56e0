"""distckpt/_ondisk/integrity.py on its own: xxh3-128 file hashes and the manifest-entry check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distckpt._errors import CheckpointCorruptError
from distckpt._ondisk.integrity import HASH_ALGORITHM, HashingFileSystem, check_file, hash_file

# XXH3-128 (seed 0) reference digests, from xxHash's own test vectors.
EMPTY = "99aa06d3014798d86001c324468d497f"
ABC = "06b05ab6733a618578af5f94892f3950"


def test_hash_file_known_digests(tmp_path: Path) -> None:
    assert HASH_ALGORITHM == "xxh3_128"
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "abc").write_bytes(b"abc")
    assert hash_file(tmp_path / "empty") == (0, EMPTY)
    assert hash_file(tmp_path / "abc") == (3, ABC)


def test_hash_file_over_several_chunks_equals_the_one_shot_digest(tmp_path: Path) -> None:
    import xxhash

    data = os.urandom(1 << 20) * 17 + b"tail"  # 17 MiB + 4 bytes: three 8 MiB reads, the last partial
    (tmp_path / "big").write_bytes(data)
    size, digest = hash_file(tmp_path / "big")
    assert size == len(data) and digest == xxhash.xxh3_128(data).hexdigest()
    data = bytearray(data)
    data[9 << 20] ^= 0x80  # one bit in the second chunk
    (tmp_path / "big").write_bytes(bytes(data))
    assert hash_file(tmp_path / "big") == (size, xxhash.xxh3_128(bytes(data)).hexdigest()) != (size, digest)


def test_check_file_names_the_file_and_what_differs(tmp_path: Path) -> None:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"abc")
    check_file(path, size_bytes=3, digest=ABC)  # matches: no error
    check_file(path, size_bytes=3, digest=None)  # size only

    with pytest.raises(CheckpointCorruptError) as e:
        check_file(path, size_bytes=4, digest=ABC)
    assert e.value.path == str(path)
    assert str(e.value) == f"{path}: size 3 bytes, manifest expects 4 bytes (truncated?)"

    path.write_bytes(b"abd")  # same size, other bytes
    check_file(path, size_bytes=3, digest=None)  # a size-only check cannot see it
    with pytest.raises(CheckpointCorruptError) as e:
        check_file(path, size_bytes=3, digest=ABC)
    assert e.value.path == str(path)
    assert f"xxh3_128 {hash_file(path)[1]} does not match the manifest's {ABC}" in str(e.value)

    missing = tmp_path / "__1_0.distcp"
    with pytest.raises(CheckpointCorruptError, match="file listed in the manifest is missing") as e:
        check_file(missing, size_bytes=3, digest=ABC)
    assert e.value.path == str(missing)


def test_hashing_file_system_records_what_it_writes_under_the_final_name(tmp_path: Path) -> None:
    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / ".metadata.tmp", "wb") as f:
        f.write(b"a")
        f.write(b"bc")
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as f:
        f.write(b"")
    assert fs.written == {".metadata.tmp": (3, ABC), "__0_0.distcp": (0, EMPTY)}
    fs.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")  # DCP's last step
    assert fs.written == {".metadata": (3, ABC), "__0_0.distcp": (0, EMPTY)}
    assert hash_file(tmp_path / ".metadata") == (3, ABC)
    with fs.create_stream(tmp_path / ".metadata", "rb") as f:  # reads are not recorded
        assert f.read() == b"abc"
    assert len(fs.written) == 2
