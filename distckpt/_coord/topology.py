"""Facts about the job's nodes, from the launcher and the file system rather than guesses.

* A node: ``$DISTCKPT_NODE_ID`` when the launcher sets it, else the host name (:func:`node_id`), the
  one definition behind ranks per node, the memory tier's placement and the messages naming nodes.
  Set it when several agents share a host (``launch/elastic_demo.py``) or containers on one host
  report one host name.
* The setup exchange: what the ranks learn of each other at the manager's construction (nodes, the
  start id, memory-tier estimates) comes from one ``all_gather`` (:func:`exchange_setup`).
* A shared root: every rank reads and writes ``<root>`` directly, so it must be the same
  storage on every node. Rank 0 writes a token file there before the setup exchange; a rank that
  does not see it after (node-local disks mounted at the same path) makes every rank raise ``ConfigError``.
* An elastic torchrun whose agents share their rendezvous store with the workers dies when a
  node joins (torch 2.13): said at construction, with the fix (:func:`elastic_store_warning`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

from .._errors import ConfigError, DistCkptError
from .collective import Collective

__all__ = [
    "NODE_ENV",
    "PROBE_PREFIX",
    "JobSetup",
    "node_id",
    "exchange_setup",
    "check_shared_root",
    "elastic_store_warning",
    "agent_nnodes",
    "hardware_summary",
]

PROBE_PREFIX = ".shared-probe-"
T = TypeVar("T")


NODE_ENV = "DISTCKPT_NODE_ID"


def node_id() -> str:
    """This process's node: ``$DISTCKPT_NODE_ID``, else the host name. Never torchrun's
    ``GROUP_RANK`` (renumbered at every rendezvous) nor ``LOCAL_WORLD_SIZE`` (a count, not an identity)."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class JobSetup:
    """What every rank knows of the others after :func:`exchange_setup` (the same on every rank
    but ``rank``).

    Attributes:
        rank: this rank, in the collective's group.
        nodes: each rank's :func:`node_id`, indexed by rank.
        estimates: each rank's memory-tier snapshot estimate (bytes; 0 without the tier).
        start_id: rank 0's random 32-hex id of this start of the job's workers (one manager's life):
            save ids, the memory tier's generation and the default tracker run id derive from it.
        probe_error: why rank 0 could not write the shared-root token file, or ``None``.
        run_id: the tracker run id rank 0 passed to the manager, or ``None``.
    """

    rank: int
    nodes: tuple[str, ...]
    estimates: tuple[int, ...]
    start_id: str
    probe_error: str | None = None
    run_id: str | None = None

    @property
    def node(self) -> str:
        """This rank's node id."""
        return self.nodes[self.rank]

    @property
    def local_world_size(self) -> int:
        """Ranks on this rank's node (they share its disk and its ``load.streams_per_node``)."""
        return self.nodes.count(self.node)


def _probes(collective: Collective, store: Any, write: bool) -> bool:
    """Whether the shared-root check runs: several ranks writing into a store that is not shared by construction."""
    return write and collective.enabled and collective.world_size > 1 and not store.shared


def exchange_setup(
    collective: Collective,
    store: Any,
    prepare: Callable[[], T],
    *,
    what: str = "preparing the checkpoint root",
    error_type: type[DistCkptError] = ConfigError,
    write: bool = True,
    estimate: int = 0,
    run_id: str | None = None,
) -> tuple[T, JobSetup]:
    """The manager's setup in one exchange: every rank runs ``prepare()`` (rank 0 prepares the root),
    rank 0 then writes the shared-root token file that :func:`check_shared_root` looks for, and one
    ``all_gather`` (:meth:`~distckpt._coord.collective.Collective.agree_and_share`) carries each
    rank's outcome and a small record: node id, memory-tier ``estimate`` (bytes), the tracker
    ``run_id`` passed to the manager, a random id and rank 0's result. Rank 0's random id, run id
    and result are taken. Collective (all ranks call it).

    Returns:
        ``(rank 0's prepare() result, JobSetup)``, the same on every rank.

    Raises:
        DistCkptError: ``prepare`` raised on some rank: on every rank, as ``agree`` raises (a
            ``DistCkptError`` keeps its type, anything else becomes ``error_type``); rank 0's token
            file is removed first.
    """
    start_id, probe, probe_error = uuid.uuid4().hex, None, None

    def local() -> T:
        nonlocal probe, probe_error
        result = prepare()
        if collective.rank == 0 and _probes(collective, store, write):
            probe = Path(store.root) / f"{PROBE_PREFIX}{start_id}"
            try:
                probe.write_text(start_id)
            except OSError as e:  # raised on every rank by check_shared_root: the others wait in the gather
                probe_error = f"rank 0 cannot write {probe}: {e}"
        return result

    def record(result: T) -> tuple:
        return node_id(), estimate, start_id, probe_error, run_id, result if collective.rank == 0 else None

    try:
        _, records = collective.agree_and_share(local, record, what=what, error_type=error_type)
    except BaseException:
        if probe is not None:
            probe.unlink(missing_ok=True)
        raise
    setup = JobSetup(
        rank=collective.rank,
        nodes=tuple(r[0] for r in records),
        estimates=tuple(r[1] for r in records),
        start_id=records[0][2],
        probe_error=records[0][3],
        run_id=records[0][4],
    )
    return records[0][5], setup


def check_shared_root(collective: Collective, store: Any, setup: JobSetup, *, write: bool = True) -> None:
    """Check that every rank sees the token file rank 0 wrote in the root of ``store`` before
    :func:`exchange_setup` (which returned ``setup``). Collective: one ``all_gather`` of a flag.

    Args:
        store: the root's ``CheckpointStore``; one whose storage is the same for every node by
            construction (``store.shared``: object storage) needs no check.
        write: whether the manager writes to ``root``; ``False`` (``save.enabled: false``): no check, and
            no token file (each node may read its own copy of a snapshot). As passed to :func:`exchange_setup`.

    Raises:
        ConfigError: on every rank, naming the ranks and nodes that do not see rank 0's token, or
            rank 0's failure to write it.
    """
    if not _probes(collective, store, write):
        return
    root = Path(store.root)
    probe = root / f"{PROBE_PREFIX}{setup.start_id}"
    if setup.probe_error is not None:  # every rank knows it from the exchange: no collective
        raise ConfigError(f"CheckpointConfig.root={str(root)!r}: {setup.probe_error}")
    try:
        seen = probe.read_text() == setup.start_id
    except OSError:
        seen = False
    views = collective.all_gather(seen)
    if collective.rank == 0:
        probe.unlink(missing_ok=True)
    blind = {r: setup.nodes[r] for r, ok in enumerate(views) if not ok}
    if blind:
        raise ConfigError(
            f"CheckpointConfig.root={str(root)!r} is not the same storage on every node: rank(s) "
            + ", ".join(f"{r} (node {n})" for r, n in blind.items())
            + f" do not see the file {probe.name} that rank 0 (node {setup.nodes[0]}) wrote there. Every rank "
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
