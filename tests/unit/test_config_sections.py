"""CheckpointConfig's sections: the new form, the deprecated flat keys, YAML, conflicts, docstrings."""

from __future__ import annotations

import ast
import dataclasses
import pickle
import warnings
from pathlib import Path
from types import MappingProxyType

import pytest

import distckpt
from distckpt import (
    AsyncSaveConfig,
    CheckpointConfig,
    ConfigError,
    CoordinationConfig,
    ElasticConfig,
    KeepBest,
    LoadConfig,
    PreemptionConfig,
    RetentionConfig,
    SaveConfig,
    ScheduleConfig,
    StorageConfig,
)
from distckpt.config import DEPRECATED_KEYS, INITIAL_LOAD, SECTIONS

# A valid value for every flat key, and what else its section needs for that value to be valid.
SAMPLES: dict[str, tuple[object, dict]] = {
    "interval_steps": (7, {}),
    "interval_seconds": (5.0, {}),
    "save_at_end": (False, {}),
    "full_at_end": (True, {}),
    "keep_last": (5, {}),
    "keep_every_steps": (10, {}),
    "keep_best": (KeepBest(metric="loss"), {}),
    "state_dict_type": ("full", {}),
    "thread_count": (2, {}),
    "incremental": (True, {}),
    "full_every": (3, {"save": {"incremental": True}}),
    "loss_history_len": (10, {}),
    "async_mode": ("thread", {}),
    "background_staging": (True, {"async_save": {"mode": "thread"}}),
    "load": (False, {}),
    "load_path": ("/tmp/elsewhere/step-000000003", {}),
    "load_step": (3, {}),
    "load_only": (["model"], {}),
    "exclude_from_loading": (["rng"], {}),
    "on_existing": ("archive", {"load": {"enabled": False}}),
    "fallback_to_older": (True, {}),
    "read_only": (True, {}),
    "verify_on_load": (False, {}),
    "fast_load": (False, {}),
    "load_streams_per_node": (4, {}),
    "probe_tolerance": (0.5, {}),
    "probe_on_mismatch": ("warn", {}),
    "batch_policy": ("keep_local_batch", {}),
    "step_rule": ("rescale", {"elastic": {"batch_policy": "keep_local_batch"}}),
    "seed": (3, {}),
    "preemption": (False, {}),
    "exit_on_preemption": (False, {}),
    "preemption_grace_s": (10.0, {}),
    "timeout_s": (100.0, {}),
    "write_timeout_s": (10.0, {}),
    "arrival_timeout_s": (5.0, {}),
    "lock": (False, {}),
    "lock_lease_s": (60.0, {}),
    "event_log": ("/tmp/events.jsonl", {}),
    "s3_endpoint_url": ("http://localhost:1", {}),
    "s3_region": ("eu-west-1", {}),
}


def test_every_flat_key_has_a_sample_and_maps_to_a_field():
    assert set(SAMPLES) == set(DEPRECATED_KEYS)
    for key, (section, name) in DEPRECATED_KEYS.items():
        assert name in {f.name for f in dataclasses.fields(SECTIONS[section])}, key
    assert len(DEPRECATED_KEYS) == 41  # every field of the flat config but root


def test_new_form_instances_and_mappings():
    cfg = CheckpointConfig(
        root="/tmp/x",
        schedule=ScheduleConfig(interval_steps=10),
        retention={"keep_last": 2, "keep_best": {"metric": "val_loss", "k": 2}},
        async_save=AsyncSaveConfig(mode="thread"),
        load=LoadConfig(only=["model"]),
        preemption={"enabled": False},
        coordination=CoordinationConfig(timeout_s=60.0),
    )
    assert cfg.schedule.interval_steps == 10 and cfg.retention.keep_last == 2
    assert cfg.retention.keep_best == KeepBest(metric="val_loss", mode="min", k=2)
    assert cfg.async_save.mode == "thread" and cfg.load_selection == frozenset({"model"})
    assert cfg.preemption.enabled is False and not cfg.effective_preemption
    assert cfg.coordination.effective_write_timeout_s == 30.0 and cfg.coordination.effective_arrival_timeout_s == 60.0
    default = CheckpointConfig(root="/tmp/x")
    assert default.schedule == ScheduleConfig() and default.save == SaveConfig() and default.elastic == ElasticConfig()
    assert default.storage == StorageConfig() and default.preemption == PreemptionConfig()
    assert default.retention == RetentionConfig() and default.retention.keep_last == 3
    proxy = MappingProxyType({"interval_steps": 3})  # any mapping
    assert CheckpointConfig(root="/tmp/x", schedule=proxy).schedule.interval_steps == 3
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # broadcast to the ranks
    assert dataclasses.replace(cfg, root="/tmp/y").retention == cfg.retention


def test_the_public_api_exports_every_section():
    for cls in SECTIONS.values():
        assert getattr(distckpt, cls.__name__) is cls and cls.__name__ in distckpt.__all__
    assert distckpt.KeepBest is KeepBest


def _expected(key):
    value, _ = SAMPLES[key]
    return KeepBest(metric="loss") if key == "keep_best" else value


@pytest.mark.parametrize("key", sorted(DEPRECATED_KEYS))
def test_flat_keyword_maps_to_its_section_with_one_warning(key):
    value, extra = SAMPLES[key]
    section, name = DEPRECATED_KEYS[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = CheckpointConfig(root="/tmp/x", **extra, **{key: value})
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == [
        f"CheckpointConfig({key}=...) is deprecated: use {section}.{name}"
    ]
    assert deprecations[0].filename == __file__  # points at the caller
    assert getattr(getattr(cfg, section), name) == _expected(key)


@pytest.mark.parametrize("key", sorted(DEPRECATED_KEYS))
def test_flat_yaml_key_maps_to_its_section_with_one_warning(key, tmp_path):
    import yaml

    value, extra = SAMPLES[key]
    section, name = DEPRECATED_KEYS[key]
    plain = {"metric": "loss"} if key == "keep_best" else value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"checkpoint": {"root": "/tmp/x", **extra, key: plain}}))
    with pytest.warns(DeprecationWarning) as caught:
        cfg = CheckpointConfig.from_yaml(path)
    assert [str(w.message) for w in caught] == [f"CheckpointConfig key {key!r} is deprecated: use {section}.{name}"]
    assert getattr(getattr(cfg, section), name) == _expected(key)


def test_yaml_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "checkpoint:\n  root: /tmp/x\n  schedule: {interval_steps: 5, save_at_end: false}\n"
        "  retention:\n    keep_last: 2\n    keep_best: {metric: acc, mode: max}\n"
        "  load: {enabled: true, exclude: [optimizer, lr_scheduler]}\n"
        "  preemption: {enabled: true, exit: false, grace_s: 12}\n  storage: {s3_region: eu}\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        cfg = CheckpointConfig.from_yaml(path)
    assert (cfg.schedule.interval_steps, cfg.schedule.save_at_end, cfg.retention.keep_last) == (5, False, 2)
    assert cfg.retention.keep_best == KeepBest(metric="acc", mode="max")
    assert cfg.load_selection == frozenset(distckpt.config.LOADABLE) - {"optimizer", "lr_scheduler"}
    assert cfg.preemption == PreemptionConfig(enabled=True, exit=False, grace_s=12)
    assert cfg.storage.s3_region == "eu"


def test_load_and_preemption_as_a_bool_are_the_flat_keys_as_a_mapping_the_section():
    with pytest.warns(DeprecationWarning, match="use preemption.enabled"):
        assert CheckpointConfig.from_dict({"root": "/tmp/x", "preemption": True}).preemption.enabled is True
    with pytest.warns(DeprecationWarning, match="use load.enabled"):
        assert CheckpointConfig(root="/tmp/x", load=False).load.enabled is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = CheckpointConfig.from_dict({"root": "/tmp/x", "preemption": {"grace_s": 5}, "load": {"step": 2}})
    assert cfg.preemption.grace_s == 5 and cfg.load.step == 2


def test_flat_and_nested_values_in_conflict_are_refused():
    with pytest.raises(ConfigError, match=r"keep_last=2 \(deprecated\) and retention.keep_last=4 conflict"):
        CheckpointConfig.from_dict({"root": "/tmp/x", "keep_last": 2, "retention": {"keep_last": 4}})
    with pytest.raises(ConfigError, match=r"async_mode='thread' \(deprecated\) and async_save.mode='process'"):
        CheckpointConfig(root="/tmp/x", async_mode="thread", async_save=AsyncSaveConfig(mode="process"))
    with pytest.warns(DeprecationWarning):  # the same value twice, or a field the section left at its default
        cfg = CheckpointConfig(root="/tmp/x", keep_last=2, keep_every_steps=5, retention=RetentionConfig(keep_last=2))
    assert (cfg.retention.keep_last, cfg.retention.keep_every_steps) == (2, 5)


def test_unknown_keys_and_wrong_types_are_config_errors():
    with pytest.raises(
        ConfigError,
        match=r"unknown CheckpointConfig key\(s\) \['keep_lats'\] \(did you mean "
        r"retention.keep_last\?\)",
    ):
        CheckpointConfig.from_dict({"root": "/tmp/x", "keep_lats": 2})
    with pytest.raises(ConfigError, match=r"unknown CheckpointConfig key\(s\) \['bogus'\]; valid keys: root, "):
        CheckpointConfig(root="/tmp/x", bogus=1)
    with pytest.raises(
        ConfigError,
        match=r"unknown CheckpointConfig.retention key\(s\) \['interval_steps'\] "
        r"\(did you mean schedule.interval_steps\?\)",
    ):
        CheckpointConfig.from_dict({"root": "/tmp/x", "retention": {"interval_steps": 5}})
    with pytest.raises(ConfigError, match=r"CheckpointConfig.retention=5: expected a RetentionConfig or a mapping"):
        CheckpointConfig(root="/tmp/x", retention=5)
    with pytest.raises(ConfigError, match=r"CheckpointConfig.schedule=.*expected a ScheduleConfig"):
        CheckpointConfig(root="/tmp/x", schedule=RetentionConfig())
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['root'\]"):
        CheckpointConfig.from_dict({"schedule": {"interval_steps": 5}})


def test_cross_section_checks_name_the_dotted_keys():
    with pytest.raises(ConfigError, match=r"retention.keep_last=1 with async_save.mode='thread'"):
        CheckpointConfig(root="/tmp/x", retention={"keep_last": 1}, async_save={"mode": "thread"})
    with pytest.raises(ConfigError, match=r"async_save.mode='process' is not supported on s3://"):
        CheckpointConfig(root="s3://bucket/x", async_save={"mode": "process"})
    with pytest.raises(ConfigError, match=r"save.incremental=true with root='s3://bucket/x'"):
        CheckpointConfig(root="s3://bucket/x", save={"incremental": True})
    with pytest.raises(ConfigError, match=r"coordination.write_timeout_s=700.0 must be below coordination.timeout_s"):
        CheckpointConfig(root="/tmp/x", coordination={"write_timeout_s": 700.0})


def test_initial_load_keeps_the_manifest_names():
    cfg = CheckpointConfig(root="/tmp/x", load=LoadConfig(step=4, exclude=["rng"]))
    assert tuple(cfg.initial_load) == INITIAL_LOAD == ("load_path", "load_step", "load_only", "exclude_from_loading")
    assert cfg.initial_load == {"load_path": None, "load_step": 4, "load_only": None, "exclude_from_loading": ["rng"]}
    assert cfg.resolved_load_path == "/tmp/x/step-000000004"
    restart = cfg.for_restart()
    assert restart.initial_load is None and restart.load.on_existing == "refuse" and restart.root == cfg.root
    assert CheckpointConfig(root="/tmp/x").initial_load is None


def test_every_section_field_documents_its_default():
    """Each field of a section has an attribute docstring naming its default."""
    source = Path(distckpt.config_sections.__file__).read_text()
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    for cls in [*SECTIONS.values(), KeepBest]:
        body = classes[cls.__name__].body
        docs = {}
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                docs[node.target.id] = after.value.value
        for f in dataclasses.fields(cls):
            assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring"
            if f.default is not dataclasses.MISSING:
                assert "Default" in docs[f.name], f"{cls.__name__}.{f.name}: its docstring names no default"


def test_launch_overrides_name_the_section():
    from launch.config import load_job_config, parse_override

    assert parse_override("checkpoint.retention.keep_last=2") == ("checkpoint", "retention.keep_last", 2)
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("train.a.b=1")
    repo = Path(__file__).resolve().parents[2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shipped configs are in the new form
        job = load_job_config(
            repo / "launch" / "configs" / "ddp.yaml",
            ["checkpoint.retention.keep_last=2", "checkpoint.coordination.timeout_s=60", "checkpoint.load.path=null"],
        )
    assert job.checkpoint.retention.keep_last == 2 and job.checkpoint.coordination.timeout_s == 60.0
    assert job.checkpoint.preemption.exit is False  # from the file
    with pytest.warns(DeprecationWarning, match="use retention.keep_every_steps"):
        job = load_job_config(repo / "launch" / "configs" / "ddp.yaml", ["checkpoint.keep_every_steps=10"])
    assert job.checkpoint.retention.keep_every_steps == 10
    with pytest.raises(ConfigError, match=r"interval_steps=7 \(deprecated\) and schedule.interval_steps=50 conflict"):
        load_job_config(repo / "launch" / "configs" / "ddp.yaml", ["checkpoint.interval_steps=7"])
    with pytest.raises(ConfigError, match=r"checkpoint.retention.keep_last='x': expected an integer"):
        load_job_config(repo / "launch" / "configs" / "ddp.yaml", ["checkpoint.retention.keep_last=x"])
    with pytest.raises(ConfigError, match=r"unknown CheckpointConfig.schedule key\(s\) \['every'\]"):
        load_job_config(repo / "launch" / "configs" / "ddp.yaml", ["checkpoint.schedule.every=7"])


@pytest.mark.parametrize("name", ["load", "preemption"])
def test_a_truth_test_of_a_section_that_was_a_bool_is_refused(name):
    section = getattr(CheckpointConfig(root="/tmp/unused"), name)
    expected = rf"CheckpointConfig\.{name} is a section: test CheckpointConfig\.{name}\.enabled"
    with pytest.raises(TypeError, match=expected):
        bool(section)
    assert section.enabled is True


@pytest.mark.parametrize(
    "section, key",
    [("memory", "enabled"), ("load", "enabled"), ("load", "fallback_to_older"), ("schedule", "save_at_end")],
)
def test_a_string_where_a_bool_belongs_is_refused(section: str, key: str) -> None:
    """YAML's quoted "false" is a non-empty string: taken as a bool it would mean true."""
    with pytest.raises(ConfigError, match=rf"CheckpointConfig\.{section}\.{key}='false': must be true or false"):
        CheckpointConfig(root="/tmp/x", **{section: {key: "false"}})
