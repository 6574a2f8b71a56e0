"""The memory tier's write side: a snapshot of each rank's state into node-local shared memory every
``memory.interval_steps`` steps, and its replicas on other nodes (docs/memory.md).

Per snapshot, on the training thread: wait for the previous snapshot's background work, plan the
items of the same DCP state_dict a durable save writes (replicated tensors once per job; the
plan reused while the state_dict's structure repeats: :class:`~distckpt._memory.plan.SnapshotPlan`),
and copy them into a reused slot file
(:class:`~distckpt._memory.snapfile.SlotFile`); that copy is the stall. On a background thread with
its own gloo group: hash the data, seal the file (complete), then one replication round: each
rank sends its file to its ring targets and receives its sources' files into its replica slots,
each verified and sealed in turn. A rank keeps at most two snapshots of its own (the last complete
one and the one being written) and two per source it replicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from .._config import CheckpointConfig
from .._coord.collective import Collective
from .._coord.topology import JobSetup
from .._engine.save_planner import LeanSavePlanner
from .._errors import CheckpointCorruptError, ConfigError
from .._state.guard import deferrable
from .._state.packing import PackError
from .._state.train_state import TrainState
from .._state.training_state import GUARDED_PARTS, CheckpointState
from .cleanup import job_dirs, reclaim_dir, remove_if_empty
from .placement import NodeLayout, file_system_type, launch_id, memory_dir
from .plan import Handover, SnapshotPlan, hand_over, resolve
from .snapfile import ALIGN, PREAMBLE, SlotFile, SnapshotHeader, data_hash, read_header, snapshot_name
from .worker import in_background

__all__ = ["MemoryTier", "estimate_bytes"]

logger = logging.getLogger(__name__)

_KINDS = {WriteItemType.TENSOR: "tensor", WriteItemType.SHARD: "shard", WriteItemType.BYTE_IO: "bytes"}


def estimate_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int) -> int:
    """Bytes one rank's snapshot is expected to take: its shards of the model's state plus its share
    of the replicated tensors, times ``1 +`` the optimizer's state per parameter byte (measured when
    the optimizer has state, else 2 for the Adam family and 1 otherwise), plus 1 MiB for the
    non-tensor items. Reads the sharded state_dict a durable save writes (DCP's
    ``get_model_state_dict``): never FSDP1's default full one, which gathers the whole model on
    every rank. Collective (FSDP1)."""
    sharded = replicated = 0
    for t in get_model_state_dict(model).values():
        local_shards = getattr(t, "local_shards", None)
        if callable(local_shards):  # FSDP1's ShardedTensor: this rank's shards
            sharded += sum(s.tensor.numel() * s.tensor.element_size() for s in local_shards())
        elif isinstance(t, DTensor):  # FSDP2
            sharded += t.to_local().numel() * t.element_size()
        elif isinstance(t, torch.Tensor):
            replicated += t.numel() * t.element_size()
    params = sharded + replicated
    factor = 2.0 if optimizer is not None and "adam" in type(optimizer).__name__.lower() else 1.0
    if optimizer is not None and optimizer.state and params:
        held = sum(
            (v.to_local() if hasattr(v, "to_local") else v).nbytes
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        factor = held / params
    mine = sharded + replicated // max(1, world_size)
    return int(mine * (1 + factor)) + (1 << 20)


class MemoryTier:
    """Snapshots of one rank into node-local memory, replicated to other nodes. Collective at construction.

    Args:
        config: ``memory`` (``interval_steps``, ``replicas``, ``dir``) and ``root`` (the job's key).
        collective: the manager's process-group helper (the capacity check, the replication group).
        setup: the manager's setup exchange (:func:`~distckpt._coord.topology.exchange_setup`): every rank's
            node and :func:`estimate_bytes` (bytes, for the capacity check), and the start id (the generation).
        wrapper: the model's wrapper kind, recorded in each snapshot.

    Raises:
        ConfigError: on every rank, when some node's memory directory cannot be created or its file
            system cannot hold two snapshots of the node's ranks plus their replicas (the sizes named).
    """

    def __init__(self, config: CheckpointConfig, collective: Collective, *, setup: JobSetup, wrapper: str) -> None:
        self.config, self.collective, self.wrapper = config.memory, collective, wrapper
        self.rank, self.world_size = collective.rank, collective.world_size
        self.node = setup.node
        self.layout = NodeLayout(setup.nodes)  # from the manager's setup exchange: no collective of its own
        estimates = list(setup.estimates)
        self.gen = setup.start_id[:12]  # this start of the workers
        self.root = config.root
        self.dir = memory_dir(self.config.dir, self.node, config.root)
        self.job = os.path.basename(self.dir)
        self.launch_id = launch_id()
        self.targets = self.layout.targets(self.rank, self.config.replicas)
        self.sources = self.layout.sources(self.rank, self.config.replicas)
        collective.agree(
            lambda: self._check_capacity(estimates), what="preparing the memory tier", error_type=ConfigError
        )
        if self.rank == 0 and self.config.replicas and len(self.layout.order) < 2:
            logger.warning(
                "memory tier: one node only, so no replica: a worker crash restores from memory, a node loss from %s",
                config.root,
            )
        self.group = None  # the replication rounds' own gloo group: never interleaves with the loop's
        if self.config.replicas and len(self.layout.order) > 1:  # the same on every rank: new_group is collective
            ranks = dist.get_process_group_ranks(collective.group)
            timeout = datetime.timedelta(seconds=config.coordination.timeout_s)
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if self._first_on_node:  # slots earlier generations were writing when they died: never restorable
            reclaim_dir(self.dir, keep_gen=self.gen, partial_only=True)
            fs = file_system_type(self.dir)
            if fs not in (None, "tmpfs", "ramfs"):
                logger.warning(
                    "memory tier: memory.dir %s is on a %s file system, not a tmpfs or ramfs: every snapshot is "
                    "written to disk (slower steps, disk wear); point memory.dir at a tmpfs such as /dev/shm",
                    self.dir,
                    fs,
                )
        self._own = [SlotFile(self._partial("own", self.rank, k)) for k in range(2)]
        self._replica = {s: [SlotFile(self._partial("replica", s, k)) for k in range(2)] for s in self.sources}
        self._newest: dict[int, int] = {}  # rank -> slot index of its last complete snapshot
        self._pending: Future | None = None
        self._copied: threading.Event | None = None  # set once the in-flight snapshot's tensors are copied
        self._refused: Exception | None = None  # the worker could not serialize a snapshot's state
        self.protected: Callable[[], set[int]] = (
            set  # the mutation guard's tensors' addresses (deferrable); create() sets it
        )
        self._reclaimed = False
        self.last_stall_s = 0.0
        self.snapshots = 0
        self._plan = SnapshotPlan(self.rank, self.world_size)

    @property
    def _first_on_node(self) -> bool:
        """Whether this rank is its node's lowest: the one that reclaims the node's directory."""
        return self.rank == self.layout.ranks_on(self.node)[0]

    def _partial(self, kind: str, rank: int, k: int) -> str:
        return os.path.join(self.dir, f"slot-{kind}-{rank}-{k}.{self.gen}.partial")

    def _check_capacity(self, estimates: list[int]) -> None:
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"memory tier: cannot create {self.dir} on node {self.node}: {e}") from e
        local = self.layout.ranks_on(self.node)
        if self.rank != local[0]:  # the node's lowest rank checks for the node (agree tells the others)
            return
        own = sum(estimates[r] for r in local)
        held = sum(estimates[s] for r in local for s in self.layout.sources(r, self.config.replicas))
        need, free = 2 * (own + held), shutil.disk_usage(self.dir).free
        if need > free:
            raise ConfigError(
                f"memory tier: node {self.node} needs {need / 2**20:.1f} MiB in {self.dir} (2 snapshots of its "
                f"{len(local)} ranks' state, {own / 2**20:.1f} MiB, and of the replicas it keeps, "
                f"{held / 2**20:.1f} MiB) but its file system has {free / 2**20:.1f} MiB free. Point memory.dir at "
                "a larger tmpfs, lower memory.replicas, or set memory.enabled: false"
            )

    @staticmethod
    def wanted(config: CheckpointConfig) -> bool:
        """Whether ``config`` runs the memory tier: ``memory.enabled`` and ``save.enabled``."""
        return config.memory.enabled and config.save.enabled

    @classmethod
    def setup_estimate(
        cls, config: CheckpointConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int
    ) -> int:
        """This rank's part of the setup exchange: :func:`estimate_bytes` when the tier runs, else 0.
        Collective (FSDP1) when the tier runs."""
        return estimate_bytes(model, optimizer, world_size) if cls.wanted(config) else 0

    @classmethod
    def create(
        cls,
        config: CheckpointConfig,
        collective: Collective,
        setup: JobSetup,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        wrapper: str,
    ) -> MemoryTier | None:
        """The tier ``config.memory`` asks for (``None`` when disabled or ``load.read_only``). Collective."""
        if not cls.wanted(config):
            return None
        tier = cls(config, collective, setup=setup, wrapper=wrapper)
        tier.protected = lambda: deferrable(model, optimizer)
        return tier

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step`` steps."""
        return step % self.config.interval_steps == 0

    def maybe_snapshot(self, step: int, state: CheckpointState, train_state: TrainState, *, explicit: set[str]) -> None:
        """Snapshot ``state`` as step ``step`` if due: the counters derived as a durable save derives
        them (``explicit``: those the caller passes), then :meth:`snapshot` of ``state.for_save``."""
        if not self.due(step):
            return
        loader_state = state.loader_state()  # read once: the counters and the saved position agree
        state.derive_counters(train_state, explicit=explicit, loader_state=loader_state)
        frozen = dataclasses.replace(train_state, loss_history=list(train_state.loss_history))
        parts = state.model_optim
        self.snapshot(
            step,
            lambda: state.for_save(frozen, full_state_dict=False, defer=True, loader_state=loader_state),
            # after build(), from the walk it did: the model and optimizer parts may be handed over
            # as they are when they hold only the guarded tensors (the cache's result)
            protected=lambda: (parts.guarded or set()) if parts.live else deferrable(parts.model, parts.optimizer),
            live=lambda: GUARDED_PARTS if parts.live else (),
            rank0=lambda: state.rank0_items,
        )

    # ------------------------------------------------------------------ write
    def snapshot(
        self,
        step: int,
        build: Callable[[], dict[str, Any]],
        protected: Callable[[], set[int]] | None = None,
        live: Callable[[], Collection[str]] = tuple,
        rank0: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        """Snapshot the state ``build()`` returns (the durable save's state_dict) as step ``step``.

        The training thread builds the state_dict, flattens it and copies what the mutation guard
        does not protect (a tensor that is neither a parameter, a persistent buffer nor optimizer
        state; a non-primitive value), and hands it to the worker thread: flattening the ``live``
        parts, planning, laying out, serialising the small values and copying the tensors, while
        the next step runs (``optimizer.step()`` and a buffered module's forward wait for the copy:
        ``guard``).

        ``protected``: the addresses the mutation guard protects, called after ``build``
        (:func:`~distckpt._state.guard.deferrable`; default :attr:`protected`). ``live``: the
        parts (a top-level key, or ``key.subkey`` of a dict) that hold only tensors at those
        addresses, in containers that only ``optimizer.step()`` changes (the optimizer's own
        per-parameter state dicts), called after ``build``: handed over unflattened and unchecked.
        ``rank0``: the flat keys of replicated tensors that rank 0 stores (DDP's broadcast buffers:
        rank 0's copy is the state), called after ``build``.

        Waits for the previous snapshot's background work first. Never raises for a snapshot that
        cannot be written (a full file system): a warning, and the step is skipped on this rank
        (training and the durable tier go on); its replication round still runs, so peers never wait.

        Raises:
            PackError, ValueError: the previous snapshot's state could not be serialized or
                flattened on the worker (a value ``torch.save`` refuses), raised here, at the next
                snapshot, as the durable save would raise it.
        """
        t0 = time.perf_counter()
        self.wait()
        refused, self._refused = self._refused, None
        if refused is not None:
            raise refused
        if not os.path.isdir(self.dir):
            self._recreate()
        handed = hand_over(build(), set(live()), (protected or self.protected)())
        handed.rank0 = rank0()
        # The step's CUDA work must be done before the side stream copies what it computed.
        event = torch.cuda.current_stream().record_event() if handed.cuda else None
        self._copied = threading.Event()
        self._pending = in_background(self._finish, step, handed, event)
        self.last_stall_s = time.perf_counter() - t0

    def _recreate(self) -> None:
        """The directory was removed under the running job (its snapshots are gone): make it and new
        slot files again, so the next snapshots are written (a warning says so)."""
        logger.warning("memory tier: %s was removed while the job ran; recreated (its snapshots are lost)", self.dir)
        os.makedirs(self.dir, exist_ok=True)
        for slot in [*self._own, *(s for slots in self._replica.values() for s in slots)]:
            slot.close(delete=False)
        self._own = [SlotFile(self._partial("own", self.rank, k)) for k in range(2)]
        self._replica = {s: [SlotFile(self._partial("replica", s, k)) for k in range(2)] for s in self.sources}
        self._newest = {}

    def _lay_out(
        self, step: int, planner: DefaultSavePlanner, items: list, slot: SlotFile
    ) -> tuple[SnapshotHeader, list[tuple[torch.Tensor, int, int]]]:
        """Lay out ``items`` in ``slot``, write the small values, and return the header and the
        tensors to copy as ``(tensor, offset, bytes)``."""
        data: list[tuple[Any, int, int]] = []
        rows: list[list[Any]] = []
        offset = PREAMBLE
        for item in items:
            resolved = resolve(planner, item, self._plan.blobs)
            value: bytes | torch.Tensor
            if isinstance(resolved, io.BytesIO):
                value = resolved.getvalue()
                nbytes, dtype, chunk = len(value), None, None
            else:
                value = resolved
                nbytes, dtype, chunk = value.numel() * value.element_size(), str(value.dtype), item.tensor_data
            data.append((value, offset, nbytes))
            rows.append(
                [
                    item.index.fqn,
                    _KINDS[item.type],
                    None if chunk is None else list(chunk.chunk.offsets),
                    None if chunk is None else list(chunk.chunk.sizes),
                    None if chunk is None else list(chunk.size),
                    dtype,
                    offset,
                    nbytes,
                ]
            )
            offset += -(-nbytes // ALIGN) * ALIGN
        slot.rename(self._partial("own", self.rank, self._own.index(slot)))  # no longer complete
        slot.reserve(offset + 128 * len(rows) + 4096)  # room for the header: the mapping is never redone
        tensors: list[tuple[torch.Tensor, int, int]] = []
        for value, at, nbytes in data:
            if isinstance(value, bytes):
                view = slot.view(at, nbytes)
                view[:] = value
                view.release()
            elif nbytes:
                tensors.append((value, at, nbytes))
        header = SnapshotHeader(
            self.job,
            self.gen,
            step,
            self.rank,
            self.world_size,
            self.wrapper,
            offset - PREAMBLE,
            "",
            rows,
            self.launch_id,
        )
        return header, tensors

    def wait_copied(self) -> None:
        """Block until the in-flight snapshot's tensors are copied (the mutation guard calls it before
        ``optimizer.step()`` and before the forward of a module with buffers); at once when none is."""
        copied = self._copied
        if copied is not None:
            copied.wait()

    def _finish(self, step: int, handed: Handover, event: Any) -> None:
        """The worker's part of a snapshot: plan, lay out and copy (then release the guard), seal the
        file, run the replication round."""
        slot_index: int | None = 1 - self._newest.get(self.rank, 1)
        header: SnapshotHeader | None = None
        try:
            assert slot_index is not None
            slot = self._own[slot_index]
            try:
                planner = LeanSavePlanner()
                try:
                    planner.set_up_planner(handed.state_dict, is_coordinator=self.rank == 0)
                except ValueError as e:  # DCP's flattening: the state itself is at fault
                    raise PackError(f"the state_dict of step {step} cannot be flattened: {e}") from e
                header, tensors = self._lay_out(step, planner, self._plan.items(planner, handed.rank0), slot)
                paths, flat = handed.paths, planner.mappings
                header.paths = {row[0]: list(paths.get(row[0]) or flat.get(row[0], (row[0],))) for row in header.items}
                _copy_tensors(slot, tensors, event)
            except Exception as e:  # noqa: BLE001 - the peers wait for this rank's replication round
                if isinstance(e, PackError):  # raised on the training thread at the next snapshot
                    self._refused = PackError(
                        f"memory tier: the snapshot of step {step} was skipped: {e}; make the value "
                        "one torch.save can serialize (tensors, containers, primitives) or leave it "
                        "out of the training state"
                    )
                    self._refused.__cause__ = e
                logger.warning(
                    "memory tier: snapshot of step %d skipped on rank %d: %s",
                    step,
                    self.rank,
                    e,
                    exc_info=not isinstance(e, OSError),
                )
                slot_index = None
        finally:
            if self._copied is not None:
                self._copied.set()
        length = 0
        if slot_index is not None and header is not None:
            slot = self._own[slot_index]
            view = slot.view(PREAMBLE, header.data_bytes)
            header.data_hash = data_hash(view)
            view.release()
            slot.seal(header, os.path.join(self.dir, snapshot_name(step, self.rank, self.world_size, self.gen)))
            self._newest[self.rank] = slot_index
            length = os.path.getsize(slot.path)
        if self.group is not None:
            self._replicate(slot_index, length)
        self.snapshots += 1
        if not self._reclaimed and length:
            self._reclaimed = True
            self.reclaim()

    def _replicate(self, slot_index: int | None, length: int) -> None:
        """One round: send this rank's file to each target, receive each source's into its slot."""
        meta = torch.tensor([length], dtype=torch.int64, device="cpu")  # gloo, whatever the default device
        works = []
        for t in self.targets:
            works.append(dist.isend(meta, group=self.group, group_dst=t, tag=1))
            if length and slot_index is not None:
                works.append(dist.isend(self._own[slot_index].tensor(0, length), group=self.group, group_dst=t, tag=2))
        for s in self.sources:
            size = torch.zeros(1, dtype=torch.int64, device="cpu")
            dist.recv(size, group=self.group, group_src=s, tag=1)
            if not size.item():
                continue
            k = 1 - self._newest.get(s, 1)
            slot = self._replica[s][k]
            slot.rename(self._partial("replica", s, k))
            slot.reserve(int(size.item()))
            dist.recv(slot.tensor(0, int(size.item())), group=self.group, group_src=s, tag=2)
            try:
                h = read_header(slot.path, verify=True)
            except CheckpointCorruptError as e:
                logger.warning("memory tier: replica from rank %d not kept: %s", s, e)
                continue
            slot.rename(os.path.join(self.dir, snapshot_name(h.step, h.rank, h.world_size, h.gen)))
            self._newest[s] = k
        for w in works:
            if w is not None:
                w.wait()

    def wait(self) -> None:
        """Block until the previous snapshot's background work is done; a failure there (a peer gone
        mid-replication) is logged and replication stops for this run, the own snapshots go on."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - the memory tier never stops training
            logger.warning("memory tier: background snapshot work failed on rank %d (%s); replicas stop", self.rank, e)
            self.targets, self.sources, self.group = [], [], None

    # ------------------------------------------------------------------ cleanup
    def reclaim(self) -> None:
        """Delete the snapshots other generations of this job left in this node's directory (the
        lowest rank of the node does it, after its first snapshot of this generation is complete).
        Only distckpt's own file names in this job's directory are touched."""
        if self._first_on_node:
            reclaim_dir(self.dir, keep_gen=self.gen)

    def close(self, *, free: bool = True) -> None:
        """Wait for the background work; with ``free``, delete this rank's snapshots and the replicas it
        keeps (their memory is freed), the other generations' snapshots of this job on this node and on
        every node whose memory directory this machine reaches (``{node}`` in ``memory.dir``: a node
        that never came back), then the job's directory once empty. ``free=False`` (leaving on an
        exception) keeps them for the restart. Idempotent."""
        if free:  # leaving on an exception: the round may wait on a dead peer; its daemon thread dies with us
            self.wait()
        for slot in [*self._own, *(s for slots in self._replica.values() for s in slots)]:
            slot.close(delete=free and slot.path.endswith((".snap", ".partial")))
        self._own, self._replica = [], {}
        if not free:
            return
        # Every rank of the job has deleted its own files before any rank deletes a directory: a
        # node's directory removed while a slower rank of the node still creates its slots there
        # failed that rank (found by bench_scale: a manager closed right after it was built).
        self.collective.barrier()
        try:
            if self._first_on_node:  # this generation's files elsewhere are their live owners' to delete
                for directory in sorted({self.dir, *job_dirs(self.config.dir, self.root)}):
                    freed = reclaim_dir(directory, keep_gen=self.gen)
                    if directory != self.dir and (remove_if_empty(directory) or freed):
                        logger.info(
                            "memory tier: freed %.1f MiB of this job's snapshots in %s", freed / 2**20, directory
                        )
            remove_if_empty(self.dir)  # by whichever of the node's ranks deletes its files last
        except OSError as e:  # the job's end is not failed by the memory left: `distckpt memory clean` frees it
            logger.warning("memory tier: cleaning up %s on rank %d failed: %s", self.dir, self.rank, e)


def _copy_tensors(slot: SlotFile, data: list[tuple[torch.Tensor, int, int]], event: Any) -> None:
    """Copy ``(tensor, offset, bytes)`` into ``slot``; CUDA tensors on a side stream once ``event``
    (recorded on the training stream at the snapshot) has passed, so the training stream goes on."""
    stream = None
    if event is not None:
        stream = torch.cuda.Stream(device=event.device if hasattr(event, "device") else None)
        stream.wait_event(event)
    with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for value, at, nbytes in data:
            slot.tensor(at, nbytes).view(value.dtype).view(value.shape).copy_(value)
    if stream is not None:
        stream.synchronize()
