"""CheckpointConfig's sections: instances and mappings, YAML, keys outside their section, docstrings."""

from __future__ import annotations

import ast
import dataclasses
import pickle
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
from distckpt._config import INITIAL_LOAD, MOVED_KEYS, SECTIONS


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


def test_yaml_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "checkpoint:\n  root: /tmp/x\n  schedule: {interval_steps: 5, save_at_end: false}\n"
        "  retention:\n    keep_last: 2\n    keep_best: {metric: acc, mode: max}\n"
        "  load: {enabled: true, exclude: [optimizer, lr_scheduler]}\n"
        "  preemption: {enabled: true, exit: false, grace_s: 12}\n  storage: {s3_region: eu}\n"
    )
    cfg = CheckpointConfig.from_yaml(path)
    assert (cfg.schedule.interval_steps, cfg.schedule.save_at_end, cfg.retention.keep_last) == (5, False, 2)
    assert cfg.retention.keep_best == KeepBest(metric="acc", mode="max")
    assert cfg.load_selection == frozenset(distckpt._config.LOADABLE) - {"optimizer", "lr_scheduler"}
    assert cfg.preemption == PreemptionConfig(enabled=True, exit=False, grace_s=12)
    assert cfg.storage.s3_region == "eu"


def _section_key(moved: str) -> tuple[str, str]:
    """``("schedule", "interval_steps")`` of a :data:`MOVED_KEYS` value (``save.enabled: false``)."""
    section, name = moved.split(":")[0].split(".")
    return section, name


def test_every_moved_key_names_a_section_field_and_no_field_is_moved():
    fields = {(name, f.name) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert len(MOVED_KEYS) == 41  # the draft's 39 flat keys but load/preemption, and 2 renamed fields
    for old, new in MOVED_KEYS.items():
        assert _section_key(new) in fields, old
        assert tuple(old.split(".")) not in fields, old  # a moved key never shadows a field


@pytest.mark.parametrize("old", ["interval_steps", "keep_last", "async_mode", "read_only", "timeout_s", "fast_load"])
def test_a_flat_keyword_is_a_config_error_naming_its_section_key(old):
    with pytest.raises(
        ConfigError, match=rf"^CheckpointConfig: `{old}` is `{MOVED_KEYS[old]}` \(set it in its section\)$"
    ):
        CheckpointConfig(root="/tmp/x", **{old: 1})


def test_every_flat_key_in_config_data_is_a_config_error_naming_its_section_key(tmp_path):
    for old, new in MOVED_KEYS.items():
        section, name = old.partition(".")[::2] if "." in old else ("", old)
        data = {"root": "/tmp/x", **({section: {name: 1}} if section else {old: 1})}
        with pytest.raises(ConfigError, match=rf"`{old}` is `{new}`") as caught:
            CheckpointConfig.from_dict(data)
        assert "\n" not in str(caught.value)
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  root: /tmp/x\n  interval_steps: 100\n")
    with pytest.raises(ConfigError, match=rf"^{path}: CheckpointConfig: `interval_steps` is `schedule.interval_steps`"):
        CheckpointConfig.from_yaml(path)


def test_the_renamed_fields_name_their_new_keys():
    with pytest.raises(ConfigError, match=r"`load.read_only` is `save.enabled: false`"):
        CheckpointConfig(root="/tmp/x", load={"read_only": True})
    with pytest.raises(ConfigError, match=r"`schedule.interval_seconds` is `schedule.interval_s`"):
        CheckpointConfig.from_dict({"root": "/tmp/x", "schedule": {"interval_seconds": 5.0}})
    assert CheckpointConfig(root="/tmp/x", schedule={"interval_s": 5.0}).schedule.interval_s == 5.0


@pytest.mark.parametrize("name", ["load", "preemption"])
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_for_a_section_names_its_enabled_key(name, value):
    word = str(value).lower()
    with pytest.raises(ConfigError, match=rf"`{name}: {word}` is `{name}.enabled: {word}`"):
        CheckpointConfig.from_dict({"root": "/tmp/x", name: value})
    with pytest.raises(ConfigError, match=rf"`{name}: {word}` is `{name}.enabled: {word}`"):
        CheckpointConfig(root="/tmp/x", **{name: value})


def test_save_enabled_false_only_loads():
    cfg = CheckpointConfig(root="/tmp/x", save=SaveConfig(enabled=False), load={"step": 2})
    assert cfg.save.enabled is False and cfg.preemption.enabled is True and cfg.effective_preemption is False
    assert CheckpointConfig(root="/tmp/x").effective_preemption is True
    with pytest.raises(ConfigError, match=r"save.enabled=false only loads: it needs load.enabled: true"):
        CheckpointConfig(root="/tmp/x", save={"enabled": False}, load={"enabled": False})
    with pytest.raises(ConfigError, match=r"save.enabled=false only loads: .*on_existing='archive'"):
        CheckpointConfig(root="/tmp/x", save={"enabled": False}, load={"path": "/tmp/y", "on_existing": "archive"})
    with pytest.raises(ConfigError, match=r"CheckpointConfig.save.enabled='no': must be true or false"):
        CheckpointConfig(root="/tmp/x", save={"enabled": "no"})


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
    with pytest.raises(ConfigError, match=r"unknown CheckpointConfig key\(s\) \['1'\]"):  # YAML's `1: x`
        CheckpointConfig.from_dict({"root": "/tmp/x", 1: "x"})
    with pytest.raises(ConfigError, match=r"unknown CheckpointConfig.save key\(s\) \['2'\]"):
        CheckpointConfig.from_dict({"root": "/tmp/x", "save": {2: "x"}})
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
    source = Path(distckpt._config_sections.__file__).read_text()
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
    job = load_job_config(
        repo / "launch" / "configs" / "ddp.yaml",
        ["checkpoint.retention.keep_last=2", "checkpoint.coordination.timeout_s=60", "checkpoint.load.path=null"],
    )
    assert job.checkpoint.retention.keep_last == 2 and job.checkpoint.coordination.timeout_s == 60.0
    assert job.checkpoint.preemption.exit is False  # from the file
    with pytest.raises(ConfigError, match=r"`keep_every_steps` is `retention.keep_every_steps`"):
        load_job_config(repo / "launch" / "configs" / "ddp.yaml", ["checkpoint.keep_every_steps=10"])
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


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("retention", "keep_last", -5, r"CheckpointConfig\.retention\.keep_last=-5: must be a positive integer"),
        ("schedule", "interval_steps", 0, r"CheckpointConfig\.schedule\.interval_steps=0: must be a positive integer"),
        ("async_save", "mode", "thread", r"retention\.keep_last=1 with async_save\.mode='thread'"),  # cross-section
    ],
)
def test_a_section_changed_after_construction_is_checked_again_by_the_manager(tmp_path, section, key, value, expected):
    from tests.distributed.trainer import Net

    cfg = CheckpointConfig(root=str(tmp_path / "ckpt"), retention={"keep_last": 1})
    setattr(getattr(cfg, section), key, value)  # accepted by the dataclass: no check runs on assignment
    with pytest.raises(ConfigError, match=expected):
        distckpt.CheckpointManager(cfg, model=Net(), optimizer=None)
    assert not (tmp_path / "ckpt").exists()  # refused before touching the root
    with pytest.raises(ConfigError, match=expected):
        cfg.validate()


@pytest.mark.parametrize(
    "cls, key, expected",
    [
        (
            ScheduleConfig,
            "interval_step",
            r"unknown CheckpointConfig\.schedule key\(s\) \['interval_step'\] "
            r"\(did you mean schedule\.interval_steps\?\); valid keys: interval_steps, ",
        ),
        (RetentionConfig, "keep_lats", r"\['keep_lats'\] \(did you mean retention\.keep_last\?\)"),
        (RetentionConfig, "interval_steps", r"\(did you mean schedule\.interval_steps\?\)"),  # another section's
        (SaveConfig, "bogus", r"unknown CheckpointConfig\.save key\(s\) \['bogus'\]; valid keys: enabled, "),
        (KeepBest, "metrc", r"unknown CheckpointConfig\.retention\.keep_best key\(s\) \['metrc'\]"),
    ],
)
def test_a_sections_unknown_keyword_is_a_config_error_with_did_you_mean(cls, key, expected):
    with pytest.raises(ConfigError, match=expected):
        cls(**{key: 5})
    assert ScheduleConfig(interval_steps=5).interval_steps == 5  # keywords work as before
    assert KeepBest(metric="loss", k=2) == KeepBest(metric="loss", mode="min", k=2)
    assert pickle.loads(pickle.dumps(ScheduleConfig(interval_steps=7))) == ScheduleConfig(interval_steps=7)
    assert dataclasses.replace(ScheduleConfig(), interval_steps=9).interval_steps == 9
