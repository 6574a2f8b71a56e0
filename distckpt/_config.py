"""Checkpoint policy configuration: a kw-only dataclass of kw-only sections, YAML only at the edge.

``CheckpointConfig(root=..., schedule=ScheduleConfig(interval_steps=10),
retention=RetentionConfig(keep_last=2))``, or in YAML::

    checkpoint:
      root: runs/my_run/ckpt
      schedule: {interval_steps: 10}
      retention: {keep_last: 2}

The sections are :mod:`distckpt._config_sections`. A key outside its section (``keep_last: 2``,
``CheckpointConfig(keep_last=2)``) is a ``ConfigError`` naming the section key
(:data:`MOVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._config_sections import (
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
from ._errors import ConfigError
from ._ondisk.layout import check_root_scheme, checkpoint_name

__all__ = [
    "AsyncSaveConfig",
    "CheckpointConfig",
    "CoordinationConfig",
    "ElasticConfig",
    "INITIAL_LOAD",
    "KeepBest",
    "LOADABLE",
    "LoadConfig",
    "MOVED_KEYS",
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
    "CheckpointConfig.save.enabled=false: this manager only loads and never writes to its root, so "
    "save() and maybe_save() are refused. Build the manager with save.enabled: true to train and save."
)
"""The ``ConfigError`` message of a save asked of a manager built with ``save.enabled: false``."""

MAX_THREAD_COUNT = 64
"""The most writer threads per rank ``save.thread_count`` accepts: each is a file per rank per save,
and more than the cores and the disk's queues only adds files and contention."""

INITIAL_LOAD = ("load_path", "load_step", "load_only", "exclude_from_loading")
"""The options that say how a run starts (``load.path``, ``load.step``, ``load.only``,
``load.exclude``), by the names every manifest records them under (``initial_load``): applied
only while the root holds no checkpoint the run committed (:mod:`distckpt._load.restart`;
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

MOVED_KEYS: dict[str, str] = {
    "interval_steps": "schedule.interval_steps",
    "interval_seconds": "schedule.interval_s",
    "schedule.interval_seconds": "schedule.interval_s",
    "save_at_end": "schedule.save_at_end",
    "full_at_end": "schedule.full_at_end",
    "keep_last": "retention.keep_last",
    "keep_every_steps": "retention.keep_every_steps",
    "keep_best": "retention.keep_best",
    "state_dict_type": "save.state_dict_type",
    "thread_count": "save.thread_count",
    "incremental": "save.incremental",
    "full_every": "save.full_every",
    "loss_history_len": "save.loss_history_len",
    "async_mode": "async_save.mode",
    "background_staging": "async_save.background_staging",
    "load_path": "load.path",
    "load_step": "load.step",
    "load_only": "load.only",
    "exclude_from_loading": "load.exclude",
    "on_existing": "load.on_existing",
    "fallback_to_older": "load.fallback_to_older",
    "read_only": "save.enabled: false",
    "load.read_only": "save.enabled: false",
    "verify_on_load": "load.verify",
    "fast_load": "load.fast_reader",
    "load_streams_per_node": "load.streams_per_node",
    "probe_tolerance": "load.probe_tolerance",
    "probe_on_mismatch": "load.probe_on_mismatch",
    "batch_policy": "elastic.batch_policy",
    "step_rule": "elastic.step_rule",
    "seed": "elastic.seed",
    "exit_on_preemption": "preemption.exit",
    "preemption_grace_s": "preemption.grace_s",
    "timeout_s": "coordination.timeout_s",
    "write_timeout_s": "coordination.write_timeout_s",
    "arrival_timeout_s": "coordination.arrival_timeout_s",
    "lock": "coordination.lock",
    "lock_lease_s": "coordination.lock_lease_s",
    "event_log": "coordination.event_log",
    "s3_endpoint_url": "storage.s3_endpoint_url",
    "s3_region": "storage.s3_region",
}
"""``{key of an unreleased draft: the section key to write instead}``, for error messages only: such
a key sets nothing, it raises ``ConfigError`` naming its replacement (``load: false`` and
``preemption: false``, the draft's bools, name ``load.enabled`` / ``preemption.enabled`` the same way)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """What to save, when, and how many to keep: ``root`` and one section per concern.

    Each section is a kw-only dataclass of :mod:`distckpt._config_sections` (whose fields document
    their unit and default), given as an instance or a mapping of its fields, or left out for its
    defaults. ``from_dict`` / ``from_yaml`` build it from config data.

    Args:
        root: directory holding ``step-*`` checkpoints, ``latest`` and pending directories (saves
            in progress), or ``s3://bucket/prefix`` (a ``str`` or ``os.PathLike``). Required.
        schedule: when to save (:class:`ScheduleConfig`).
        retention: how many checkpoints to keep (:class:`RetentionConfig`).
        save: whether this manager saves, what one save writes and how (:class:`SaveConfig`).
        async_save: saves in the background (:class:`AsyncSaveConfig`).
        load: what ``load()`` resumes from, which parts, and how it reads (:class:`LoadConfig`).
        elastic: a resume at another world size or global batch (:class:`ElasticConfig`).
        preemption: SIGTERM handling (:class:`PreemptionConfig`).
        coordination: collective timeouts, the root's lock, the event log (:class:`CoordinationConfig`).
        storage: object storage of an ``s3://`` root (:class:`StorageConfig`).
        memory: the memory tier, node-local snapshots with replicas (:class:`MemoryConfig`).

    Raises:
        ConfigError: an unknown keyword (a key of :data:`MOVED_KEYS` names its section key), a
            section of the wrong type or with unknown fields, or an invalid value (the message
            names its dotted key).
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

    def __new__(cls, *args: Any, **kwargs: Any) -> "CheckpointConfig":
        """Check the keyword names before the generated ``__init__`` runs (it sets the fields):
        an unknown one is a ``ConfigError`` naming the key to use (:data:`MOVED_KEYS`) instead of
        a bare ``TypeError``.

        Raises:
            ConfigError: a keyword that is neither ``root`` nor a section.
        """
        _check_keys(kwargs, ["root", *SECTIONS], "")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in SECTIONS:
            setattr(self, name, _section(name, getattr(self, name)))
        if not isinstance(self.root, (str, os.PathLike)):
            raise ConfigError(f"CheckpointConfig.root={self.root!r}: must be a directory path")
        self.root = os.fspath(self.root)
        self._check()

    def validate(self) -> None:
        """Run every check of construction again: each section's own (its ``__post_init__``, with
        ``retention.keep_best``'s) and the config's. A section's fields can be assigned after it was
        built (``config.retention.keep_last = -5``) and nothing checks an assignment, so
        ``CheckpointManager`` calls this before it uses the config.

        Raises:
            ConfigError: as at construction, naming the dotted key.
        """
        # a section given as anything else (a mapping assigned since) is built, or refused, by __post_init__ below
        built: list[Any] = [getattr(self, n) for n, cls in SECTIONS.items() if isinstance(getattr(self, n), cls)]
        for section in built:
            section.__post_init__()
        keep_best = getattr(self.retention, "keep_best", None)  # a mapping of a section has no attribute
        if isinstance(keep_best, KeepBest):
            keep_best.__post_init__()
        self.__post_init__()

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
        if not self.save.enabled and (not self.load.enabled or self.load.on_existing == "archive"):
            raise ConfigError(
                "CheckpointConfig.save.enabled=false only loads: it needs load.enabled: true and no "
                f"load.on_existing: archive (enabled={self.load.enabled}, on_existing={self.load.on_existing!r})"
            )
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
        """This config for a restart of its run (:mod:`distckpt._load.restart`): without the
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
        """``preemption.enabled``, unless ``save.enabled`` is false: a manager that never saves leaves SIGTERM alone."""
        return self.preemption.enabled and self.save.enabled

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CheckpointConfig":
        """Build from config data: ``root`` and sections (mappings of their fields).

        Raises:
            ConfigError: an unknown key (a key of :data:`MOVED_KEYS` names its section key, others
                the valid keys), a missing ``root``, or an invalid value.
        """
        _check_keys(values, ["root", *SECTIONS], "")  # before cls(**values): YAML keys need not be strings
        if "root" not in values:
            raise ConfigError("CheckpointConfig: missing required key(s) ['root'] (e.g. root: runs/my_run/ckpt)")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, section: str | None = "checkpoint") -> "CheckpointConfig":
        """Read a YAML file. With ``section``, the config is that top-level mapping if present.

        Raises:
            ConfigError: unreadable YAML, not a mapping, unknown keys or a missing ``root``
                (the message names the file).
        """
        import yaml

        class Loader(yaml.SafeLoader):
            """PyYAML reads YAML 1.1, where ``1e3`` (no dot) is a string; YAML 1.2 reads a float."""

        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.load(f, Loader=Loader) or {}  # noqa: S506 - a SafeLoader
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if section is not None and isinstance(data, dict) and section in data:
            data = data[section]
        elif section is not None and isinstance(data, dict) and data and not set(data) & _FIELDS:
            near = difflib.get_close_matches(section, [str(k) for k in data], n=1)
            raise ConfigError(
                f"{path}: no `{section}:` section (top-level keys: {', '.join(sorted(map(str, data)))})"
                + (f"; `{near[0]}:` looks like a misspelling of it" if near else "")
                + f"; put the CheckpointConfig fields under `{section}:`, or at the top level"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of CheckpointConfig fields")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e


_FIELDS = {f.name for f in dataclasses.fields(CheckpointConfig)}  # from_yaml: a file with none is not a config
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _check_keys(keys: Mapping[str, Any], valid: list[str], section: str) -> None:
    """``ConfigError`` for the keys not in ``valid`` (of section ``section``, ``""``: the root's)."""
    unknown = sorted(str(key) for key in set(keys) - set(valid))
    if not unknown:
        return
    dotted = [f"{section}.{key}" if section else key for key in unknown]
    moved = [f"`{key}` is `{MOVED_KEYS[key]}`" for key in dotted if key in MOVED_KEYS]
    if moved:
        raise ConfigError(f"CheckpointConfig: {'; '.join(moved)} (set it in its section)")
    where = f"CheckpointConfig.{section}" if section else "CheckpointConfig"
    raise ConfigError(
        f"unknown {where} key(s) {unknown}{_suggest(unknown)}; valid keys: {', '.join(valid)}"
        + ("" if section else " (each section an instance or a mapping of its fields)")
    )


def _section(name: str, value: Any) -> Any:
    """Section ``name`` from ``value``: an instance of its dataclass, or a mapping of its fields."""
    cls = SECTIONS[name]
    if isinstance(value, cls):
        return value
    if isinstance(value, bool) and name in ("load", "preemption"):
        raise ConfigError(f"CheckpointConfig: `{name}: {str(value).lower()}` is `{name}.enabled: {str(value).lower()}`")
    if not isinstance(value, Mapping):
        raise ConfigError(f"CheckpointConfig.{name}={value!r}: expected a {cls.__name__} or a mapping of its fields")
    _check_keys(value, [f.name for f in dataclasses.fields(cls)], name)
    return cls(**value)


def _suggest(unknown: list[str]) -> str:
    """`` (did you mean schedule.interval_steps?)`` for misspelt or misplaced keys, or ``""``."""
    dotted: dict[str, str] = {}  # the first section's field of a name (schedule.interval_steps, not memory's)
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            dotted.setdefault(f.name, f"{name}.{f.name}")
    near = [dotted[m[0]] for key in unknown if (m := difflib.get_close_matches(key, dotted, n=1, cutoff=0.75))]
    return f" (did you mean {', '.join(near)}?)" if near else ""


def _check_section_keywords(cls: type, section: str) -> None:
    """Give section dataclass ``cls`` the keyword check of :meth:`CheckpointConfig.__new__`: an unknown
    keyword (``ScheduleConfig(interval_step=5)``) is a ``ConfigError`` with the mapping form's "did you
    mean" (:func:`_check_keys`) instead of the generated ``__init__``'s bare ``TypeError``."""

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        _check_keys(kwargs, [f.name for f in dataclasses.fields(klass)], section)
        return object.__new__(klass)

    cls.__new__ = __new__  # type: ignore[assignment]


for _name, _cls in [*SECTIONS.items(), ("retention.keep_best", KeepBest)]:
    _check_section_keywords(_cls, _name)
