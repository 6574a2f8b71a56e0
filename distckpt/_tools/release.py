"""Release export: a training checkpoint -> a directory to publish a model from.

``OUT/model.safetensors`` holds the model's FULL tensors only, streamed by
:func:`distckpt._tools.export.export_checkpoint` (``model_only``: bounded memory, any world size or
wrapper); ``OUT/model_card.md`` and ``OUT/training_config.json`` describe where it came from:
counters, loss and recent loss history, metrics, world size and wrapper at save, torch/distckpt
versions, hardware, and every plain ``extra_state`` value (where a training script registers
its data description and hyper-parameters). Optimizer, scheduler, scaler, RNG and data-loader
state are never written.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .._errors import CheckpointNotFoundError
from .._ondisk.layout import refuse_output_in_checkpoint, refuse_url_output
from .._state.packing import unpack
from .._storage.localfs import write_atomic
from .._version import __version__
from .export import ExportDtype, ExportResult, export_checkpoint
from .reader import CheckpointReader

__all__ = ["ReleaseResult", "release_checkpoint", "release_dir_name"]

MODEL_FILE, CARD_FILE, CONFIG_FILE = "model.safetensors", "model_card.md", "training_config.json"
_HISTORY_IN_CARD = 10


@dataclass(kw_only=True)
class ReleaseResult:
    """What :func:`release_checkpoint` wrote.

    Attributes:
        path: the release directory.
        files: the files written in it (names).
        model: the export of ``model.safetensors``.
        training_config: the content of ``training_config.json``.
    """

    path: str
    files: list[str]
    model: ExportResult
    training_config: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, ``model`` a nested one (``distckpt release --json``)."""
        return asdict(self)


def release_dir_name(name: str, step: int, loss: float | None) -> str:
    """``name`` suffixed with the step and the loss: ``<name>-step<N>-loss<L>`` (``L`` with 4
    decimals; the loss part is left out when the checkpoint has none)."""
    return f"{name}-step{step}" + (f"-loss{loss:.4f}" if loss is not None and math.isfinite(loss) else "")


def release_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: ExportDtype | None = None,
    name_with_step: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> ReleaseResult:
    """Write a release directory (model weights, model card, training config) from a checkpoint.

    Args:
        checkpoint_dir: a committed distckpt checkpoint (any world size, wrapper, FULL or SHARDED).
        out_dir: the release directory (created; its parent must exist).
        dtype: cast floating-point model tensors (``fp32``/``bf16``/``fp16``); ``None`` keeps them.
        name_with_step: write to ``<out_dir>-step<N>-loss<L>`` instead (:func:`release_dir_name`).
        overwrite: replace the three files when they exist (nothing else in the directory is touched).
        progress: a progress bar on stderr while the weights are written.

    Returns:
        What was written.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` is not a distckpt checkpoint (no manifest).
        CheckpointCorruptError: damaged metadata or a file failing its hash check.
        FileExistsError: a release file exists and ``overwrite`` is false.
        FileNotFoundError: the parent of the release directory does not exist.
        ConfigError: the release directory is inside a checkpoint (a directory with a manifest),
            or ``out_dir`` is a URL (``s3://...``: a release is written locally; checked first).
        ValueError: an unknown dtype, or a checkpoint without model tensors.
    """
    refuse_url_output(out_dir, "release directory")
    reader = CheckpointReader(checkpoint_dir)
    manifest = reader.manifest
    if manifest is None:
        raise CheckpointNotFoundError(
            f"{reader.path} has no distckpt manifest: a release needs a committed distckpt checkpoint "
            "(`distckpt export --model-only` writes the weights of any DCP directory)"
        )
    state = unpack(reader.read(["train_state"])["train_state"]) if "train_state" in reader.items else {}
    history = [(int(s), float(v)) for s, v in state.get("loss_history", [])]
    out = Path(out_dir)
    if name_with_step:
        out = out.with_name(release_dir_name(out.name, manifest.step, manifest.loss))
    refuse_output_in_checkpoint(out, "release directory")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} does not exist; create it first")
    for name in (MODEL_FILE, CARD_FILE, CONFIG_FILE):
        if (out / name).exists() and not overwrite:
            raise FileExistsError(f"{out / name} exists; pass overwrite (--force) to replace the release files")
    extra, not_shown = _extra_values(reader)
    config = {
        "source": reader.path,
        "released": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": manifest.step,
        "epoch": state.get("epoch", manifest.epoch),
        "batch_in_epoch": state.get("batch_in_epoch"),
        "global_samples_seen": state.get("global_samples_seen", manifest.global_samples_seen),
        "global_tokens_seen": state.get("global_tokens_seen"),
        "loss": manifest.loss,
        "loss_history": history,
        "metrics": manifest.metrics,
        "probe_loss": manifest.probe_loss,
        "run_id": manifest.run_id,
        "world_size": manifest.world_size,
        "wrapper": manifest.wrapper,
        "state_dict_type": manifest.state_dict_type,
        "saved_at": manifest.wall_time,
        "torch_version": manifest.torch_version,
        "distckpt_version": manifest.distckpt_version,
        "released_with": {"distckpt": __version__, "torch": torch.__version__},
        "hardware": manifest.hardware,
        "dtype": dtype or "as saved",
        "extra_state": extra,
        "extra_state_not_shown": not_shown,
    }
    out.mkdir(exist_ok=True)
    model = export_checkpoint(
        reader.path,
        out / MODEL_FILE,
        format="safetensors",
        dtype=dtype,
        model_only=True,
        overwrite=overwrite,
        progress=progress,
    )
    # strict JSON: a non-finite loss/metric (NaN, inf) is written as null
    write_atomic(out / CONFIG_FILE, json.dumps(_finite(config), indent=1, default=str, allow_nan=False) + "\n")
    write_atomic(out / CARD_FILE, model_card(config, model))
    return ReleaseResult(path=str(out), files=[MODEL_FILE, CARD_FILE, CONFIG_FILE], model=model, training_config=config)


def model_card(config: Mapping[str, Any], model: ExportResult) -> str:
    """The Markdown model card of a release (``config`` as in ``training_config.json``)."""

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)

    hw = config.get("hardware") or {}
    recent = config["loss_history"][-_HISTORY_IN_CARD:]
    accelerators = (
        f"{hw['accelerator_count']} x {hw.get('accelerator')}" if hw.get("accelerator_count") else "no accelerator"
    )
    hardware = f"{accelerators}, {hw.get('cpu_count', '-')} CPUs, {hw.get('platform', '-')}" if hw else "not recorded"
    lines = [
        f"# Model release: step {config['step']}",
        "",
        f"Weights of the training checkpoint `{config['source']}` (released {config['released']} with distckpt "
        f"{config['released_with']['distckpt']}). `{MODEL_FILE}` holds the model's tensors only: no optimizer, "
        "LR scheduler, gradient scaler, RNG or data-loader state.",
        "",
        "## Training progress at the checkpoint",
        "",
        "| step | epoch | samples seen | tokens seen | loss | probe loss |",
        "|---|---|---|---|---|---|",
        "| "
        + " | ".join(
            fmt(config.get(k))
            for k in ("step", "epoch", "global_samples_seen", "global_tokens_seen", "loss", "probe_loss")
        )
        + " |",
        "",
        "Recent losses (step: loss): " + (", ".join(f"{s}: {v:.6g}" for s, v in recent) or "none recorded"),
        "",
        "Metrics at this step: "
        + (", ".join(f"{k} = {fmt(v)}" for k, v in sorted(config["metrics"].items())) or "none recorded"),
        "",
        "## Where it was trained",
        "",
        f"- world size {config['world_size']}, wrapper {config['wrapper']}, {config['state_dict_type']} checkpoint",
        f"- torch {config['torch_version']}, distckpt {config['distckpt_version']} (at the save)",
        f"- hardware (rank 0 at the save): {hardware}",
        f"- experiment run id: {fmt(config.get('run_id'))}",
        "",
        "## Data and hyper-parameters (the run's extra_state)",
        "",
        "```json",
        json.dumps(config["extra_state"], indent=1, default=str),
        "```",
        "",
        "## Files",
        "",
        f"- `{MODEL_FILE}`: {model.num_tensors} tensors, {model.size_bytes} bytes, dtype {config['dtype']}",
        f"- `{CONFIG_FILE}`: everything above as JSON",
    ]
    return "\n".join(lines) + "\n"


def _extra_values(reader: CheckpointReader) -> tuple[dict[str, Any], list[str]]:
    """Plain ``extra_state`` values (``extra.<name>``, packed by the manager) as JSON-able data;
    the names of those that are not (``Stateful`` objects' state, tensors) are listed."""
    objects = [k for k in reader.keys("extra") if reader.items[k].kind != "tensor"]
    values: dict[str, Any] = {}
    not_shown = [k[len("extra.") :] for k in reader.keys("extra") if reader.items[k].kind == "tensor"]
    for key, raw in reader.iter_read(objects):
        name = key[len("extra.") :]
        try:
            values[name] = _jsonable(unpack(raw) if isinstance(raw, bytes) else raw)
        except (TypeError, ValueError, RuntimeError):
            not_shown.append(name)
    return values, sorted(not_shown)


def _jsonable(value: Any) -> Any:
    """Containers of primitives as JSON data; a tensor as a short description; else TypeError."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"<tensor {list(value.shape)} {value.dtype}>"
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    raise TypeError(f"not JSON data: {type(value).__name__}")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by ``None``, in containers too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
