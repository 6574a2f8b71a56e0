"""The manifest ``distckpt.json``: what a committed checkpoint holds (docs/design.md, section 3).

Written last by rank 0 (tmp + ``os.replace``) before the pending directory is renamed, so its
presence with a matching file list is what makes a checkpoint loadable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._errors import CheckpointCorruptError, IncompatibleCheckpointError
from .integrity import BlockDigests, new_hasher
from .layout import MANIFEST

__all__ = [
    "SCHEMA_VERSION",
    "DIGESTS_FORMAT",
    "encode_digests",
    "holds_blocks",
    "Manifest",
    "FileEntry",
    "TensorSpec",
    "model_fingerprint",
    "migrate",
    "check_model_fits",
    "structure_problems",
    "first_problem",
    "is_extra_state",
]

SCHEMA_VERSION = 7
# v1 -> v2: files gained "hash" (xxh3_128 hex), the manifest gained "hash_algorithm".
# v2 -> v3: a file path may name another checkpoint's file ("../step-N/__0_0.distcp", an
# incremental checkpoint's reference): an older distckpt would delete referenced checkpoints.
# v3 -> v4: files may carry "block_ends" + "block_hashes" (xxh3_128 per block, integrity.py);
# an older distckpt would call such a manifest malformed, so it says "upgrade" instead. A
# manifest without block digests (S3, async_save.mode: process) is still written as v3.
# v4 -> v5: "initial_load", the load options the run that wrote it started with (restart.py); a
# manifest without them is written as v4 (or v3), which older distckpt reads.
# v5 -> v6: "interval", the statistics of ``schedule.interval_steps: auto`` (save/interval.py); a
# manifest without them is written as v5 or older.
# v6 -> v7: files may include per-rank digest files (".digests-rank-N.json", digests.py) holding the
# block digests the manifest no longer carries; an older distckpt would verify its data files whole
# only, and its tools would report no block digests. A manifest without them (rank 0's empty one, which
# marks a directory distckpt's, aside) is written as v6 or older.


DIGESTS_FORMAT = 1
"""Format of a per-rank digest file (:mod:`distckpt._ondisk.digests`, which reads them)."""


def holds_blocks(path: str, size_bytes: int, digest: str | None) -> bool:
    """Whether the digest file ``path`` (a manifest entry's size and hash) lists any block digests:
    not rank 0's empty one, written with small files only to mark the directory distckpt's."""
    m = re.match(r"^\.digests-rank-(\d+)\.json$", path.rsplit("/", 1)[-1])
    if m is None:
        return False
    data, empty = encode_digests(int(m.group(1)), {})
    return (size_bytes, digest) != (len(data), empty)


def encode_digests(rank: int, blocks: dict[str, BlockDigests]) -> tuple[bytes, str]:
    """``(file content, its xxh3-128 hex digest)`` of rank ``rank``'s digest file.

    Args:
        blocks: ``{file name relative to the checkpoint: its block digests}``.
    """
    files = {name: {"block_ends": list(b.ends), "block_hashes": list(b.hashes)} for name, b in sorted(blocks.items())}
    data = json.dumps({"format": DIGESTS_FORMAT, "rank": rank, "files": files}, sort_keys=True).encode()
    hasher = new_hasher()
    hasher.update(data)
    return data, hasher.hexdigest()


@dataclass(kw_only=True)
class FileEntry:
    """One data file of a checkpoint. ``path`` is relative to the checkpoint directory.

    ``block_ends`` / ``block_hashes`` (optional, POSIX saves of files over 1 MiB): the end
    offset and xxh3-128 of each block of the file (:class:`~distckpt._ondisk.integrity.BlockDigests`),
    so a reshard can read and verify only the blocks it needs.
    """

    path: str
    size_bytes: int
    hash: str | None = None
    block_ends: list[int] | None = None
    block_hashes: list[str] | None = None

    def blocks(self) -> BlockDigests | None:
        """The file's block digests, or ``None`` when the manifest has none."""
        if self.block_ends is None or self.block_hashes is None:
            return None
        if not isinstance(self.block_ends, list) or not isinstance(self.block_hashes, list):
            raise TypeError("block_ends / block_hashes must be lists")
        return BlockDigests(tuple(self.block_ends), tuple(self.block_hashes))


@dataclass(kw_only=True)
class TensorSpec:
    """Global shape and dtype of one model tensor (``dtype`` as ``str(torch.dtype)``)."""

    shape: list[int]
    dtype: str


@dataclass(kw_only=True)
class Manifest:
    """Contents of ``distckpt.json``.

    Attributes:
        step: global optimizer step at save.
        world_size: number of ranks that wrote the checkpoint.
        wrapper: wrapper kind of the model at save (``plain``, ``ddp``, ``fsdp1``, ``fsdp2``,
            with a ``+compile`` suffix when compiled).
        state_dict_type: ``sharded`` or ``full``.
        model: fingerprint, ``{fqn: TensorSpec}`` with clean keys, sorted.
        model_fingerprint: sha256 over the sorted ``(fqn, shape, dtype)`` list.
        timings_s: seconds per phase (``stage``, ``write``, ``commit``).
        files: every file of the checkpoint except the manifest itself.
        run_id: the experiment tracker's run id (``CheckpointManager(run_id=)``).
        metrics: ``{name: value}`` passed with the saved step (best-K retention reads them).
        probe_loss: the probe's loss at the save (``CheckpointManager(probe=)``).
        hardware: rank 0's machine at the save (platform, CPUs, accelerators).
        batch_change: set when the run that wrote it resumed with another global batch
            (``elastic.batch_policy: keep_local_batch``): policy, step rule, global batch, world size and
            step before/after (``TrainState.batch_change``).
        data_prefix: object storage only: the save's data prefix relative to the root
            (``data/step-N-<id>``); absent on POSIX, where the manifest sits in the directory.
        initial_load: ``CheckpointConfig.initial_load`` of the run that wrote it (``load_path``,
            ``load_step``, ``load_only``, ``exclude_from_loading``); absent when none was set.
            A start with the same options is a restart of that run (:mod:`distckpt._load.restart`).
        interval: ``schedule.interval_steps: auto`` only: the statistics the interval is chosen from
            (save costs, run time, failures, the kind of this save) and the decision in force when
            the save started (:meth:`distckpt._save.interval.IntervalStats.to_dict`); a resume takes
            them over. Absent otherwise.
    """

    step: int
    epoch: int = 0
    global_samples_seen: int = 0
    wall_time: float = 0.0
    world_size: int
    wrapper: str
    state_dict_type: str
    torch_version: str
    distckpt_version: str
    model: dict[str, TensorSpec]
    model_fingerprint: str
    loss: float | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)
    hash_algorithm: str | None = "xxh3_128"
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    probe_loss: float | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    batch_change: dict[str, Any] | None = None
    data_prefix: str | None = None
    initial_load: dict[str, Any] | None = None
    interval: dict[str, Any] | None = None

    def to_json(self) -> str:
        """The manifest as JSON text (sorted keys). Unset ``data_prefix`` / ``initial_load`` and a file's
        unset block digests are left out, and ``schema_version`` is the oldest schema that holds what is
        set: a manifest using no newer field stays readable by an older distckpt."""
        # asdict's deep copy, without its recursion over every TensorSpec (milliseconds per thousand)
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["model"] = {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in self.model.items()}
        data["files"] = [asdict(f) for f in self.files]
        for name in ("data_prefix", "initial_load", "interval"):  # unset: the manifest stays byte-for-byte as before
            if data[name] is None:
                del data[name]
        for f in data["files"]:  # files without blocks (and S3 manifests) keep their old form
            if f["block_ends"] is None and f["block_hashes"] is None:
                del f["block_ends"], f["block_hashes"]
        if data["schema_version"] == SCHEMA_VERSION:  # the oldest schema that holds it, which older distckpt reads
            blocks = any("block_ends" in f for f in data["files"])
            # rank 0's empty digest file (small files only) needs no v7: an older distckpt checks it as a file
            digests = any(holds_blocks(f["path"], f["size_bytes"], f["hash"]) for f in data["files"])
            data["schema_version"] = (
                7 if digests else 6 if "interval" in data else 5 if "initial_load" in data else 4 if blocks else 3
            )
        # A field per line (readable), each value by json's C encoder: ``indent=`` selects its pure
        # Python encoder, which costs far more for a model of many tensors.
        return (
            "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(data[k], sort_keys=True)}" for k in sorted(data)) + "\n}"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str = "<memory>") -> "Manifest":
        """Parse a manifest dict.

        Raises:
            CheckpointCorruptError: missing fields or a schema newer than this distckpt reads.
        """
        version = data.get("schema_version")
        if not isinstance(version, int):
            raise CheckpointCorruptError(f"{path}: manifest has no integer schema_version", path=path)
        if version > SCHEMA_VERSION:
            raise CheckpointCorruptError(
                f"{path}: manifest schema_version {version} is newer than this distckpt reads "
                f"({SCHEMA_VERSION}); upgrade distckpt",
                path=path,
            )
        if version < SCHEMA_VERSION:
            data = migrate(data)
        try:
            data = dict(data)
            data["model"] = {k: TensorSpec(**v) for k, v in data["model"].items()}
            data["files"] = [FileEntry(**f) for f in data["files"]]
            manifest = cls(**data)
        except (KeyError, TypeError) as e:
            raise CheckpointCorruptError(f"{path}: malformed manifest ({e})", path=path) from e
        for f in manifest.files:
            if (f.block_ends is None) != (f.block_hashes is None) or (f.block_ends is not None and not _blocks_ok(f)):
                raise CheckpointCorruptError(
                    f"{path}: malformed manifest (block digests of {f.path} do not tile its {f.size_bytes} bytes)",
                    path=path,
                )
        return manifest

    @classmethod
    def read(cls, checkpoint_dir: str | os.PathLike) -> "Manifest":
        """Read ``<checkpoint_dir>/distckpt.json``.

        Raises:
            CheckpointCorruptError: absent, unreadable or malformed manifest.
        """
        path = Path(checkpoint_dir) / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{path}: manifest missing (uncommitted checkpoint)", path=str(path)) from e
        except (OSError, ValueError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable manifest ({e})", path=str(path)) from e
        if not isinstance(data, dict):
            raise CheckpointCorruptError(f"{path}: manifest is not a JSON object", path=str(path))
        return cls.from_dict(data, path=str(path))


def _blocks_ok(f: FileEntry) -> bool:
    try:
        blocks = f.blocks()
        return blocks is not None and blocks.valid_for(f.size_bytes)
    except TypeError:  # ends that are not numbers
        return False


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Upgrade an older manifest dict to the current schema (files of v1 have no hash)."""
    data = dict(data)
    if data["schema_version"] == 1:
        data["files"] = [dict(f, hash=None) for f in data.get("files", [])]
        data["hash_algorithm"] = None
        data["schema_version"] = 2
    if data["schema_version"] == 2:
        data["schema_version"] = 3  # nothing to change: v2 files are all the checkpoint's own
    if data["schema_version"] == 3:
        data["schema_version"] = 4  # nothing to change: v3 files have no block digests
    if data["schema_version"] == 4:
        data["schema_version"] = 5  # nothing to change: a v4 run started without initial-load options
    if data["schema_version"] == 5:
        data["schema_version"] = 6  # nothing to change: a v5 run had no interval statistics
    if data["schema_version"] == 6:
        data["schema_version"] = 7  # nothing to change: a v6 manifest carries its block digests itself
    return data


def is_extra_state(fqn: str) -> bool:
    """Whether a model state_dict key is (or lies under) a module's ``get_extra_state()`` value
    (``_extra_state``, torch's key for it): module data such as FP8 scaling history, whose shape
    may change during training. It is not part of the model's layout: the manifest's model, its
    fingerprint and the checks against them leave it out."""
    return "_extra_state" in fqn.split(".")


def model_fingerprint(specs: dict[str, TensorSpec]) -> str:
    """sha256 (hex) of the sorted ``fqn shape dtype`` lines: equal iff the model layout is equal."""
    lines = [f"{k} {tuple(v.shape)} {v.dtype}" for k, v in sorted(specs.items())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def check_model_fits(manifest: Manifest, path: str, live: dict[str, TensorSpec], ties: dict[str, list[str]]) -> None:
    """Compare a checkpoint's model (its manifest) with the live model before touching anything.

    Args:
        manifest: the checkpoint's manifest.
        path: the checkpoint directory (for the message).
        live: ``{fqn: TensorSpec}`` of the live model.
        ties: ``{fqn: [fqns sharing its tensor]}``; a key missing from the checkpoint whose tied
            twin was saved with the same spec is not a difference (it is loaded from the twin).

    Raises:
        IncompatibleCheckpointError: every missing / unexpected key and shape / dtype mismatch.
    """
    if manifest.model_fingerprint == model_fingerprint(live):
        return
    # A manifest written before extra state was left out may list it: not a layout difference.
    saved = {k: v for k, v in manifest.model.items() if not is_extra_state(k)}
    missing = sorted(k for k in set(live) - set(saved) if not any(saved.get(t) == live[k] for t in ties.get(k, [])))
    unexpected = sorted(set(saved) - set(live))
    mismatched = []
    for key in sorted(set(saved) & set(live)):
        for what in ("shape", "dtype"):
            a, b = getattr(saved[key], what), getattr(live[key], what)
            if list(a) != list(b) if what == "shape" else a != b:
                mismatched.append((key, what, str(a), str(b)))
    if not (missing or unexpected or mismatched):
        return
    lines = [f"checkpoint {path} does not fit the live model:"]
    lines += [f"  missing in checkpoint: {k}" for k in missing]
    lines += [f"  unexpected (in checkpoint, not in model): {k}" for k in unexpected]
    lines += [f"  {what} mismatch for {k}: checkpoint {a}, model {b}" for k, what, a, b in mismatched]
    lines.append(
        "Load into the same architecture (a renamed layer or changed size/dtype needs "
        "an explicit conversion; distckpt never casts or drops weights silently)."
    )
    raise IncompatibleCheckpointError("\n".join(lines), missing=missing, unexpected=unexpected, mismatched=mismatched)


def structure_problems(
    manifest: Manifest,
    *,
    location: str,
    manifest_path: str | None = None,
    dir_step: int | None = None,
    present: Iterable[str] | None = None,
    metadata: Any = None,
) -> list[CheckpointCorruptError]:
    """What a committed checkpoint must agree with beyond its files' sizes and hashes: the one
    set of checks ``distckpt verify``, ``distckpt ls``, resume discovery and ``load()`` apply,
    so a checkpoint ``verify`` calls corrupt is never listed as committed nor loaded.

    Args:
        manifest: the checkpoint's parsed manifest.
        location: the checkpoint directory or data-prefix URL (files are named ``location/name``).
        manifest_path: where the manifest is, for messages (``None``: "the manifest of ``location``").
        dir_step: the step the checkpoint's name says (``step-N``); ``None``: not checked (a
            ``load.path`` named otherwise; S3 checks its manifest name when parsing it).
        present: relative names of the files there; ``None``: not checked. A file present but not
            listed was added or renamed after the commit.
        metadata: the checkpoint's DCP ``Metadata``; ``None``: not checked. Every item must lie in
            a listed file, within its size, and the model tensors must be the manifest's model
            (modules' extra state left out on both sides: :func:`is_extra_state`).

    Returns:
        Every problem found (empty when consistent), each naming its file in ``.path``.
    """
    where = manifest_path or f"the manifest of {location}"
    problems = []
    if dir_step is not None and dir_step != manifest.step:
        problems.append(
            CheckpointCorruptError(
                f"{where}: manifest says step {manifest.step}, directory is step {dir_step}", path=where
            )
        )
    listed = {f.path: f.size_bytes for f in manifest.files}
    for name in sorted(set(present or ()) - set(listed) - {MANIFEST}):
        problems.append(
            CheckpointCorruptError(
                f"{location}/{name}: file not listed in the manifest (added or renamed after the commit)",
                path=f"{location}/{name}",
            )
        )
    if metadata is None:
        return problems
    meta_path = f"{location}/.metadata"
    for index, info in (metadata.storage_data or {}).items():
        size = listed.get(info.relative_path)
        if size is None:
            problems.append(
                CheckpointCorruptError(
                    f"{meta_path}: item {index.fqn!r} is stored in {info.relative_path!r}, which the "
                    "manifest does not list",
                    path=meta_path,
                )
            )
        elif info.offset + info.length > size:
            problems.append(
                CheckpointCorruptError(
                    f"{location}/{info.relative_path}: item {index.fqn!r} at bytes {info.offset}.."
                    f"{info.offset + info.length} lies past the end ({size} bytes)",
                    path=f"{location}/{info.relative_path}",
                )
            )
    saved = {
        k[len("model.") :]: (list(v.size), str(v.properties.dtype))
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata) and not is_extra_state(k)
    }
    recorded = {k: (list(v.shape), v.dtype) for k, v in manifest.model.items() if not is_extra_state(k)}
    if saved != recorded:
        diff = sorted(k for k in set(saved) | set(recorded) if saved.get(k) != recorded.get(k))
        problems.append(
            CheckpointCorruptError(
                f"{where}: the manifest's model fingerprint does not match the tensors in "
                f".metadata (first differences: {', '.join(diff[:5])})",
                path=where,
            )
        )
    return problems


def first_problem(problems: list[CheckpointCorruptError], location: str) -> CheckpointCorruptError | None:
    """The first of ``problems`` (``None`` when empty), saying how many more there are and that
    ``distckpt verify location`` lists them all."""
    if len(problems) <= 1:
        return problems[0] if problems else None
    first = problems[0]
    return CheckpointCorruptError(
        f"{first} (and {len(problems) - 1} more problem(s): `distckpt verify {location}` lists them)", path=first.path
    )
