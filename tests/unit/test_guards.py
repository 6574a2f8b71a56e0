"""Guards against silent damage: unsupported root URL schemes, outputs written into a checkpoint,
strict JSON in a release, options that cannot apply, a restart over a root holding only
corrupt checkpoints on object storage, a deferred checkpoint in a save's way."""

import json
import math

import pytest

from distckpt import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    SaveConfig,
    ScheduleConfig,
)
from distckpt._cli import main
from distckpt._load.discovery import CheckpointDiscovery
from distckpt._ondisk.manifest import Manifest
from distckpt._storage import Others, open_store
from distckpt._storage.commit import commit
from distckpt._tools.export import export_checkpoint
from distckpt._tools.release import release_checkpoint
from tests.distributed.trainer import Net

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize(
    "root,hint",
    [
        ("gs://bucket/x", None),
        ("S3://b/z", "s3://b/z"),
        ("s3a://b/z", "s3://b/z"),
        ("s3:/b/z", "s3://b/z"),
        ("hdfs://nn/ckpt", None),
    ],
)
def test_unsupported_url_scheme_root_is_refused(tmp_path, monkeypatch, root, hint):
    monkeypatch.chdir(tmp_path)
    for make in (lambda: CheckpointConfig(root=root), lambda: open_store(root)):
        with pytest.raises(ConfigError, match="supported roots are s3://bucket/prefix, file:///path") as err:
            make()
        assert (f"Did you mean {hint}?" in str(err.value)) if hint else "Did you mean" not in str(err.value)
    assert main(["ls", root]) != 0
    assert list(tmp_path.iterdir()) == []  # no ./gs:/... directory


def test_supported_roots_still_accepted(tmp_path):
    assert CheckpointConfig(root="s3://bucket/x").root == "s3://bucket/x"
    assert CheckpointConfig(root=f"file://{tmp_path}").root == f"file://{tmp_path}"
    assert CheckpointConfig(root="runs/ckpt").root == "runs/ckpt"
    assert open_store(f"file://{tmp_path}").root == str(tmp_path)


def test_full_every_needs_incremental(tmp_path):
    with pytest.raises(ConfigError, match="save.full_every=5 needs save.incremental: true"):
        CheckpointConfig(root=str(tmp_path), save=SaveConfig(full_every=5))


@pytest.mark.parametrize("run_id", [123, "", b"x"])
def test_run_id_of_wrong_type_is_a_config_error(tmp_path, run_id):
    with pytest.raises(ConfigError, match="run_id"):
        CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None, run_id=run_id)


def saved(root, **kw):
    manager = CheckpointManager(
        CheckpointConfig(root=str(root), schedule=ScheduleConfig(interval_steps=None)), model=Net(), optimizer=None
    )
    manager.save(1, **kw)
    manager.close()
    return root / "step-000000001"


def test_release_training_config_is_strict_json_with_non_finite_values(tmp_path):
    ckpt = saved(tmp_path / "ckpt", loss=float("nan"), metrics={"val_loss": float("inf"), "acc": 0.5})
    release_checkpoint(ckpt, tmp_path / "rel", progress=False)

    def refuse(name):
        raise AssertionError(f"bare {name} in training_config.json")

    config = json.loads((tmp_path / "rel" / "training_config.json").read_text(), parse_constant=refuse)
    assert config["loss"] is None and config["metrics"] == {"val_loss": None, "acc": 0.5}
    assert math.isnan(Manifest.read(ckpt).loss)  # the checkpoint keeps its value


def test_release_or_export_into_a_checkpoint_is_refused(tmp_path):
    ckpt = saved(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for out in (ckpt, ckpt / "release", ckpt / "a" / "b"):
        with pytest.raises(ConfigError, match="is inside the checkpoint"):
            release_checkpoint(ckpt, out, overwrite=True, progress=False)
    assert main(["release", str(ckpt), str(ckpt / "rel"), "--no-progress"]) != 0
    data = next(ckpt.glob("*.distcp"))
    with pytest.raises(ConfigError, match="is inside the checkpoint"):
        export_checkpoint(ckpt, data, overwrite=True, progress=False)
    assert main(["export", str(ckpt), str(data), "--force", "--no-progress"]) != 0
    deferred = tmp_path / "old" / "step-000000000"
    deferred.mkdir(parents=True)
    (deferred / "distckpt.deferred.json").write_text("{}")
    with pytest.raises(ConfigError, match="is inside the checkpoint"):
        export_checkpoint(ckpt, deferred / "x.safetensors", progress=False)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # nothing written into it
    release_checkpoint(ckpt, tmp_path / "rel", progress=False)  # beside it is fine


def test_commit_over_a_deferred_checkpoint_says_so(tmp_path):
    ckpt = saved(tmp_path / "ckpt")
    final = tmp_path / "ckpt" / "step-000000002"
    final.mkdir()
    (final / "distckpt.deferred.json").write_text("{}")
    with pytest.raises(FileExistsError, match="is a deferred checkpoint"):
        commit(tmp_path / "pending", final, Manifest.read(ckpt))


class _CorruptOnlyStore:
    root, kind = "s3://bucket/run", "s3"

    def __init__(self, names):
        self.names = names

    def remove_leftovers(self):
        return []

    def committed_steps(self):
        return []

    def others(self):
        return Others(unmanaged=[], deferred=[], set_aside=[f"manifests/{n}" for n in self.names], latest=None)


def test_object_store_root_holding_only_corrupt_manifests_refuses_a_fresh_start(tmp_path):
    config = CheckpointConfig(root="s3://bucket/run")
    names = ["archived-step-000000001-0", "corrupt-step-000000004-0", "rolledback-step-000000009-0"]
    with pytest.raises(CheckpointCorruptError, match="only checkpoints set aside as corrupt") as err:
        CheckpointDiscovery(_CorruptOnlyStore(names), config, rank=0, locked=True).choose([])
    assert "manifests/corrupt-step-000000004-0" in str(err.value) and "archived" not in str(err.value)
    other = CheckpointDiscovery(_CorruptOnlyStore(names[::2]), config, rank=0, locked=True)
    assert other.choose([]) is None  # archived / rolled back only: a fresh start, as before


@pytest.mark.parametrize(
    "env,nodes",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "PET_NNODES": "1:2"}, "1:2"),
        ({"PET_NNODES": "2:4"}, "2:4"),  # no USE_AGENT_STORE: torchrun's default, shared
        (
            {"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_NNODES": "1:2"},
            None,
        ),  # the fix
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "PET_NNODES": "2"}, None),  # a fixed node count
    ],
)
def test_an_elastic_torchrun_sharing_its_store_is_warned_about_at_construction(
    tmp_path, monkeypatch, caplog, env, nodes
):
    # Issue 24 item 13: such a job died with DistStoreError (role_info) ~80 s after a node joined.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING", logger="distckpt"):
        CheckpointManager(CheckpointConfig(root=str(tmp_path)), model=Net(), optimizer=None).close()
    said = [r for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage()]
    assert len(said) == (nodes is not None)
    if nodes is not None:
        assert said[0].levelname == "WARNING" and "DistStoreError" in said[0].getMessage()
        assert f"elastically (--nnodes {nodes})" in said[0].getMessage()


def test_the_agents_node_counts_come_from_its_command_line():
    from distckpt._coord.topology import agent_nnodes, elastic_store_warning

    assert agent_nnodes({}, ["python", "/bin/torchrun", "--nnodes", "1:2", "train.py"]) == (1, 2)
    assert agent_nnodes({}, ["python", "-m", "torch.distributed.run", "--nnodes=2:4", "t.py"]) == (2, 4)
    assert agent_nnodes({}, ["torchrun", "--nnodes", "3", "t.py"]) == (3, 3)
    assert agent_nnodes({}, ["torchrun", "--standalone", "t.py"]) is None
    assert agent_nnodes({"PET_NNODES": "1:8"}, ["torchrun", "--nnodes", "2", "t.py"]) == (1, 8)
    shared = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert elastic_store_warning(shared, ["torchrun", "--nnodes", "1:2"]) is not None
    assert elastic_store_warning({}, ["torchrun", "--nnodes", "1:2"]) is None  # not a torchrun worker
