"""The controller against other users and a changing world: stale views, the lock, two controllers, a full disk.

Issue 14, classes 2, 3, 4 and the daemon's state dir on a full disk (class 9),
on the private live cluster with a real unprivileged user:
- a job its owner cancels while the daemon waits for the checkpoint ACK is
  never requeued, resized or released (the plan is abandoned, journaled);
- no other user can take `controller.lock` or read the journal; a state dir
  owned by someone else is refused; a busy lock names its real holder;
- the daemon's heartbeat stays fresh through a long ACK wait, so a user's
  `watch` defers instead of acting mid-plan; a heartbeat from the future,
  from a dead pid or written by another user is not trusted;
- a daemon state dir on a full disk gives one line and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import sqlite3
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.cluster.model import JobState
from slurm_elastic.spec import ElasticSpec



# -- helpers -----------------------------------------------------------------------------------------------
def _daemon_dir(cluster: Any) -> Path:
    return Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"])


def _plans(journal: Path, job_id: int) -> list[dict[str, Any]]:
    """The journal's plans of one job with their steps, read-only (the daemon owns the journal)."""
    if not journal.exists():
        return []
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT plan_id, status, step, note FROM plans WHERE job_id=? ORDER BY plan_id",
                          (job_id,)).fetchall()
        out = []
        for plan_id, status, step, note in rows:
            steps = [s for (s,) in db.execute("SELECT step FROM steps WHERE plan_id=? ORDER BY rowid", (plan_id,))]
            out.append({"plan_id": plan_id, "status": status, "step": step, "note": note, "steps": steps})
        return out
    except sqlite3.Error:
        return []
    finally:
        db.close()


def _as_user(cluster: Any, user: str, argv: list[str], *, extra: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in {**cluster.env, **(extra or {})}.items() if k.startswith(("SLURM", "FAKE", "PATH"))}
    return subprocess.run(["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in env.items()], *argv],
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def _submit_small_as(cluster: Any, user: str, *, step_s: str) -> int:
    """An elastic 6-8 GPU job of `user` started at 4 GPUs (raw sbatch), so a controller plans a grow to 8.

    Below its minimum on purpose: an unmeasured job within its range keeps its size until it has
    written metrics (control/requests.py), and these trainers are too slow to write any.
    """
    spec = ElasticSpec(6, 8, gpu_step=2, ckpt_dir=str(cluster.root / "ckpt"))
    proc = _as_user(cluster, user, [
        "sbatch", "--parsable", f"--comment={spec.to_comment()}", "-N1", "--gres=gpu:4", "--cpus-per-gpu=1",
        "--mem-per-gpu=1024M", "--requeue", f"--output={cluster.root / 'out'}/%j.out",
        str(cluster.root / "fake_trainer.sbatch")],
        extra={"SLURM_ELASTIC_CKPT_DIR": str(cluster.root / "ckpt"), "FAKE_STEP_S": step_s})
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.strip().split(";")[0])
    cluster.wait_for(lambda: cluster.snapshot().job(job_id).state is JobState.RUNNING, 60, what="job running")
    return job_id


def _stop(proc: subprocess.Popen[str], log: Path) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    print(log.read_text()[-4000:])
    return proc.returncode


# -- class 2: the controller acts on a stale view ------------------------------------------------------------
@pytest.mark.slurm
def test_a_job_cancelled_by_its_owner_during_the_ack_wait_is_never_requeued(elastic_cluster: Any, plain_user: str,
                                                                             tmp_path: Path, figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    # 60 s steps: the trainer cannot ACK within the daemon's 20 s, so the plan sits in the ACK wait.
    job = _submit_small_as(cluster, plain_user, step_s="60")
    journal = _daemon_dir(cluster) / "journal.sqlite"
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "1", "--hysteresis", "0", "--ack-timeout", "20",
                           log=log)
    try:
        cluster.wait_for(lambda: any("signal" in p["steps"] for p in _plans(journal, job)), 120,
                         what=lambda: f"the daemon to signal job {job}: {_plans(journal, job)}")
        cancelled = _as_user(cluster, plain_user, ["scancel", str(job)])
        assert cancelled.returncode == 0, cancelled.stderr
        t0 = time.monotonic()
        [plan] = cluster.wait_for(lambda: [p for p in _plans(journal, job) if p["status"] != "open"] or None, 120,
                                  what=lambda: f"the plan of job {job} to end: {_plans(journal, job)}")
        ended_after = time.monotonic() - t0
        time.sleep(5)  # long enough for a requeued job to show up again
        final = cluster.snapshot().job(job)
    finally:
        rc = _stop(daemon, log)
    figures.put(plan_status=plan["status"], plan_steps=plan["steps"], plan_ended_s=round(ended_after, 1),
                job_state=final.state.value)
    assert rc == 0
    assert plan["status"] == "abandoned", plan
    assert not {"hold", "resize", "release"} & set(plan["steps"]), plan
    assert "cancel" in plan["note"].lower() or "ended" in plan["note"].lower(), plan
    assert final.state.finished and final.restarts == 0, (final.state, final.restarts)
    assert [p for p in _plans(journal, job) if p["plan_id"] != plan["plan_id"]] == []


# -- class 3: any user can deny the controller -----------------------------------------------------------------
HOLD_LOCK = """
import fcntl, os, sys, time
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError as exc:
    print("refused", exc.errno, flush=True)
    sys.exit(0)
print("held", flush=True)
sys.stdin.read()   # holds the lock until the test closes our stdin
"""

READ_FILE = """
import sys
try:
    data = open(sys.argv[1], "rb").read(64)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("read", len(data))
"""


@pytest.mark.slurm
def test_no_other_user_can_take_the_lock_or_read_the_journal(elastic_cluster: Any, plain_user: str,
                                                             figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    daemon = ("admin", "daemon", "--interval", "1", "--max-cycles", "1")
    cluster.cli(*daemon, timeout=120)           # creates the state dir, the lock and the journal
    directory = _daemon_dir(cluster)
    lock, journal = directory / "controller.lock", directory / "journal.sqlite"
    holder = subprocess.Popen(["runuser", "-u", plain_user, "--", cluster.user_python, "-c", HOLD_LOCK, str(lock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd="/")
    try:
        said = (holder.stdout.readline() if holder.stdout else "").strip()
        second = cluster.cli(*daemon, check=False, timeout=120)
    finally:
        if holder.stdin:
            holder.stdin.close()   # killing runuser would leave its child holding the lock
        holder.wait(30)
    read = _as_user(cluster, plain_user, [cluster.user_python, "-c", READ_FILE, str(journal)])
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (directory, lock, journal)}
    figures.put(other_user_lock=said, daemon_rc_while_other_user_tried=second.returncode,
                other_user_journal_read=read.stdout.strip(), modes={k: oct(v) for k, v in modes.items()})
    assert said.startswith("refused"), f"{plain_user} took controller.lock: {said}"
    assert second.returncode == 0, second.stderr[-2000:]
    assert read.stdout.startswith("refused"), f"{plain_user} read the journal: {read.stdout}"
    assert modes["controller.lock"] == 0o600 and modes["journal.sqlite"] == 0o600, modes
    assert modes[directory.name] & 0o022 == 0, modes


@pytest.mark.slurm
def test_a_state_dir_of_another_user_is_refused_and_a_busy_lock_names_its_holder(
        elastic_cluster: Any, plain_user: str, tmp_path: Path, figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    planted = cluster.root / "state" / "planted-by-user"
    made = _as_user(cluster, plain_user, ["mkdir", "-p", str(planted)])
    assert made.returncode == 0, made.stderr
    refused = cluster.cli("admin", "daemon", "--interval", "1", "--max-cycles", "1", check=False, timeout=120,
                          env={"SLURM_ELASTIC_DAEMON_DIR": str(planted)})
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    figures.put(foreign_dir_rc=refused.returncode, foreign_dir_stderr=lines)
    assert refused.returncode != 0 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert str(planted) in lines[0] and plain_user in lines[0], lines
    assert sorted(os.listdir(planted)) == [], "nothing of the controller may be written there"

    log = tmp_path / "daemon.log"
    daemon = cluster.spawn("admin", "daemon", "--interval", "5", log=log)
    try:
        cluster.wait_for(lambda: (_daemon_dir(cluster) / "daemon.heartbeat").exists(), 60, what="first heartbeat")
        busy = cluster.cli("admin", "daemon", "--interval", "1", "--max-cycles", "1", check=False, timeout=120)
    finally:
        _stop(daemon, log)
    lines = [ln for ln in busy.stderr.splitlines() if ln.strip()]
    figures.put(busy_stderr=lines)
    assert busy.returncode != 0 and len(lines) == 1, busy.stderr
    assert f"pid {daemon.pid}" in lines[0] and "uid 0" in lines[0], lines


# -- class 4: two controllers on one job -----------------------------------------------------------------------
@pytest.mark.slurm
def test_watch_defers_while_the_daemon_waits_long_for_an_ack(elastic_cluster: Any, plain_user: str,
                                                             tmp_path: Path, figures: Any) -> None:
    from slurm_elastic.control.state_dir import read_heartbeat

    cluster = elastic_cluster
    cluster.cancel_all()
    job = _submit_small_as(cluster, plain_user, step_s="120")   # no ACK within the daemon's 60 s
    directory = _daemon_dir(cluster)
    journal = directory / "journal.sqlite"
    user_journal = Path(cluster.env["SLURM_ELASTIC_STATE_DIR"]) / "journal.sqlite"
    daemon_log, watch_log = tmp_path / "daemon.log", tmp_path / "watch.log"
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "10", "--hysteresis", "0", "--ack-timeout", "60",
                           log=daemon_log)
    watch = None
    ages: list[float] = []
    stale: list[float] = []
    try:
        cluster.wait_for(lambda: any("signal" in p["steps"] for p in _plans(journal, job)), 120,
                         what=lambda: f"the daemon to signal job {job}: {_plans(journal, job)}")
        watch = cluster.spawn("-v", "watch", "--interval", "2", "--hysteresis", "0", "--ack-timeout", "5",
                              log=watch_log, user=plain_user)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and any(p["status"] == "open" for p in _plans(journal, job)):
            beat = read_heartbeat(directory)
            age = float("inf") if beat is None else time.time() - beat.at
            ages.append(age)
            if beat is None or not beat.fresh():
                stale.append(age)
            time.sleep(1)
        plans = _plans(journal, job)
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait(10)
        _stop(daemon, daemon_log)
        cluster.cancel_all()
    watch_text = watch_log.read_text()
    print(watch_text[-3000:])
    figures.put(heartbeat_max_age_s=round(max(ages), 1) if ages else None, stale_reads=len(stale),
                watch_plans=len(_plans(user_journal, job)))
    assert plans and plans[-1]["status"] == "done", plans
    assert len(ages) >= 40, "the ACK wait should have lasted about 60 s"
    assert stale == [], f"the heartbeat went stale mid-plan (ages {stale[:5]})"
    assert _plans(user_journal, job) == [], "the user's watch acted while the daemon was mid-plan"
    assert "deferring" in watch_text


def _write_beat(directory: Path, **fields: Any) -> None:
    from slurm_elastic.control.state_dir import write_heartbeat

    write_heartbeat(directory, 10.0)
    path = directory / "daemon.heartbeat"
    beat = json.loads(path.read_text())
    beat.update(fields)
    path.write_text(json.dumps(beat))


WRITE_BEAT = """
import json, os, socket, sys, time
path = os.path.join(sys.argv[1], "daemon.heartbeat")
with open(path, "w") as f:
    json.dump({"pid": int(sys.argv[2]), "host": socket.gethostname(), "at": time.time(), "interval_s": 10.0,
               "uid": os.getuid()}, f)
"""


@pytest.mark.slurm
def test_watch_trusts_no_future_dead_or_foreign_heartbeat(elastic_cluster: Any, plain_user: str, tmp_path: Path,
                                                          figures: Any) -> None:
    from slurm_elastic.control.protocol import ProtocolSettings
    from slurm_elastic.control.reconcile import ControllerConfig
    from slurm_elastic.control.state_dir import read_heartbeat
    from slurm_elastic.control.user_mode import run_watch

    from control.fake_slurm import FakeSlurm

    seen: dict[str, bool] = {}
    future = tmp_path / "future"
    future.mkdir(mode=0o755)
    _write_beat(future, at=time.time() + 3600)
    dead = tmp_path / "dead"
    dead.mkdir(mode=0o755)
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write_beat(dead, pid=gone.pid, host=socket.gethostname())
    # A shared, world-writable dir where another user wrote a heartbeat naming a live process (ours).
    foreign = elastic_cluster.root / "state" / f"foreign-{os.getpid()}"   # traversable by every user
    foreign.mkdir()
    os.chmod(foreign, 0o1777)
    wrote = subprocess.run(["runuser", "-u", plain_user, "--", elastic_cluster.user_python, "-c", WRITE_BEAT, str(foreign),
                            str(os.getpid())], capture_output=True, text=True, cwd="/", timeout=60)
    assert wrote.returncode == 0, wrote.stderr
    assert (foreign / "daemon.heartbeat").stat().st_uid == pwd.getpwnam(plain_user).pw_uid
    # A root-owned daemon dir whose heartbeat file belongs to another user.
    chowned = tmp_path / "chowned"
    chowned.mkdir(mode=0o755)
    _write_beat(chowned)
    ent = pwd.getpwnam(plain_user)
    os.chown(chowned / "daemon.heartbeat", ent.pw_uid, ent.pw_gid)

    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.1, settle_timeout_s=0.5),
                              min_resize_interval_s=0, node_confirm_s=0)
    for name, directory in (("future", future), ("dead", dead), ("foreign", foreign), ("chowned", chowned)):
        beat = read_heartbeat(directory)
        seen[name] = beat is not None and beat.fresh()
        slurm = FakeSlurm()
        mine = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="alice")
        stop = threading.Event()
        timer = threading.Timer(1.0, lambda s=slurm, m=mine: s.finish(m))
        guard = threading.Timer(20.0, stop.set)    # the old code would defer for ever
        timer.start()
        guard.start()
        try:
            result = run_watch(slurm, "alice", state_dir=tmp_path / f"alice-{name}", daemon_dir=directory,
                               config=config, interval_s=0.05, stop=stop)
        finally:
            timer.cancel()
            guard.cancel()
        seen[f"{name}_watch_deferred"] = result.deferred_cycles > 0
    figures.put(**seen)
    assert not any(seen.values()), seen


# -- class 9: the daemon's state dir on a full disk ----------------------------------------------------------
def _fill(mount: Path) -> None:
    """Write until the filesystem says ENOSPC."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.slurm
@pytest.mark.parametrize("existing", [False, True], ids=["fresh-dir", "existing-state"])
def test_a_daemon_state_dir_on_a_full_disk_says_one_line(elastic_cluster: Any, tmp_path: Path, existing: bool,
                                                         figures: Any) -> None:
    cluster = elastic_cluster
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        env = {"SLURM_ELASTIC_DAEMON_DIR": str(mount / "daemon")}
        args = ("admin", "daemon", "--interval", "1", "--max-cycles", "1")
        if existing:
            cluster.cli(*args, env=env, timeout=120)   # a daemon ran here before the disk filled up
        _fill(mount)
        proc = cluster.cli(*args, env=env, check=False, timeout=120)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    figures.put(rc=proc.returncode, stderr=lines)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert str(mount / "daemon") in lines[0] and "space" in lines[0].lower(), lines
