"""ElasticSession: the training loop's one object - environment, process group, restore, signal, commit, exit."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal as signal_module
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic import settings
from slurm_elastic.goodput import GradientNoise
from slurm_elastic.errors import CheckpointError, ElasticError, SpecError
from slurm_elastic.spec import BatchRange, parse_batch_range
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train import peers, regroup, rendezvous, start_line
from slurm_elastic.train.checkpointer import (
    DEFAULT_GROUP_BYTES,
    FinishedSnapshot,
    LayerCheckpointer,
    ReplicaState,
    load_into,
    merge_shards,
    model_fingerprint,
    optimizer_groups_json,
)
from slurm_elastic.train.connections import GroupConnections
from slurm_elastic.train.environment import JobEnvironment, export_torch_env, group_backend
from slurm_elastic.train.noise import DEFAULT_EVERY_STEPS, DEFAULT_SMOOTHING, GradientNoiseEstimator, NoiseEstimate, has_dtensor
from slurm_elastic.train.rng import RawRng, capture_rng, capture_rng_raw, restore_rng, rng_json
from slurm_elastic.train.sampler import (
    BatchGeometry,
    BatchGeometryError,
    ElasticSampler,
    adaptive_world_sizes,
    choose_batch,
    valid_world_sizes,
)
from slurm_elastic.train.incarnation import Incarnation
from slurm_elastic.train.store import DEFAULT_CHECKSUM, CheckpointStore

log = logging.getLogger(__name__)


class PeerLost(ElasticError):
    """A collective failed or timed out: another rank is gone."""


class ElasticSession:
    """Use as `with ElasticSession(...) as s:`; call `attach`, then per step `micro_batches` and `optimizer_step`.

    Ends the process with REQUEUE_EXIT_CODE after a signalled checkpoint,
    PEER_LOST_EXIT_CODE when a peer is lost (a collective fails, or a peer's
    heartbeat stops for `liveness_timeout_s`), GEOMETRY_EXIT_CODE when the
    global batch cannot be split over this world size.

    On peer loss the survivors commit a just-in-time checkpoint of the last
    step all of them completed, when one of them holds a full replica (DDP),
    and report the lost ranks and nodes (protocol.PeerLostReport); with
    `jit=False` they only report.
    """

    def __init__(self, *, ckpt_dir: str | None = None, job_key: str | None = None, signal: str | None = None,
                 every_steps: int | None = None, every_seconds: float | None = None, keep: int = 2,
                 checksum: str = DEFAULT_CHECKSUM,
                 wait_for_previous: bool = False, fast_exit: bool = True,
                 backend: str | None = None, timeout_s: float = 300.0, metrics_every_s: float = 5.0,
                 env: JobEnvironment | None = None, jit: bool = True,
                 heartbeat_s: float = peers.DEFAULT_INTERVAL_S, liveness_timeout_s: float = peers.DEFAULT_TIMEOUT_S,
                 jit_deadline_s: float = 120.0, batch: BatchRange | str | None = None,
                 measure_noise: bool = True, noise_smoothing: float = DEFAULT_SMOOTHING,
                 noise_every_steps: int = DEFAULT_EVERY_STEPS, total_steps: int | None = None) -> None:
        root = ckpt_dir or settings.CKPT_DIR.read()
        if not root:
            raise ElasticError(f"no checkpoint directory: pass ckpt_dir or set {protocol.CKPT_DIR_ENV} "
                               f"(the ckpt= field of the job's elastic spec)")
        self.env = env or JobEnvironment.from_env()
        self.ckpt_root = os.path.abspath(root)
        self.job_key = protocol.job_key(job_key or settings.JOB_KEY.read() or self.env.job_id)
        self.job_dir = protocol.job_dir(self.ckpt_root, self.job_key)
        self.signal_name = protocol.signal_name(signal)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        # The run's length, in the metrics rows: the controller ranks jobs by the work they have left
        # (docs/controller.md). None: not declared.
        self.total_steps = total_steps
        # Periodic snapshots that fall due while the previous one is still being
        # written are skipped (no stall) unless wait_for_previous, which blocks
        # until it is committed (deterministic checkpoint steps).
        self.wait_for_previous = wait_for_previous
        # After a signalled stop the process has nothing left to do; interpreter
        # finalisation of torch & co. took ~8 s on a loaded node, so leave at once.
        self.fast_exit = fast_exit
        self.backend = backend
        self.timeout_s = timeout_s
        self.metrics_every_s = metrics_every_s
        # The writer identity (fencing token) of this incarnation, from the environment read once above.
        self.store = CheckpointStore(self.job_dir, keep=keep, checksum=checksum,
                                     writer=Incarnation.of(self.env.job_id, self.env.restart_count))
        self.step = 0
        self._steps_here = 0                       # optimizer steps taken in this process
        self._replica_sum: int | None = None       # the weights' check the next agreement compares
        self.restored_step: int | None = None
        self.user_state: dict[str, Any] = {}   # JSON-able extras saved in the manifest
        self._signalled = False
        self._signalled_by = ""                 # the signal's name, for the log (the checkpoint signal or TERM)
        self._exit_after_snapshot = False
        self._owns_group = False
        self._connections = GroupConnections({})       # the sockets of the group this session formed
        self._old_handler: Any = None
        self._old_term_handler: Any = None
        self._old_mask: set[signal_module.Signals] = set()
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._ckpt: LayerCheckpointer | None = None
        self.geometry: BatchGeometry | None = None
        self.sampler: ElasticSampler | None = None
        self._armed_meta: list[dict[str, Any]] = []    # per armed snapshot, in order
        self._finished: list[FinishedSnapshot] = []
        self._committed = 0                             # snapshots settled (committed or dropped)
        self._last_arm_time = time.monotonic()
        self._metrics_mark = (time.monotonic(), 0)
        # This session's ranks went on in their processes (a regroup): its first row says so, and the time
        # since the last row is then the in-place path's cost, which the controller keeps apart from a relaunch's.
        self._resumed_in_place = self.env.generation > 0
        self.stall_s_total = 0.0
        self.last_committed_step: int | None = None
        self.jit = jit
        self.heartbeat_s = heartbeat_s
        self.liveness_timeout_s = liveness_timeout_s
        self.jit_deadline_s = jit_deadline_s
        self.run_dir = peers.RunDirectory(self.job_dir, self.env.job_id, self.env.restart_count, self.env.step_id,
                                          self.env.generation)
        if regroup.running():
            regroup.session_started(self.run_dir.path, self.env.rank)
        self._liveness: peers.Liveness | None = None
        # Held while the optimizer changes the state (and while rank 0 commits): a peer-loss
        # handler takes it and keeps it, so the state it reads is a whole step's.
        self._state_lock = threading.Lock()
        self._boundary_rng: dict[int, RawRng] = {}     # the last two step boundaries' generators
        self._boundary_user_state: Any = {}            # user_state as the last step boundary left it
        self._peer_loss_lock = threading.Lock()
        # Under slurm_elastic.train.regroup the survivors of a peer loss may go on in their processes;
        # whichever thread handles the loss first, the training thread is the one that can unwind the loop.
        self._keep_ranks = regroup.running() and self.env.launcher == "slurm"
        self._loss_handled = threading.Event()         # the first handler's agreement (and commit) is done
        self._training_thread_here = threading.Event()  # the training thread reached the loss too
        self._decision: dict[str, Any] | None = None
        self.regrouped = False                          # this session was left for a re-formed group
        # Adaptive batch (opt-in): the range from the argument, else from the wrapper's variable.
        text = batch if batch is not None else settings.BATCH.read()
        try:
            self.batch_range = parse_batch_range(text) if isinstance(text, str) else text
        except SpecError as exc:
            raise ElasticError(f"{exc} (from {'batch=' if batch is not None else protocol.BATCH_ENV})") from None
        self.base_batch: int | None = None          # the batch the learning rate is tuned for (attach's global_batch)
        self.lr_gain = 1.0                          # AdaScale's gain of this start's batch (1 at a fixed batch)
        # Where the current start is in the sample stream: the batch may differ from the checkpoint's.
        self._stream_mark = (0, 0)                  # (step, samples consumed before it)
        self.measure_noise = measure_noise
        self.noise_smoothing = noise_smoothing
        self.noise_every_steps = noise_every_steps
        self.noise: GradientNoiseEstimator | None = None
        self.restored_noise: NoiseEstimate | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ElasticSession:
        sig = getattr(signal_module, "SIG" + self.signal_name)
        # Slurm ends a job's tasks with SIGTERM first (a preemption's GraceTime where the site does not
        # send the job's own signal - seen on 22.05 -, scancel, a limit without a warning), SIGKILL
        # KillWait or GraceTime later: the ranks commit on it as on the checkpoint signal. One that came
        # while the survivors of a lost peer moved to this session was held for it (train/regroup.py).
        self._old_handler, held = regroup.take_signal(sig, self._on_signal)
        self._old_term_handler, held_term = regroup.take_signal(signal_module.SIGTERM, self._on_signal)
        if held or held_term:
            self._signalled, self._signalled_by = True, held or held_term
        # The job templates start the ranks with the signal blocked, so one sent while Python and torch
        # import stays pending instead of being lost; with the handler in place it is delivered now.
        self._old_mask = signal_module.pthread_sigmask(signal_module.SIG_UNBLOCK, {sig})
        export_torch_env(self.env)
        line_buffered_output()
        if self.env.is_main:
            # Creates and verifies the job directory and takes the writer role before restoring, so a
            # stale incarnation elsewhere (a partitioned node) stops at its next commit, not racing us.
            self.store.claim()
        elif self.env.world_size > 1:
            # Every rank may be first here; each needs the run directory before the group exists.
            self.store.ensure_job_dir()
        if self.env.world_size > 1:
            self.run_dir.create()
            if self.env.is_main:
                self.run_dir.remove_older_runs()
        if self.env.world_size > 1 and not dist.is_initialized():
            backend = group_backend(self.backend, cuda=torch.cuda.is_available())
            if "nccl" in backend:
                torch.cuda.set_device(self.env.local_rank)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            store = rendezvous.connect(self.env, self.run_dir, timeout_s=self.timeout_s)

            def form_group() -> None:
                if store is None:
                    dist.init_process_group(backend, init_method=self.env.init_method, rank=self.env.rank,
                                            world_size=self.env.world_size, timeout=timeout)
                else:
                    dist.init_process_group(backend, store=store, rank=self.env.rank,
                                            world_size=self.env.world_size, timeout=timeout)
            # The store's connection is among them: it is this group's alone (train/rendezvous.py).
            connections = GroupConnections.opened_by(form_group)
            if backend == "gloo" or backend.startswith("cpu:gloo"):
                # the session's collectives wait on gloo's sockets (on NCCL a GPU collective does not)
                self._connections = connections
            self._owns_group = True
        if self.env.world_size > 1:
            # Beside the ranks of its own node, each rank watches the first rank of the next
            # node, so whichever node stops, a rank on another node sees it.
            self._liveness = peers.Liveness(self.run_dir, rank=self.rank, world_size=self.world_size,
                                            node=self.env.node_name, watch=self.env.local_world_size + 1,
                                            interval_s=self.heartbeat_s, timeout_s=self.liveness_timeout_s,
                                            on_lost=self._on_peer_silent)
            self._liveness.start()
        log.info("elastic session: rank %d/%d, job key %s, restart %d, signal %s", self.env.rank,
                 self.env.world_size, self.job_key, self.env.restart_count, self.signal_name)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.regrouped:
            return False          # left in _leave_for_regroup; the Regroup goes on to the runner
        if exc is not None and not _clean_exit(exc) and self.env.world_size > 1:
            self._peer_lost_behind(exc)       # does not return when a peer was lost
        if exc is None and self._ckpt is not None:
            if self._exit_after_snapshot:
                # The loop ended between the signal and the checkpoint pass: take it now.
                self._finish_signalled_stop()
            self._settle(block=True)          # drains: no copy-on-write, nothing steps meanwhile
        t0 = time.monotonic()
        if self._ckpt is not None:
            self._ckpt.close()
        log.debug("checkpointer closed in %.3f s", time.monotonic() - t0)
        self.store.close()   # the job directory's descriptor: a session that ended holds nothing open
        if self._liveness is not None:
            # A clean end must not look like a loss to the watchers; an error must (the peers
            # are stuck in a collective with this rank otherwise, for the collective timeout).
            self._liveness.stop(peers.DONE if exc is None or _clean_exit(exc) else peers.FAILED)
        # The handlers stay until the group is gone: Slurm's SIGTERM reaches one node's tasks after
        # another's, and a late copy must not kill a rank that has committed and is leaving.
        if self._owns_group and dist.is_initialized() and (exc is None or _clean_exit(exc)):
            _quiesce_gloo()
            log.debug("process group quiesced after %.3f s", time.monotonic() - t0)
            dist.destroy_process_group()
            log.debug("process group destroyed after %.3f s", time.monotonic() - t0)
        if self.fast_exit and isinstance(exc, SystemExit) and exc.code == protocol.REQUEUE_EXIT_CODE:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            regroup.exit_now(protocol.REQUEUE_EXIT_CODE)     # with the handlers in place to the end
        sig = getattr(signal_module, "SIG" + self.signal_name)
        signal_module.signal(sig, self._old_handler)
        signal_module.signal(signal_module.SIGTERM, self._old_term_handler)
        signal_module.pthread_sigmask(signal_module.SIG_SETMASK, self._old_mask)
        return False

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: checkpointing inside a signal handler could interrupt a
        # collective or the optimizer halfway.
        self._signalled = True
        self._signalled_by = signal_module.Signals(signum).name.removeprefix("SIG")

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def samples_consumed(self) -> int:
        return self.first_sample(self.step)

    @property
    def adaptive(self) -> bool:
        return self.batch_range is not None

    def first_sample(self, step: int) -> int:
        """The global sample index step `step` starts at (steps since this start ran at this start's batch)."""
        assert self.geometry is not None
        mark_step, mark_samples = self._stream_mark
        return mark_samples + (step - mark_step) * self.geometry.global_batch

    # -- setup -----------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, global_batch: int, micro_batch: int,
               dataset_size: int, scheduler: Any = None, seed: int = 0, shuffle: bool = True,
               layers: Sequence[nn.Module] | None = None, group_bytes: int = DEFAULT_GROUP_BYTES,
               announce: bool = True) -> int:
        """Check the batch geometry, restore the newest complete checkpoint, hook the layers.

        Returns the step training continues from (0 for a fresh start). Rank 0 writes one line
        to stderr saying where and why (`announce_start`); ElasticLoop, which knows the epoch,
        passes announce=False and says it itself.

        With an adaptive batch range, `global_batch` is the base batch (the one
        the learning rate is tuned for); the batch of this start is chosen
        after the restore, from the checkpoint's gradient-noise estimate.
        """
        self.base_batch = global_batch
        if self.batch_range is not None:
            self._write_batch_range(global_batch)
        else:
            self._write_geometry(global_batch, micro_batch)
        try:
            self.geometry = BatchGeometry.solve(global_batch, micro_batch, self.world_size)
        except BatchGeometryError as exc:
            if self.batch_range is None:
                log.error("%s; exiting with %d", exc, protocol.GEOMETRY_EXIT_CODE)
                raise SystemExit(protocol.GEOMETRY_EXIT_CODE) from exc
            # Adaptive: the base batch need not split here; the chosen one must (below).
            self.geometry = BatchGeometry(global_batch, micro_batch, self.world_size, 1)
        self.sampler = ElasticSampler(dataset_size, seed=seed, shuffle=shuffle)
        self._sampler_meta = {"seed": seed, "dataset_size": dataset_size, "shuffle": shuffle}
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._restore(model, optimizer, scheduler)
        if self.batch_range is not None:
            self._choose_batch(micro_batch)
        if self.measure_noise and self.env.is_main:
            self._start_noise(model)
        self._ckpt = LayerCheckpointer(model, optimizer, self.store, rank=self.rank, world_size=self.world_size,
                                       layers=layers, group_bytes=group_bytes)
        with self._state_lock:
            self._mark_boundary()
        self._last_arm_time = time.monotonic()
        self._metrics_mark = (time.monotonic(), self.step)
        if announce:
            self.announce_start()
        return self.step

    def announce_start(self, epoch: int | None = None) -> None:
        """Rank 0: 'resumed at step N (epoch E) from <checkpoint> after <cause>' on stderr, whatever
        logging the script configured (or where a fresh start begins)."""
        if self.env.is_main:
            start_line.announce(start_line.start_line(self.job_dir, self.env, step=self.step,
                                                      restored_step=self.restored_step, epoch=epoch))

    def _write_geometry(self, global_batch: int, micro_batch: int,
                        valid: tuple[int, ...] | None = None) -> None:
        if not self.env.is_main or global_batch % max(micro_batch, 1):
            return
        valid = valid if valid is not None else valid_world_sizes(global_batch, micro_batch)
        body = protocol.Geometry(
            world_size=self.world_size, valid_world_sizes=tuple(valid), global_batch=global_batch,
            micro_batch=micro_batch,
            # the controller takes this as the job's GPU step when the current size does not divide
            nearest_valid_world_size=min(valid, key=lambda w: (abs(w - self.world_size), w)))
        self._advise(protocol.GEOMETRY_FILE, body.to_bytes())

    def _advise(self, name: str, data: bytes) -> None:
        """Write a file the controller reads as advice (geometry, batch range): a full or failing disk loses
        the advice (the controller then decides without it), never the training."""
        try:
            self.store.write_job_file(name, data)
        except OSError as exc:
            log.error("%s not written (%s): the controller decides without it; training goes on", name, exc)

    def _write_batch_range(self, base_batch: int) -> None:
        assert self.batch_range is not None
        lo, hi = self.batch_range.min_batch, self.batch_range.max_batch
        if not lo <= base_batch <= hi:
            raise ElasticError(f"the base batch {base_batch} (global_batch=) is outside the adaptive range {lo}-{hi}")
        if self.env.is_main:
            self._advise(protocol.BATCH_FILE, protocol.BatchRange(lo, hi, base_batch).to_bytes())

    def _choose_batch(self, micro_batch: int) -> None:
        """Adaptive: this start's global batch and LR gain, from the restored noise (the same on every rank)."""
        assert self.batch_range is not None and self.base_batch is not None
        lo, hi = self.batch_range.min_batch, self.batch_range.max_batch
        restored = self.restored_noise
        noise = GradientNoise(restored.grad_sqr, restored.grad_var) if restored is not None else None
        try:
            choice = choose_batch(lo, hi, self.base_batch, micro_batch, self.world_size, noise)
            self._write_geometry(choice.global_batch, micro_batch, adaptive_world_sizes(lo, hi, micro_batch))
            self.geometry = BatchGeometry.solve(choice.global_batch, micro_batch, self.world_size)
        except BatchGeometryError as exc:
            if self.env.is_main and exc.valid_world_sizes:
                self._write_geometry(exc.nearest * micro_batch, micro_batch, exc.valid_world_sizes)
            log.error("%s; exiting with %d", exc, protocol.GEOMETRY_EXIT_CODE)
            raise SystemExit(protocol.GEOMETRY_EXIT_CODE) from exc
        self.lr_gain = choice.lr_gain
        log.info("adaptive batch: global batch %d (%s; range %d-%d, base %d), learning rate x %.4g", choice.global_batch,
                 choice.why, lo, hi, self.base_batch, self.lr_gain)

    def _start_noise(self, model: nn.Module) -> None:
        if has_dtensor(model.parameters()):
            log.info("gradient noise is not measured under FSDP (a hook sees a shard, not a micro-batch's gradient)")
            return
        assert self.geometry is not None
        self.noise = GradientNoiseEstimator(model, smoothing=self.noise_smoothing, every_steps=self.noise_every_steps)
        # The session's contract: micro-batch losses are scaled so that .grad accumulates the global mean.
        self.noise.micro_grad_scale = 1.0 / self.geometry.accumulation
        if self.restored_noise is not None:
            self.noise.resume(self.restored_noise)

    def _restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        fingerprint = model_fingerprint(model)
        choice: list[Any] = [None]
        if self.env.is_main:
            try:
                choice[0] = self.store.candidates(model_fingerprint=fingerprint)
            except CheckpointError as exc:
                choice[0] = f"error: {exc}"
        if self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)   # in-memory exchange, nothing unpickled from disk
        if isinstance(choice[0], str):
            raise CheckpointError(choice[0].removeprefix("error: "))
        for step in choice[0]:
            # One read per file: the sha256 is checked while loading; any rank finding
            # damage makes all ranks fall back to the next older step together.
            try:
                manifest, tensors = self._read_step(step)
                ok = 1
            except CheckpointError as exc:
                log.warning("rank %d: checkpoint step %d unusable: %s", self.rank, step, exc)
                ok = 0
            if self.world_size > 1:
                t = torch.tensor([ok], dtype=torch.int64)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                ok = int(t[0])
            if ok:
                self._apply(step, manifest, tensors, model, optimizer, scheduler)
                return
        if self.store.committed_steps():
            log.error("no checkpoint in %s verifies; starting from step 0", self.job_dir)

    def _read_step(self, step: int) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        manifest = self.store.read_manifest(step)
        assert self.geometry is not None
        if "noise" in manifest:
            try:
                NoiseEstimate.from_json(manifest["noise"])
            except ValueError as exc:
                raise CheckpointError(f"checkpoint step {step}: {exc}") from None
        if self.batch_range is None and manifest["global_batch"] != self.geometry.global_batch:
            raise CheckpointError(f"checkpoint step {step} used global batch {manifest['global_batch']}, this run "
                                  f"{self.geometry.global_batch}; exact resume needs the same global batch")
        if manifest.get("sharded"):
            records = sorted(manifest["files"], key=lambda r: (r.get("rank", 0), r["name"]))
            by_rank: dict[int, list] = {}
            for rec, tensors in zip(records, self.store.read_files(step, records)):
                by_rank.setdefault(rec.get("rank", 0), []).extend(tensors.items())
            return manifest, list(merge_shards([by_rank[r] for r in sorted(by_rank)]))
        return manifest, [kv for tensors in self.store.read_files(step, manifest["files"]) for kv in tensors.items()]

    def _apply(self, step: int, manifest: dict[str, Any], tensors: list[tuple[str, torch.Tensor]],
               model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        load_into(model, optimizer, tensors, manifest.get("optimizer", {}).get("param_groups"))
        if scheduler is not None and manifest.get("scheduler") is not None:
            scheduler.load_state_dict(manifest["scheduler"])
        rng = manifest.get("rng") or []
        if self.rank < len(rng) and rng[self.rank] is not None:   # None: a rank lost before a JIT commit
            restore_rng(rng[self.rank])
        self.user_state = dict(manifest.get("user_state") or {})
        self.restored_noise = NoiseEstimate.from_json(manifest["noise"]) if "noise" in manifest else None
        self.step = step
        self._stream_mark = (step, int(manifest["samples_consumed"]))
        self.restored_step = step
        self.last_committed_step = step
        log.info("restored step %d (world size %d -> %d)", step, manifest["world_size"], self.world_size)

    # -- the loop ----------------------------------------------------------------------------------
    def micro_batches(self) -> list[list[int]]:
        """Data-set indices of this rank's micro-batches for the current step."""
        assert self.geometry is not None and self.sampler is not None, "call attach() first"
        first = self.first_sample(self.step)
        return [self.sampler.micro_batch_at(first, self.geometry, self.rank, m)
                for m in range(self.geometry.accumulation)]

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps the whole run takes, as the loop declared it (ElasticSession(total_steps=N),
        or set here once known); the controller reads it from the metrics rows as the work left."""
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ElasticError(f"total_steps must be a positive int or None, got {value!r}")
        self._total_steps = value

    def done(self, total_steps: int) -> bool:
        return self.step >= total_steps

    def optimizer_step(self, scaler: Any = None) -> None:
        """optimizer.step(), scheduler.step(), zero_grad; then the checkpoint/signal bookkeeping.

        `scaler`: an AMP loop's torch.amp.GradScaler: the step is scaler.step(optimizer) (skipped where the
        gradients are not finite, and still counted as a step, as such loops count it), then scaler.update()."""
        assert self._optimizer is not None and self._ckpt is not None, "call attach() first"
        if self._exit_after_snapshot:
            # This step's forward pass was the checkpoint pass of a signalled stop;
            # its update is dropped, so the committed step is the last one done.
            self._finish_signalled_stop()
        if self.noise is not None:
            assert self.geometry is not None
            self.noise.step_done(micro_batch=self.geometry.micro_batch, global_batch=self.geometry.global_batch,
                                 micro_batches=self.geometry.accumulation)
        # The per-step agreement runs before the update: a rank whose loop swallowed a failed
        # gradient all-reduce learns here, before it applies gradients its peers never added to.
        signal_now, due, min_finished = self._agree(self.step + 1)
        with self._state_lock:
            self._step_optimizer(scaler)      # the step pre-hook waits for outstanding layer copies
            if scaler is not None:
                scaler.update()
            if self._scheduler is not None:
                self._scheduler.step()
            self._optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self._mark_boundary()
        self._steps_here += 1
        if self._steps_here & (self._steps_here - 1) == 0:     # 1, 2, 4, 8 ... steps into this start
            self._replica_sum = self._replica_sum_bits()    # compared in the next step's agreement
        self._write_metrics()
        self._settle_upto(min_finished)
        if signal_now:
            log.info("rank %d: signal %s seen after step %d; next forward pass is the checkpoint pass",
                     self.rank, self._signalled_by or self.signal_name, self.step)
            self._arm()
            self._exit_after_snapshot = True
        elif due:
            if self.wait_for_previous:
                self._settle(block=True)
            # The decision uses settled counts, which are equal on all ranks.
            if self._committed == len(self._armed_meta):
                self._arm()
            else:
                log.debug("step %d: previous checkpoint still being written; skipping this one", self.step)

    def _replica_sum_bits(self) -> int | None:
        """One parameter's sum as int64 bits, for the ranks to compare (None: nothing to compare). Ranks
        whose gradients are not averaged (no DistributedDataParallel, or a script that decided it had no
        peers) each train a model of their own, and a checkpoint would stitch layers of different models
        together; a learning rate of 0 in a warmup hides it at the first step, hence again at 2, 4, 8 ..."""
        assert self._optimizer is not None and self._ckpt is not None
        if self.world_size == 1 or self._ckpt.sharded:
            return None
        first = next((p for g in self._optimizer.param_groups for p in g["params"]), None)
        if first is None:
            return None
        bits = struct.unpack("<q", struct.pack("<d", float(first.detach().double().sum())))[0]
        return 0 if bits == -(1 << 63) else bits          # -0.0, whose negation int64 cannot hold

    def _step_optimizer(self, scaler: Any = None) -> None:
        """optimizer.step() (through the AMP `scaler` where given) at lr x lr_gain (adaptive batch); the groups
        keep the unscaled rate, which is what the scheduler sets and the checkpoint records."""
        optimizer = self._optimizer
        assert optimizer is not None

        def step() -> None:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if self.lr_gain == 1.0:
            step()
            return
        groups = optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group, lr in zip(groups, saved):
            group["lr"] = lr * self.lr_gain
        try:
            step()
        finally:
            for group, lr in zip(groups, saved):
                group["lr"] = lr

    def checkpoint_now(self) -> None:
        """Take and commit a checkpoint of the current step synchronously (e.g. at the end of training)."""
        assert self._ckpt is not None
        self._settle(block=True)
        self._arm()
        self._settle(block=True)

    # -- internals ------------------------------------------------------------------------------------
    def _arm(self) -> None:
        assert self._ckpt is not None and self._optimizer is not None and self.geometry is not None
        self._armed_meta.append({
            "step": self.step,
            "samples_consumed": self.samples_consumed,
            "rng": capture_rng(),
            "optimizer": {"class": type(self._optimizer).__name__,
                          "param_groups": optimizer_groups_json(self._model, self._optimizer)},
            "scheduler": _json_or_none(self._scheduler.state_dict()) if self._scheduler is not None else None,
            "user_state": _json_or_none(self.user_state) or {},
        })
        self._ckpt.arm(self.step)
        self._last_arm_time = time.monotonic()

    def _agree(self, step: int) -> tuple[bool, bool, int]:
        """One small all-reduce per step: any rank signalled, rank 0's periodic decision for `step`, snapshots
        done everywhere. A failure is a lost peer, handled here: raised, the user's loop might swallow it."""
        assert self._ckpt is not None
        self._finished.extend(self._ckpt.poll())
        due = 0
        if self.env.is_main:
            due = int((self.every_steps is not None and step % self.every_steps == 0) or
                      (self.every_seconds is not None and time.monotonic() - self._last_arm_time >= self.every_seconds))
        if self.world_size == 1:
            return self._signalled, bool(due), len(self._finished)
        # Every rank has taken the same steps in this start, so all carry a replica sum or none.
        replica_sum, self._replica_sum = self._replica_sum, None
        extra = [] if replica_sum is None else [replica_sum, -replica_sum]
        t = torch.tensor([int(self._signalled), due, -len(self._finished), *extra], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except Exception as exc:
            self._peer_lost(f"step {self.step}: all-reduce failed: {type(exc).__name__}: {exc}", "collective-error")
        if extra and int(t[3]) != -int(t[4]):
            raise ElasticError(
                f"after step {self.step} the {self.world_size} ranks hold different weights: their gradients are "
                f"not averaged across ranks. Wrap the model in DistributedDataParallel after session.attach() "
                f"(a script that decides from RANK or WORLD_SIZE finds them set by the session)")
        return bool(t[0]), bool(t[1]), int(-t[2])

    def _settle(self, *, block: bool) -> None:
        assert self._ckpt is not None
        if block:
            self._finished.extend(self._ckpt.drain())
        while self._committed < len(self._armed_meta):
            n = len(self._finished)
            if self.world_size > 1:
                t = torch.tensor([-n], dtype=torch.int64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                n = int(-t[0])
            if n <= self._committed:
                if not block:
                    return
                continue
            self._settle_upto(n)

    def _settle_upto(self, min_finished: int) -> None:
        """Commit (rank 0) every snapshot that all ranks have finished writing."""
        while self._committed < min_finished:
            mine = self._finished[self._committed]
            meta = self._armed_meta[self._committed]
            report = {"ok": mine.ok, "error": mine.error, "rng": meta["rng"],
                      "files": [r.to_json() for r in mine.records], "stall_s": mine.stall_s}
            reports = [report]
            if self.world_size > 1:
                reports = [None] * self.world_size
                dist.all_gather_object(reports, report)
            self._committed += 1
            self.stall_s_total += mine.stall_s
            step = meta["step"]
            if not all(r["ok"] for r in reports):
                errors = "; ".join(f"rank {i}: {r['error']}" for i, r in enumerate(reports) if not r["ok"])
                log.error("checkpoint of step %d not committed (%s); the previous checkpoint (step %s) stays",
                          step, errors, self.last_committed_step)
                if self.env.is_main:
                    self.store.discard_step(step)
                continue
            if self.env.is_main:
                try:
                    with self._state_lock:     # never beside a just-in-time commit of this rank's
                        self.store.commit(step, self._manifest(meta, reports))
                except OSError as exc:
                    log.error("checkpoint of step %d: committing the manifest failed: %s", step, exc)
                    self.store.discard_step(step)
                    continue
            self.last_committed_step = step

    def _manifest(self, meta: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.geometry is not None and self._ckpt is not None and self._model is not None
        noise = self.noise.estimate() if self.noise is not None else None
        extra = {"noise": noise.to_json()} if noise is not None else {}
        return {**extra,
            "step": meta["step"],
            "samples_consumed": meta["samples_consumed"],
            "world_size": self.world_size,
            "sharded": self._ckpt.sharded,
            "global_batch": self.geometry.global_batch,
            "micro_batch": self.geometry.micro_batch,
            "accumulation": self.geometry.accumulation,
            "model_fingerprint": model_fingerprint(self._model),
            "files": sorted((f for r in reports for f in r["files"]), key=lambda f: f["name"]),
            "layer_groups": [{"file": g.file_name, "owner": g.owner, "bytes": g.nbytes,
                              "layers": [self._ckpt.slots[s].name for s in g.slots]} for g in self._ckpt.groups],
            "rng": [r["rng"] for r in reports],
            "optimizer": meta["optimizer"],
            "scheduler": meta["scheduler"],
            "sampler": self._sampler_meta,
            "user_state": meta["user_state"],
            "job": {"id": self.env.job_id, "restart_count": self.env.restart_count, "key": self.job_key},
            "created": time.time(),
        }

    # -- peer loss -------------------------------------------------------------------------------
    def _mark_boundary(self) -> None:
        """After each optimizer step (state lock held): what a just-in-time checkpoint needs."""
        assert self._ckpt is not None
        self._ckpt.mark_boundary()
        self._boundary_rng[self.step] = capture_rng_raw()
        for old in [s for s in self._boundary_rng if s < self.step - 1]:
            del self._boundary_rng[old]
        # the loop may change user_state as the next step starts, before a lost peer stops it: the
        # just-in-time checkpoint of this step saves this copy (a JSON round trip: keep user_state small)
        try:
            self._boundary_user_state = json.loads(json.dumps(self.user_state, allow_nan=False))
        except (TypeError, ValueError):
            self._boundary_user_state = {}    # not JSON-able: each periodic checkpoint says so

    def _on_peer_silent(self, reason: str) -> None:
        """The liveness thread saw a heartbeat stop (or another rank said so): the training
        thread may be blocked in a collective for the whole collective timeout, so the
        survivors' agreement runs in a thread of its own while the heartbeat goes on."""
        threading.Thread(target=self._peer_lost, args=(reason, "heartbeat"), name="peer-lost", daemon=True).start()

    def _peer_lost(self, reason: str, detected_by: str) -> None:
        """Stop stepping, agree with the other survivors, commit if this rank is the committer; then go on in
        this process at the new size (raises regroup.Regroup) where every survivor can, else exit with
        PEER_LOST_EXIT_CODE. The agreement runs once per process; never returns."""
        in_training_thread = threading.current_thread() is threading.main_thread()
        if not self._peer_loss_lock.acquire(blocking=False):
            if in_training_thread and self._keep_ranks:
                self._loss_handled.wait()
                self._training_thread_here.set()
                if self._decision is not None:
                    self._regroup_or_exit(self._decision)
            while True:              # the first caller ends the process
                time.sleep(3600)
        detected_at = time.time()
        log.error("rank %d: peer lost (%s); agreeing on the step to commit", self.rank, reason)
        decision: dict[str, Any] | None = None
        try:
            assert self._liveness is not None
            self._liveness.declare_lost(reason)
            # Kept until the process ends: no optimizer step starts after this, one under way
            # finishes first, and rank 0's periodic commit is not running beside this one.
            self._state_lock.acquire()
            state: ReplicaState | None = None
            if self._ckpt is not None:
                if not self._ckpt.halt_writer(timeout_s=self.jit_deadline_s / 2):
                    log.warning("rank %d: the checkpoint writer is still busy; going on without it", self.rank)
                state = self._ckpt.replica_state() if self.jit else None
            decision = peers.agree(self.run_dir, self._liveness, self._status(state), world_size=self.world_size,
                                   deadline_s=self.jit_deadline_s,
                                   died_quiet_s=peers.died_quiet_s(self.heartbeat_s) if _a_peer_died(reason)
                                   else None)
            log.info("rank %d: survivors agreed: %s", self.rank, decision["reason"])
            if decision["committer"] == self.rank:
                assert state is not None
                self._commit_jit(decision, state, detected_by, detected_at)
            elif decision["committer"] is None and decision["survivors"] and decision["survivors"][0] == self.rank:
                self._report(decision, detected_by, detected_at, commit="none", committed_step=self.last_committed_step)
        except BaseException as exc:   # whatever happens here, the process must end with the peer-loss code
            log.exception("rank %d: handling the peer loss failed: %s", self.rank, exc)
            decision = None
        if self._keep_ranks and decision is not None and len(decision["survivors"]) < settings.MIN_GPUS.read():
            # Below the job's minimum the controller requeues it: a stopped srun spares that the KillWait wait.
            peers.give_up_regroup(self.run_dir, rank=self.rank, why="fewer survivors than the job's minimum GPUs")
        elif self._keep_ranks and decision is not None:
            self._decision = decision
            self._loss_handled.set()
            if in_training_thread:
                self._regroup_or_exit(decision)
            # The state is committed and the next session restores it, so the training thread may step
            # on: held here, the lock would keep it from the collective whose failure brings it over.
            self._state_lock.release()
            # The training thread takes over when its own collective fails. One blocked in a collective
            # with a frozen peer, or with a survivor that left the group but whose model still holds it,
            # would wait the collective timeout: cutting the group's connections gives it its error now.
            # Should it still not come (another backend, a group the script formed itself), after the
            # survivors' readiness deadline the process ends as without regrouping (the others see it
            # not ready and do the same).
            self._connections.sever()
            if self._training_thread_here.wait(peers.regroup_deadline_s(self.liveness_timeout_s)):
                return
            peers.give_up_regroup(self.run_dir, rank=self.rank,
                                  why=f"its training thread is blocked in {_where_training_is()}")
        self._loss_handled.set()
        self._exit_peer_lost()

    def _regroup_or_exit(self, decision: dict[str, Any]) -> None:
        """The training thread, after the agreement: re-form the group with the other survivors in this
        process (raises regroup.Regroup) when every one of them is ready to, else exit for a relaunch."""
        if self._signalled and self._signalled_by == "TERM":
            # Slurm is ending the job's tasks (it requeues a job whose node failed, and signals the rest just
            # as the ranks see the peer die): the commit is done, and a new group would live until the SIGKILL.
            peers.give_up_regroup(self.run_dir, rank=self.rank, why="Slurm is ending the job's tasks (SIGTERM)")
            self._exit_peer_lost()
        try:
            # Leave the old group first: a survivor whose training thread still waits in a collective on
            # this rank (it saw the loss only through the `lost` file) gets its error now, not at the
            # collective timeout. Destroying the group does not close its connections while the user's
            # model holds it, so they are cut as well; then it can go no other way but on.
            left = regroup.leave_group()
            self._connections.sever()
            if not left:
                peers.give_up_regroup(self.run_dir, rank=self.rank, why="the old process group did not close")
            go = peers.agree_to_regroup(self.run_dir, rank=self.rank, survivors=decision["survivors"],
                                        deadline_s=peers.regroup_deadline_s(self.liveness_timeout_s))
            if go:
                env = regroup.survivor_env(os.environ, decision, self.rank)
                change = regroup.Regroup(env, rank=self.rank, new_rank=sorted(decision["survivors"]).index(self.rank),
                                         world_size=len(decision["survivors"]), step=int(decision["step"] or 0))
                self._leave_for_regroup()
                log.info("rank %d: %s", self.rank, change)
                raise change
            log.warning("rank %d: not every survivor can go on in its process; exiting to be relaunched", self.rank)
        except regroup.Regroup:
            raise
        except BaseException as exc:
            log.exception("rank %d: re-forming the group failed: %s", self.rank, exc)
        self._exit_peer_lost()

    def _leave_for_regroup(self) -> None:
        """What __exit__ would do, for a session whose process goes on: the liveness thread, the layer hooks
        and the writer, the job directory, the signal handlers (a stop signal this session saw, or one sent
        before the next session's handler is in place, is held for it: Slurm's SIGTERM to a job it requeues
        after a node failure comes while the survivors agree, and lost it would let them train on to the
        SIGKILL). The group was left in _regroup_or_exit."""
        sig = getattr(signal_module, "SIG" + self.signal_name)
        regroup.hold_signals({sig: self._old_handler, signal_module.SIGTERM: self._old_term_handler})
        if self._signalled:         # read after the holders are in place: no signal falls between
            regroup.carry(self._signalled_by or self.signal_name)
        self.regrouped = True
        if self._liveness is not None:
            self._liveness.stop(peers.DONE)
        if self._ckpt is not None:
            self._ckpt.close(wait=False)     # halted: it writes nothing more
        self.store.close()
        signal_module.pthread_sigmask(signal_module.SIG_SETMASK, self._old_mask)

    def _exit_peer_lost(self) -> None:
        code = protocol.PEER_LOST_EXIT_CODE
        log.error("rank %d: exiting with %d", self.rank, code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # A broken process group can hang in destroy/atexit; leave at once.
        regroup.exit_now(code)

    def _peer_lost_behind(self, exc: BaseException) -> None:
        """The session ends by an error (a raised exception, or an exit code other than 0 and the
        contract's): when a peer loss is behind it, handle that loss (never returns).

        Frameworks hide the cause: a Hydra-style runner catches, logs and exits 1, a Lightning-style
        loop re-raises its own error. So the cause is looked for along the exception's chain, and,
        when the chain does not tell, in what the peers say: a `lost` file or a watched peer that
        stopped beating, within one liveness timeout. A failure with all peers alive exits as it was,
        also when they fail alike (the liveness thread is quiet meanwhile, `failed` peers not counted).
        """
        cause = _peer_loss_in(exc)
        if cause is not None:
            self._peer_lost(f"{type(cause).__name__}: {cause}", "collective-error")
        if self._liveness is None or self._ckpt is None:
            return
        self._liveness.quiet()
        end = time.monotonic() + self.liveness_timeout_s + 2 * self.heartbeat_s
        while time.monotonic() < end:
            seen = self._liveness.loss_seen()
            if seen is not None:
                self._peer_lost(f"{seen} (this rank was ending by {type(exc).__name__}: {exc})", "heartbeat")
            time.sleep(self.heartbeat_s / 2)

    def _status(self, state: ReplicaState | None) -> dict[str, Any]:
        rng = {str(step): rng_json(raw) for step, raw in self._boundary_rng.items()}
        body: dict[str, Any] = {"rank": self.rank, "node": self.env.node_name, "step": self.step, "rng": rng,
                                "replica": bool(state and state.replica), "clean": bool(state and state.clean),
                                "digest": state.replicated_digest if state else "", "time": time.time()}
        if state is None:
            body["unclean"] = "just-in-time checkpoints are off (jit=False)" if self._ckpt else "not attached yet"
        elif not state.clean or not state.replica:
            body["unclean"] = state.unclean
        return body

    def _commit_jit(self, decision: dict[str, Any], state: ReplicaState, detected_by: str,
                    detected_at: float) -> None:
        assert self._ckpt is not None and self.geometry is not None and self._optimizer is not None
        step = int(decision["step"])
        assert step == self.step, (step, self.step)
        self._report(decision, detected_by, detected_at, commit="pending", committed_step=None)
        t0 = time.monotonic()
        try:
            if step in self.store.committed_steps():
                log.info("rank %d: step %d is committed already", self.rank, step)
            else:
                statuses = peers.read_statuses(self.run_dir, self.world_size)
                rng = [statuses[r]["rng"].get(str(step)) if r in statuses else None for r in range(self.world_size)]
                # A lost rank's generators are gone with it. The manifest format wants a state per
                # rank, so its slot takes the committer's, and the manifest says which ranks those are.
                substituted = [r for r in range(self.world_size) if rng[r] is None]
                if substituted:
                    log.warning("rank %d: no generator state of ranks %s at step %d; recording rank %d's for them",
                                self.rank, substituted, step, self.rank)
                rng = [state if state is not None else rng[self.rank] for state in rng]
                # Whatever a periodic snapshot of this step left is not ours: every survivor's
                # writer was halted before its status was published.
                self.store.discard_step(step)
                records = self._ckpt.write_replica(step, state, rank=self.rank)
                meta = {"step": step, "samples_consumed": self.samples_consumed,
                        "optimizer": {"class": type(self._optimizer).__name__,
                                      "param_groups": optimizer_groups_json(self._model, self._optimizer)},
                        "scheduler": (_json_or_none(self._scheduler.state_dict())
                                      if self._scheduler is not None else None),
                        "user_state": self._boundary_user_state}
                reports = [{"files": [r.to_json() for r in records] if i == 0 else [], "rng": rng[i]}
                           for i in range(self.world_size)]
                manifest = self._manifest(meta, reports)
                manifest["jit"] = {"digest": state.digest, "lost": decision["lost"], "survivors": decision["survivors"],
                                   "committer": self.rank, "detected_by": detected_by,
                                   "rng_of_committer_for_ranks": substituted}
                self.store.commit(step, manifest)
        except (OSError, CheckpointError) as exc:
            log.error("rank %d: just-in-time checkpoint of step %d failed: %s", self.rank, step, exc)
            self._report(decision, detected_by, detected_at, commit="failed", committed_step=self.last_committed_step,
                         reason=f"committing step {step} failed: {exc}")
            return
        self.last_committed_step = step
        log.info("rank %d: just-in-time checkpoint of step %d committed in %.2f s", self.rank, step,
                 time.monotonic() - t0)
        self._report(decision, detected_by, detected_at, commit="done", committed_step=step)

    def _report(self, decision: dict[str, Any], detected_by: str, detected_at: float, *, commit: str,
                committed_step: int | None, reason: str | None = None) -> None:
        """The peer-lost report for the controller (protocol.PeerLostReport), replaced whole."""
        lost = tuple(protocol.LostRank(int(r["rank"]), _node_or_unknown(r["node"])) for r in decision["lost"])
        alive = {_node_or_unknown(n) for n in decision["survivor_nodes"].values()}
        report = protocol.PeerLostReport(
            job_id=self.env.job_id, restart_count=self.env.restart_count, step_id=self.env.step_id,
            world_size=self.world_size, detected_by=detected_by, detected_at=detected_at, lost=lost,
            lost_nodes=tuple(sorted({r.node for r in lost} - alive)), surviving_nodes=tuple(sorted(alive)),
            agreed_step=decision["step"] if decision["committer"] is not None else None, commit=commit,
            committed_step=committed_step, reason=reason or decision["reason"])
        name = protocol.peer_lost_file_name(self.env.job_id, self.env.restart_count, self.env.step_id)
        self.store.write_job_file(name, report.to_bytes())

    def _finish_signalled_stop(self) -> None:
        assert self._ckpt is not None
        self._settle(block=True)
        if self.env.is_main:
            armed = self._armed_meta[-1]["step"] if self._armed_meta else None
            ack = protocol.Ack(step=self.last_committed_step, time=time.time(),
                               committed=self.last_committed_step == armed, world_size=self.world_size)
            self.store.write_job_file(protocol.ack_file_name(self.env.job_id, self.env.restart_count), ack.to_bytes())
        if self.world_size > 1:
            dist.barrier()   # nobody leaves before the acknowledgement exists
        log.info("rank %d: checkpoint of step %s committed; exiting with %d (requeue expected)", self.rank,
                 self.last_committed_step, protocol.REQUEUE_EXIT_CODE)
        self._exit_after_snapshot = False
        raise SystemExit(protocol.REQUEUE_EXIT_CODE)

    def _write_metrics(self) -> None:
        if not self.env.is_main or self.geometry is None:
            return
        t0, s0 = self._metrics_mark
        now = time.monotonic()
        if now - t0 < self.metrics_every_s or self.step == s0:
            return
        steps_per_s = (self.step - s0) / max(now - t0, 1e-9)
        noise = self.noise.estimate() if self.noise is not None else None
        try:
            row = protocol.MetricsRow(step=self.step, time=time.time(), gpus=self.world_size,
                                      nodes=self.env.num_nodes, steps_per_s=steps_per_s,
                                      samples_per_s=steps_per_s * self.geometry.global_batch,
                                      batch=self.geometry.global_batch,
                                      grad_sqr=noise.grad_sqr if noise is not None else None,
                                      grad_var=noise.grad_var if noise is not None else None,
                                      total_steps=self.total_steps,
                                      in_place=1 if self._resumed_in_place else None)
            self.store.append_metrics(row)
            self._resumed_in_place = False
        except ValueError as exc:
            log.warning("metrics row not written: %s", exc)
        except OSError as exc:
            log.warning("cannot append to %s: %s", protocol.METRICS_FILE, exc)
        self._metrics_mark = (now, self.step)


def _quiesce_gloo() -> None:
    """Let gloo's worker threads finish releasing the last collectives before teardown.

    Seen with torch 2.13 on gloo: a worker thread frees a finished work's tensors
    and needs the GIL for that, while the main thread, holding the GIL, destroys
    the process group (the last reference often sits in DDP's Reducer) and waits
    for that worker's mutex: a deadlock at exit. A barrier followed by a short
    sleep (which releases the GIL) lets the workers get through first.
    """
    try:
        dist.barrier()
    except Exception as exc:   # a peer already gone: nothing left to quiesce
        log.debug("barrier before teardown failed: %s", exc)
    time.sleep(0.2)


def _where_training_is() -> str:
    """The innermost frames of the training (main) thread, for the log of a regroup given up."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "an unknown place"
    where = []
    while frame is not None and len(where) < 4:
        where.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return " < ".join(where)


def _node_or_unknown(name: Any) -> str:
    return name if protocol.valid_node_name(name) else "unknown"


def _clean_exit(exc: BaseException) -> bool:
    """An end that is not a failure: sys.exit() with 0 or one of the contract's codes to the batch script."""
    return isinstance(exc, SystemExit) and (exc.code in (None, 0) or exc.code in (
        protocol.REQUEUE_EXIT_CODE, protocol.PEER_LOST_EXIT_CODE, protocol.GEOMETRY_EXIT_CODE))


def _peer_loss_in(exc: BaseException) -> BaseException | None:
    """The peer-loss error `exc` is or was raised from or during (its __cause__/__context__ chain), if any."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if _is_peer_loss(link):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _is_peer_loss(exc: BaseException) -> bool:
    if isinstance(exc, (PeerLost, dist.DistError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in
                                                 ("Gloo", "gloo", "Connection", "timed out", "Timed out", "NCCL"))


def _a_peer_died(reason: str) -> bool:
    """The error says a peer's kernel closed its end (a reset or closed connection, a broken pipe): its
    process is gone, not slow. A timeout says nothing of the kind."""
    return any(s in reason for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def _json_or_none(obj: Any) -> Any:
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError):
        log.warning("state %r is not JSON-able; it is not checkpointed", type(obj).__name__)
        return None


def line_buffered_output() -> None:
    """Under srun stdout is a file or pipe, block-buffered: a rank killed with its node would lose
    everything since the last 8 KiB. Lines reach the job's output as printed."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (ValueError, OSError):
                pass
