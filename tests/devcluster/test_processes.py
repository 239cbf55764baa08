"""Process identity checks: a pid is signalled only when /proc says it is ours."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from slurm_elastic.devcluster import processes
from slurm_elastic.devcluster.processes import Identity


def test_identity_needs_program_name_and_every_marker() -> None:
    ours = Identity("slurmd", ("/s/etc/slurm.conf", "-N\0n2"))
    assert ours.matches(["/usr/sbin/slurmd", "-f", "/s/etc/slurm.conf", "-N", "n2"])
    assert not ours.matches(["/usr/sbin/slurmd", "-f", "/s/etc/slurm.conf", "-N", "n3"])
    assert not ours.matches(["/usr/sbin/slurmd", "-N", "n2"])  # another cluster's slurmd
    assert not ours.matches(["/usr/bin/python3", "-f", "/s/etc/slurm.conf", "-N", "n2"])
    assert not ours.matches([])


def test_verified_pid_rejects_reused_or_stale_pids(tmp_path: Path) -> None:
    pid_file = tmp_path / "x.pid"
    assert processes.verified_pid(pid_file, Identity("sleep", ())) is None  # no file
    child = subprocess.Popen(["sleep", "29.123"])
    try:
        pid_file.write_text(f"{child.pid}\n")
        while processes.cmdline(child.pid) is None:  # argv appears a moment after exec
            time.sleep(0.01)
        assert processes.verified_pid(pid_file, Identity("sleep", ("29.123",))) == child.pid
        # Same pid, but not the process we started: a pid reused by something else.
        assert processes.verified_pid(pid_file, Identity("sleep", ("29.124",))) is None
        assert processes.verified_pid(pid_file, Identity("slurmd", ())) is None
    finally:
        child.kill()
        child.wait()
    assert processes.verified_pid(pid_file, Identity("sleep", ("29.123",))) is None  # stale
    pid_file.write_text("garbage")
    assert processes.read_pid(pid_file) is None


def test_descendants_and_stop() -> None:
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        kids = processes.descendants([parent.pid])
        for _ in range(50):
            if kids:
                break
            time.sleep(0.05)
            kids = processes.descendants([parent.pid])
        assert len(kids) == 1 and processes.cmdline(kids[0])[0] == "sleep"
        assert processes.stop([*kids, parent.pid], grace=2.0) == []
        assert not processes.is_alive(kids[0])
    finally:
        parent.kill()
        parent.wait()


def test_port_free_sees_a_listener() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.listen()
        assert not processes.port_free(port)
    assert processes.port_free(port)


def test_stepds_are_found_by_their_open_log_file(tmp_path: Path) -> None:
    log_file = tmp_path / "slurmd-n1.log"
    log_file.touch()
    # A process named slurmstepd that holds the node's log open, like a real step daemon.
    fake = subprocess.Popen(
        ["bash", "-c", f"exec -a 'slurmstepd: [1.batch]' sleep 30 3>>{log_file}"],
    )
    try:
        for _ in range(50):
            if processes.stepds_writing([log_file]):
                break
            time.sleep(0.05)
        assert processes.stepds_writing([log_file]) == [fake.pid]
        assert processes.stepds_writing([tmp_path / "slurmd-n2.log"]) == []
    finally:
        fake.kill()
        fake.wait()


def test_an_srun_that_outlived_its_batch_script_is_found_by_the_cluster_it_ran_against(tmp_path: Path) -> None:
    """`cluster down` must see a job's srun whose batch script was killed (its parent is then init)."""
    conf = str(tmp_path / "etc" / "slurm.conf")

    def start(name: str, slurm_conf: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", f"exec -a {name} sleep 60"], env={"SLURM_CONF": slurm_conf})

    ours, other_cluster, not_srun = start("srun", conf), start("srun", conf + ".other"), start("sleep", conf)
    try:
        deadline = time.monotonic() + 10
        while ours.pid not in processes.clients_of(conf) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = processes.clients_of(conf)
        assert ours.pid in found
        assert other_cluster.pid not in found and not_srun.pid not in found
    finally:
        for p in (ours, other_cluster, not_srun):
            p.kill()
            p.wait()


# A parent and a child in its own process group (same session) that, like srun's shepherd, acts on the
# parent's end: it writes a mark when its pipe from the parent closes.
_SHEPHERD = """
import os, signal, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setpgid(0, 0)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.close(w)
    print(os.getpid(), flush=True)
    os.read(r, 1)                      # EOF: the parent is gone
    open(sys.argv[1], "w").write("acted")
    os._exit(0)
os.close(r)
time.sleep(60)
"""


def _stopped_pair(tmp_path: Path, name: str) -> tuple[subprocess.Popen, int, Path]:
    mark = tmp_path / name
    parent = subprocess.Popen([sys.executable, "-c", _SHEPHERD, str(mark)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)   # as the batch script: its session is its own
    child = int(parent.stdout.readline())
    for pid in (parent.pid, child):
        processes.send(pid, signal.SIGSTOP)
    return parent, child, mark


def _kill_in_order(order: list[int], parent: subprocess.Popen, child: int) -> None:
    """SIGKILL each in turn. Linux sends SIGHUP and SIGCONT to the stopped members of a process group that a
    death orphans, but whether it does depends on the kernel and on who reaps the orphan (CI's sandbox did
    not), so after each kill this sends the SIGCONT itself and gives a continued child the time to act."""
    for pid in order:
        processes.send(pid, signal.SIGKILL)
        if pid == parent.pid:
            parent.wait()
        processes.send(child, signal.SIGCONT)
        processes.wait_gone([child], 10)


def test_killed_children_first_a_stopped_child_never_acts_on_its_parents_end(tmp_path: Path) -> None:
    """LocalCluster.node_down's order: killed parent first, the continued child runs on and acts on its
    parent's end (srun's shepherd cancelled the step, killing the other nodes' ranks); killed children
    first, it never runs again."""
    parent, child, mark = _stopped_pair(tmp_path, "parent-first")
    try:
        _kill_in_order([parent.pid, child], parent, child)
        assert mark.exists(), "the continued child did not act on its parent's end (the premise)"
    finally:
        processes.send(child, signal.SIGKILL)

    parent, child, mark = _stopped_pair(tmp_path, "children-first")
    try:
        assert processes.children_first([parent.pid, child]) == [child, parent.pid]
        assert processes.children_first([child, parent.pid]) == [child, parent.pid]
        _kill_in_order(processes.children_first([parent.pid, child]), parent, child)
        assert not mark.exists()
    finally:
        processes.send(child, signal.SIGKILL)
