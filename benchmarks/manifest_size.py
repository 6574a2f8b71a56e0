"""Probe: the size of the manifest a save of W ranks writes, in one process.

Each simulated rank "writes" ``files_per_rank`` files of ``bytes_per_rank / files_per_rank`` bytes
(sparse files: nothing is written but their length) with one 8 MiB block digest per 8 MiB, as the
hashing writer reports them (``WrittenFile`` with ``.blocks``); then the save's own code runs:
every rank's ``PosixStore.write_digests`` (its digest file) and rank 0's ``list_files`` + the
manifest's ``to_json``. ``python -m benchmarks.manifest_size --world-size 1024 --gib-per-rank 8``
prints the manifest's size and the digest files' total.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# The manifest and digest files a save at W ranks commits, built without W processes (none is public):
from distckpt._ondisk.integrity import MAX_BLOCK_BYTES, BlockDigests, WrittenFile  # a rank's file records
from distckpt._ondisk.manifest import Manifest, TensorSpec, model_fingerprint  # the manifest under test
from distckpt._storage.posix import PosixStore  # writes the digest files as a commit does

__all__ = ["manifest_size", "main"]


def manifest_size(
    world_size: int, bytes_per_rank: int, *, files_per_rank: int = 4, workdir: str | None = None
) -> dict[str, float]:
    """Build the manifest of a synthetic save and measure it.

    Args:
        world_size: ranks simulated.
        bytes_per_rank: bytes each rank writes (split evenly over ``files_per_rank`` files,
            each a multiple of 8 MiB).
        files_per_rank: DCP files per rank (``save.thread_count``).
        workdir: where the pending directory is made (``None``: a temporary directory, removed).

    Returns:
        ``manifest_bytes`` (the ``distckpt.json`` text, UTF-8), ``digest_bytes`` (all digest files),
        ``files`` (manifest entries), ``seconds`` (rank 0's ``list_files`` + ``to_json``).
    """
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        store = PosixStore(tmp)
        pending = store.pending_location(1, "probe")
        store.begin_write(pending)
        file_bytes = bytes_per_rank // files_per_rank // MAX_BLOCK_BYTES * MAX_BLOCK_BYTES
        ends = tuple(range(MAX_BLOCK_BYTES, file_bytes + 1, MAX_BLOCK_BYTES))
        hashes = tuple(f"{i:032x}" for i in range(len(ends)))  # well formed; content is not measured
        blocks = BlockDigests(ends, hashes)
        reported: dict[str, tuple[int, str]] = {}
        for rank in range(world_size):
            written: dict[str, tuple[int, str]] = {}  # WrittenFile values, as a writer reports them
            for i in range(files_per_rank):
                name = f"__{rank}_{i}.distcp"
                with open(Path(pending) / name, "wb") as f:
                    f.truncate(file_bytes)
                written[name] = WrittenFile(file_bytes, f"{rank:016x}{i:016x}", blocks)
            reported.update(store.write_digests(pending, rank, written))
        digest_bytes = sum(p.stat().st_size for p in Path(pending).glob(".digests-rank-*.json"))
        t0 = time.perf_counter()
        specs = {f"model.layers.{i}.weight": TensorSpec(shape=[8192, 8192], dtype="torch.bfloat16") for i in range(64)}
        manifest = Manifest(
            step=1,
            world_size=world_size,
            wrapper="fsdp2",
            state_dict_type="sharded",
            torch_version="probe",
            distckpt_version="probe",
            model=specs,
            model_fingerprint=model_fingerprint(specs),
            files=store.list_files(pending, reported),
        )
        text = manifest.to_json()
        seconds = time.perf_counter() - t0
        return {
            "manifest_bytes": len(text.encode()),
            "digest_bytes": digest_bytes,
            "files": len(manifest.files),
            "seconds": seconds,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--gib-per-rank", type=float, default=8.0)
    parser.add_argument("--files-per-rank", type=int, default=4)
    args = parser.parse_args(argv)
    got = manifest_size(args.world_size, int(args.gib_per_rank * (1 << 30)), files_per_rank=args.files_per_rank)
    print(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
