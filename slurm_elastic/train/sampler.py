"""Data position keyed by the global sample index, and the batch geometry (fixed, or chosen by goodput)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slurm_elastic.goodput import GradientNoise, best_batch, gain
from slurm_elastic.errors import ElasticError


class BatchGeometryError(ElasticError):
    """The global batch cannot be split evenly over this world size."""

    def __init__(self, message: str, *, valid_world_sizes: tuple[int, ...], nearest: int) -> None:
        super().__init__(message)
        self.valid_world_sizes = valid_world_sizes
        self.nearest = nearest


@dataclass(frozen=True, slots=True)
class BatchGeometry:
    """global_batch = micro_batch x world_size x accumulation, exactly."""

    global_batch: int
    micro_batch: int
    world_size: int
    accumulation: int

    @classmethod
    def solve(cls, global_batch: int, micro_batch: int, world_size: int) -> BatchGeometry:
        if global_batch < 1 or micro_batch < 1 or world_size < 1:
            raise ElasticError(f"batch sizes and world size must be positive (global {global_batch}, "
                               f"micro {micro_batch}, world {world_size})")
        if global_batch % micro_batch:
            raise ElasticError(f"global batch {global_batch} is not a multiple of the micro batch {micro_batch}")
        micro_batches = global_batch // micro_batch
        if micro_batches % world_size:
            valid = valid_world_sizes(global_batch, micro_batch)
            nearest = nearest_valid_world_size(global_batch, micro_batch, world_size)
            raise BatchGeometryError(
                f"global batch {global_batch} with micro batch {micro_batch} cannot be split over "
                f"{world_size} ranks; nearest valid world size is {nearest} "
                f"(valid: {', '.join(map(str, valid))})", valid_world_sizes=valid, nearest=nearest)
        return cls(global_batch, micro_batch, world_size, micro_batches // world_size)

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation


def valid_world_sizes(global_batch: int, micro_batch: int) -> tuple[int, ...]:
    n = global_batch // micro_batch
    return tuple(w for w in range(1, n + 1) if n % w == 0)


def nearest_valid_world_size(global_batch: int, micro_batch: int, world_size: int) -> int:
    """The valid world size closest to `world_size`, preferring the smaller one on a tie (it fits)."""
    return min(valid_world_sizes(global_batch, micro_batch), key=lambda w: (abs(w - world_size), w))


# -- adaptive batch: the global batch chosen at each start ----------------------------------
def adaptive_batches(min_batch: int, max_batch: int, micro_batch: int, world_size: int) -> list[int]:
    """Global batches in [min_batch, max_batch] this world size can run: micro x world x accumulation."""
    unit = micro_batch * world_size
    first = max(1, -(-min_batch // unit))
    return [unit * a for a in range(first, max_batch // unit + 1)]


def adaptive_world_sizes(min_batch: int, max_batch: int, micro_batch: int) -> tuple[int, ...]:
    return tuple(w for w in range(1, max_batch // micro_batch + 1)
                 if adaptive_batches(min_batch, max_batch, micro_batch, w))


@dataclass(frozen=True, slots=True)
class BatchChoice:
    """The global batch of this start and the learning-rate factor that goes with it."""

    global_batch: int
    lr_gain: float
    why: str


def choose_batch(min_batch: int, max_batch: int, base_batch: int, micro_batch: int, world_size: int,
                 noise: GradientNoise | None) -> BatchChoice:
    """The goodput-best global batch at this world size, and AdaScale's gain for it.

    Throughput model: at a fixed world size a step of accumulation a takes a
    times one micro-batch step (the synchronisation it would amortise is not
    measured), so samples/s is the same for every candidate and goodput
    follows statistical efficiency. Without a measured noise the base batch
    is kept when it fits, else the nearest candidate below it (else the
    smallest), with the gain min(1, batch / base): linear scaling downwards,
    no increase of the learning rate on a guess.
    """
    candidates = adaptive_batches(min_batch, max_batch, micro_batch, world_size)
    if not candidates:
        valid = adaptive_world_sizes(min_batch, max_batch, micro_batch)
        nearest = min(valid, key=lambda w: (abs(w - world_size), w)) if valid else 1
        raise BatchGeometryError(
            f"no global batch in adaptive:{min_batch}-{max_batch} splits into micro-batches of {micro_batch} over "
            f"{world_size} ranks; nearest valid world size is {nearest}", valid_world_sizes=valid, nearest=nearest)
    if noise is None:
        below = [b for b in candidates if b <= base_batch]
        batch = max(below) if below else min(candidates)
        return BatchChoice(batch, min(1.0, batch / base_batch), "no gradient noise measured yet")
    batch, _ = best_batch(candidates, lambda b: 1.0, base_batch, noise)
    return BatchChoice(batch, gain(batch, base_batch, noise),
                       f"best goodput for noise scale {noise.noise_scale:.4g} samples")


class ElasticSampler:
    """Sample indices for (step, rank, micro-batch), derived from the global sample index alone.

    Global sample g lives in epoch g // N at position g % N of that epoch's
    permutation (seeded by seed and epoch), so the data order is one fixed
    stream no matter how many ranks consume it: after a restart at another
    world size, training continues at `samples_consumed` and every sample is
    still seen exactly once per epoch.
    """

    def __init__(self, dataset_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ElasticError("the data set is empty")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch = -1
        self._perm = torch.arange(dataset_size)

    def epoch_of(self, global_index: int) -> int:
        return global_index // self.dataset_size

    def indices(self, start: int, count: int) -> list[int]:
        """Data-set indices of global samples [start, start + count)."""
        out: list[int] = []
        g = start
        while len(out) < count:
            epoch, pos = divmod(g, self.dataset_size)
            take = min(count - len(out), self.dataset_size - pos)
            out.extend(self._permutation(epoch)[pos:pos + take].tolist())
            g += take
        return out

    def micro_batch(self, step: int, geometry: BatchGeometry, rank: int, micro: int) -> list[int]:
        """Indices of micro-batch `micro` (0..accumulation-1) of `rank` in optimizer step `step`.

        Rank r takes a contiguous slice of the global batch; the split changes
        with the world size but the global batch's contents do not.
        """
        return self.micro_batch_at(step * geometry.global_batch, geometry, rank, micro)

    def micro_batch_at(self, first_sample: int, geometry: BatchGeometry, rank: int, micro: int) -> list[int]:
        """As micro_batch, for the step whose first global sample is `first_sample` (the global batch may have
        changed at a restart: the step's place in the stream is then the samples consumed, not step x batch)."""
        if not 0 <= rank < geometry.world_size or not 0 <= micro < geometry.accumulation:
            raise ElasticError(f"rank {rank} / micro-batch {micro} outside the geometry {geometry}")
        start = first_sample + rank * geometry.per_rank + micro * geometry.micro_batch
        return self.indices(start, geometry.micro_batch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return self._perm
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.dataset_size, generator=gen)
            self._perm_epoch = epoch
        return self._perm
