"""Another user's entry at a job's directory name is moved aside by the admin daemon, so it cannot block the job."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.control.job_dirs import JobDirGuard
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec
from slurm_elastic.train.jobdir import JobDir

FAST = ProtocolSettings(ack_timeout_s=0.1, settle_timeout_s=0.5)
ME = os.getuid()
ALICE = ME + 1     # the job's user
# Whose the entries this test makes are: another user's to alice's job (as root, handed to a third uid: the
# guard leaves root's own entries alone).
SQUATTER = ALICE + 1 if ME == 0 else ME


def _squat(path: Path) -> Path:
    if ME == 0:
        os.lchown(path, SQUATTER, SQUATTER)
    return path


def _cluster(tmp_path: Path) -> tuple[InMemorySlurm, Path, int]:
    slurm = InMemorySlurm(ack=False)   # its stand-in shim would write the ACK into the job directory itself
    root = tmp_path / "scratch"
    root.mkdir(mode=0o1777)
    os.chmod(root, 0o1777)
    job = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(root)), nodes=1, gpus_per_node=1, user="alice", run=False)
    return slurm, root, job


def _reconciler(slurm: InMemorySlurm, tmp_path: Path, **config) -> Reconciler:
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), ControllerConfig(node_confirm_s=0, protocol=FAST, **config))
    rec.job_dirs = JobDirGuard(uid_of=lambda user: ALICE if user == "alice" else None)
    return rec


def test_a_directory_another_user_made_at_a_jobs_name_is_moved_aside_with_one_line(tmp_path, caplog):
    slurm, root, job = _cluster(tmp_path)
    squat = root / str(job)
    squat.mkdir(mode=0o777)
    (squat / "planted").write_text("x")
    _squat(squat)
    rec = _reconciler(slurm, tmp_path)
    rec.cycle()
    assert not squat.exists()
    [aside] = [p for p in root.iterdir() if p.name.startswith(f"{job}.moved-aside-{SQUATTER}-")]
    assert (aside / "planted").read_text() == "x"                     # moved, not read or deleted
    rec.cycle()
    assert sum("moved aside" in r.getMessage() for r in caplog.records) == 1


def test_a_link_at_a_jobs_name_is_moved_not_followed(tmp_path):
    slurm, root, job = _cluster(tmp_path)
    target = tmp_path / "victim"
    target.mkdir()
    (root / str(job)).symlink_to(target)
    _squat(root / str(job))
    _reconciler(slurm, tmp_path).cycle()
    assert not (root / str(job)).is_symlink() and target.is_dir() and not any(target.iterdir())


def test_the_jobs_own_directory_and_user_mode_are_left_alone(tmp_path):
    slurm, root, job = _cluster(tmp_path)
    own = root / str(job)
    own.mkdir(mode=0o700)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), ControllerConfig(node_confirm_s=0, protocol=FAST))
    rec.job_dirs = JobDirGuard(uid_of=lambda user: ME)                 # the entry is the job user's own
    rec.cycle()
    assert own.is_dir()

def test_a_user_mode_controller_never_renames(tmp_path):
    slurm, root, job = _cluster(tmp_path)
    squat = root / str(job)
    squat.mkdir(mode=0o777)
    _reconciler(slurm, tmp_path, user="alice").cycle()
    assert squat.is_dir()


def test_after_the_move_the_jobs_shim_creates_its_own_directory(tmp_path):
    slurm, root, job = _cluster(tmp_path)
    (root / str(job)).mkdir(mode=0o755)
    _squat(root / str(job))
    _reconciler(slurm, tmp_path).cycle()
    d = JobDir.open(str(root / str(job)), create=True)                # as the job's user would
    assert d is not None and os.stat(d.path).st_mode & 0o777 == 0o700


def test_outside_a_shared_sticky_root_or_for_roots_own_entry_nothing_is_renamed(tmp_path, caplog):
    """The root comes from the job's comment, which its user writes (seen: `--ckpt-dir /home/bob/private`, a
    comment naming a root-owned /etc directory): the daemon renames only what undoes a squat in a shared
    sticky root, never an entry in a directory that is not one, nor root's own entry."""
    slurm = InMemorySlurm(ack=False)
    private = tmp_path / "private"                  # another user's (or root's) own directory: not sticky
    private.mkdir(mode=0o700)
    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    a = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(private)), nodes=1, gpus_per_node=1, user="alice", run=False)
    b = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(shared)), nodes=1, gpus_per_node=1, user="alice", run=False)
    victim = private / str(a)
    victim.mkdir()
    _squat(victim)
    roots = shared / str(b)
    roots.mkdir()                                   # ME's: root's when the tests run as root
    rec = _reconciler(slurm, tmp_path)
    rec.cycle()
    rec.cycle()
    assert victim.is_dir() and not [p for p in private.iterdir() if "moved-aside" in p.name]
    left = [r.getMessage() for r in caplog.records if "left as it is" in r.getMessage()]
    assert any(f"job {a}:" in m and "not a shared sticky directory" in m for m in left), left
    if ME == 0:
        assert roots.is_dir() and any(f"job {b}:" in m and "it is root's" in m for m in left), left
    assert len(left) == (2 if ME == 0 else 1)      # once per entry, not every cycle
