"""Configuration of the demonstration training job: kw-only dataclasses, YAML only at the edge.

A job config is one YAML file with four sections, each a dataclass::

    model:       GPTConfig fields (launch.model)
    data:        DataConfig
    train:       TrainConfig
    checkpoint:  distckpt.CheckpointConfig: root and its sections (schedule, retention, save, ...)

Command-line overrides are dotted ``section.key=value`` pairs whose values are parsed as
YAML scalars (``train.steps=40``); a checkpoint field is ``checkpoint.<section>.key=value``
(``checkpoint.load.path=null``, ``checkpoint.schedule.interval_steps=10``). Unknown sections
or keys are errors that name the valid ones.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import yaml

from distckpt import CheckpointConfig, ConfigError
from launch.model import GPTConfig

__all__ = ["DataConfig", "TrainConfig", "JobConfig", "load_job_config", "parse_override"]


@dataclass(kw_only=True)
class DataConfig:
    """Corpus and batching.

    Attributes:
        seq_len: tokens per sample (``<= model.seq_len``).
        max_bytes: cap on the corpus (stdlib sources) in bytes; ``None`` for no cap.
        global_batch_size: samples per optimizer step summed over all ranks (``G``); held
            constant across world sizes, so it must be divisible by every world size used.
        num_workers: ``StatefulDataLoader`` worker processes per rank.
        seed: seed of the sampler's per-epoch shuffle.
    """

    seq_len: int = 128
    max_bytes: int | None = 4 * 1024 * 1024
    global_batch_size: int = 16
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 1")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.num_workers} must be >= 0")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation, wrapping and outputs.

    Attributes:
        steps: optimizer steps to reach (a resumed run continues up to this step).
        lr: peak learning rate of AdamW.
        warmup_steps: linear warmup steps, then cosine decay to ``min_lr_ratio * lr`` at ``steps``.
        min_lr_ratio: final learning-rate multiplier.
        weight_decay: AdamW weight decay on matrices (not on biases, LayerNorm weights).
        grad_clip: max global gradient norm (``clip_grad_norm_``); ``None`` disables.
        grad_accum_steps: micro-batches per optimizer step; each rank splits its
            ``G / world_size`` samples into this many equal parts.
        wrapper: ``"ddp"`` or ``"fsdp2"``.
        ddp_fixed_buckets: keep DDP's gradient-bucket layout fixed for the whole run
            (``find_unused_parameters=True``, which turns off DDP's one-time bucket rebuild
            after a process's first iteration). Without it, a same-world resume on 3+ ranks
            reduces its first step with a different layout than the uninterrupted run, so the
            gradient sums differ in the last bits. See docs/resume.md, "Exactness".
        compile: wrap the model in ``torch.compile``.
        compile_backend: ``torch.compile`` backend (``inductor``, ``aot_eager``, ``eager``).
        amp: ``"none"`` or ``"fp16"`` (autocast + GradScaler; CUDA only, ignored with a
            warning on CPU).
        seed: seed of the model init and of the shared per-sample dropout seed stream.
        out: directory for ``metrics.jsonl``, ``events.jsonl`` and ``samples.rank<r>.jsonl``.
        log_every: print a progress line every this many steps (rank 0).
        dist_timeout_s: timeout of the training process group's collectives.
    """

    steps: int = 100
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    grad_accum_steps: int = 1
    wrapper: Literal["ddp", "fsdp2"] = "ddp"
    ddp_fixed_buckets: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    amp: Literal["none", "fp16"] = "none"
    seed: int = 0
    out: str = "runs/train"
    log_every: int = 10
    dist_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.grad_accum_steps < 1 or self.log_every < 1:
            raise ConfigError("train.steps, train.grad_accum_steps and train.log_every must be >= 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps={self.steps}]")
        if self.wrapper not in ("ddp", "fsdp2"):
            raise ConfigError(f"train.wrapper={self.wrapper!r}: expected 'ddp' or 'fsdp2'")
        if self.amp not in ("none", "fp16"):
            raise ConfigError(f"train.amp={self.amp!r}: expected 'none' or 'fp16'")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be positive or null")


@dataclass(kw_only=True)
class JobConfig:
    """The whole job: one dataclass per YAML section.

    Raises:
        ConfigError: ``data.seq_len > model.seq_len``.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.seq_len={self.model.seq_len}")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for logs and ``events.jsonl``)."""
        return dataclasses.asdict(self)


# CheckpointConfig's sections ({name: dataclass}), from its public field types.
_CHECKPOINT_SECTIONS: dict[str, type] = {
    name: hint
    for name, hint in typing.get_type_hints(CheckpointConfig).items()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint)
}
_SECTIONS: dict[str, type] = {
    "model": GPTConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
}


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into ``(section, key, value)``; the value is a YAML scalar. In
    the ``checkpoint`` section the key may be ``sub.key`` (``checkpoint.retention.keep_last=2``).

    Raises:
        ConfigError: no ``=``, or the key is not ``section.key`` (``checkpoint.sub.key``).
    """
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    depth = 1 if section == "checkpoint" else 0
    if not sep or not dot or not name or name.count(".") > depth or "" in name.split("."):
        raise ConfigError(
            f"override {text!r}: expected section.key=value, e.g. train.steps=40 or "
            "checkpoint.schedule.interval_steps=10"
        )
    return section, name, yaml.safe_load(raw) if raw.strip() else None


def load_job_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job YAML file, apply dotted overrides, build and validate the dataclasses.

    Args:
        path: YAML file with the sections ``model``, ``data``, ``train``, ``checkpoint``.
        overrides: ``section.key=value`` strings, applied in order after the file.

    Returns:
        The validated :class:`JobConfig`.

    Raises:
        ConfigError: unreadable file, unknown section or key (the message lists the valid
            ones), a value of the wrong type, or a failed validation.
    """
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with sections {sorted(_SECTIONS)}")
    sections: dict[str, dict[str, Any]] = {}
    for name, values in raw.items():
        _check_section(name, f"{path}")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping")
        sections[name] = dict(values)
    for text in overrides:
        section, key, value = parse_override(text)
        _check_section(section, f"override {text!r}")
        target = sections.setdefault(section, {})
        sub, dot, key = key.rpartition(".")
        if dot:
            if not isinstance(target.get(sub, {}), dict):  # a flat value where a section mapping belongs
                raise ConfigError(f"override {text!r}: {section}.{sub} is {target[sub]!r}, not a section mapping")
            target = target.setdefault(sub, {})
        target[key] = value
    built: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values = sections.get(name, {})
        built[name] = _build_checkpoint(values) if cls is CheckpointConfig else _build(cls, name, values)
    return JobConfig(**built)


def _check_section(name: str, where: str) -> None:
    if name not in _SECTIONS:
        raise ConfigError(f"{where}: unknown section {name!r}; valid sections: {', '.join(_SECTIONS)}")


def _build(cls: type, section: str, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {[f'{section}.{k}' for k in unknown]}; "
            f"valid keys in {section}: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    coerced = {k: _coerce(f"{section}.{k}", v, hints[k]) for k, v in values.items()}
    try:
        return cls(**coerced)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid {section} config: {e}") from e


def _build_checkpoint(values: dict[str, Any]) -> CheckpointConfig:
    """The ``checkpoint`` section: ``root`` and sections, their fields coerced like the other
    sections'; ``CheckpointConfig.from_dict`` checks the keys."""
    coerced = dict(values)
    for key, value in values.items():
        if key in _CHECKPOINT_SECTIONS and isinstance(value, dict):
            hints = typing.get_type_hints(_CHECKPOINT_SECTIONS[key])
            coerced[key] = {
                k: _coerce(f"checkpoint.{key}.{k}", v, hints[k]) if k in hints else v for k, v in value.items()
            }
    try:
        return CheckpointConfig.from_dict(coerced)
    except ConfigError as e:
        raise ConfigError(f"invalid checkpoint config: {e}") from e


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Accept ints for floats and YAML 1.1 spellings like ``1e-3`` (a string to PyYAML)."""
    args = typing.get_args(hint)
    allowed = args if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{name}: null is not allowed")
    if float in allowed and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r}: expected a number") from None
    literals = [v for a in allowed if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    if isinstance(value, str) and value in literals:  # schedule.interval_steps: auto
        return value
    if int in allowed and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}={value!r}: expected an integer")
    if bool in allowed and not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected true or false")
    return value
