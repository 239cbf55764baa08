"""An elastic job is sized on the nodes Slurm would start it on: its partition's, its reservation's while
that is active, none of another reservation's that opens before its time limit would end; a running job
a requeue could not start again keeps its size (its reservation is over, or another one holds its nodes)."""

from __future__ import annotations

from slurm_elastic.allocate.from_state import partition_nodes
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.reservations import AdvanceReservation
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec
from tests.control.test_rigid_neighbours import Clock


def _two_partitions() -> InMemorySlurm:
    """n1-n2 in `gpu` (the elastic job's), n3-n4 in `big`, 4 GPUs each, nothing else running."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    for name in ("n3", "n4"):
        slurm.add_node(name, gpus=4, cpus=32, mem_mb=64000, partitions=("big",))
    return slurm


def _controller(slurm: InMemorySlurm, tmp_path) -> Reconciler:
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    return Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep)


def test_a_job_grows_to_what_its_partition_holds_and_runs_there(tmp_path):
    slurm = _two_partitions()
    job = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    rec = _controller(slurm, tmp_path)
    report = rec.cycle()
    assert report.target(job) == 8          # all of gpu's GPUs; the 8 of `big` are not the job's to take
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].gpus == 8
    assert set(slurm.jobs[job].nodes) == {"n1", "n2"}
    assert rec.cycle().target(job) == 8      # and it stays


def test_a_pending_jobs_partition_list_gives_the_nodes_of_its_largest_partition():
    slurm = _two_partitions()
    slurm.add_node("n5", gpus=4, cpus=32, mem_mb=64000, partitions=("big",))
    state = slurm.snapshot()
    assert partition_nodes(state, "gpu") == {"n1", "n2"}
    # Slurm starts it in one partition, never across two: sized on the one with the most GPUs
    assert partition_nodes(state, "gpu,big") == {"n3", "n4", "n5"}
    assert partition_nodes(state, "") is None
    assert partition_nodes(state, "elsewhere") == frozenset()   # no node: it cannot run anywhere


def test_the_wrapper_sizes_a_new_job_on_its_partitions_nodes(tmp_path):
    from slurm_elastic.control.submit import parse_command_line, submit

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\nsrun true\n")
    site = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "ckpt")}
    for args, gpus in ((["--partition=big"], 8), ([], 8)):    # no -p: the default partition, gpu
        description, _ = submit(_two_partitions(), parse_command_line(["--gpus=1-16", *args, str(script)],
                                                                      environ=site))
        assert description.shape.nodes * description.shape.gpus_per_node == gpus, (args, description.shape)


def _window(active: bool) -> AdvanceReservation:
    return AdvanceReservation("course", 0.0, 1e12 if active else 1.0, ("n1", "n2"), active=active)


def test_a_job_in_an_active_reservation_grows_to_what_the_reservation_holds_and_runs_there(tmp_path):
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    slurm.advance_reservations = [_window(True)]
    job = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4,
                        reservation="course")
    rec = _controller(slurm, tmp_path)
    assert rec.cycle().target(job) == 8      # n1-n2's GPUs; the other 8 are not the reservation's
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and set(slurm.jobs[job].nodes) == {"n1", "n2"}


def test_a_job_whose_reservation_is_over_keeps_its_size_and_a_pending_one_is_given_nothing(tmp_path):
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    slurm.advance_reservations = [_window(True)]
    ckpt = str(tmp_path / "ckpt")
    running = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, reservation="course")
    slurm.advance_reservations = [_window(False)]          # the window closes while it runs
    waiting = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, reservation="course")
    other = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=ckpt), nodes=1, gpus_per_node=4)
    assert slurm.jobs[waiting].reason == "Reservation"
    rec = _controller(slurm, tmp_path)
    report = rec.cycle()
    # 12 GPUs are free: a requeue would grow it, and Slurm would never start it again
    assert report.target(running) == 4 and "its reservation course is over" in report.pinned[running]
    assert report.target(waiting) == 0
    assert report.target(other) == 12        # nothing kept for the job that cannot start
    rec.cycle()
    assert slurm.jobs[running].state is JobState.RUNNING and slurm.jobs[running].restarts == 0


def test_a_rigid_job_in_an_active_reservation_gets_its_nodes_back_and_one_in_a_closed_one_gets_nothing(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    elastic = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
    slurm.advance_reservations = [AdvanceReservation("course", 0.0, 1.0, ("n2",), active=False)]
    closed = slurm.add_job(None, nodes=1, gpus_per_node=4, reservation="course")
    rec = _controller(slurm, tmp_path)
    assert rec.cycle().target(elastic) == 8                 # nothing it gave back could start the rigid job
    slurm.cancel(closed)
    slurm.advance_reservations = [AdvanceReservation("course", 0.0, 1e12, ("n2",), active=True)]
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, reservation="course")
    report = rec.cycle()
    assert report.target(elastic) == 4 and report.waits[rigid].endswith("on n2")
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[rigid].nodes == ("n2",)
    assert slurm.jobs[elastic].state is JobState.RUNNING and slurm.jobs[elastic].nodes == ("n1",)


def test_the_wrapper_sizes_a_new_job_in_a_reservation_on_the_reservations_nodes(tmp_path):
    from slurm_elastic.control.submit import parse_command_line, submit

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\nsrun true\n")
    site = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "ckpt")}
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    for window, gpus in ((_window(True), 8), (_window(False), 1)):     # a closed one: its minimum
        slurm.advance_reservations = [window]
        description, _ = submit(slurm, parse_command_line(["--gpus=1-16", "--reservation=course", str(script)],
                                                          environ=site))
        assert description.shape.nodes * description.shape.gpus_per_node == gpus, (window, description.shape)


# -- reservations a job is not in (a maintenance announced ahead) ---------------------------------------
def _maintenance(slurm: InMemorySlurm, opens_in_s: float, nodes=("n2",)) -> None:
    slurm.advance_reservations = [AdvanceReservation("maint", slurm.now + opens_in_s, slurm.now + opens_in_s + 3600,
                                                     tuple(nodes), active=False)]


def test_a_pending_unlimited_job_is_sized_off_the_nodes_of_a_maintenance_to_come_and_starts(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    _maintenance(slurm, 7 * 86400)                 # a week ahead: an unlimited job would overlap it
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4, run=False)
    rec = _controller(slurm, tmp_path)
    assert rec.cycle().target(job) == 4            # n1's GPUs; at 8 Slurm would leave it pending a week
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].nodes == ("n1",)


def test_a_job_whose_time_limit_ends_before_the_window_opens_may_use_its_nodes(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    _maintenance(slurm, 7 * 86400)
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4, run=False,
                        time_limit_s=86400)
    rec = _controller(slurm, tmp_path)
    assert rec.cycle().target(job) == 8
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and set(slurm.jobs[job].nodes) == {"n1", "n2"}


def test_a_running_job_on_the_nodes_of_a_maintenance_to_come_is_kept_where_it_is(tmp_path):
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    job = slurm.add_job(ElasticSpec(1, 12, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    assert slurm.jobs[job].nodes == ("n1",)
    _maintenance(slurm, 7 * 86400, nodes=("n1",))
    rec = _controller(slurm, tmp_path)
    report = rec.cycle()
    # 8 GPUs are free on n2-n3, but a requeue would leave it pending until the maintenance ends
    assert report.target(job) == 4 and "reservation maint on n1" in report.pinned[job]
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].restarts == 0


def test_a_running_job_moves_off_a_reservations_nodes_when_a_job_of_that_reservation_waits(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    job = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
    slurm.advance_reservations = [AdvanceReservation("course", slurm.now - 60, slurm.now + 3600, ("n2",),
                                                     active=True)]
    rec = _controller(slurm, tmp_path)
    assert "reservation course on n2 (from now)" in rec.cycle().pinned[job]   # nobody of `course` waits
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, reservation="course")
    report = rec.cycle()
    assert report.target(job) == 4
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[rigid].nodes == ("n2",)
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].nodes == ("n1",)


def test_a_rigid_job_is_not_given_nodes_a_reservation_keeps_it_off(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4,
                        time_limit_s=600)
    _maintenance(slurm, 3600, nodes=("n1",))       # opens in an hour: after the elastic job's limit, within the rigid's
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, time_limit_s=7200)
    rec = _controller(slurm, tmp_path)
    report = rec.cycle()
    # n2 is the one node Slurm could start it on: the elastic job gives that one up, not n1
    assert report.target(job) == 4 and report.rigid.reserved[0].nodes == ("n2",)
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[rigid].nodes == ("n2",)
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].nodes == ("n1",)


def test_a_running_job_below_its_max_says_why_the_solve_does_not_grow_it(tmp_path):
    """Seen converting a real script: a watch that never grew a job back after its node returned said nothing.
    The solve's own reason is the job's note (status, the watch's log once per size)."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    a = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    b = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    rec = _controller(slurm, tmp_path)
    report = rec.cycle()
    assert report.plans == () and report.target(a) == report.target(b) == 4
    assert report.waits[a].startswith("stays at 4 GPUs (") and report.waits[b].startswith("stays at 4 GPUs (")
    slurm.cancel(b)
    report = rec.cycle()
    assert report.target(a) == 8 and a not in report.waits     # grown: nothing to explain


def test_a_job_its_own_speeds_keep_below_its_max_says_so_beside_a_free_node(tmp_path):
    """Seen converting pytorch/examples' ImageNet script: 4 ranks on a 2-core machine measured slower than 2,
    the job stayed at 2 GPUs after its node returned, and `status` said nothing (the solve's cause is "max":
    the request rules allowed no more). The note names the rule that stopped its counts."""
    from slurm_elastic import jobfiles as shim
    from slurm_elastic.control.requests import MeasuredRequests
    from tests.control.test_requests import ME, _row, _rows, ran_at

    slurm = InMemorySlurm(nodes=2, gpus_per_node=2)
    ckpt = str(tmp_path / "ckpt")
    job = slurm.add_job(ElasticSpec(2, 4, gpu_step=2, ckpt_dir=ckpt), nodes=2, gpus_per_node=2, user=ME)
    src = MeasuredRequests()
    ran_at(slurm, src, job, (4, 2), (2, 1))
    _rows(shim.metrics_path(ckpt, str(job)), [_row(100, 0, 4, 9.75, nodes=2, total=100_000),
                                              _row(200, 100, 4, 9.75, nodes=2, total=100_000),
                                              _row(300, 200, 2, 11.6, total=100_000),
                                              _row(400, 300, 2, 11.6, total=100_000)])
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    report = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep,
                        requests=src).cycle(dry_run=True)
    assert slurm.jobs[job].gpus == 2 and report.target(job) == 2
    assert report.waits[job].startswith("stays at 2 GPUs (largest allowed): allowed up to 2 GPUs: no larger count "
                                        "is faster in its measured speed model"), report.waits[job]
