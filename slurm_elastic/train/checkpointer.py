"""LayerCheckpointer: snapshot each layer as the next forward pass reaches it, write it in the background."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch import nn

from slurm_elastic.errors import CheckpointError
from slurm_elastic.train.store import CheckpointStore, FileRecord, TensorSource

log = logging.getLogger(__name__)

DEFAULT_GROUP_BYTES = 64 << 20
_PY_SCALAR_TAGS = {bool: "b", int: "i", float: "f"}


@dataclass(frozen=True, slots=True)
class LayerSlot:
    """One hooked layer and the state it owns (names relative to the unwrapped model)."""

    index: int
    name: str
    params: tuple[tuple[str, nn.Parameter], ...]
    buffers: tuple[tuple[str, nn.Module, str], ...]   # (fqn, owning module, attribute)
    nbytes: int


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Consecutive layers written as one file by one rank."""

    index: int
    slots: tuple[int, ...]
    owner: int
    nbytes: int

    @property
    def file_name(self) -> str:
        return f"group-{self.index:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class FinishedSnapshot:
    """What the background writer reports for one step on this rank."""

    step: int
    ok: bool
    records: tuple[FileRecord, ...]
    error: str | None
    stall_s: float           # time the training thread spent on this snapshot (hooks + waits)
    write_s: float
    copied_bytes: int = 0    # live host state the writer had not read when optimizer.step() came


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """This rank's whole model and optimizer state as of the last step boundary, for a
    just-in-time checkpoint: one tensor mapping per layer group, in file layout."""

    replica: bool            # a full copy (DDP); False for a shard (FSDP)
    clean: bool              # nothing changed it since the boundary (else `unclean` says what)
    unclean: str | None
    groups: dict[int, dict[str, torch.Tensor]]
    digest: str              # xxh3-128 over every key, dtype, shape and byte, in key order
    # The same over what DDP keeps equal on every replica: parameters and optimizer state. Not the
    # buffers: DDP copies rank 0's into the others at the start of each forward (broadcast_buffers),
    # so after it every rank's BatchNorm statistics have moved by its own batch and differ.
    replicated_digest: str = ""


@dataclass
class _Snapshot:
    step: int
    pending: set[int]
    copies: dict[int, Future] = field(default_factory=dict)
    group_left: dict[int, int] = field(default_factory=dict)
    records: list[FileRecord] = field(default_factory=list)
    error: str | None = None
    stall_s: float = 0.0
    write_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    # Host tensors the writer reads in place: key -> (tensor, its version counter at capture).
    # `freeze` (before optimizer.step) replaces the ones not read yet by copies. The lock
    # guards these fields only; the writer copies a chunk outside it, with `reading` set,
    # so hooks never wait for a copy and `freeze` waits for at most one chunk.
    lock: threading.Condition = field(default_factory=threading.Condition)
    live: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    read: set[str] = field(default_factory=set)
    reading: bool = False
    copied_bytes: int = 0
    torn: str | None = None

    def freeze(self) -> None:
        """The optimizer is about to update the live state: copy what the writer has not read,
        and let no chunk copy from live memory still be running when this returns."""
        with self.lock:
            for key, (t, version) in self.live.items():
                if key in self.read:
                    continue
                if t._version != version and self.torn is None:
                    self.torn = _torn_message(key)
                self.frozen[key] = t.clone()     # reading alongside the writer's copy is fine
                self.copied_bytes += t.numel() * t.element_size()
            self.live.clear()
            while self.reading:
                self.lock.wait()


def _torn_message(key: str) -> str:
    return (f"{key} was changed in place outside optimizer.step() while its checkpoint was taken; "
            f"the checkpointer only knows optimizer.step() as the point where state changes")


class _SnapshotSource(TensorSource):
    """A group file's tensors: live host state is read in place until `freeze` copies it."""

    def __init__(self, snap: _Snapshot, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.snap = snap

    @contextmanager
    def hold(self, key: str) -> Iterator[torch.Tensor]:
        snap = self.snap
        with snap.lock:
            if snap.torn is not None:
                raise CheckpointError(snap.torn)
            entry = snap.live.get(key)
            if entry is None:
                source = snap.frozen.get(key, self._tensors[key])
            else:
                self._check_version(key, *entry)
                source = entry[0]
                snap.reading = True
        if entry is None:
            yield source
            return
        try:
            yield source
        finally:
            with snap.lock:
                snap.reading = False
                snap.lock.notify_all()
                # Changed while copied: only something other than the optimizer can do that,
                # since freeze() holds optimizer.step() back until this copy is done.
                self._check_version(key, *entry)

    def _check_version(self, key: str, t: torch.Tensor, version: int) -> None:
        if t._version != version:
            self.snap.torn = self.snap.torn or _torn_message(key)
            raise CheckpointError(self.snap.torn)

    def release(self, key: str) -> None:
        with self.snap.lock:
            self.snap.read.add(key)
            self.snap.frozen.pop(key, None)


class _Hook:
    """A hook of this checkpointer on the user's optimizer. Pickled or deep-copied with it, it becomes a
    hook that does nothing: the copy is not the optimizer this checkpointer saves, and a closure could
    not be pickled at all."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_DetachedHook, ())


class _DetachedHook:
    """What a _Hook becomes in a saved or copied optimizer: nothing."""

    def __call__(self, *args: Any) -> None:
        return None


class LayerCheckpointer:
    """Forward pre-hooks that take each layer's post-step state, and a writer thread.

    After optimizer.step() of step t, `arm(t)` marks every layer this rank
    owns as pending. The forward pass of step t+1 reaches each layer; its
    pre-hook takes the layer's parameters, buffers and optimizer state
    (unchanged since step t) and hands full layer groups to the writer
    thread. On GPU the hook starts a non-blocking copy to pinned host memory
    on a side stream. On CPU the state already is host memory: the writer
    reads it in place (copy-on-write), and optimizer.step() of t+1, through
    a step pre-hook, copies only what the writer has not read yet. So
    optimizer.step() waits for copies still outstanding, never for writes,
    and a writer that keeps up costs training no copy at all. Each
    data-parallel rank owns some layer groups, so ranks write in parallel
    and every byte is written once.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, store: CheckpointStore, *,
                 rank: int = 0, world_size: int = 1, layers: Sequence[nn.Module] | None = None,
                 group_bytes: int = DEFAULT_GROUP_BYTES,
                 before_write: Callable[[int, LayerGroup], None] | None = None) -> None:
        self.model = unwrap(model)
        self.optimizer = optimizer
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.slots = _build_slots(self.model, layers)
        self.groups = _build_groups(self.slots, world_size, group_bytes)
        self._group_of = {s: g.index for g in self.groups for s in g.slots}
        # FSDP (DTensor parameters): every rank holds a different shard of every
        # layer, so every rank writes every group, its own shard of it.
        self.sharded = any(_is_dtensor(p) for s in self.slots for _, p in s.params)
        self._mine = {s for g in self.groups if self._owns(g) for s in g.slots}
        self._check_optimizer()
        self._before_write = before_write   # test seam: runs in the writer thread before each file
        self._snap: _Snapshot | None = None
        self._cuda_stream: Any = None
        self._work: queue.Queue[tuple[_Snapshot, LayerGroup] | tuple[_Snapshot, None] | None] = queue.Queue()
        self._finished: queue.Queue[FinishedSnapshot] = queue.Queue()
        self._in_flight = 0
        self._halted = False
        # State tensors and their version counters as of the last optimizer step, and the
        # buffers then: the forward pass after it changes BatchNorm statistics in place.
        self._boundary_versions: list[tuple[str, torch.Tensor, int]] = []
        self._boundary_buffers: dict[str, torch.Tensor] = {}
        self._boundary_event: Any = None
        self._writer = threading.Thread(target=self._write_loop, name="ckpt-writer", daemon=True)
        self._writer.start()
        # One process-wide forward pre-hook, not one on each layer: a hook on the module is pickled with
        # it, and `torch.load` of a `torch.save(model)` (weights_only, torch's default) refuses any class
        # it does not know, ours included (seen converting word_language_model: its final test crashed).
        self._slots_of: dict[int, tuple[nn.Module, list[int]]] = {}
        for s in self.slots:
            module = _slot_module(self.model, s)
            if s.index in self._mine and module is not None:
                self._slots_of.setdefault(id(module), (module, []))[1].append(s.index)
        self._handles = [nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook)] \
            if self._slots_of else []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(_Hook(lambda *_: self.wait_for_copies())))

    def _owns(self, group: LayerGroup) -> bool:
        return self.sharded or group.owner == self.rank

    def file_name(self, group: LayerGroup) -> str:
        return f"group-{group.index:05d}-rank-{self.rank:05d}.safetensors" if self.sharded else group.file_name

    # -- the training thread's side ------------------------------------------------------
    @property
    def armed(self) -> bool:
        return self._snap is not None

    @property
    def pending_layers(self) -> list[str]:
        """Names of layers of the armed snapshot that no forward pass has reached yet."""
        snap = self._snap
        return [] if snap is None else [self.slots[s].name for s in sorted(snap.pending)]

    @property
    def in_flight(self) -> int:
        """Snapshots handed to the writer and not yet reported by `poll`."""
        return self._in_flight

    def arm(self, step: int) -> None:
        """Snapshot the state as it is now (after optimizer.step of `step`) during the next forward pass."""
        if self._snap is not None:
            raise CheckpointError(f"a snapshot of step {self._snap.step} is still being taken")
        t0 = time.monotonic()
        self.store.ensure_job_dir()
        self.store.begin_step(step)
        snap = _Snapshot(step=step, pending=set(self._mine))
        for g in self.groups:
            if self._owns(g):
                snap.group_left[g.index] = len(g.slots)
        self._snap = snap
        self._in_flight += 1
        # Layers without a hook (parameters held by a container, not a layer) are
        # taken now: nothing changes them before the next optimizer.step().
        for s in list(snap.pending):
            if _slot_module(self.model, self.slots[s]) is None:
                self._capture(snap, s)
        if not snap.group_left:
            self._work.put((snap, None))   # this rank owns nothing: report an empty success
            self._snap = None
        snap.stall_s += time.monotonic() - t0

    def wait_for_copies(self) -> None:
        """Runs before optimizer.step(): take layers the forward did not reach, finish the
        device copies, and copy the host state the writer has not read yet."""
        snap = self._take_rest()
        if snap is not None:
            t0 = time.monotonic()
            snap.freeze()
            snap.stall_s += time.monotonic() - t0

    def _take_rest(self) -> _Snapshot | None:
        snap = self._snap
        if snap is None:
            return None
        t0 = time.monotonic()
        for s in sorted(snap.pending):
            self._capture(snap, s)
        for fut in snap.copies.values():
            fut.result()
        self._snap = None
        snap.stall_s += time.monotonic() - t0
        return snap

    def poll(self) -> list[FinishedSnapshot]:
        """Snapshots whose files are all written (or failed) since the last call."""
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def drain(self) -> list[FinishedSnapshot]:
        """Block until every armed snapshot is written. No copy-on-write: nothing can
        step the optimizer while the training thread waits here."""
        self._take_rest()
        out = []
        while self._in_flight > len(out):
            out.append(self._finished.get())
        self._in_flight -= len(out)
        return out

    # -- just-in-time checkpoint (a peer is lost) ------------------------------------------
    def mark_boundary(self) -> None:
        """Right after optimizer.step(): remember what the state is, so `replica_state` can
        tell whether it is still that state and return it as of this point.

        Costs a walk over the parameters (no copy) plus a copy of the persistent
        buffers, which are small next to the parameters in the usual models.
        """
        versions: list[tuple[str, torch.Tensor, int]] = []
        buffers: dict[str, torch.Tensor] = {}
        for s in self.slots:
            for fqn, p in s.params:
                versions.append(("param/" + fqn, p, p._version))
                state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        versions.append((f"optim/{fqn}/{key}", value, value._version))
            for fqn, module, attr in s.buffers:
                buf = module._buffers.get(attr)
                if buf is not None:
                    buffers["buffer/" + fqn] = buf.detach().clone()
        self._boundary_versions = versions
        self._boundary_buffers = buffers
        if versions and versions[0][1].device.type == "cuda":
            # What a peer-loss handler copies must be the state these kernels produce, not
            # wait for the collectives queued after them (which may never finish).
            self._boundary_event = torch.cuda.Event()
            self._boundary_event.record()

    def replica_state(self) -> ReplicaState:
        """The state as of the last `mark_boundary`, read from live memory (nothing may step
        the optimizer meanwhile: the session holds its state lock)."""
        if self.sharded:
            return ReplicaState(False, False, "this rank holds a shard (FSDP), not a replica", {}, "")
        unclean = next((f"{key} changed since the last optimizer step" for key, t, v in self._boundary_versions
                        if t._version != v), None)
        # On a GPU (not exercised on the CPU-only development machine) the copies run on a
        # stream of their own that waits for the step boundary only.
        stream = None
        if self._boundary_event is not None:
            stream = torch.cuda.Stream()
            stream.wait_event(self._boundary_event)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            groups = self._replica_groups()
        digest = state_digest(kv for tensors in groups.values() for kv in tensors.items())
        replicated = state_digest(kv for tensors in groups.values() for kv in tensors.items()
                                  if not kv[0].startswith("buffer/"))
        return ReplicaState(True, unclean is None, unclean, groups, digest, replicated)

    def _replica_groups(self) -> dict[int, dict[str, torch.Tensor]]:
        groups: dict[int, dict[str, torch.Tensor]] = {}
        for g in self.groups:
            tensors: dict[str, torch.Tensor] = {}
            for index in g.slots:
                slot = self.slots[index]
                for fqn, _module, _attr in slot.buffers:
                    if "buffer/" + fqn in self._boundary_buffers:
                        tensors["buffer/" + fqn] = _host(self._boundary_buffers["buffer/" + fqn])
                for fqn, p in slot.params:
                    tensors["param/" + fqn] = _host(p.detach())
                    state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            tensors[f"optim/{fqn}/{key}"] = _host(value.detach())
                        elif type(value) in _PY_SCALAR_TAGS:
                            tensors[f"optimpy/{fqn}/{key}:{_PY_SCALAR_TAGS[type(value)]}"] = _encode_scalar(value)
            groups[g.index] = tensors
        return groups

    def halt_writer(self, timeout_s: float) -> bool:
        """Let the writer finish the file it is on and write nothing after it (snapshots still
        queued are dropped): the just-in-time checkpoint may reuse their step directory."""
        self._halted = True
        done = threading.Event()
        self._work.put(done)   # type: ignore[arg-type]
        return done.wait(timeout_s)

    def write_replica(self, step: int, state: ReplicaState, *, rank: int) -> list[FileRecord]:
        """Write every group of `state` as step `step`'s files, from this one rank."""
        self.store.begin_step(step)
        return [self.store.write_tensors(step, g.file_name, state.groups[g.index], rank=rank) for g in self.groups]

    def close(self, *, wait: bool = True) -> None:
        """Remove the hooks and end the writer (wait=False: without waiting for a file it is still on)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._work.put(None)
        if wait:
            self._writer.join()

    # -- capture ---------------------------------------------------------------------------
    def _forward_pre_hook(self, module: nn.Module, _args: Any) -> None:
        """Called before every module's forward in the process: takes the state of this model's layers."""
        mine = self._slots_of.get(id(module))
        snap = self._snap
        if mine is None or mine[0] is not module or snap is None:
            return
        for slot in mine[1]:
            if slot in snap.pending:
                t0 = time.monotonic()
                self._capture(snap, slot)
                snap.stall_s += time.monotonic() - t0

    def _capture(self, snap: _Snapshot, slot_index: int) -> None:
        snap.pending.discard(slot_index)
        slot = self.slots[slot_index]
        # Buffers are copied here, synchronously: this layer's forward may update
        # them (BatchNorm running stats) right after the hook returns.
        eager: dict[str, torch.Tensor] = {}
        for fqn, module, attr in slot.buffers:
            buf = module._buffers.get(attr)
            if buf is not None:
                eager["buffer/" + fqn] = _host_copy_now(buf)
        live: dict[str, torch.Tensor] = {}
        for fqn, p in slot.params:
            _put_local(live, "param/" + fqn, p.detach())
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    _put_local(live, f"optim/{fqn}/{key}", value.detach())
                elif type(value) in _PY_SCALAR_TAGS:
                    eager[f"optimpy/{fqn}/{key}:{_PY_SCALAR_TAGS[type(value)]}"] = _encode_scalar(value)
                else:
                    raise CheckpointError(f"optimizer state {key!r} of {fqn} is a {type(value).__name__}; "
                                          f"only tensors and numbers can be checkpointed")
        snap.copies[slot_index] = self._take(snap, live, eager)
        g = self._group_of[slot_index]
        snap.group_left[g] -= 1
        if snap.group_left[g] == 0:
            self._work.put((snap, self.groups[g]))

    def _take(self, snap: _Snapshot, live: dict[str, torch.Tensor], done: dict[str, torch.Tensor]) -> Future:
        if any(t.device.type == "cuda" for t in live.values()):
            return self._copy_cuda(live, done)
        # Host state: the writer reads it where it is; freeze() copies what is left of it
        # when optimizer.step() comes. A non-contiguous tensor is copied now (rare).
        out = dict(done)
        with snap.lock:
            for k, t in live.items():
                if not t.is_contiguous():
                    out[k] = t.contiguous()
                    continue
                snap.live[k] = (t, t._version)
                out[k] = t
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def _copy_cuda(self, live: dict[str, torch.Tensor], done: dict[str, torch.Tensor]) -> Future:
        # Not exercised on the CPU-only development machine; follows the usual
        # side-stream pattern: the copy waits for the compute stream, the host
        # buffers are pinned, and an event says when they are valid.
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        stream = self._cuda_stream
        stream.wait_stream(torch.cuda.current_stream())
        out = dict(done)
        with torch.cuda.stream(stream):
            for k, t in live.items():
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                dst.copy_(t, non_blocking=True)
                t.record_stream(stream)
                out[k] = dst
            event = torch.cuda.Event()
            event.record(stream)
        def finish() -> dict[str, torch.Tensor]:
            event.synchronize()
            return out
        return _LazyFuture(finish)

    # -- the writer thread ---------------------------------------------------------------------
    def _write_loop(self) -> None:
        owned = sum(1 for g in self.groups if self._owns(g))
        left: dict[int, int] = {}
        while True:
            item = self._work.get()
            if item is None:
                return
            if isinstance(item, threading.Event):   # halt_writer's marker: all before it is done
                item.set()
                continue
            if self._halted:
                continue
            snap, group = item
            if group is None:
                self._finished.put(FinishedSnapshot(snap.step, True, (), None, snap.stall_s, 0.0))
                continue
            left.setdefault(id(snap), owned)
            t0 = time.monotonic()
            if snap.error is None:
                try:
                    tensors: dict[str, torch.Tensor] = {}
                    for s in group.slots:
                        tensors.update(snap.copies[s].result())
                    if self._before_write is not None:
                        self._before_write(snap.step, group)
                    source = _SnapshotSource(snap, tensors)
                    snap.records.append(self.store.write_tensors(snap.step, self.file_name(group), source,
                                                                 rank=self.rank))
                except Exception as exc:   # a full disk must not stop training: report, keep going
                    snap.error = f"{type(exc).__name__}: {exc}"
                    log.error("checkpoint of step %d: writing %s failed: %s", snap.step, self.file_name(group), exc)
            snap.write_s += time.monotonic() - t0
            left[id(snap)] -= 1
            if left[id(snap)] == 0:
                del left[id(snap)]
                with snap.lock:
                    snap.live.clear()       # the writer is done: drop the references to live state
                    snap.frozen.clear()
                self._finished.put(FinishedSnapshot(snap.step, snap.error is None, tuple(snap.records),
                                                    snap.error, snap.stall_s, snap.write_s, snap.copied_bytes))

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        known = {id(p) for s in self.slots for _, p in s.params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    raise CheckpointError("the optimizer holds a parameter that is not part of the model; "
                                          "build the optimizer from model.parameters()")


class _LazyFuture(Future):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self._fn = fn
        self._lock2 = threading.Lock()

    def result(self, timeout: float | None = None) -> Any:
        with self._lock2:
            if not self.done():
                self.set_result(self._fn())
        return super().result(timeout)


# -- layout ------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel (or similar `.module` wrappers)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and isinstance(model, _WRAPPERS) else model


_WRAPPERS: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def _build_slots(model: nn.Module, layers: Sequence[nn.Module] | None) -> list[LayerSlot]:
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=True)}
    if layers is None:
        chosen = [m for _, m in model.named_modules()
                  if next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None]
        chosen = [m for m in chosen if m is not model] or [model]
    else:
        chosen = list(layers)
        for m in chosen:
            if id(m) not in names:
                raise CheckpointError(f"layer {type(m).__name__} is not a submodule of the model")
    claimed: set[int] = set()
    slots: list[LayerSlot] = []

    def claim(module: nn.Module, name: str, recurse: bool) -> LayerSlot | None:
        params, buffers, nbytes = [], [], 0
        for sub_name, sub in (module.named_modules() if recurse else [("", module)]):
            prefix = ".".join(x for x in (name, sub_name) if x)
            for attr, p in sub._parameters.items():
                if p is None or id(p) in claimed:
                    continue
                claimed.add(id(p))
                params.append((f"{prefix}.{attr}" if prefix else attr, p))
                nbytes += p.numel() * p.element_size()
            for attr, b in sub._buffers.items():
                if b is None or id(b) in claimed or attr in sub._non_persistent_buffers_set:
                    continue
                claimed.add(id(b))
                buffers.append((f"{prefix}.{attr}" if prefix else attr, sub, attr))
                nbytes += b.numel() * b.element_size()
        if not params and not buffers:
            return None
        return LayerSlot(index=len(slots), name=name, params=tuple(params), buffers=tuple(buffers), nbytes=nbytes)

    for m in chosen:
        slot = claim(m, names[id(m)], recurse=True)
        if slot is not None:
            slots.append(slot)
    # Whatever no chosen layer holds (a root-level embedding table, a container's
    # own parameter) forms a "rest" slot without a hook, taken at arm time.
    rest = claim(model, "", recurse=True)
    if rest is not None:
        slots.append(LayerSlot(index=rest.index, name="<rest>", params=rest.params, buffers=rest.buffers,
                               nbytes=rest.nbytes))
    return slots


def _slot_module(model: nn.Module, slot: LayerSlot) -> nn.Module | None:
    if slot.name == "<rest>":
        return None
    return model.get_submodule(slot.name) if slot.name else model


def _build_groups(slots: Sequence[LayerSlot], world_size: int, group_bytes: int) -> list[LayerGroup]:
    """Pack consecutive layers into files of about `group_bytes`, then spread files over ranks by size."""
    packs: list[list[LayerSlot]] = []
    size = 0
    for s in slots:
        if not packs or size >= group_bytes:
            packs.append([])
            size = 0
        packs[-1].append(s)
        size += s.nbytes
    # With fewer files than ranks some ranks would idle; split packs while that helps.
    while len(packs) < world_size and any(len(p) > 1 for p in packs):
        big = max(range(len(packs)), key=lambda i: (sum(s.nbytes for s in packs[i]) if len(packs[i]) > 1 else -1))
        p = packs.pop(big)
        half = len(p) // 2
        packs[big:big] = [p[:half], p[half:]]
    sizes = [sum(s.nbytes for s in p) for p in packs]
    load = [0] * world_size
    owners = [0] * len(packs)
    for i in sorted(range(len(packs)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return [LayerGroup(index=i, slots=tuple(s.index for s in p), owner=owners[i], nbytes=sizes[i])
            for i, p in enumerate(packs)]


def state_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 of checkpoint-keyed host tensors: key, dtype, shape and bytes, in key order.
    Replicas of one step have the same digest; so has that step's checkpoint, read back."""
    h = xxhash.xxh3_128()
    for key, t in sorted(tensors, key=lambda kv: kv[0]):
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """Names, shapes and dtypes of every parameter and persistent buffer: two models that
    could exchange checkpoints have the same fingerprint."""
    import hashlib

    model = unwrap(model)
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


SHARD_SUFFIX = "#shard"


def _is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _put_local(out: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> None:
    """A DTensor contributes its local shard (FSDP shards dim 0 in rank order), marked as such."""
    if _is_dtensor(t):
        placements = t.placements
        if len(placements) != 1 or not placements[0].is_shard(0):
            raise CheckpointError(f"{key}: only FSDP's dim-0 sharding is supported, got {placements}")
        out[key + SHARD_SUFFIX] = t.to_local()
    else:
        out[key] = t


def merge_shards(per_rank: Sequence[Iterable[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors from the files of every rank (in rank order): dim-0 shards are concatenated,
    replicated tensors (a scalar step count, buffers) are taken from the first rank."""
    shards: dict[str, list[torch.Tensor]] = {}
    for items in per_rank:
        for key, t in items:
            shards.setdefault(key, []).append(t)
    for key, parts in shards.items():
        if key.endswith(SHARD_SUFFIX):
            yield key[: -len(SHARD_SUFFIX)], torch.cat(parts, dim=0)
        else:
            yield key, parts[0]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.to("cpu")


def _host_copy_now(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _encode_scalar(value: bool | float) -> torch.Tensor:
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(value, dtype=torch.float64)


def decode_state(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                      dict[str, dict[str, Any]]]:
    """Split a checkpoint's tensors into parameters, buffers and per-parameter optimizer state."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for key, t in tensors:
        kind, _, rest = key.partition("/")
        if kind == "param":
            params[rest] = t
        elif kind == "buffer":
            buffers[rest] = t
        elif kind == "optim":
            fqn, _, skey = rest.rpartition("/")
            optim.setdefault(fqn, {})[skey] = t
        elif kind == "optimpy":
            fqn, _, tagged = rest.rpartition("/")
            skey, _, tag = tagged.rpartition(":")
            value = {"b": bool, "i": int, "f": float}.get(tag)
            if value is None:
                raise CheckpointError(f"unknown scalar tag in checkpoint key {key!r}")
            optim.setdefault(fqn, {})[skey] = value(t.item())
        else:
            raise CheckpointError(f"unexpected key {key!r} in a checkpoint file (foreign checkpoint?)")
    return params, buffers, optim


def load_into(model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: Iterable[tuple[str, torch.Tensor]],
              param_groups: Sequence[Mapping[str, Any]] | None) -> None:
    """Copy a checkpoint's state into the live model and optimizer, refusing anything that does not fit."""
    model = unwrap(model)
    params, buffers, optim = decode_state(tensors)
    live_params = dict(model.named_parameters())
    live_buffers = {n: b for n, b in model.named_buffers()}
    persistent = set(model.state_dict().keys())
    missing = [n for n in live_params if n not in params] + \
              [n for n in live_buffers if n in persistent and n not in buffers]
    extra = [n for n in params if n not in live_params] + [n for n in buffers if n not in live_buffers]
    if missing or extra:
        raise CheckpointError(f"checkpoint does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for n, p in live_params.items():
            _copy_checked(n, p, params[n])
        for n, b in live_buffers.items():
            if n in buffers:
                _copy_checked(n, b, buffers[n])
    if optimizer is None:
        return
    by_id = {id(p): n for n, p in live_params.items()}
    if param_groups is not None:
        if len(param_groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint has {len(param_groups)} optimizer parameter groups, "
                                  f"the optimizer {len(optimizer.param_groups)}")
        for saved, group in zip(param_groups, optimizer.param_groups):
            names = [by_id[id(p)] for p in group["params"]]
            if list(saved.get("params", names)) != names:
                raise CheckpointError("optimizer parameter groups hold different parameters than the checkpoint's")
            for k, v in saved.items():
                if k != "params":
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for p in group["params"]:
            saved_state = optim.get(by_id[id(p)])
            if saved_state:
                optimizer.state[p] = {k: _state_value(p, v) for k, v in saved_state.items()}


def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise CheckpointError(f"checkpoint tensor {name} is {tuple(src.shape)} {src.dtype}, "
                              f"the model has {tuple(dst.shape)} {dst.dtype}")
    if _is_dtensor(dst):
        dst.to_local().copy_(_local_slice(dst, src))
    else:
        dst.copy_(src)


def _local_slice(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` under `like`'s (DTensor) sharding - at the current world size."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return full[index]


def _state_value(p: torch.Tensor, v: Any) -> Any:
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    if _is_dtensor(p) and tuple(v.shape) == tuple(p.shape):
        from torch.distributed.tensor import DTensor

        local = _local_slice(p, v).to(p.to_local().device).contiguous()
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return v.to(p.device)


def optimizer_groups_json(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Hyper-parameters of every parameter group, as JSON, with parameters named by fqn."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    out = []
    for group in optimizer.param_groups:
        entry: dict[str, Any] = {"params": [names[id(p)] for p in group["params"]]}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if v is None or isinstance(v, (bool, int, float, str, list)):
                entry[k] = v
            else:
                log.warning("optimizer hyper-parameter %s (%s) is not JSON; not checkpointed", k, type(v).__name__)
        out.append(entry)
    return out
