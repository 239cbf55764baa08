"""Live tests on the local Slurm cluster: the backend contract, the resize protocol's steps, node loss/gain.

Marked `slurm`; they use the session fixture `slurm_cluster` (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import pytest

from slurm_elastic.cluster.backend import Backend, SubmitDescription
from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.cluster.pyslurm_backend import PyslurmBackend, known_problem, probe_pyslurm
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.cluster.watch import (JobRequeuedBySlurm, NodeGained, NodeLost, WakeFile, Watcher,
                                         clear_triggers, install_wake_triggers, watch)
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.errors import SlurmError, UnknownJob
from slurm_elastic.spec import ElasticSpec

from tests.conftest import TEST_CLUSTER_ENV

pytestmark = pytest.mark.slurm

# The batch script of an elastic job as the job templates shape it: a USR2 trap in the batch
# shell and in every srun task, and the per-GPU variables of the *original* submission cleared
# before srun (a requeued job keeps its submit-time environment; SLURM_CPUS_PER_GPU=2 from the
# first submit makes srun refuse a step once the job was resized to 1 CPU per GPU).
STEP = """#!/bin/bash
trap 'echo "step $SLURM_PROCID on $SLURMD_NODENAME got USR2"' USR2
echo "step $SLURM_PROCID on $SLURMD_NODENAME gpus=$SLURM_GPUS_ON_NODE"
for i in $(seq 3000); do sleep 0.2; done
"""
BATCH = """#!/bin/bash
trap 'echo "batch got USR2"' USR2
echo "start restart=${{SLURM_RESTART_COUNT:-0}} nodes=$SLURM_JOB_NUM_NODES gpus_on_node=$SLURM_GPUS_ON_NODE"
unset SLURM_CPUS_PER_GPU SLURM_MEM_PER_GPU SLURM_GPUS_PER_NODE SLURM_TRES_PER_TASK
srun {step} &
while true; do wait; [ $? -lt 128 ] && break; done
"""


def backends() -> list:
    """cli, and pyslurm where it is usable; probed in a child process (at collection, SLURM_CONF may be unset,
    and libslurm then ends the process that imports pyslurm)."""
    params = [pytest.param("cli", id="cli")]
    probe = probe_pyslurm(probe_env())
    problem = probe.problem if probe.version is None else (
        known_problem(SlurmVersion.parse(probe.version)) or probe.problem)
    if problem is None:
        params.append(pytest.param("pyslurm", id="pyslurm"))
    else:
        # The test install leaves pyslurm out (the `pyslurm` extra): PyPI's pyslurm builds only against
        # its own Slurm release (25.11), which no Debian suite here ships (docs/slurm-backends.md).
        params.append(pytest.param("pyslurm", id="pyslurm", marks=pytest.mark.skip(
            reason=f"pyslurm is not usable here (not installed without the pyslurm extra; PyPI's builds only "
                   f"against Slurm 25.11): {problem}")))
    return params


def probe_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the pyslurm probe runs with at collection: SLURM_CONF is set only later, by the
    session's cluster fixture, so an existing cluster named by SLURM_ELASTIC_TEST_CLUSTER gives it now."""
    env = dict(os.environ if environ is None else environ)
    if not env.get("SLURM_CONF") and env.get(TEST_CLUSTER_ENV):
        env["SLURM_CONF"] = env[TEST_CLUSTER_ENV]
    return env


def make_backend(name: str) -> Backend:
    return CliBackend() if name == "cli" else PyslurmBackend()


def write_job(tmp_path: Path) -> Path:
    step = tmp_path / "step.sh"
    step.write_text(STEP)
    step.chmod(0o755)
    batch = tmp_path / "batch.sh"
    batch.write_text(BATCH.format(step=step))
    batch.chmod(0o755)
    return batch


def elastic_job(tmp_path: Path, *, nodes: int, gpus: int, extra: tuple[str, ...] = (),
                partition: str | None = None) -> SubmitDescription:
    spec = ElasticSpec(1, 8, cpus_per_gpu=1, mem_per_gpu_mb=500)
    return SubmitDescription(script=str(write_job(tmp_path)), shape=RequestShape(nodes, gpus, 1, 500),
                             comment=spec.to_comment(), job_name="elastic-live",
                             workdir=str(tmp_path),
                             extra_args=(f"--output={tmp_path}/out-%j.txt",
                                         *((f"--partition={partition}",) if partition else ()), *extra))


def job_in(backend: Backend, job_id: int) -> Job:
    return backend.snapshot().job(job_id)


def wait_job(slurm_cluster, backend: Backend, job_id: int, pred: Callable[[Job], bool], what: str,
             timeout: float = 60) -> Job:
    return slurm_cluster.wait_for(lambda: (lambda j: j if pred(j) else None)(job_in(backend, job_id)), timeout,
                                  what=f"job {job_id} {what}")


def wait_for_job(slurm_cluster, read: Callable[[], Job], pred: Callable[[Job], bool], what: str,
                 timeout: float = 60) -> Job:
    last: list[Job] = []

    def check() -> Job | None:
        job = read()
        last[:] = [job]
        return job if pred(job) else None

    try:
        return slurm_cluster.wait_for(check, timeout, what=what)
    except AssertionError as exc:
        seen = last[0] if last else None
        detail = f"{seen.state.value} reason={seen.reason!r} held={seen.held}" if seen else "never read"
        raise AssertionError(f"{exc}; job was {detail}") from None


def output(tmp_path: Path, job_id: int) -> str:
    path = tmp_path / f"out-{job_id}.txt"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("backend_name", backends())
def test_contract_snapshot_and_unknown_jobs(slurm_cluster, backend_name: str) -> None:
    backend = make_backend(backend_name)
    state = backend.snapshot()
    assert isinstance(state, ClusterState)
    assert set(slurm_cluster.nodes) <= {n.name for n in state.nodes}
    for name in slurm_cluster.nodes:
        assert state.node(name).gpus == slurm_cluster.gpus_per_node
    assert state.slurm_version.split(".")[:2] == slurm_cluster.slurm_version.split(".")[:2]
    if isinstance(backend, CliBackend):
        before = backend.calls
        backend.snapshot()
        assert backend.calls - before == 2  # squeue --json + one node call, whatever the job count
    unknown = 999_999
    for action in (backend.hold, backend.requeue_hold, backend.release, backend.cancel,
                   lambda j: backend.signal(j, "USR2"),
                   lambda j: backend.set_resources(j, RequestShape(1, 1, 1, 100))):
        with pytest.raises(UnknownJob, match="Invalid job id"):
            action(unknown)


@pytest.mark.parametrize("backend_name", backends())
def test_contract_hold_release_cancel_pending_job(slurm_cluster, backend_name: str, tmp_path: Path) -> None:
    backend = make_backend(backend_name)
    jid = backend.submit(elastic_job(tmp_path, nodes=1, gpus=1, extra=("--begin=now+3600",),
                                     partition=slurm_cluster.partition))
    try:
        job = job_in(backend, jid)
        assert job.state is JobState.PENDING and not job.held and job.elastic
        backend.hold(jid)
        assert job_in(backend, jid).held
        backend.release(jid)
        assert not job_in(backend, jid).held
        backend.hold(jid)
        backend.cancel(jid)
        job = job_in(backend, jid)
        # 24.11 and 26.05 keep "hold": true on a held job after it is cancelled: it is not held
        assert job.state is JobState.CANCELLED and not job.held
        with pytest.raises(SlurmError, match="already completing or completed") as info:
            backend.cancel(jid)  # pyslurm's cancel returns silently here; the backend must not
        assert type(info.value) is SlurmError
    finally:
        slurm_cluster.cancel(jid)


def test_exclude_nodes_keeps_the_jobs_own_list_and_readmits_only_what_came_back(slurm_cluster,
                                                                                tmp_path: Path) -> None:
    """ExcNodeList replaces the job's list: the node the user excluded stays, a readmitted node leaves it,
    and an empty list clears it (`ExcNodeList=` on every version claimed)."""
    backend = CliBackend()
    first, second = slurm_cluster.nodes[0], slurm_cluster.nodes[1]
    jid = backend.submit(elastic_job(tmp_path, nodes=1, gpus=1, extra=("--begin=now+3600", f"--exclude={first}"),
                                     partition=slurm_cluster.partition))
    try:
        assert backend._excluded(jid) == (first,)
        backend.exclude_nodes(jid, (second,))
        assert set(backend._excluded(jid)) == {first, second}
        backend.exclude_nodes(jid, (), readmit=(second,))
        assert backend._excluded(jid) == (first,)
        backend.exclude_nodes(jid, (), readmit=(first,))
        assert backend._excluded(jid) == ()
    finally:
        slurm_cluster.cancel(jid)


def test_resize_protocol_steps(slurm_cluster, tmp_path: Path) -> None:
    """submit 2x2 -> signal -> requeue_hold -> set_resources 1x3 -> release -> runs with 3 GPUs on 1 node."""
    backend = CliBackend()
    watcher = Watcher()  # sees every step: the controller's own requeue must not look like Slurm's
    jid = backend.submit(elastic_job(tmp_path, nodes=2, gpus=2, partition=slurm_cluster.partition))

    def job_now() -> Job:
        state = backend.snapshot()
        assert not [e for e in watcher.observe(state) if isinstance(e, JobRequeuedBySlurm) and e.job_id == jid]
        return state.job(jid)

    try:
        job = wait_for_job(slurm_cluster, job_now, lambda j: j.state is JobState.RUNNING, "running")
        assert (job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb) == (2, 2, 1, 500)
        assert (job.cpus_per_node, job.mem_per_node_mb) == (2, 1000)  # 2 GPUs x 500 MB per node, not 500
        assert job.spec is not None and job.requeue and job.restarts == 0 and len(job.nodes) == 2
        slurm_cluster.wait_for(lambda: output(tmp_path, jid).count("gpus=2") == 2, 30, what="both steps started")

        backend.signal(jid, "USR2")
        slurm_cluster.wait_for(lambda: output(tmp_path, jid).count("got USR2") == 3, 30,
                               what="USR2 in the batch shell and both srun tasks")
        out = output(tmp_path, jid)
        assert "batch got USR2" in out and "step 0 on" in out and "step 1 on" in out
        assert job_now().state is JobState.RUNNING  # the signal alone does not end the job

        backend.requeue_hold(jid)
        job = wait_for_job(slurm_cluster, job_now, lambda j: j.state is JobState.PENDING and j.held, "held")
        requeued_at = time.monotonic()
        assert job.restarts == 1
        backend.set_resources(jid, RequestShape(1, 3, 1, 500))
        job = job_now()
        assert (job.num_nodes, job.gpus_per_node, job.held) == (1, 3, True)
        # Slurm refuses a launch within the second of the requeue that revoked the job's credential
        # ("Job credential revoked", the job ends FAILED); the controller keeps the same gap
        # (RequeueProtocol._credential_gap).
        time.sleep(max(0.0, requeued_at + ProtocolSettings().credential_gap_s - time.monotonic()))
        backend.release(jid)
        job = wait_for_job(slurm_cluster, job_now, lambda j: j.state is JobState.RUNNING, "running again", 30)
        assert (len(job.nodes), job.num_nodes, job.gpus_per_node, job.restarts) == (1, 1, 3, 1)
        slurm_cluster.wait_for(lambda: "start restart=1 nodes=1 gpus_on_node=3" in output(tmp_path, jid), 30,
                               what="the batch script restarted with 3 GPUs on 1 node")
        slurm_cluster.wait_for(lambda: "gpus=3" in output(tmp_path, jid), 30, what="the srun step with 3 GPUs")
    except AssertionError:
        # Seen once on 26.05.5 (not reproduced): the job COMPLETED after USR2. What the job printed and
        # what Slurm says of it are what would tell why.
        shown = subprocess.run(["scontrol", "show", "job", str(jid)], capture_output=True, text=True, check=False)
        print(f"job {jid} output:\n{output(tmp_path, jid)}\nscontrol show job:\n{shown.stdout}{shown.stderr}")
        raise
    finally:
        slurm_cluster.cancel(jid)


GROW_BATCH = """#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0}"
unset SLURM_CPUS_PER_GPU SLURM_MEM_PER_GPU SLURM_GPUS_PER_NODE SLURM_TRES_PER_TASK
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then srun --ntasks=3 --ntasks-per-node=3 echo task-ran; fi
sleep 600
"""


def test_a_job_grown_past_its_submitted_cpus_starts_a_task_per_gpu(slurm_cluster, tmp_path: Path) -> None:
    """Submitted at 1 GPU (1 CPU), resized to 3 GPUs with 1 CPU each: the released job runs a 3-task step, as
    the templates' srun does. Before the resize set the CPU count too, the job kept the 1 CPU of its
    submission and srun refused ("More processors requested than permitted"; seen live on 22.05)."""
    backend = CliBackend()
    script = tmp_path / "grow.sh"
    script.write_text(GROW_BATCH)
    script.chmod(0o755)
    spec = ElasticSpec(1, 8, cpus_per_gpu=1, mem_per_gpu_mb=500)
    jid = backend.submit(SubmitDescription(script=str(script), shape=RequestShape(1, 1, 1, 500),
                                           comment=spec.to_comment(), job_name="elastic-grow", workdir=str(tmp_path),
                                           extra_args=(f"--output={tmp_path}/out-%j.txt",
                                                       f"--partition={slurm_cluster.partition}")))
    try:
        wait_job(slurm_cluster, backend, jid, lambda j: j.state is JobState.RUNNING, "running")
        slurm_cluster.wait_for(lambda: "start restart=0" in output(tmp_path, jid), 30, what="the first start")
        backend.requeue_hold(jid)
        wait_job(slurm_cluster, backend, jid, lambda j: j.state is JobState.PENDING and j.held, "held")
        requeued_at = time.monotonic()
        backend.set_resources(jid, RequestShape(1, 3, 1, 500))
        time.sleep(max(0.0, requeued_at + ProtocolSettings().credential_gap_s - time.monotonic()))   # as test_resize_protocol_steps
        backend.release(jid)
        job = wait_job(slurm_cluster, backend, jid, lambda j: j.state is JobState.RUNNING, "running again", 30)
        assert (job.gpus_per_node, job.cpus_per_node) == (3, 3), (job.gpus_per_node, job.cpus_per_node)
        slurm_cluster.wait_for(lambda: output(tmp_path, jid).count("task-ran") == 3, 30,
                               what=f"3 tasks of the grown job's step; output: {output(tmp_path, jid)[-500:]}")
    finally:
        slurm_cluster.cancel(jid)


class EventLog:
    """Runs `watch()` in a thread and timestamps every event (monotonic seconds)."""

    def __init__(self, backend: Backend, *, interval_s: float, grace_s: float, wake: WakeFile | None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.seen: list[tuple[float, object]] = []
        self._stop = False
        self.watcher = Watcher(grace_s=grace_s)
        self._thread = threading.Thread(target=self._run, args=(backend, interval_s, wake), daemon=True)
        self._thread.start()

    def _run(self, backend, interval_s, wake) -> None:
        for ev in watch(backend, interval_s=interval_s, wake=wake, stop=lambda: self._stop, watcher=self.watcher):
            self.events.put((time.monotonic(), ev))

    def first(self, pred: Callable[[object], bool], timeout: float) -> tuple[float, object]:
        for t, ev in self.seen:
            if pred(ev):
                return t, ev
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, ev = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append((t, ev))
            if pred(ev):
                return t, ev
        raise AssertionError(f"no matching event within {timeout:.0f} s; saw {[e for _, e in self.seen]}")

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=30)


def test_node_down_up_and_spare(slurm_cluster, tmp_path: Path, record_property) -> None:
    """One node failure: NodeLost and JobRequeuedBySlurm; then node-up and a spare give NodeGained.

    Measures seconds from the kill to the NodeLost event against seconds until Slurm marks the
    node DOWN, and when the strigger wake-up hint fired.
    """
    local = slurm_cluster.require_local()
    victim = slurm_cluster.nodes[-1]
    backend = CliBackend()
    jid = backend.submit(elastic_job(tmp_path, nodes=1, gpus=1, extra=(f"--nodelist={victim}",),
                                     partition=slurm_cluster.partition))
    trigger_ids: list[int] = []
    log = None
    try:
        wait_job(slurm_cluster, backend, jid, lambda j: j.state is JobState.RUNNING, "running")
        wake_path = tmp_path / "wake"
        try:
            trigger_ids = install_wake_triggers(tmp_path / "wake.sh", wake_path)
        except Exception as exc:  # a site cluster may refuse triggers to non-SlurmUser callers
            pytest.fail(f"strigger on the local cluster failed: {exc}")
        log = EventLog(backend, interval_s=1.0, grace_s=5.0, wake=WakeFile(wake_path))
        time.sleep(2.5)  # a baseline snapshot before the failure

        t0 = time.monotonic()
        local.node_down(victim)
        marks: dict[str, float] = {}

        def slurm_marked_down() -> bool:
            state = slurm_cluster.node_state(victim)
            now = time.monotonic() - t0
            if "NOT_RESPONDING" in state:
                marks.setdefault("not_responding_s", now)
            if wake_path.exists():
                marks.setdefault("strigger_wake_s", now)
            if state.startswith("DOWN"):
                marks.setdefault("slurm_down_s", now)
            return "slurm_down_s" in marks

        slurm_cluster.wait_for(slurm_marked_down, 90, interval=0.25, what=f"Slurm to mark {victim} DOWN")
        t_lost, lost = log.first(lambda e: isinstance(e, NodeLost) and e.node == victim, 30)
        t_req, req = log.first(lambda e: isinstance(e, JobRequeuedBySlurm) and e.job_id == jid, 30)
        assert req.restarts == 1 and victim in req.nodes and victim in req.lost_nodes
        # No false loss of ours: the watcher's early call (not responding past the grace) named no other
        # node - the grace is there for 24.11's sub-second blip. A node Slurm itself set DOWN is a loss
        # the watcher must report: 24.11.5 sets healthy nodes DOWN for a second when a ping round that
        # waits on the dead node outlasts the short SlurmdTimeout ('Nodes n[1-4] not responding';
        # tests/conftest.py, NODE_FAILURE_SLURMD_TIMEOUT_S).
        others = [e for _, e in log.seen
                  if isinstance(e, NodeLost) and e.node != victim and e.node in slurm_cluster.nodes]
        assert not [e for e in others if e.reason != "down"], others
        if others:
            print(f"\nSlurm itself set DOWN (not our call): {others}")
        slurm_cluster.wait_for(lambda: wake_path.exists() or None, 60, what="the strigger wake-up hint")
        marks.setdefault("strigger_wake_s", time.monotonic() - t0)
        figures = {"node_lost_event_s": round(t_lost - t0, 2), "lost_reason": lost.reason,
                   "slurm_down_s": round(marks["slurm_down_s"], 2),
                   "not_responding_seen_s": round(marks.get("not_responding_s", float("nan")), 2),
                   "requeued_event_s": round(t_req - t0, 2), "strigger_wake_s": round(marks["strigger_wake_s"], 2)}
        record_property("detection_latency", json.dumps(figures))
        print(f"\nDETECTION LATENCY (Slurm {slurm_cluster.slurm_version}): {json.dumps(figures)}")

        t1 = time.monotonic()
        local.node_up(victim)
        t_gain, _ = log.first(lambda e: isinstance(e, NodeGained) and e.node == victim, 30)
        spare = slurm_cluster.spares[0] if slurm_cluster.spares else None
        if spare is not None:
            local.node_up(spare)
            _, gained = log.first(lambda e: isinstance(e, NodeGained) and e.node == spare, 30)
            assert gained.reason in ("resumed", "new")
        print(f"node-up -> NodeGained: {t_gain - t1:.2f} s")
    finally:
        if log is not None:
            log.stop()
        if trigger_ids:
            clear_triggers(trigger_ids)
        slurm_cluster.cancel(jid)
        slurm_cluster.restore()


def test_spare_start_drain_and_resume(slurm_cluster) -> None:
    """A started spare is gained; draining it is a loss; resuming it a gain again (no node failure needed)."""
    local = slurm_cluster.require_local()
    if not slurm_cluster.spares:
        pytest.skip("the local cluster has no spare node")
    spare = slurm_cluster.spares[-1]
    backend = CliBackend()
    w = Watcher(grace_s=5.0)
    w.observe(backend.snapshot())
    try:
        local.node_up(spare)
        started = [(e.node, e.reason) for e in w.observe(backend.snapshot()) if isinstance(e, NodeGained)]
        assert started == [(spare, "resumed")]  # it was in the snapshot before, DOWN as a spare
        slurm_cluster.run("scontrol", "update", f"NodeName={spare}", "State=DRAIN", "Reason=slurm-elastic test")
        lost = [e for e in w.observe(backend.snapshot()) if isinstance(e, NodeLost)]
        assert [(e.node, e.reason, e.detail) for e in lost] == [(spare, "drained", "slurm-elastic test")]
        slurm_cluster.run("scontrol", "update", f"NodeName={spare}", "State=RESUME")
        gained = [e for e in w.observe(backend.snapshot()) if isinstance(e, NodeGained)]
        assert [(e.node, e.reason) for e in gained] == [(spare, "resumed")]
    finally:
        slurm_cluster.restore()
