"""ElasticLoop: keep the user's epoch loop; `prepare()` wraps model, optimizer, scheduler, DataLoader on a session.

The shape is HF Accelerate's (`model, optimizer, loader = loop.prepare(...)`);
underneath is the ElasticSession step API, unchanged. What moves inside:

- the data position: the prepared DataLoader yields this rank's micro-batches
  of the optimizer steps not done yet (an epoch that is already done yields
  nothing, so `for epoch in range(0, n)` resumes where the checkpoint is);
- accumulation: `optimizer.step()` / `zero_grad()` act only at the last
  micro-batch of an optimizer step, and gradients are synchronised only then;
- loss scaling: gradients are divided by the accumulation count, so a mean
  loss gives the mean over the global batch at every world size;
- gradient clipping: `torch.nn.utils.clip_grad_norm_` called while a step's
  micro-batches are still being accumulated measures the norm without
  clipping; at the last micro-batch it clips the whole step's gradient, as
  the script's own clip did at one micro-batch per step;
- checkpoints, the signalled stop and the exits (85/86/87), with the rank's
  output flushed before each.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from slurm_elastic.errors import ElasticError
from slurm_elastic.train.environment import group_backend
from slurm_elastic.train.session import ElasticSession

log = logging.getLogger(__name__)

SCHEDULER_INTERVALS = ("step", "epoch")


class ElasticLoop:
    """Start the job's side of elasticity now; `prepare()` the training objects; `close()` at the end.

    `global_batch` is the number of samples per optimizer step, the same at
    every world size (micro_batch x world size x accumulation). The
    micro-batch is the DataLoader's `batch_size` (or `micro_batch=` when a
    Dataset is prepared). Other keyword arguments go to ElasticSession
    (`every_steps`, `every_seconds`, `ckpt_dir`, `keep`, ...).

    Usable as a context manager too (`with ElasticLoop(...) as loop:`).

    Adaptive batch (opt-in): `batch="adaptive:MIN-MAX"` (or the wrapper's
    SLURM_ELASTIC_BATCH) makes `global_batch` the base batch the learning
    rate is tuned for; each start then runs at the batch the session chooses
    for its world size (`loop.global_batch`), with the learning rate scaled
    by `loop.lr_gain` (docs/training.md, "Adaptive batch and gradient noise").
    """

    def __init__(self, *, global_batch: int, micro_batch: int | None = None, seed: int = 0,
                 scheduler_interval: str = "step", ddp_kwargs: dict[str, Any] | None = None,
                 **session_options: Any) -> None:
        if scheduler_interval not in SCHEDULER_INTERVALS:
            raise ElasticError(f"scheduler_interval must be one of {', '.join(SCHEDULER_INTERVALS)}, "
                               f"got {scheduler_interval!r}")
        self.base_batch = global_batch
        self.micro_batch = micro_batch
        self.seed = seed
        self.scheduler_interval = scheduler_interval
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.session = ElasticSession(**session_options)
        self._closed = False
        self._prepared = False
        self._continues_at = 0             # the epoch the loop said it continues at (epochs_done read)
        self._current: tuple[int, int] | None = None     # (step, micro-batch) of the batch last yielded
        self._restore_clipping: Any = lambda: None        # undoes _defer_clipping at the end
        self._stepped_current = False
        self._window_has_grads = False
        self._sync_target: Any = None                     # DDP or FSDP module whose sync we switch
        self._scheduler: ElasticScheduler | None = None
        self._previous_excepthook = sys.excepthook
        try:
            self.session.__enter__()
        except BaseException:
            _flush()
            raise
        self._own_group = False
        if not dist.is_initialized():
            # One rank too: a torchrun-ready script builds its DistributedSampler and DDP on a
            # process group, and the same script must run when the job shrinks to one GPU.
            # An in-process store: no port to find or to collide on.
            dist.init_process_group(group_backend(self.session.backend, cuda=torch.cuda.is_available()),
                                    store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        self._had_group = dist.is_initialized()
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    # -- what a loop may ask ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world_size(self) -> int:
        return self.session.world_size

    @property
    def step(self) -> int:
        """Optimizer steps done (restored ones included)."""
        return self.session.step

    @property
    def epoch(self) -> int:
        """The epoch the data position is in (after a restore: the one to continue), numbered as the loop
        numbers its epochs (from 1 when its first set_epoch() was 1)."""
        if not self._prepared:
            return 0
        first = self.session.user_state.get(FIRST_EPOCH_KEY)
        return self._epoch_of_step(self.session.step) + (first if first in (0, 1) else 0)

    @property
    def epochs_done(self) -> int:
        """Epochs the data has finished (0 for a fresh job), however the loop numbers them: where a loop
        that resumes by its own counter starts (`trainer.epochs_run = loop.epochs_done`), so that finished
        epochs' prints, snapshots and evaluations do not run again.

        Reading it says the loop continues there: the loader's next iteration without set_epoch() (a peek
        at the first batch before set_epoch, as PyTorch's tutorial does) is that epoch, not the first."""
        if not self._prepared:
            return 0
        self._continues_at = self._epoch_of_step(self.session.step)
        return self._continues_at

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step in this start (the base batch until prepare() has chosen)."""
        geometry = self.session.geometry
        return geometry.global_batch if self._prepared and geometry is not None else self.base_batch

    @property
    def lr_gain(self) -> float:
        """The factor the optimizer's learning rate is multiplied by at each step (1 at a fixed batch)."""
        return self.session.lr_gain

    @property
    def accumulation(self) -> int:
        assert self.session.geometry is not None, "call prepare() first"
        return self.session.geometry.accumulation

    # -- prepare -----------------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Wrap one model, one optimizer, one DataLoader (or Dataset) and at most one LR scheduler.

        Returns them in the order given (one object alone is returned as is).
        Restores the newest complete checkpoint into them first.
        """
        try:
            out = self._prepare(objects)
        except BaseException as exc:
            self._leave(exc)
            raise
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare(self, objects: tuple[Any, ...]) -> list[Any]:
        if self._prepared:
            raise ElasticError("prepare() was called twice; prepare the model, optimizer and data in one call")
        kinds: dict[str, list[int]] = {"model": [], "optimizer": [], "data": [], "scheduler": []}
        for i, obj in enumerate(objects):
            kinds[_kind(obj)].append(i)
        for kind, need in (("model", 1), ("optimizer", 1), ("data", 1)):
            if len(kinds[kind]) != need:
                raise ElasticError(f"prepare() needs exactly one {kind} (nn.Module, torch.optim.Optimizer, "
                                   f"DataLoader or Dataset), got {len(kinds[kind])}")
        if len(kinds["scheduler"]) > 1:
            raise ElasticError("prepare() takes at most one LR scheduler")
        model: nn.Module = objects[kinds["model"][0]]
        optimizer: torch.optim.Optimizer = objects[kinds["optimizer"][0]]
        data = objects[kinds["data"][0]]
        scheduler = objects[kinds["scheduler"][0]] if kinds["scheduler"] else None
        dataset, micro, shuffle, seed, loader_kwargs = self._data_plan(data)

        if torch.cuda.is_available():
            # Accelerate's device placement: DDP needs the module on its device before wrapping,
            # and the optimizer keeps the same Parameter objects across .to().
            model.to(torch.device("cuda", torch.cuda.current_device()))
        for_session = scheduler
        if scheduler is not None and self.scheduler_interval == "epoch":
            for_session = _EpochSchedule(scheduler, self)
        # attach() before DDP: restore and layer hooks see the plain model (ElasticSession's rule).
        self.session.attach(model, optimizer, global_batch=self.base_batch, micro_batch=micro,
                            dataset_size=len(dataset), scheduler=for_session, seed=seed, shuffle=shuffle,
                            announce=False)
        if self.session.noise is not None:
            # Its hooks run before the accumulation divisor's (_wrap_model): they see each micro-batch's mean.
            self.session.noise.micro_grad_scale = 1.0
        self._dataset_size = len(dataset)
        self._prepared = True
        self._defer_clipping()
        wrapped = self._wrap_model(model)
        model.register_forward_pre_hook(self._on_forward)
        replaced: dict[int, Any] = {
            kinds["model"][0]: wrapped,
            kinds["optimizer"][0]: ElasticOptimizer(optimizer, self),
            kinds["data"][0]: ElasticDataLoader(self, dataset, loader_kwargs),
        }
        if scheduler is not None:
            self._scheduler = ElasticScheduler(scheduler, self)
            replaced[kinds["scheduler"][0]] = self._scheduler
        log.info("elastic loop: rank %d/%d, global batch %d = micro %d x %d ranks x %d accumulation, "
                 "continuing at step %d (epoch %d)", self.rank, self.world_size, self.global_batch, micro,
                 self.world_size, self.accumulation, self.step, self.epoch)
        self.session.announce_start(self.epoch)
        return [replaced.get(i, obj) for i, obj in enumerate(objects)]

    def _data_plan(self, data: Any) -> tuple[Dataset, int, bool, int, dict[str, Any]]:
        """The dataset, micro-batch, shuffle and seed of the user's loader, and what to rebuild it with."""
        if isinstance(data, DataLoader):
            if isinstance(data.dataset, IterableDataset):
                raise ElasticError("an IterableDataset has no sample index to resume from; prepare a map-style "
                                   "Dataset (one with __getitem__ and __len__)")
            if data.batch_size is None:
                raise ElasticError("the DataLoader has its own batch_sampler; the session decides the batches: "
                                   "build it with batch_size=<micro-batch> instead")
            if self.micro_batch is not None and self.micro_batch != data.batch_size:
                raise ElasticError(f"micro_batch={self.micro_batch} differs from the DataLoader's batch_size "
                                   f"{data.batch_size}; give one of them")
            shuffle, seed = _order_of(data.sampler, self.seed)
            kwargs: dict[str, Any] = {
                "num_workers": data.num_workers, "collate_fn": data.collate_fn, "pin_memory": data.pin_memory,
                "timeout": data.timeout, "worker_init_fn": data.worker_init_fn,
                "multiprocessing_context": data.multiprocessing_context, "generator": data.generator,
                "persistent_workers": data.persistent_workers, "pin_memory_device": data.pin_memory_device}
            if data.num_workers > 0:
                kwargs["prefetch_factor"] = data.prefetch_factor
            return data.dataset, data.batch_size, shuffle, seed, kwargs
        if self.micro_batch is None:
            raise ElasticError("a Dataset was prepared without micro_batch=: pass ElasticLoop(micro_batch=...) "
                               "or prepare a DataLoader with batch_size=")
        if isinstance(data, IterableDataset):
            raise ElasticError("an IterableDataset has no sample index to resume from; prepare a map-style Dataset")
        return data, self.micro_batch, True, self.seed, {}

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        a = self.accumulation
        if isinstance(model, FSDPModule):
            # FSDP2 reduce-scatters the accumulated (summed) micro-batch gradients once;
            # dividing by world x accumulation makes that the global-batch mean.
            for module in model.modules():     # the factor is per FSDP module, it does not recurse
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(float(self.world_size * a))
            self._sync_target = model
            return model
        if a > 1:
            # Before accumulation into .grad (DDP reduces .grad afterwards): each micro-batch
            # contributes 1/accumulation of its mean, as if the loss were divided.
            for p in model.parameters():
                if p.requires_grad:
                    p.register_hook(_divide_by(a))
        # DDP at one rank too: the same `.module`, `no_sync()` and state_dict keys at every world size.
        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        self._sync_target = ddp
        return ddp

    # -- the hooks the wrappers call -------------------------------------------------------------
    def _epoch_of_step(self, step: int) -> int:
        """An optimizer step belongs to the epoch its first sample is in (ElasticSampler's stream)."""
        return self.session.first_sample(step) // self._dataset_size

    def _first_step(self, epoch: int) -> int:
        """The first step of this start's batch whose first sample is in `epoch` or later (steps before this
        start's step may come out smaller than they were: they are done, and only bound empty ranges)."""
        mark_step, mark_samples = self.session._stream_mark
        return mark_step - ((mark_samples - epoch * self._dataset_size) // self.global_batch)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and module.training:
            self._window_has_grads = True

    def _before_micro_batch(self, step: int, micro: int) -> None:
        if self.session.step != step:
            raise ElasticError(f"the next batch belongs to optimizer step {step + 1} but step {self.session.step + 1} "
                               f"is not done: call optimizer.step() after every batch (the session accumulates; "
                               f"remove any accumulation of your own)")
        self._current = (step, micro)
        self._stepped_current = False
        last = micro == self.accumulation - 1
        target = self._sync_target
        if target is None:
            return
        if isinstance(target, nn.parallel.DistributedDataParallel):
            target.require_backward_grad_sync = last       # what no_sync() switches
        else:
            target.set_requires_gradient_sync(last)

    def _optimizer_step(self) -> None:
        if self._current is None or self._stepped_current:
            raise ElasticError("optimizer.step() without a new batch from the prepared DataLoader; call it once "
                               "per batch")
        self._stepped_current = True
        if self._scheduler is not None:
            self._scheduler._batches += 1
        if self._current[1] < self.accumulation - 1:
            return                                        # accumulating: the update comes at the last micro-batch
        self._window_has_grads = False
        if self._scheduler is not None:
            self._scheduler._real_steps += 1
        try:
            self.session.optimizer_step()
        except BaseException as exc:
            self._leave(exc)                              # the signalled stop ends the process here (85)
            raise

    def _zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        if not self._window_has_grads:
            optimizer.zero_grad(set_to_none=set_to_none)

    def _defer_clipping(self) -> None:
        """While this loop runs, clip_grad_norm_ clips only a whole optimizer step's gradient.

        A micro-batch's gradient is part of a sum; clipping it would change the update the script
        made at one micro-batch per step. The norm is still computed and returned (scripts log it).
        """
        utils = nn.utils
        original = utils.clip_grad_norm_
        loop = self

        @functools.wraps(original)
        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
            current = loop._current
            if loop._closed or current is None or current[1] == loop.accumulation - 1:
                return original(parameters, max_norm, *args, **kwargs)
            return original(parameters, math.inf, *args, **kwargs)     # a factor of exactly 1

        utils.clip_grad_norm_ = clip_grad_norm_
        self._restore_clipping = lambda: setattr(utils, "clip_grad_norm_", original)

    def _epoch_started(self) -> None:
        if self._scheduler is not None:
            self._scheduler._check()

    # -- ending --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit outstanding checkpoints and leave the process group (replaces destroy_process_group())."""
        if self._closed or self.session.regrouped:
            return       # a session left for a re-formed group (train/regroup.py) is closed already
        if self._had_group and not dist.is_initialized():
            self._closed = True
            _flush()
            raise ElasticError("the process group was destroyed before ElasticLoop.close(); replace "
                               "destroy_process_group() with loop.close()")
        if self._scheduler is not None:
            self._scheduler._check()
        self._closed = True
        self._restore_clipping()
        sys.excepthook = self._previous_excepthook
        _flush()
        try:
            self.session.__exit__(None, None, None)
        except SystemExit as exc:
            # The loop ended between a signal and its checkpoint pass: the session took the
            # checkpoint now and asks for the requeue exit; leave as after any signalled stop.
            _flush()
            self.session.__exit__(SystemExit, exc, exc.__traceback__)
            raise
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        _flush()

    def __enter__(self) -> ElasticLoop:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.close()
        else:
            self._leave(exc)
        return False

    def _leave(self, exc: BaseException) -> None:
        """An exception ends the loop: the session decides the exit (85 signalled, 86 peer lost)."""
        if self._closed:
            return
        self._closed = True
        self._restore_clipping()
        sys.excepthook = self._previous_excepthook
        _flush()   # the session may os._exit, which drops block-buffered output
        self.session.__exit__(type(exc), exc, exc.__traceback__)
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()   # one rank: no peer it could hang on
        _flush()

    def _excepthook(self, exc_type: Any, exc: BaseException, tb: Any) -> None:
        # An exception no one caught (a peer lost inside the user's backward): give the
        # session its say before the interpreter exits.
        self._leave(exc)
        self._previous_excepthook(exc_type, exc, tb)

    def _at_exit(self) -> None:
        if not self._closed:
            log.info("elastic loop closed at interpreter exit (call loop.close() to choose the moment)")
            self.close()


class ElasticOptimizer(torch.optim.Optimizer):
    """The user's optimizer: `step()`/`zero_grad()` act at the last micro-batch of an optimizer step only.

    A torch Optimizer (LR schedulers check that) holding no state of its own;
    everything else is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, loop: ElasticLoop) -> None:   # no super().__init__: a view
        self.optimizer = optimizer
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ElasticError("optimizer.step(closure) is not supported by the elastic loop")
        self._loop._optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._loop._zero_grad(self.optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"


class ElasticScheduler:
    """The user's LR scheduler; the session steps it (per optimizer step or per epoch) and checkpoints it.

    The loop's own `scheduler.step()` calls change nothing; they are counted
    so that a loop stepping per epoch under scheduler_interval='step' (or the
    reverse) is an error instead of a silently different schedule. Once per
    batch counts as once per step: that is what the loop meant before the
    session split its batches into micro-batches.
    """

    def __init__(self, scheduler: Any, loop: ElasticLoop) -> None:
        self.scheduler = scheduler
        self._loop = loop
        self._user_calls = 0
        self._real_steps = 0
        self._batches = 0          # optimizer.step() calls of the loop, one per micro-batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise ElasticError("scheduler.step() with arguments (e.g. ReduceLROnPlateau) is not supported by the "
                               "elastic loop")
        self._user_calls += 1

    def _check(self) -> None:
        calls, steps, batches = self._user_calls, self._real_steps, self._batches
        self._user_calls = self._real_steps = self._batches = 0
        interval = self._loop.scheduler_interval
        # Per step: a loop written for one batch per optimizer step calls it once per batch.
        ok = calls in (0, steps, batches) if interval == "step" else calls <= 1
        if not ok:
            other = "epoch" if interval == "step" else "step"
            raise ElasticError(f"scheduler.step() was called {calls} times over {steps} optimizer steps; with "
                               f"scheduler_interval={interval!r} the session steps it once per {interval}: pass "
                               f"ElasticLoop(scheduler_interval={other!r}) if that is what your loop does")


class _EpochSchedule:
    """What the session steps after each optimizer step: the scheduler, once per epoch boundary crossed."""

    def __init__(self, scheduler: Any, loop: ElasticLoop) -> None:
        self.scheduler = scheduler
        self._loop = loop

    def step(self) -> None:
        done = self._loop.session.step    # the session steps the schedule before counting the step
        for _ in range(self._loop._epoch_of_step(done + 1) - self._loop._epoch_of_step(done)):
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


# In the session's user_state (saved with every checkpoint): the label of the data's first epoch.
FIRST_EPOCH_KEY = "slurm_elastic.first_epoch"


class ElasticBatchSampler:
    """This rank's micro-batches (data-set index lists) of the optimizer steps of one epoch not done yet."""

    def __init__(self, loop: ElasticLoop) -> None:
        self._loop = loop
        self._set_epoch: int | None = None
        self._next_epoch: int | None = None      # None: where the loop said it continues (0 unless it did)
        self._plan: list[tuple[int, int]] = []

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler.set_epoch: the next iteration is that epoch (an epoch done yields nothing)."""
        self._set_epoch = int(epoch)

    def _first_label(self) -> int:
        """The number the loop gives the data's first epoch: 0, or 1 for a loop that counts epochs from 1.

        Fixed by the loop's first set_epoch() of a fresh job (nothing trained yet) and kept in the
        checkpoint, so a resumed loop that starts counting from 1 again lands on the same data.
        """
        state = self._loop.session.user_state
        first = state.get(FIRST_EPOCH_KEY)
        if first not in (0, 1):
            fresh = self._loop.step == 0 and self._loop.session.restored_step is None
            first = 1 if fresh and self._set_epoch == 1 else 0
            state[FIRST_EPOCH_KEY] = first
        return int(first)

    def plan(self) -> tuple[int, list[tuple[int, int]]]:
        """The epoch the next iteration is, and its (step, micro-batch) pairs still to do."""
        loop = self._loop
        if self._set_epoch is None:
            epoch = self._next_epoch if self._next_epoch is not None else loop._continues_at
        else:
            first = self._first_label()
            label, epoch = self._set_epoch, self._set_epoch - first
            here = loop._epoch_of_step(loop.step)
            if epoch > here:
                raise ElasticError(f"the loop asks for epoch {label} but the data position (step {loop.step}) is "
                                   f"in epoch {here + first}; iterating would skip data: loop over every epoch "
                                   f"from {first} (epochs already done yield nothing) or start at loop.epoch")
            if epoch < 0:
                return epoch, []
        first = max(loop._first_step(epoch), loop.step)
        steps = range(first, loop._first_step(epoch + 1))
        return epoch, [(s, m) for s in steps for m in range(loop.accumulation)]

    def start(self) -> tuple[int, list[tuple[int, int]]]:
        epoch, self._plan = self.plan()
        return epoch, list(self._plan)

    def finished(self, epoch: int) -> None:
        self._next_epoch = epoch + 1
        self._set_epoch = None

    def __len__(self) -> int:
        return len(self.plan()[1])

    def __iter__(self) -> Iterator[list[int]]:
        loop = self._loop
        session = loop.session
        assert session.sampler is not None and session.geometry is not None
        for step, micro in self._plan:
            yield session.sampler.micro_batch_at(session.first_sample(step), session.geometry, loop.rank, micro)


class ElasticDataLoader:
    """The user's DataLoader, same dataset, collate and workers; the batches come from the elastic sampler."""

    def __init__(self, loop: ElasticLoop, dataset: Dataset, loader_kwargs: dict[str, Any]) -> None:
        self._loop = loop
        self.dataset = dataset
        self.batch_sampler = ElasticBatchSampler(loop)
        self._loader = DataLoader(dataset, batch_sampler=self.batch_sampler, **loader_kwargs)

    @property
    def sampler(self) -> ElasticBatchSampler:
        """For `loader.sampler.set_epoch(epoch)` as written for DistributedSampler."""
        return self.batch_sampler

    @property
    def batch_size(self) -> int:
        assert self._loop.session.geometry is not None
        return self._loop.session.geometry.micro_batch

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        loop = self._loop
        loop._epoch_started()
        epoch, plan = self.batch_sampler.start()
        for (step, micro), batch in zip(plan, self._loader):
            loop._before_micro_batch(step, micro)
            yield batch
        if plan and loop.step != plan[-1][0] + 1:
            raise ElasticError(f"epoch {epoch} ended with optimizer step {plan[-1][0] + 1} not done: call "
                               f"optimizer.step() after every batch")
        self.batch_sampler.finished(epoch)


def _kind(obj: Any) -> str:
    from torch.optim.lr_scheduler import LRScheduler

    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, Dataset)):
        return "data"
    if isinstance(obj, LRScheduler):
        return "scheduler"
    raise ElasticError(f"prepare() does not know what to do with a {type(obj).__name__}; it takes a model, an "
                       f"optimizer, a DataLoader or Dataset and an LR scheduler")


def _order_of(sampler: Any, seed: int) -> tuple[bool, int]:
    """(shuffle, seed) of the user's sampler; the elastic sampler replaces it with the same intent."""
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, RandomSampler):
        return True, seed
    if isinstance(sampler, SequentialSampler):
        return False, seed
    raise ElasticError(f"the DataLoader's {type(sampler).__name__} cannot be resumed elastically; use shuffle=True/"
                       f"False or a DistributedSampler (the session keeps the data order and position)")


def _divide_by(a: int) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad / a
    return hook


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):
            pass
