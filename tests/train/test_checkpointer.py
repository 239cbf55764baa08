"""LayerCheckpointer: snapshots are taken in the forward pass and hold post-step values."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from slurm_elastic.errors import CheckpointError
from slurm_elastic.train.checkpointer import (
    LayerCheckpointer,
    _build_groups,
    _build_slots,
    decode_state,
    load_into,
)
from slurm_elastic.train.store import CheckpointStore


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4)).double()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_snapshot_of_step_t_holds_post_step_t_values_after_step_t_plus_1(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    release = threading.Event()
    writing = threading.Event()

    def hold_writer(step: int, group: object) -> None:
        writing.set()
        assert release.wait(30), "test never released the writer"

    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, opt, store, group_bytes=1, before_write=hold_writer)
    _train_step(model, opt, seed=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}

    ck.arm(1)
    assert ck.pending_layers == ["0", "1", "3", "4"]
    g = torch.Generator().manual_seed(2)
    loss = model(torch.randn(32, 8, generator=g, dtype=torch.float64)).pow(2).mean()
    # The forward pass of step 2 reached every layer: all were captured by the hooks.
    assert ck.pending_layers == []
    loss.backward()
    assert writing.wait(30)
    opt.step()            # must not wait for the (blocked) writer: it copies what the writer has not read
    opt.zero_grad()
    live = model.state_dict()
    assert not torch.equal(live["0.weight"], expected["0.weight"])
    assert not torch.equal(live["1.running_mean"], expected["1.running_mean"])   # the forward updated it
    release.set()
    [done] = ck.drain()
    assert done.ok and done.step == 1 and len(done.records) == len(ck.groups) == 4
    # The writer had read nothing when optimizer.step() came: every live tensor was copied then.
    live_bytes = sum(t.numel() * t.element_size() for p in model.parameters() for t in [p, *opt.state[p].values()])
    assert done.copied_bytes == live_bytes
    saved = [kv for rec in done.records for kv in store.read_tensors(1, rec.to_json()).items()]
    params, buffers, optim = decode_state(saved)
    for name, value in expected.items():
        got = params.get(name, buffers.get(name))
        assert got is not None and torch.equal(got, value), name
    for name, state in expected_opt.items():
        for key, value in state.items():
            assert torch.equal(optim[name][key], value), (name, key)
    ck.close()


def test_a_writer_that_keeps_up_costs_the_optimizer_step_no_copy(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, opt, store, group_bytes=1)
    _train_step(model, opt, seed=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ck.arm(1)
    g = torch.Generator().manual_seed(2)
    model(torch.randn(32, 8, generator=g, dtype=torch.float64)).pow(2).mean().backward()
    finished = []
    for _ in range(3000):
        finished += ck.poll()
        if finished:
            break
        threading.Event().wait(0.01)
    [done] = finished
    opt.step()
    assert done.ok and done.copied_bytes == 0
    saved = dict(kv for rec in done.records for kv in store.read_tensors(1, rec.to_json()).items())
    assert torch.equal(saved["param/0.weight"], expected["0.weight"])
    assert not torch.equal(model.state_dict()["0.weight"], expected["0.weight"])
    ck.close()


def test_state_changed_in_place_outside_the_optimizer_fails_the_snapshot(tmp_path: Path) -> None:
    """A torn snapshot (half before, half after some in-place update) must never be committed."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    release = threading.Event()
    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, opt, store, group_bytes=1, before_write=lambda *_: release.wait(30))
    _train_step(model, opt, seed=1)
    ck.arm(1)
    g = torch.Generator().manual_seed(2)
    model(torch.randn(32, 8, generator=g, dtype=torch.float64)).pow(2).mean().backward()
    with torch.no_grad():
        model[3].weight.mul_(0.5)      # e.g. a hand-written weight constraint
    release.set()
    opt.step()
    [done] = ck.drain()
    assert not done.ok and "3.weight was changed in place outside optimizer.step()" in done.error
    ck.close()


def test_loading_a_snapshot_restores_model_and_optimizer(tmp_path: Path) -> None:
    model, other = _model(), _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, opt, store)
    _train_step(model, opt, seed=1)
    ck.arm(1)
    ck.wait_for_copies()
    [done] = ck.drain()
    ck.close()
    opt2 = torch.optim.Adam(other.parameters(), lr=0.5)
    saved = [kv for rec in done.records for kv in store.read_tensors(1, rec.to_json()).items()]
    groups = [{"params": [n for n, _ in model.named_parameters()], "lr": 0.1}]
    load_into(other, opt2, saved, groups)
    assert opt2.param_groups[0]["lr"] == 0.1
    _train_step(model, opt, seed=3)
    _train_step(other, opt2, seed=3)
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n


def test_load_refuses_a_different_model(tmp_path: Path) -> None:
    model = _model()
    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, None, store)
    ck.arm(0)
    ck.wait_for_copies()
    [done] = ck.drain()
    ck.close()
    saved = [kv for rec in done.records for kv in store.read_tensors(0, rec.to_json()).items()]
    wider = nn.Sequential(nn.Linear(8, 32)).double()
    with pytest.raises(CheckpointError, match="does not fit"):
        load_into(wider, None, saved, None)


def test_groups_cover_every_layer_once_and_spread_over_ranks() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
    slots = _build_slots(model, None)
    groups = _build_groups(slots, world_size=4, group_bytes=1 << 40)   # one pack, split for the ranks
    covered = sorted(s for g in groups for s in g.slots)
    assert covered == list(range(len(slots)))
    assert {g.owner for g in groups} == {0, 1, 2, 3}
    loads = [sum(g.nbytes for g in groups if g.owner == r) for r in range(4)]
    assert max(loads) <= 2 * min(loads)


def test_tied_and_container_parameters_are_saved_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.scale = nn.Parameter(torch.ones(1))

    slots = _build_slots(Tied(), None)
    names = [n for s in slots for n, _ in s.params]
    assert sorted(names) == ["emb.weight", "scale"]
    assert slots[-1].name == "<rest>"


def test_optimizer_with_foreign_parameters_is_refused(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CheckpointError, match="not part of the model"):
        LayerCheckpointer(model, opt, CheckpointStore(str(tmp_path)))


def test_replica_state_is_the_step_boundary_even_after_the_next_forward(tmp_path: Path) -> None:
    """What a just-in-time checkpoint writes: parameters, Adam state and BatchNorm statistics as of
    the last optimizer step, though the next forward pass already moved the statistics in place."""
    from slurm_elastic.train.checkpointer import state_digest

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path / "job"))
    ck = LayerCheckpointer(model, opt, store, group_bytes=1024)
    _train_step(model, opt, 1)
    ck.mark_boundary()
    boundary = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(32, 8, dtype=torch.float64)).sum().backward()       # the next step's forward and backward
    assert not torch.equal(model[1].running_mean, boundary["1.running_mean"])
    state = ck.replica_state()
    assert state.replica and state.clean
    got = {k.partition("/")[2]: t for g in state.groups.values() for k, t in g.items() if k.startswith(("param/", "buffer/"))}
    assert got.keys() == boundary.keys()
    assert all(torch.equal(got[k], boundary[k]) for k in boundary)
    ck.halt_writer(timeout_s=30)
    records = ck.write_replica(1, state, rank=0)
    on_disk = [kv for rec in records for kv in store.read_tensors(1, rec.to_json()).items()]
    assert state_digest(on_disk) == state.digest
    with torch.no_grad():
        model[0].weight.mul_(2)                  # changed outside optimizer.step(): not the boundary any more
    later = ck.replica_state()
    assert not later.clean and "param/0.weight" in later.unclean and later.digest != state.digest
    ck.close()
