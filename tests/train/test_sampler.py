"""ElasticSampler and BatchGeometry: one data stream regardless of world size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.errors import ElasticError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.sampler import (
    BatchGeometry,
    BatchGeometryError,
    ElasticSampler,
    nearest_valid_world_size,
    valid_world_sizes,
)

from .launch import run_ranks


def _consume(sampler: ElasticSampler, step: int, geom: BatchGeometry) -> list[int]:
    return [i for r in range(geom.world_size) for m in range(geom.accumulation)
            for i in sampler.micro_batch(step, geom, r, m)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 120), micro=st.integers(1, 4), mult=st.integers(1, 6),
       worlds=st.lists(st.integers(1, 6), min_size=1, max_size=4), seed=st.integers(0, 5))
def test_every_sample_once_per_epoch_across_world_size_changes(n: int, micro: int, mult: int, worlds: list[int],
                                                               seed: int) -> None:
    global_batch = micro * 12 * mult            # 12 = lcm-ish of 1..4 and 6: most worlds divide
    sampler = ElasticSampler(n, seed=seed)
    stream: list[int] = []
    step = 0
    steps_per_phase = max(1, (2 * n) // global_batch // len(worlds) + 1)
    for w in worlds:
        if (global_batch // micro) % w:
            continue
        geom = BatchGeometry.solve(global_batch, micro, w)
        for _ in range(steps_per_phase):
            stream.extend(_consume(ElasticSampler(n, seed=seed), step, geom))   # a fresh sampler: restart
            step += 1
    # the stream equals the single-rank stream, and each full epoch is a permutation
    assert stream == sampler.indices(0, len(stream))
    for e in range(len(stream) // n):
        assert Counter(stream[e * n:(e + 1) * n]) == Counter(range(n))


def test_geometry_keeps_the_global_batch() -> None:
    for w in (1, 2, 3, 4, 6, 12):
        g = BatchGeometry.solve(48, 4, w)
        assert g.micro_batch * g.world_size * g.accumulation == 48
    assert valid_world_sizes(48, 4) == (1, 2, 3, 4, 6, 12)
    assert nearest_valid_world_size(48, 4, 5) == 4      # tie 4/6: the smaller one fits
    assert nearest_valid_world_size(48, 4, 11) == 12
    with pytest.raises(BatchGeometryError, match="nearest valid world size is 4") as info:
        BatchGeometry.solve(48, 4, 5)
    assert info.value.valid_world_sizes == (1, 2, 3, 4, 6, 12)
    with pytest.raises(ElasticError, match="not a multiple"):
        BatchGeometry.solve(18, 4, 1)


def test_world_size_that_cannot_split_the_batch_exits_87_and_reports(tmp_path: Path) -> None:
    results = run_ranks("slurm_elastic.train.examples.digits",
                        ["--ckpt-dir", str(tmp_path), "--steps", "2", "--global-batch", "48", "--micro-batch", "4"],
                        world_size=5, job_id="99")
    assert [r.returncode for r in results] == [protocol.GEOMETRY_EXIT_CODE] * 5, results[0].stdout[-2000:]
    geometry = json.loads((tmp_path / "99" / protocol.GEOMETRY_FILE).read_text())
    assert geometry["world_size"] == 5 and geometry["nearest_valid_world_size"] == 4
    assert geometry["valid_world_sizes"] == [1, 2, 3, 4, 6, 12]
