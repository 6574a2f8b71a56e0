"""Checkpoint policy configuration: a kw-only dataclass of kw-only sections, YAML only at the edge.

``CheckpointConfig(root=..., schedule=ScheduleConfig(interval_steps=10),
retention=RetentionConfig(keep_last=2))``, or in YAML::

    checkpoint:
      root: runs/my_run/ckpt
      schedule: {interval_steps: 10}
      retention: {keep_last: 2}

The sections are :mod:`distckpt.config_sections`. The flat keys of earlier versions
(``keep_last=2``, ``keep_last: 2``; :data:`DEPRECATED_KEYS`) still work, each with one
``DeprecationWarning`` naming its new key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from .config_sections import (
    LOADABLE,
    AsyncSaveConfig,
    CoordinationConfig,
    ElasticConfig,
    KeepBest,
    LoadConfig,
    MemoryConfig,
    PreemptionConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
    StorageConfig,
)
from .errors import ConfigError
from .ondisk.layout import check_root_scheme, checkpoint_name

__all__ = [
    "AsyncSaveConfig",
    "CheckpointConfig",
    "CoordinationConfig",
    "DEPRECATED_KEYS",
    "ElasticConfig",
    "INITIAL_LOAD",
    "KeepBest",
    "LOADABLE",
    "LoadConfig",
    "MemoryConfig",
    "PreemptionConfig",
    "READ_ONLY_SAVE",
    "RetentionConfig",
    "SECTIONS",
    "SaveConfig",
    "ScheduleConfig",
    "StorageConfig",
]

READ_ONLY_SAVE = (
    "CheckpointConfig.load.read_only=true: this manager only loads and never writes to its root, so "
    "save() and maybe_save() are refused. Build the manager without read_only to train and save."
)
"""The ``ConfigError`` message of a save asked of a ``read_only`` manager."""

MAX_THREAD_COUNT = 64
"""The most writer threads per rank ``save.thread_count`` accepts: each is a file per rank per save,
and more than the cores and the disk's queues only adds files and contention."""

INITIAL_LOAD = ("load_path", "load_step", "load_only", "exclude_from_loading")
"""The options that say how a run starts (``load.path``, ``load.step``, ``load.only``,
``load.exclude``), by the names every manifest records them under (``initial_load``): applied
only while the root holds no checkpoint the run committed (:mod:`distckpt.load.restart`;
docs/configuration.md "Initial-load options")."""

SECTIONS: dict[str, type] = {
    "schedule": ScheduleConfig,
    "retention": RetentionConfig,
    "save": SaveConfig,
    "async_save": AsyncSaveConfig,
    "load": LoadConfig,
    "elastic": ElasticConfig,
    "preemption": PreemptionConfig,
    "coordination": CoordinationConfig,
    "storage": StorageConfig,
    "memory": MemoryConfig,
}
"""``{section: its dataclass}``: the keys of :class:`CheckpointConfig` besides ``root``."""

DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "interval_steps": ("schedule", "interval_steps"),
    "interval_seconds": ("schedule", "interval_seconds"),
    "save_at_end": ("schedule", "save_at_end"),
    "full_at_end": ("schedule", "full_at_end"),
    "keep_last": ("retention", "keep_last"),
    "keep_every_steps": ("retention", "keep_every_steps"),
    "keep_best": ("retention", "keep_best"),
    "state_dict_type": ("save", "state_dict_type"),
    "thread_count": ("save", "thread_count"),
    "incremental": ("save", "incremental"),
    "full_every": ("save", "full_every"),
    "loss_history_len": ("save", "loss_history_len"),
    "async_mode": ("async_save", "mode"),
    "background_staging": ("async_save", "background_staging"),
    "load": ("load", "enabled"),
    "load_path": ("load", "path"),
    "load_step": ("load", "step"),
    "load_only": ("load", "only"),
    "exclude_from_loading": ("load", "exclude"),
    "on_existing": ("load", "on_existing"),
    "fallback_to_older": ("load", "fallback_to_older"),
    "read_only": ("load", "read_only"),
    "verify_on_load": ("load", "verify"),
    "fast_load": ("load", "fast_reader"),
    "load_streams_per_node": ("load", "streams_per_node"),
    "probe_tolerance": ("load", "probe_tolerance"),
    "probe_on_mismatch": ("load", "probe_on_mismatch"),
    "batch_policy": ("elastic", "batch_policy"),
    "step_rule": ("elastic", "step_rule"),
    "seed": ("elastic", "seed"),
    "preemption": ("preemption", "enabled"),
    "exit_on_preemption": ("preemption", "exit"),
    "preemption_grace_s": ("preemption", "grace_s"),
    "timeout_s": ("coordination", "timeout_s"),
    "write_timeout_s": ("coordination", "write_timeout_s"),
    "arrival_timeout_s": ("coordination", "arrival_timeout_s"),
    "lock": ("coordination", "lock"),
    "lock_lease_s": ("coordination", "lock_lease_s"),
    "event_log": ("coordination", "event_log"),
    "s3_endpoint_url": ("storage", "s3_endpoint_url"),
    "s3_region": ("storage", "s3_region"),
}
"""``{flat key of earlier versions: (section, field)}``. A flat key still works, as a keyword
(``CheckpointConfig(keep_last=2)``) or a YAML/dict key (``keep_last: 2``), with one
``DeprecationWarning`` naming the new key. ``load`` and ``preemption`` are both: a bool is the
flat key (``load.enabled``, ``preemption.enabled``), a mapping the section."""


@dataclass(kw_only=True, init=False)
class CheckpointConfig:
    """What to save, when, and how many to keep: ``root`` and one section per concern.

    Each section is a kw-only dataclass of :mod:`distckpt.config_sections` (whose fields document
    their unit and default), given as an instance or a mapping of its fields, or left out for its
    defaults. The flat keys of :data:`DEPRECATED_KEYS` are still accepted as keywords (one
    ``DeprecationWarning`` each); a flat key and its section's field set to different values is a
    ``ConfigError``.

    Args:
        root: directory holding ``step-*`` checkpoints, ``latest`` and pending directories (saves
            in progress), or ``s3://bucket/prefix``. Required.
        schedule: when to save (:class:`ScheduleConfig`).
        retention: how many checkpoints to keep (:class:`RetentionConfig`).
        save: what one save writes and how (:class:`SaveConfig`).
        async_save: saves in the background (:class:`AsyncSaveConfig`).
        load: what ``load()`` resumes from, which parts, and how it reads (:class:`LoadConfig`).
        elastic: a resume at another world size or global batch (:class:`ElasticConfig`).
        preemption: SIGTERM handling (:class:`PreemptionConfig`).
        coordination: collective timeouts, the root's lock, the event log (:class:`CoordinationConfig`).
        storage: object storage of an ``s3://`` root (:class:`StorageConfig`).
        memory: the memory tier, node-local snapshots with replicas (:class:`MemoryConfig`).

    Raises:
        ConfigError: an unknown keyword, an invalid value (the message names its dotted key), or a
            flat key in conflict with its section.
    """

    root: str
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    async_save: AsyncSaveConfig = field(default_factory=AsyncSaveConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    coordination: CoordinationConfig = field(default_factory=CoordinationConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __init__(
        self,
        *,
        root: str | os.PathLike[str],
        schedule: ScheduleConfig | Mapping[str, Any] | None = None,
        retention: RetentionConfig | Mapping[str, Any] | None = None,
        save: SaveConfig | Mapping[str, Any] | None = None,
        async_save: AsyncSaveConfig | Mapping[str, Any] | None = None,
        load: LoadConfig | Mapping[str, Any] | bool | None = None,
        elastic: ElasticConfig | Mapping[str, Any] | None = None,
        preemption: PreemptionConfig | Mapping[str, Any] | bool | None = None,
        coordination: CoordinationConfig | Mapping[str, Any] | None = None,
        storage: StorageConfig | Mapping[str, Any] | None = None,
        memory: MemoryConfig | Mapping[str, Any] | None = None,
        **flat: Any,
    ) -> None:
        given = dict(
            schedule=schedule,
            retention=retention,
            save=save,
            async_save=async_save,
            load=load,
            elastic=elastic,
            preemption=preemption,
            coordination=coordination,
            storage=storage,
            memory=memory,
        )
        sections = _regroup(given, flat, lambda key: f"CheckpointConfig({key}=...)")
        for name in SECTIONS:
            setattr(self, name, sections[name])
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"CheckpointConfig.root={root!r}: must be a directory path")
        self.root = os.fspath(root)
        self._check()

    def _check(self) -> None:
        """The checks that need ``root`` or span sections (each section checks its own fields)."""
        for name in SECTIONS:  # YAML's "false" is a string; a truth test of it would pass
            section = getattr(self, name)
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if f.type in ("bool", bool) and not isinstance(value, bool):
                    raise ConfigError(f"CheckpointConfig.{name}.{f.name}={value!r}: must be true or false")
        if not self.root:
            raise ConfigError("CheckpointConfig.root must be a non-empty directory path")
        check_root_scheme(self.root, "CheckpointConfig.root")
        if self.save.thread_count > MAX_THREAD_COUNT:  # section checks: config_sections is at its line cap
            raise ConfigError(
                f"CheckpointConfig.save.thread_count={self.save.thread_count}: at most {MAX_THREAD_COUNT} "
                "(writer threads, and files, per rank per save; 4 is the default, `make bench` measures 1 and 4)"
            )
        self._check_memory_dir()
        if self.root.startswith("s3://"):
            if len(self.root[5:].split("/", 1)[0]) < 3:
                raise ConfigError(
                    f"CheckpointConfig.root={self.root!r}: expected s3://bucket/prefix "
                    "(a bucket name of 3-63 characters)"
                )
            if self.async_save.mode == "process":
                raise ConfigError(
                    "CheckpointConfig.async_save.mode='process' is not supported on s3:// roots (use 'thread')"
                )
        keep_last, mode = self.retention.keep_last, self.async_save.mode
        if mode != "off" and keep_last is not None and keep_last < 2:
            raise ConfigError(
                f"CheckpointConfig.retention.keep_last={keep_last} with async_save.mode={mode!r}: "
                "keep at least 2 (the newest may still be in flight when retention runs)"
            )
        if self.save.incremental and "://" in self.root:
            raise ConfigError(
                f"CheckpointConfig.save.incremental=true with root={self.root!r}: incremental checkpoints refer "
                "to earlier checkpoints' files by relative file-system paths, so they need a local (POSIX) root; "
                "set save.incremental: false for this root"
            )

    def _check_memory_dir(self) -> None:
        """``memory.dir``: ``{node}`` its only placeholder; with ``memory.enabled``, not inside a
        local root (retention, ``ls`` and ``prune`` own the root's entries, and it is not a tmpfs)."""
        template = self.memory.dir
        unknown = sorted(set(re.findall(r"\{([^{}/]*)\}", template)) - {"node"})
        if unknown:
            raise ConfigError(
                f"CheckpointConfig.memory.dir={template!r}: unknown placeholder(s) "
                f"{', '.join('{' + u + '}' for u in unknown)}; the only one is {{node}} (the node id)"
            )
        if not self.memory.enabled or "://" in self.root:
            return
        root, where = os.path.realpath(self.root), os.path.realpath(template.replace("{node}", "node"))
        if where == root or where.startswith(root.rstrip(os.sep) + os.sep):
            raise ConfigError(
                f"CheckpointConfig.memory.dir={template!r} is inside the checkpoint root {self.root!r}: "
                "point it at a node-local tmpfs outside the root (the default is /dev/shm/distckpt)"
            )

    @property
    def load_selection(self) -> frozenset[str]:
        """The parts of a checkpoint ``load()`` restores (``load.only`` / ``load.exclude``; :data:`LOADABLE`)."""
        return self.load.selection

    @property
    def initial_load(self) -> dict[str, Any] | None:
        """``{option: value}`` of :data:`INITIAL_LOAD` as configured (paths as strings, parts as
        lists), or ``None`` when none is set: what every checkpoint of this run records."""
        load = self.load
        values: dict[str, Any] = {
            "load_path": None if load.path is None else os.fspath(load.path),
            "load_step": load.step,
            "load_only": None if load.only is None else list(load.only),
            "exclude_from_loading": None if load.exclude is None else list(load.exclude),
        }
        return values if any(v is not None for v in values.values()) else None

    def for_restart(self) -> "CheckpointConfig":
        """This config for a restart of its run (:mod:`distckpt.load.restart`): without the
        :data:`INITIAL_LOAD` options, so ``load()`` resumes the root's newest checkpoint in full."""
        load = dataclasses.replace(self.load, path=None, step=None, only=None, exclude=None, on_existing="refuse")
        return dataclasses.replace(self, load=load)

    @property
    def resolved_load_path(self) -> str | None:
        """``load.path``, or ``<root>/step-<load.step>``; ``None`` when neither is set."""
        if self.load.step is not None:
            return os.path.join(self.root, checkpoint_name(self.load.step))
        return self.load.path

    @property
    def effective_preemption(self) -> bool:
        """``preemption.enabled``, unless ``load.read_only``: a manager that never saves leaves SIGTERM alone."""
        return self.preemption.enabled and not self.load.read_only

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "CheckpointConfig":
        """Build from a mapping: ``root`` and sections (mappings of their fields); the flat keys
        of :data:`DEPRECATED_KEYS` still work, each with one ``DeprecationWarning``.

        Raises:
            ConfigError: an unknown key (names the valid ones), a missing required key
                (``root``), an invalid value, or a flat key in conflict with its section.
        """
        valid = ["root", *SECTIONS]
        unknown = sorted(set(values) - set(valid) - set(DEPRECATED_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown CheckpointConfig key(s) {unknown}{_suggest(unknown)}; valid keys: "
                f"{', '.join(valid)} (each section a mapping of its fields)"
            )
        if "root" not in values:
            raise ConfigError("CheckpointConfig: missing required key(s) ['root'] (e.g. root: runs/my_run/ckpt)")
        given = {name: values.get(name) for name in SECTIONS}
        flat = {key: value for key, value in values.items() if key != "root" and key not in given}
        sections = _regroup(given, flat, lambda key: f"CheckpointConfig key {key!r}")
        return cls(root=values["root"], **sections)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, section: str | None = "checkpoint") -> "CheckpointConfig":
        """Read a YAML file. With ``section``, the config is that top-level mapping if present.

        Raises:
            ConfigError: unreadable YAML, not a mapping, unknown keys or a missing ``root``
                (the message names the file).
        """
        import yaml

        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if section is not None and isinstance(data, dict) and section in data:
            data = data[section]
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of CheckpointConfig fields")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e


def _regroup(given: dict[str, Any], flat: dict[str, Any], spelled: Callable[[str], str]) -> dict[str, Any]:
    """``{section: instance}`` of every section, from ``given`` (``{section: instance, mapping or
    None}``) and the flat keys in ``flat`` (one ``DeprecationWarning`` each, ``spelled(key)``
    naming the flat key). ``load`` / ``preemption`` given as a bool are the flat keys.

    Raises:
        ConfigError: an unknown key, a section of the wrong type or with unknown fields, a flat key
            set to another value than its section's field, or an invalid value.
    """
    given, flat = dict(given), dict(flat)
    for name in ("load", "preemption"):
        if name not in flat and given.get(name) is not None and not isinstance(given[name], (Mapping, SECTIONS[name])):
            flat[name] = given.pop(name)
    unknown = sorted(set(flat) - set(DEPRECATED_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown CheckpointConfig key(s) {unknown}{_suggest(unknown)}; valid keys: root, "
            f"{', '.join(SECTIONS)} (each section a mapping or instance of its fields)"
        )
    updates: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        section, name = DEPRECATED_KEYS[key]
        updates[section][name] = value
    sections = {name: _section(name, given.get(name), updates[name]) for name in SECTIONS}
    for key in flat:  # once the values are known to be valid and free of conflicts
        warnings.warn(
            f"{spelled(key)} is deprecated: use {'.'.join(DEPRECATED_KEYS[key])}", DeprecationWarning, stacklevel=3
        )  # the caller of CheckpointConfig(...) / from_dict
    return sections


def _section(name: str, value: Any, updates: dict[str, Any]) -> Any:
    """Section ``name`` from ``value`` (an instance, a mapping or ``None``) and the flat keys' ``updates``."""
    cls = SECTIONS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if value is None:
        value = {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(
                f"unknown CheckpointConfig.{name} key(s) {unknown}{_suggest(unknown)}; valid keys: {', '.join(fields)}"
            )
        nested = dict(value)
    elif isinstance(value, cls):  # a field left at its default may take the flat key's value
        nested = {k: v for k, f in fields.items() if (v := getattr(value, k)) != _default(f)}
    else:
        raise ConfigError(f"CheckpointConfig.{name}={value!r}: expected a {cls.__name__} or a mapping of its fields")
    for key, new in updates.items():
        if key in nested and nested[key] != new:
            old = next(k for k, v in DEPRECATED_KEYS.items() if v == (name, key))
            raise ConfigError(
                f"CheckpointConfig: {old}={new!r} (deprecated) and {name}.{key}={nested[key]!r} "
                f"conflict; set only {name}.{key}"
            )
    if isinstance(value, Mapping):
        return cls(**{**value, **updates})
    return cls(**{**{k: getattr(value, k) for k in fields}, **updates}) if updates else value


def _suggest(unknown: list[str]) -> str:
    """`` (did you mean schedule.interval_steps?)`` for misspelt or misplaced keys, or ``""``."""
    dotted = {f.name: f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    dotted.update({key: ".".join(new) for key, new in DEPRECATED_KEYS.items()})
    near = [dotted[m[0]] for key in unknown if (m := difflib.get_close_matches(key, dotted, n=1, cutoff=0.75))]
    return f" (did you mean {', '.join(near)}?)" if near else ""


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
