"""Facts about the job's nodes, from the launcher and the file system rather than guesses.

* Ranks per node: torchrun (and most launchers) export ``LOCAL_WORLD_SIZE``; only without it
  are ranks counted by host name (which is wrong when several agents share a host, as in
  ``launch/elastic_demo.py``, or when containers on one host report one name).
* A shared root: every rank reads and writes ``<root>`` directly, so it must be the same
  storage on every node. Rank 0 writes a token file there at construction; a rank that does
  not see it (node-local disks mounted at the same path) makes every rank raise ``ConfigError``.
* An elastic torchrun whose agents share their rendezvous store with the workers dies when a
  node joins (torch 2.13): said at construction, with the fix (:func:`elastic_store_warning`).
"""

from __future__ import annotations

import os
import platform
import socket
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import ConfigError
from .collective import Collective

__all__ = [
    "PROBE_PREFIX",
    "local_world_size",
    "check_shared_root",
    "elastic_store_warning",
    "agent_nnodes",
    "hardware_summary",
]

PROBE_PREFIX = ".shared-probe-"


def local_world_size(collective: Collective) -> int:
    """Ranks on this rank's node: ``$LOCAL_WORLD_SIZE`` when set (a positive integer), else the
    ranks whose host name equals this one's. Collective (all ranks call it)."""
    hosts = collective.all_gather(socket.gethostname())
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return hosts.count(hosts[collective.rank])


def check_shared_root(collective: Collective, store: Any, *, write: bool = True) -> None:
    """Check that every rank sees the files rank 0 writes in the root of ``store``. Collective.

    Args:
        store: the root's ``CheckpointStore``; one whose storage is the same for every node by
            construction (``store.shared``: object storage) needs no check.
        write: whether the manager writes to ``root``; ``False`` (``save.enabled: false``): no check, and
            no token file (each node may read its own copy of a snapshot).

    Raises:
        ConfigError: on every rank, naming the ranks and hosts that do not see rank 0's token.
    """
    if not write or not collective.enabled or collective.world_size == 1 or store.shared:
        return
    root = Path(store.root)
    token = collective.broadcast(uuid.uuid4().hex if collective.rank == 0 else "")  # rank 0's on every rank
    probe = root / f"{PROBE_PREFIX}{token}"
    write_error = None
    if collective.rank == 0:
        try:
            probe.write_text(token)
        except OSError as e:  # raised on every rank below, not here: the others wait in the barrier
            write_error = f"rank 0 cannot write {probe}: {e}"
    collective.barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    views = collective.all_gather((seen, socket.gethostname(), write_error))
    if collective.rank == 0:
        probe.unlink(missing_ok=True)
    if views[0][2] is not None:
        raise ConfigError(f"CheckpointConfig.root={str(root)!r}: {views[0][2]}")
    blind = {r: host for r, (ok, host, _) in enumerate(views) if not ok}
    if blind:
        raise ConfigError(
            f"CheckpointConfig.root={str(root)!r} is not the same storage on every node: rank(s) "
            + ", ".join(f"{r} (host {h})" for r, h in blind.items())
            + f" do not see the file {probe.name} that rank 0 (host {views[0][1]}) wrote there. Every rank "
            "writes its shards into the root and rank 0 commits them: use a shared file system (NFS, "
            "Lustre, GPFS, a mounted bucket) at the same path on every node, not a node-local disk."
        )


def agent_nnodes(env: Mapping[str, str] | None = None, agent_argv: list[str] | None = None) -> tuple[int, int] | None:
    """``(min, max)`` nodes of the torchrun agent that started this worker, or ``None`` when
    unknown. torchrun exports neither to its workers: read ``$PET_NNODES`` (torchrun's
    environment form of ``--nnodes``), else the agent's ``--nnodes`` from its command line (the
    worker's parent process, ``/proc/<ppid>/cmdline`` on Linux).

    Args:
        env: the environment (``None``: ``os.environ``).
        agent_argv: the agent's command line (``None``: read from ``/proc``).
    """
    env = os.environ if env is None else env
    value = env.get("PET_NNODES")
    if value is None:
        if agent_argv is None:
            try:
                agent_argv = Path(f"/proc/{os.getppid()}/cmdline").read_text().split("\0")
            except OSError:
                return None
        for i, arg in enumerate(agent_argv):
            if arg == "--nnodes" and i + 1 < len(agent_argv):
                value = agent_argv[i + 1]
            elif arg.startswith("--nnodes="):
                value = arg.split("=", 1)[1]
            if value is not None:
                break
    low, _, high = (value or "").partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        return None


def elastic_store_warning(env: Mapping[str, str] | None = None, agent_argv: list[str] | None = None) -> str | None:
    """Why this elastic torchrun job will die when a node joins, with the fix, or ``None``.

    torch 2.13's c10d rendezvous shares the agent's TCP store with its workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default); on scale-up the running agent
    then waits for the new node's ``role_info`` until the store timeout and the whole job ends
    in ``DistStoreError`` (docs/elastic.md). Said when this process is a torchrun
    worker (``TORCHELASTIC_RUN_ID`` set) whose agent shares its store and whose node count may
    change (``--nnodes MIN:MAX`` with ``MIN < MAX``, :func:`agent_nnodes`).

    Args:
        env, agent_argv: as :func:`agent_nnodes` (tests pass them).
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE", str(env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1")) != "True":
        return None  # each rendezvous round has its own store: the fix is in place
    nodes = agent_nnodes(env, agent_argv)
    if nodes is None or nodes[0] >= nodes[1]:
        return None
    return (
        f"torchrun runs this job elastically (--nnodes {nodes[0]}:{nodes[1]}) and its agents share their "
        "rendezvous TCP store with the workers (TORCHELASTIC_USE_AGENT_STORE=True): with torch 2.13 the whole "
        "job dies with DistStoreError (waiting for role_info) about a minute after a node joins. Export "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every node (README: Elastic training)."
    )


def hardware_summary() -> dict[str, Any]:
    """This machine, for the manifest and a release's model card: platform, CPU count and
    accelerators (CUDA device name and count when available)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "accelerator": "cpu",
        "accelerator_count": 0,
    }
    if torch.cuda.is_available():
        info.update(
            accelerator=torch.cuda.get_device_name(0),
            accelerator_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
        )
    return info
