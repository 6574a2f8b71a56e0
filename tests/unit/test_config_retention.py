import re

import pytest

from distckpt import CheckpointConfig, ConfigError, CoordinationConfig
from distckpt._ondisk.layout import checkpoint_name, is_pending, parse_step, pending_name
from distckpt._save.retention import steps_to_delete


def test_unknown_key_names_the_valid_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  root: /tmp/x\n  interval_step: 5\n")
    with pytest.raises(ConfigError) as err:
        CheckpointConfig.from_yaml(path)
    assert "interval_step" in str(err.value) and "did you mean schedule.interval_steps?" in str(err.value)
    assert "valid keys: root, schedule, retention" in str(err.value)


def test_from_yaml_without_the_section_names_the_top_level_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training: {lr: 0.1}\ncheckpont:\n  root: /tmp/x\n")
    with pytest.raises(
        ConfigError,
        match=r"no `checkpoint:` section \(top-level keys: checkpont, training\); `checkpont:` looks like a",
    ):
        CheckpointConfig.from_yaml(path)


def test_from_yaml_reads_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "checkpoint:\n  root: /tmp/x\n  schedule: {interval_steps: 5}\n  retention:\n    keep_last: 2\nother: 1\n"
    )
    cfg = CheckpointConfig.from_yaml(path)
    assert (cfg.root, cfg.schedule.interval_steps, cfg.retention.keep_last) == ("/tmp/x", 5, 2)


def test_from_yaml_reads_exponents_without_a_dot_as_numbers(tmp_path):
    """YAML 1.2 reads ``1e3`` as a float; PyYAML (YAML 1.1) as the string '1e3'."""
    path = tmp_path / "c.yaml"
    path.write_text("root: /tmp/x\ncoordination: {timeout_s: 1e3, liveness_timeout_s: 2.5E+1}\n")
    cfg = CheckpointConfig.from_yaml(path)
    assert (cfg.coordination.timeout_s, cfg.coordination.liveness_timeout_s) == (1000.0, 25.0)
    path.write_text("root: /tmp/x\nschedule: {interval_steps: 1e3}\n")  # an integer field: says what to write
    with pytest.raises(ConfigError, match=r"interval_steps=1000.0: must be a positive integer \(write 1000"):
        CheckpointConfig.from_yaml(path)


@pytest.mark.parametrize(
    "key,value",
    [
        ("schedule.interval_steps", -1),
        ("schedule.interval_s", 0),
        ("retention.keep_last", 0),
        ("save.state_dict_type", "FULLISH"),
        ("save.thread_count", 0),
        ("coordination.write_timeout_s", -1.0),
        ("coordination.write_timeout_s", 600.0),
        ("schedule.interval_steps", 1.5),
        ("save.thread_count", 2.5),
        ("coordination.timeout_s", float("nan")),
        ("coordination.timeout_s", float("inf")),
        ("schedule.interval_s", float("nan")),
        ("load.streams_per_node", 1.5),
        ("retention.keep_last", True),
    ],
)
def test_bad_values_name_the_field(key, value):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"CheckpointConfig.{re.escape(key)}="):
        CheckpointConfig(root="/tmp/x", **{section: {name: value}})


def test_write_deadline_defaults_to_half_the_group_timeout():
    assert CoordinationConfig(timeout_s=60.0).effective_write_timeout_s == 30.0
    assert CoordinationConfig(timeout_s=60.0, write_timeout_s=50.0).effective_write_timeout_s == 50.0


def test_config_is_kw_only():
    with pytest.raises(TypeError):
        CheckpointConfig("/tmp/x")  # type: ignore[misc]


def test_layout_names_round_trip():
    assert checkpoint_name(100) == "step-000000100" and parse_step("step-000000100") == 100
    assert parse_step("step-12") is None and parse_step("latest") is None
    assert is_pending(pending_name(7, "ab12")) and not is_pending("step-000000007")
    assert pending_name(7, "ab12") == ".pending-step-000000007-ab12"
    assert is_pending(".staging-step-000000007-ab12")  # the name earlier versions gave it
    assert not is_pending(".staging-notes") and not is_pending(".pending-step-7-ab")


@pytest.mark.parametrize(
    "steps,keep_last,every,expected",
    [
        ([10, 20, 30, 40], 2, None, [10, 20]),
        ([10, 20, 30, 40], 1, 20, [10, 30]),
        ([10, 20, 30, 40], None, None, []),
        ([40], 1, None, []),
        ([5, 10, 15, 20, 25], 2, 10, [5, 15]),
    ],
)
def test_retention(steps, keep_last, every, expected):
    assert steps_to_delete(steps, keep_last=keep_last, keep_every_steps=every) == expected
