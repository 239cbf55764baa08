"""peers.py: the decision rule, heartbeats and their watchers, exclusive creation (no torch, no process group)."""

from __future__ import annotations

import time
from pathlib import Path

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train import peers


def _status(rank: int, step: int, digest: str = "d", *, replica: bool = True, clean: bool = True) -> dict:
    return {"rank": rank, "node": f"n{rank}", "step": step, "digest": digest, "replica": replica, "clean": clean,
            "unclean": None if clean else "param/w changed since the last optimizer step", "rng": {}}


def test_the_last_step_all_survivors_completed_is_committed_by_the_lowest_rank_at_it() -> None:
    d = peers.decide({0: _status(0, 8, "new"), 1: _status(1, 7, "old"), 3: _status(3, 7, "old")}, 4, {2: "n2"})
    assert (d["step"], d["committer"], d["digest"]) == (7, 1, "old")
    assert d["lost"] == [{"rank": 2, "node": "n2"}] and d["survivors"] == [0, 1, 3]
    d = peers.decide({0: _status(0, 8), 1: _status(1, 8)}, 3, {2: "n2"})
    assert (d["step"], d["committer"]) == (8, 0)


def test_nothing_is_committed_that_could_be_torn_or_mixed() -> None:
    differ = peers.decide({0: _status(0, 5, "a"), 1: _status(1, 5, "b")}, 3, {})
    assert differ["committer"] is None and "differ" in differ["reason"]
    sharded = peers.decide({0: _status(0, 5, replica=False), 1: _status(1, 5, replica=False)}, 3, {})
    assert sharded["committer"] is None and "no survivor holds a full replica" in sharded["reason"]
    apart = peers.decide({0: _status(0, 5), 1: _status(1, 7)}, 3, {})
    assert apart["committer"] is None and "more than one step apart" in apart["reason"]
    unclean = peers.decide({0: _status(0, 5, clean=False), 1: _status(1, 5)}, 3, {})
    assert unclean["committer"] == 1
    none_clean = peers.decide({0: _status(0, 5, clean=False), 1: _status(1, 6)}, 3, {})
    assert none_clean["committer"] is None and "changed since" in none_clean["reason"]


def test_the_first_decision_stands(tmp_path: Path) -> None:
    run = peers.RunDirectory(str(tmp_path), "7", 0, 0)
    run.create()
    assert run.create_once(protocol.DECISION_FILE, {"step": 1})
    assert not run.create_once(protocol.DECISION_FILE, {"step": 2})
    assert run.read(protocol.DECISION_FILE) == {"step": 1}
    assert sorted(p.name for p in tmp_path.joinpath(run.name).iterdir()) == [protocol.DECISION_FILE]


def _liveness(run: peers.RunDirectory, rank: int, lost: list, world: int = 2) -> peers.Liveness:
    return peers.Liveness(run, rank=rank, world_size=world, node=f"n{rank}", watch=1, interval_s=0.05,
                          timeout_s=0.6, on_lost=lost.append)


def test_a_silent_peer_is_lost_a_busy_or_finished_one_is_not(tmp_path: Path) -> None:
    run = peers.RunDirectory(str(tmp_path), "7", 0, 0)
    run.create()
    seen: list[str] = []
    watcher, peer = _liveness(run, 0, seen), _liveness(run, 1, [])
    peer.start()
    watcher.start()
    time.sleep(2.0)            # beating peers, for more than three liveness timeouts
    assert seen == []
    peer._stop.set()           # frozen: the thread stops beating, no clean-end heartbeat
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and "rank(s) [1]" in seen[0]
    assert run.read(protocol.LOST_FILE)["rank"] == 0
    watcher.stop()


def test_a_clean_end_is_not_a_loss_and_others_hear_of_a_loss(tmp_path: Path) -> None:
    run = peers.RunDirectory(str(tmp_path), "7", 0, 0)
    run.create()
    seen0: list[str] = []
    seen2: list[str] = []
    a, b, c = _liveness(run, 0, seen0, 3), _liveness(run, 1, [], 3), _liveness(run, 2, seen2, 3)
    for x in (a, b, c):
        x.start()
    b.stop(peers.DONE)
    time.sleep(2.0)
    assert seen0 == [] and seen2 == []
    c.declare_lost("rank 1 said nothing")      # e.g. a collective failed on rank 2
    deadline = time.monotonic() + 30
    while not seen0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen0 == ["rank 2 reported: rank 1 said nothing"] and seen2 == []   # rank 2 knew already
    a.stop()
    c.stop()
