"""The S3 store: atomic commits without rename (docs/design.md, "Storage seam").

Layout under ``s3://bucket/prefix``::

    data/step-000000040-<save id>/   one save's DCP files (.metadata, __r_i.distcp); unique per
                                     save, written once, never overwritten
    manifests/step-000000040.json    the commit record: rank 0 PUTs it last, in one request,
                                     with If-None-Match: * (a conditional create)
    latest                           a hint: the name of the last commit
    .lock                            the root's lock (created with If-None-Match: *)
    .interval.json                   interval_steps: auto's journal (save/schedule.py)

A checkpoint exists iff its manifest exists and names its data prefix; the manifest is written after every rank
reported its files written (and their hashes), so a crash at any instant leaves either no manifest (the save's objects
are unreferenced, removed at the next start) or a complete checkpoint. A second writer of the same step (a stale job)
gets ``PreconditionFailed`` and fails its save instead of replacing the commit. Retention deletes the manifest first,
then the data. The data of the step ``latest`` names without its manifest is damaged, not a leftover (docs/format.md,
"Layout"). A checkpoint's *location* is its data prefix URL, which plain ``dcp.load(...,
storage_reader=FsspecReader(location))`` reads.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any, Callable

from typing_extensions import override

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from .._ondisk.integrity import HASH_ALGORITHM, BlockDigests, new_hasher
from .._ondisk.layout import LATEST, checkpoint_name, parse_set_aside, parse_step
from .._ondisk.manifest import FileEntry, Manifest, first_problem, structure_problems
from .base import CheckpointStore, Others, split_location
from .generic import find_committed
from .s3_client import S3LockFile, S3Objects, split_url
from .s3_dcp import S3Reader, S3Writer

__all__ = ["S3Store", "S3LockFile"]  # S3LockFile: s3_client

logger = logging.getLogger(__name__)

DATA, MANIFESTS = "data/", "manifests/"
_DATA_RE = re.compile(r"^(step-\d{9,})-([0-9a-f]+)$")
_MANIFEST_RE = re.compile(r"^(step-\d{9,})\.json$")


def _step_of(rel: str) -> str:
    """``step-N`` of a ``data/step-N-<id>`` prefix."""
    return rel[len(DATA) :].rsplit("-", 1)[0]


class S3Store(CheckpointStore):
    """A checkpoint root on S3 (see the module docstring and
    :class:`~distckpt._storage.base.CheckpointStore`).

    Args:
        root: ``s3://bucket[/prefix]``.
        endpoint_url, region: S3 client settings (default: the standard AWS environment).
    """

    kind = "s3"
    shared = True

    def __init__(self, root: str, *, endpoint_url: str | None = None, region: str | None = None) -> None:
        self.root = root.rstrip("/")
        self.bucket, self.prefix = split_url(self.root)
        self.endpoint_url, self.region = endpoint_url, region
        self.objects = S3Objects(self.bucket, endpoint_url=endpoint_url, region=region)

    # ------------------------------------------------------------------ names
    def key(self, rel: str) -> str:
        """Object key of ``rel`` under the root's prefix."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _manifest_key(self, step: int) -> str:
        return self.key(f"{MANIFESTS}{checkpoint_name(step)}.json")

    def _rel(self, location: str) -> str:
        """``data/step-...-id`` of a location URL of this root."""
        bucket, key = split_url(location)
        base = self.key("")
        if bucket != self.bucket or not key.startswith(base):
            raise CheckpointCorruptError(f"{location}: not a checkpoint of {self.root}", path=location)
        return key[len(base) :]

    def location(self, data_prefix: str) -> str:
        """The location URL of ``data_prefix`` (``data/step-N-<id>``, relative to the root)."""
        return self.objects.url(self.key(data_prefix))

    # ------------------------------------------------------------------ write
    def prepare(self, *, read_only: bool = False) -> None:
        """The bucket exists and the credentials reach it (a read, so ``read_only`` changes nothing)."""
        self.objects.check_bucket(self.root)

    @override
    def pending_location(self, step: int, save_id: str) -> str:
        return self.location(f"{DATA}{checkpoint_name(step)}-{save_id}")

    @override
    def final_location(self, step: int, pending: str) -> str:
        return pending  # no rename: the manifest makes the data prefix a checkpoint

    @override
    def begin_write(self, pending: str) -> None:
        pass

    @override
    def dcp_writer(
        self,
        location: str,
        *,
        thread_count: int,
        write_timeout_s: float | None,
        incremental: tuple[int, int | None] | None = None,
    ) -> Any:
        if incremental is not None:  # CheckpointConfig refuses incremental on object storage
            raise ValueError("incremental saves need a POSIX root")
        return S3Writer(
            location,
            thread_count=thread_count,
            write_timeout_s=write_timeout_s,
            endpoint_url=self.endpoint_url,
            region=self.region,
        )

    @override
    def dcp_reader(
        self,
        location: str,
        *,
        expected_files: dict[str, tuple[int, str | None]] | None,
        fast: bool,
        thread_count: int,
        block_digests: Mapping[str, BlockDigests] | None = None,
    ) -> Any:
        # Whole objects: each object a rank needs is downloaded and verified once (block_digests unused).
        return S3Reader(location, expected_files=expected_files, endpoint_url=self.endpoint_url, region=self.region)

    @override
    def read_file(self, location: str, name: str) -> bytes:
        bucket, key = split_url(location)  # any prefix of this bucket: a plain dcp.save's too
        data = self.objects.get(f"{key.rstrip('/')}/{name}") if bucket == self.bucket else None
        if data is None:
            raise FileNotFoundError(f"{location}/{name}: no such object")
        return data

    def object_sizes(self, location: str) -> dict[str, int]:
        """``{file name: size}`` of every object under a checkpoint's data prefix (tools)."""
        base = self.key(self._rel(location)) + "/"
        return {k[len(base) :]: size for k, size in self.objects.list_objects(base).items()}

    def manifest_path(self, location: str) -> str | None:
        """``None`` (tools): the manifest's key names its step; parsing it checks that."""
        return None

    def named_step(self, location: str) -> int | None:
        """``None`` (tools): :meth:`read_manifest` checks the step."""
        return None

    @override
    def list_files(
        self, pending: str, hashes: dict[str, tuple[int, str]], *, references: bool = False
    ) -> list[FileEntry]:  # no incremental saves: no references
        entries = []
        for name, size in sorted(self.object_sizes(pending).items()):
            reported = hashes.get(name)
            if reported is not None and reported[0] != size:
                raise CheckpointCorruptError(
                    f"{pending}/{name}: {size} bytes stored, its writer wrote {reported[0]}", path=f"{pending}/{name}"
                )
            entries.append(FileEntry(path=name, size_bytes=size, hash=reported[1] if reported else None))
        return entries

    def commit(self, pending: str, step: int, manifest: Manifest, on_phase: Callable[[str], None] | None = None) -> str:
        """PUT the manifest (conditional create), then ``latest``. ``on_phase`` gets ``"manifest"``
        and ``"latest"`` before each.

        Raises:
            FileExistsError: ``step`` is already committed (e.g. by a newer job): nothing replaced.
            OSError: the PUT failed; the save's data stays unreferenced (removed at the next start).
        """
        phase = on_phase or (lambda name: None)
        manifest.data_prefix = self._rel(pending)
        phase("manifest")
        try:
            self.objects.put(self._manifest_key(step), manifest.to_json().encode(), if_absent=True)
        except FileExistsError as e:
            raise FileExistsError(
                f"{self.objects.url(self._manifest_key(step))} already exists: "
                f"{checkpoint_name(step)} is committed (by this or another job); "
                "refusing to replace a commit"
            ) from e
        phase("latest")
        self.objects.put(self.key(LATEST), (checkpoint_name(step) + "\n").encode())
        return pending

    @override
    def abort(self, pending: str) -> None:
        try:
            self.objects.delete_prefix(self.key(self._rel(pending)) + "/")
        except OSError as e:  # the next start removes unreferenced data
            logger.warning("could not remove the failed save's objects under %s: %s", pending, e)

    # ------------------------------------------------------------------ read
    def _parse_manifest(self, step: int, data: bytes | None, url: str) -> Manifest:
        if data is None:
            raise CheckpointCorruptError(f"{url}: manifest missing (uncommitted checkpoint)", path=url)
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise CheckpointCorruptError(f"{url}: unreadable manifest ({e})", path=url) from e
        if not isinstance(obj, dict):
            raise CheckpointCorruptError(f"{url}: manifest is not a JSON object", path=url)
        manifest = Manifest.from_dict(obj, path=url)
        if (
            manifest.step != step
            or not manifest.data_prefix
            or not _DATA_RE.match(manifest.data_prefix[len(DATA) :] if manifest.data_prefix.startswith(DATA) else "")
        ):
            raise CheckpointCorruptError(
                f"{url}: manifest does not describe {checkpoint_name(step)} "
                f"(step {manifest.step}, data {manifest.data_prefix!r})",
                path=url,
            )
        return manifest

    @override
    def read_manifest(self, location: str) -> Manifest:
        rel = self._rel(location)
        named = _MANIFEST_RE.match(rel[len(MANIFESTS) :]) if rel.startswith(MANIFESTS) else None
        if named is not None and (step := parse_step(named.group(1))) is not None:  # location_of: unreadable
            found = self._parse_manifest(step, self.objects.get(self.key(rel)), location)  # raises its problem
            raise CheckpointCorruptError(
                f"{location}: a manifest, not a checkpoint (its checkpoint: {self.location(found.data_prefix or '')})",
                path=location,
            )
        m = _DATA_RE.match(rel[len(DATA) :]) if rel.startswith(DATA) else None
        step = parse_step(m.group(1)) if m else None
        if step is None:
            raise CheckpointCorruptError(
                f"{location}: not a checkpoint data prefix of {self.root} (expected {self.root}/{DATA}step-N-<id>)",
                path=location,
            )
        url = self.objects.url(self._manifest_key(step))
        manifest = self._parse_manifest(step, self.objects.get(self._manifest_key(step)), url)
        if manifest.data_prefix != rel:
            raise CheckpointCorruptError(
                f"{location}: not committed ({url} commits {manifest.data_prefix})", path=location
            )
        return manifest

    def _check_file(
        self, location: str, name: str, *, size_bytes: int, digest: str | None, sizes: dict[str, int] | None = None
    ) -> None:
        url = f"{location}/{name}"
        actual = (self.object_sizes(location) if sizes is None else sizes).get(name)
        if actual is None:
            raise CheckpointCorruptError(f"{url}: object listed in the manifest is missing", path=url)
        if actual != size_bytes:
            raise CheckpointCorruptError(
                f"{url}: size {actual} bytes, manifest expects {size_bytes} bytes (truncated?)", path=url
            )
        if digest is None:
            return
        data = self.objects.get(self.key(self._rel(location)) + "/" + name) or b""
        hasher = new_hasher()
        hasher.update(data)
        if hasher.hexdigest() != digest:
            raise CheckpointCorruptError(
                f"{url}: {HASH_ALGORITHM} {hasher.hexdigest()} does not match the "
                f"manifest's {digest} (bytes changed after the commit)",
                path=url,
            )

    @override
    def validate(self, location: str, *, check_hashes: bool = False) -> Manifest:
        manifest = self.read_manifest(location)
        sizes = self.object_sizes(location)
        for entry in manifest.files:
            self._check_file(
                location,
                entry.path,
                size_bytes=entry.size_bytes,
                digest=entry.hash if check_hashes else None,
                sizes=sizes,
            )
        problem = first_problem(structure_problems(manifest, location=location, present=sizes), location)
        if problem is not None:  # the checks `distckpt verify` makes, but the hashes
            raise problem
        return manifest

    def verify(self, location: str) -> list[CheckpointCorruptError]:
        """Every problem of one checkpoint: manifest, sizes, hashes (tools)."""
        try:
            manifest = self.read_manifest(location)
            sizes = self.object_sizes(location)
        except CheckpointCorruptError as e:
            return [e]
        problems = []
        for entry in manifest.files:
            try:
                self._check_file(location, entry.path, size_bytes=entry.size_bytes, digest=entry.hash, sizes=sizes)
            except CheckpointCorruptError as e:
                problems.append(e)
        return problems

    @override
    def committed_steps(self) -> list[int]:
        steps = []
        for name in self.objects.list_objects(self.key(MANIFESTS)):
            m = _MANIFEST_RE.match(name.rsplit("/", 1)[-1])
            if m and (step := parse_step(m.group(1))) is not None:
                steps.append(step)
        return sorted(steps)

    @override
    def others(self) -> Others:
        # No unmanaged or deferred names: every data/step-N-<id> prefix is distckpt's, and one no
        # manifest names is a save's leftover (remove_leftovers' business), except those of the
        # step `latest` names (damaged: docs/format.md, "Layout"); nothing is incremental.
        damaged = [self.location(rel) for rel in self.damaged_prefixes()]
        return Others(
            unmanaged=[], damaged=damaged, deferred=[], set_aside=self._set_aside_names(), latest=self._latest()
        )

    def damaged_prefixes(self, latest: str | None = None) -> list[str]:
        """``data/step-N-<id>`` prefixes of the step ``latest`` names when that step has no manifest
        (not even a set-aside one): it committed (``latest`` is written after the manifest), then lost
        its manifest. Every other unreferenced prefix may be an interrupted save's: a leftover."""
        step = parse_step(latest or self._latest() or "")
        if step is None or step in self.committed_steps() or step in self._set_aside_steps():
            return []
        return [rel for rel in self._data_names() if rel.startswith(f"{DATA}{checkpoint_name(step)}-")]

    @override
    def location_of(self, step: int) -> str:
        """The data prefix its manifest names (one GET); the manifest's URL when there is none
        or it does not parse (:meth:`read_manifest` of it then raises its problem)."""
        key = self._manifest_key(step)
        try:
            manifest = self._parse_manifest(step, self.objects.get(key), self.objects.url(key))
        except CheckpointCorruptError:
            return self.objects.url(key)
        return self.location(manifest.data_prefix or "")

    @override
    def exists(self, location: str) -> bool:
        bucket, key = split_url(location)
        return bucket == self.bucket and bool(self.objects.list_objects(key.rstrip("/") + "/"))

    def is_plain_dcp(self, location: str) -> bool:
        """Not a data prefix of a root (``<root>/data/step-N-<id>``) but holding objects: a plain ``dcp.save``."""
        return split_location(location)[1] is None and self.exists(location)

    # ------------------------------------------------------------------ delete
    def _delete_checkpoint(self, step: int) -> None:
        """Manifest first (the checkpoint stops existing), then its data objects."""
        key = self._manifest_key(step)
        try:
            manifest = self._parse_manifest(step, self.objects.get(key), self.objects.url(key))
        except CheckpointCorruptError:
            return  # retention only deletes valid checkpoints; never guess at data
        self.objects.delete([key])
        self.objects.delete_prefix(self.key(manifest.data_prefix or "") + "/")

    def delete_checkpoints(
        self,
        steps: list[int],
        *,
        before: Callable[[int], None] | None = None,
        remove: Callable[[Any], None] | None = None,
    ) -> list[str]:
        """Retention: each manifest, then its data (no incremental references on S3)."""
        done = []
        for step in steps:
            if before is not None:
                before(step)
            self._delete_checkpoint(step)
            done.append(f"deleted {checkpoint_name(step)} of {self.root}")
        return done

    def deferred_by(self, steps: list[int]) -> list[str]:
        """None (tools): no incremental references on S3."""
        return []

    def check_tool_root(self) -> None:
        """Raise ``CheckpointNotFoundError`` when the root is one checkpoint's data prefix (tools)."""
        if split_location(self.root)[1] is not None:
            raise CheckpointNotFoundError(f"{self.root} is a checkpoint; pass its root")

    def remove_leftovers(self) -> list[str]:
        """Delete data prefixes no manifest references (interrupted saves and deletes). Only
        ``data/step-N-<hex>`` prefixes are touched, and none of a step whose manifest is unreadable."""
        removed = self.unreferenced()
        for rel in removed:
            self.objects.delete_prefix(self.key(f"{rel}/"))
        self._repair_latest()
        return removed

    def leftovers(self) -> list[str]:
        """What :meth:`remove_leftovers` would remove (tools)."""
        return self.unreferenced()

    def unreferenced(self) -> list[str]:
        """``data/step-N-<hex>`` prefixes no manifest references (saves in progress, or left by a
        crash), except those of a step whose manifest is set aside or unreadable."""
        referenced, unsure = set(), set()
        for name in self.objects.list_objects(self.key(MANIFESTS)):  # set-aside manifests keep their data
            found = re.search(r"(step-\d{9,})", name.rsplit("/", 1)[-1])
            if found and not _MANIFEST_RE.match(name.rsplit("/", 1)[-1]):
                unsure.add(found.group(1))
        for step in self.committed_steps():
            key = self._manifest_key(step)
            try:
                referenced.add(self._parse_manifest(step, self.objects.get(key), "").data_prefix)
            except CheckpointCorruptError:
                unsure.add(checkpoint_name(step))
        unsure |= {_step_of(rel) for rel in self.damaged_prefixes()}  # kept: damaged, never a leftover
        return [rel for rel in self._data_names() if rel not in referenced and _step_of(rel) not in unsure]

    def _data_names(self) -> list[str]:
        """Every ``data/step-N-<id>`` prefix holding an object, sorted. From the objects, not the
        "directories": some servers (SeaweedFS) keep a prefix after its last object is deleted."""
        base = self.key(DATA)
        names = {
            rest.split("/", 1)[0]
            for k in self.objects.list_objects(base)
            if "/" in (rest := k[len(base) :]) and not rest.endswith("/")
        }
        return sorted(f"{DATA}{n}" for n in names if _DATA_RE.match(n))

    # ------------------------------------------------------------------ latest, lock
    def _latest(self) -> str | None:
        data = self.objects.get(self.key(LATEST))
        return data.decode("utf-8", "replace").strip() or None if data is not None else None

    def _repair_latest(self) -> str | None:
        name = self._latest()
        if name is None:
            return None
        step = parse_step(name)
        if step is not None and (step in self.committed_steps() or self.damaged_prefixes(name)):
            return name  # a damaged checkpoint keeps latest: the evidence that it committed
        for s, _, result in find_committed(self):
            if isinstance(result, Manifest):
                self.objects.put(self.key(LATEST), (checkpoint_name(s) + "\n").encode())
                return checkpoint_name(s)
        self.objects.delete([self.key(LATEST)])
        return None

    @override
    def root_file(self, name: str) -> S3LockFile:  # the lock (".lock") is one
        return S3LockFile(self.objects, self.key(name))

    def _set_aside_names(self) -> list[str]:
        """Names (``manifests/<reason>-step-N-<n>``) of the set-aside manifests."""
        names = [k.rsplit("/", 1)[-1] for k in self.objects.list_objects(self.key(MANIFESTS))]
        return sorted(
            MANIFESTS + n[: -len(".json")] for n in names if n.endswith(".json") and not _MANIFEST_RE.match(n)
        )

    def _set_aside_steps(self) -> set[int]:
        return {aside[1] for n in self._set_aside_names() if (aside := parse_set_aside(n[len(MANIFESTS) :]))}

    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        """Rename the manifest of ``step`` to ``manifests/<reason>-step-N-<n>.json`` (copy, then
        delete): no longer a checkpoint (never loaded, counted or deleted), its data kept;
        ``latest`` is repaired. A damaged ``step`` (:meth:`damaged_prefixes`: no manifest) gets a
        set-aside record naming its data prefixes instead, which keeps them out of the leftovers.

        Returns:
            The new manifest name (``manifests/<reason>-step-N-<n>``).
        """
        taken = {k.rsplit("/", 1)[-1] for k in self.objects.list_objects(self.key(MANIFESTS))}
        n = 0
        while (name := f"{reason}-{checkpoint_name(step)}-{n}.json") in taken:
            n += 1
        damaged = [] if step in self.committed_steps() else self.damaged_prefixes(checkpoint_name(step))
        if damaged:
            record = {"set_aside": reason, "no_manifest": True, "data_prefixes": damaged}
            self.objects.put(self.key(MANIFESTS + name), json.dumps(record).encode(), if_absent=True)
        else:
            self.objects.copy(self._manifest_key(step), self.key(MANIFESTS + name))
            self.objects.delete([self._manifest_key(step)])
        self._repair_latest()
        return MANIFESTS + name[: -len(".json")]
