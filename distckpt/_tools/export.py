"""Checkpoint <-> single file: export a DCP checkpoint as safetensors or ``torch.save`` FULL
tensors, and import a weights file (or a plain DCP directory's model weights) as a committed
step-0 checkpoint.

Both run in one process. The import is a one-rank save through :class:`~distckpt.CheckpointManager`
(committed exactly as a training save). Export needs no process group; it reads a batch of items at a time
(:class:`~distckpt._tools.reader.CheckpointReader`) and streams them into the output file
(:mod:`distckpt._tools.single_file`), so peak memory is about one batch of tensors plus one cast
copy, not the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import torch
import torch.distributed as dist

from .._config import CheckpointConfig
from .._config_sections import StorageConfig
from .._errors import CheckpointNotFoundError, ConfigError
from .._manager import CheckpointManager
from .._ondisk.layout import refuse_output_in_checkpoint, refuse_url_output
from .._state.rng import capture_rng, derive_rng, restore_rng
from .._storage import CheckpointStore
from .._storage.claims import refuse_or_archive
from .reader import CheckpointReader
from .single_file import SafetensorsWriter, TorchZipWriter

__all__ = [
    "ExportFormat",
    "ExportDtype",
    "ExportResult",
    "export_checkpoint",
    "import_weights",
    "import_into",
    "load_weights",
]

logger = logging.getLogger(__name__)

ExportFormat = Literal["safetensors", "torch"]
ExportDtype = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Item of an imported checkpoint describing its source (``bytes``; the manager ignores it)."""


@dataclass(kw_only=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        path: the output file.
        format: ``safetensors`` or ``torch``.
        dtype: the cast applied to floating-point model tensors, or ``None``.
        num_tensors: tensors written.
        size_bytes: size of the output file.
        skipped: keys not exported (non-tensor items, which safetensors cannot hold).
        seconds: wall time.
    """

    path: str
    format: str
    dtype: str | None
    num_tensors: int
    size_bytes: int
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``distckpt export --json``)."""
        return asdict(self)


class _Progress:
    """Byte progress on stderr: tqdm when installed, else a plain line (TTY only)."""

    def __init__(self, total_bytes: int, desc: str, enabled: bool) -> None:
        self.total, self.done, self.desc, self.bar = total_bytes, 0, desc, None
        self.enabled = enabled
        self._last = -1
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and sys.stderr.isatty():
            pct = 100 * self.done // max(self.total, 1)
            if pct != self._last:
                self._last = pct
                print(
                    f"\r{self.desc}: {pct:3d}% {self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    format: ExportFormat = "safetensors",
    dtype: ExportDtype | None = None,
    model_only: bool = False,
    overwrite: bool = False,
    check_files: bool = True,
    progress: bool = False,
) -> ExportResult:
    """Write a checkpoint's items as FULL tensors into one file.

    Args:
        checkpoint_dir: a checkpoint directory (any world size, wrapper, FULL or SHARDED).
        out_path: output file; written as ``<out_path>.tmp-<pid>`` then renamed.
        format: ``"safetensors"`` (tensors only; non-tensor items are skipped and listed in the
            result) or ``"torch"`` (a ``torch.save`` dict; non-tensor items keep the value DCP
            stores: distckpt's are ``bytes`` that ``distckpt._state.training_state.unpack`` decodes).
        dtype: cast floating-point *model* tensors to ``fp32``/``bf16``/``fp16``; optimizer
            state and integer tensors keep their dtype. ``None`` keeps every dtype.
        model_only: only ``model.<fqn>`` tensors, written under ``<fqn>``.
        overwrite: replace an existing ``out_path``.
        check_files: check each data file's size and hash against the manifest before use.
        progress: show a progress bar on stderr.

    Returns:
        What was written. Keys are the checkpoint's flattened keys (``model.<fqn>``,
        ``optim.state.<fqn>.<name>``, ...), or ``<fqn>`` with ``model_only``.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` is not a directory.
        CheckpointCorruptError: unsafe or damaged metadata, or a file failing its check.
        FileExistsError: ``out_path`` exists and ``overwrite`` is false.
        FileNotFoundError: ``out_path``'s directory does not exist (checked before any read).
        ConfigError: ``out_path`` is a URL (local files only) or inside a checkpoint (has a manifest).
        ValueError: unknown format/dtype, nothing to export, or a dtype safetensors cannot hold.
    """
    t0 = time.perf_counter()
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format={format!r}: expected 'safetensors' or 'torch'")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)} or None")
    refuse_url_output(out_path)  # before Path(): it would turn "s3://b/k" into a local "s3:/b/k"
    refuse_output_in_checkpoint(out_path := Path(out_path))
    if out_path.exists() and not overwrite:
        raise FileExistsError(f"{out_path} exists; pass overwrite=True to replace it")
    if not out_path.parent.is_dir():  # before any reading: not after a progress bar
        raise FileNotFoundError(f"output directory {out_path.parent} does not exist; create it first")
    reader = CheckpointReader(checkpoint_dir, check_files=check_files)
    keys = reader.keys("model") if model_only else reader.keys()
    tensor_keys = [k for k in keys if reader.items[k].kind == "tensor"]
    object_keys = [k for k in keys if reader.items[k].kind != "tensor"]
    if not tensor_keys:
        raise ValueError(f"{reader.path}: no {'model ' if model_only else ''}tensors to export")
    cast = DTYPES[dtype] if dtype else None

    def out_name(key: str) -> str:
        return key[len("model.") :] if model_only else key

    def out_dtype(key: str) -> torch.dtype:
        stored = reader.items[key].torch_dtype
        assert stored is not None  # tensor items carry a dtype
        return cast if cast is not None and key.startswith("model.") and stored.is_floating_point else stored

    def out_shape(key: str) -> list[int]:
        shape = reader.items[key].shape
        assert shape is not None  # tensor items carry a shape
        return shape

    entries = [(out_name(k), out_shape(k), out_dtype(k)) for k in tensor_keys]
    skipped = object_keys if format == "safetensors" else []
    values = {} if format == "safetensors" else _object_values(reader, object_keys, out_name)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    total = sum(reader.items[k].size_bytes for k in tensor_keys)
    bar = _Progress(total, f"export {out_path.name}", progress)
    metadata = {"format": "pt", "source": str(reader.path)}
    if reader.manifest is not None:
        metadata["step"] = str(reader.manifest.step)

    def stream(writer: SafetensorsWriter | TorchZipWriter) -> None:
        for key, tensor in reader.iter_read(tensor_keys):
            writer.write(out_name(key), tensor.to(out_dtype(key)))
            bar.update(reader.items[key].size_bytes)
            del tensor
        writer.close()

    try:
        if format == "safetensors":
            with open(tmp, "wb") as f:
                stream(SafetensorsWriter(f, entries, metadata))
                f.flush()
                os.fsync(f.fileno())
        else:
            with TorchZipWriter(tmp, entries, values) as writer:
                stream(writer)
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    if skipped:
        logger.info(
            "export: %d non-tensor item(s) not stored in safetensors: %s", len(skipped), ", ".join(skipped[:10])
        )
    return ExportResult(
        path=str(out_path),
        format=format,
        dtype=dtype,
        num_tensors=len(entries),
        size_bytes=out_path.stat().st_size,
        skipped=skipped,
        seconds=time.perf_counter() - t0,
    )


def _object_values(reader: CheckpointReader, keys: list[str], out_name) -> dict[str, Any]:
    from .._state.packing import pack

    values = {}
    for key, value in reader.iter_read(keys):
        # Tensors inside a value would need storage records of their own: keep those packed.
        values[out_name(key)] = pack(value) if _has_tensor(value) else value
    return values


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(k) or _has_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(_has_tensor(v) for v in value)
    return False


# ---------------------------------------------------------------------------------- import
def load_weights(weights_path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read ``{name: tensor}`` from a safetensors file, a ``torch.save`` state dict, or a DCP
    directory (see :func:`load_dcp_model_weights`).

    The torch file is read with ``weights_only=True`` (memory-mapped when it is a zip file).

    Raises:
        CheckpointNotFoundError: no such file or DCP directory.
        CheckpointCorruptError: a DCP directory with unsafe or damaged metadata or files.
        ValueError: not a flat mapping of names to tensors (names the offending entry).
        ImportError: a safetensors file without the ``safetensors`` package.
    """
    path = Path(weights_path)
    if path.is_dir():
        return load_dcp_model_weights(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: no such weights file")
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"{path} is a safetensors file: pip install safetensors") from e
        try:
            obj: Any = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{path}: unreadable safetensors file ({e})") from e
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=head[:2] == b"PK")
        except Exception as e:  # pickle/zip errors of many types
            raise ValueError(
                f"{path}: not a safetensors file nor a torch.save state dict readable "
                f"with weights_only=True ({type(e).__name__}: {e})"
            ) from e
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a {{name: tensor}} mapping, got {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            hint = " (a nested state dict: save that inner dict instead)" if isinstance(value, Mapping) else ""
            raise ValueError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor{hint}")
    if not obj:
        raise ValueError(f"{path}: holds no tensors")
    return dict(obj)


def load_dcp_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights of a DCP directory (``dcp.save`` output, any world size, sharded or
    not) as FULL CPU tensors ``{fqn: tensor}``, read in this process with distckpt's safe
    reader (allow-listed metadata unpickler; a distckpt manifest, if present, is checked).

    Supported layouts: ``model.<fqn>`` items (a training state such as ``{"model": ...,
    "optim": ...}``: only the model's tensors are taken, the rest is listed in the log), or,
    without any ``model.`` item, bare ``<fqn>`` items that are all tensors (a model
    ``state_dict`` saved on its own).

    Raises:
        CheckpointNotFoundError: not a DCP directory (no ``.metadata``).
        CheckpointCorruptError: unsafe or damaged metadata, or a file that cannot be read.
        ValueError: no ``model.`` item and some items are not tensors, or no tensors at all.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointNotFoundError(f"{path}: a directory without DCP .metadata: not a DCP checkpoint")
    reader = CheckpointReader(path)
    model_keys = [k for k in reader.keys("model") if reader.items[k].kind == "tensor"]
    if model_keys:
        names = {k: k[len("model.") :] for k in model_keys}
        ignored = [k for k in reader.keys() if k not in names]
        if ignored:
            logger.info(
                "import %s: takes the %d model.* tensors; ignores %d other item(s): %s",
                path,
                len(names),
                len(ignored),
                ", ".join(ignored[:10]) + (" ..." if len(ignored) > 10 else ""),
            )
    else:
        objects = [k for k in reader.keys() if reader.items[k].kind != "tensor"]
        if objects:
            raise ValueError(
                f"{path}: no model.* items, and not a bare model state_dict: {len(objects)} item(s) are not "
                f"tensors ({', '.join(objects[:5])}). distckpt imports the model.* tensors of a DCP "
                "checkpoint, or a DCP directory holding only a model's tensors"
            )
        names = {k: k for k in reader.keys()}
    if not names:
        raise ValueError(f"{path}: holds no tensors")
    return {names[k]: v for k, v in reader.iter_read(list(names))}


def import_weights(
    weights_path: str | os.PathLike,
    root: str | os.PathLike,
    *,
    step: int = 0,
    on_existing: Literal["refuse", "archive"] = "refuse",
    endpoint_url: str | None = None,
    region: str | None = None,
) -> str:
    """Commit a weights file as checkpoint ``<root>/step-<step>`` that ``CheckpointManager``
    loads into the same architecture under any wrapper at any world size.

    The checkpoint holds ``model.<name>`` for every tensor (dtype kept), ``train_state``
    (step ``step``, counters 0), rank 0's RNG state derived from ``(seed 0, rank 0, step)``
    (other ranks derive theirs from the config seed), and an ``imported`` item naming the
    source. It has no optimizer, scheduler, scaler or dataloader state: load it with those
    left out of the manager (``optimizer=None``), then build them.

    A DCP directory (a plain ``dcp.save``, any world size) is imported the same way: its model
    tensors (:func:`load_dcp_model_weights`) are read FULL and written as a new checkpoint,
    hashed, with a manifest; the directory itself is never changed.

    Args:
        weights_path: safetensors file, ``torch.save`` state dict ``{fqn: tensor}``, or DCP
            directory; names must be the model's state_dict keys without wrapper prefixes.
        root: checkpoint root, a directory (created if absent) or ``s3://bucket/prefix``; its
            write lock is held meanwhile.
        step: global step recorded for the checkpoint.
        on_existing: when ``root`` already holds checkpoints: ``"refuse"`` (raise) or
            ``"archive"`` (rename them ``archived-step-N-<n>`` first; nothing is deleted).
        endpoint_url, region: S3 client settings of an ``s3://`` root (default: the standard
            AWS environment).

    Returns:
        The committed checkpoint's location (a directory path, or an S3 data-prefix URL).

    Raises:
        CheckpointNotFoundError: no such weights file.
        ValueError: not a flat ``{name: tensor}`` mapping.
        FileExistsError: ``<root>/step-<step>`` already exists.
        ConfigError: ``root`` holds checkpoints and ``on_existing`` is ``"refuse"`` (a later
            ``load`` would resume those, not the import).
        CheckpointLockedError: another job writes this root.
    """
    if on_existing not in ("refuse", "archive"):
        raise ValueError(f"on_existing={on_existing!r}: expected 'refuse' or 'archive'")
    config = CheckpointConfig(
        root=os.fspath(root), storage=StorageConfig(s3_endpoint_url=endpoint_url, s3_region=region)
    )

    def refuse_or_archive_existing(store: CheckpointStore) -> None:  # under the root's lock
        refuse_or_archive(
            store,
            on_existing=on_existing,
            locked=True,
            subject=store.root,
            why="a load.enabled: true run would resume those, not the import",
            choices="on_existing='archive' (CLI: --archive-existing) to set them aside as archived-step-N-<n> "
            "(nothing is deleted)",
        )
        if store.exists(store.location_of(step)):
            raise FileExistsError(
                f"{store.location_of(step)} already exists; import into another root or pick another step"
            )

    return import_into(config, weights_path, step=step, before_write=refuse_or_archive_existing)


def import_into(
    config: CheckpointConfig,
    weights_path: str | os.PathLike,
    *,
    step: int,
    before_write: Callable[[CheckpointStore], None],
) -> str:
    """:func:`import_weights` into ``config.root`` (and its ``storage`` settings) as a one-rank
    training save: a :class:`~distckpt.CheckpointManager` over a module holding the weights (each
    a buffer at its name) saves ``step``, staged, written and committed as every save is
    (:class:`~distckpt._save.transaction.SaveTransaction`). Without an initialised
    ``torch.distributed`` a gloo process group of world size 1 is created for the call (and
    destroyed after). ``before_write(store)`` runs holding the root's lock, before anything is
    written: the refuse-or-archive of the checkpoints the root holds.

    Returns:
        The committed checkpoint's location (a directory path, or an S3 data-prefix URL).

    Raises:
        CheckpointNotFoundError, ValueError: as :func:`load_weights`.
        CheckpointLockedError: another job writes this root.
        ConfigError: ``torch.distributed`` is initialised with more than one rank (import from a
            process of its own), or from the manager's construction or ``before_write``.
        OSError, FileExistsError: from ``before_write``.
        CheckpointSaveError: the save failed; nothing is committed and the pending location is removed.
    """
    t0 = time.perf_counter()
    weights = load_weights(weights_path)
    source = {"source": str(Path(weights_path).resolve()), "size_bytes": Path(weights_path).stat().st_size}
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ConfigError(
            f"import of {weights_path}: torch.distributed is initialised with {dist.get_world_size()} ranks; "
            "an import is one process's save: run it in a process of its own (`distckpt import`)"
        )
    config = dataclasses.replace(
        config,
        save=dataclasses.replace(config.save, state_dict_type="full"),
        async_save=dataclasses.replace(config.async_save, mode="off"),
        preemption=dataclasses.replace(config.preemption, enabled=False),
        coordination=dataclasses.replace(config.coordination, lock=True),  # before_write archives under it
        memory=dataclasses.replace(config.memory, enabled=False),
    )
    try:
        with CheckpointManager(config, model=_module_holding(weights), optimizer=None) as manager:
            before_write(manager.store)
            manager.state.imported = {**source, "time": time.time()}  # the WEIGHTS_ONLY_KEY item
            saved = capture_rng(every_device=True)
            try:
                derive_rng(0, 0, step)  # what the loading ranks derive for rank 0 (seed 0)
                location = manager.save(step)
            finally:
                restore_rng(saved)
            manager.close()
    finally:
        if created:
            dist.destroy_process_group()
    logger.info(
        "imported %s as %s (%d tensors) in %.2f s", weights_path, location, len(weights), time.perf_counter() - t0
    )
    return location


def _module_holding(weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``state_dict()`` is ``weights``: each tensor a buffer at its dotted name."""
    root = torch.nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in dict(module.named_children()):
                module.add_module(part, torch.nn.Module())
            module = module.get_submodule(part)
        module.register_buffer(leaf, tensor)
    return root
