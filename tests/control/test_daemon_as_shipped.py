"""The daemon as shipped: the unit's own ExecStart starts it, metrics are valid Prometheus text on loopback."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_elastic.control.plugin import installed_entry_point, unit_file_source

import tcp_listeners  # tests/tcp_listeners.py

ENTRY = Path(sys.executable).parent / "slurm-elastic"


def _unit_from_cli() -> str:
    proc = subprocess.run([str(ENTRY), "admin", "unit"], capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout


def _exec_start(unit: str) -> list[str]:
    lines = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].removeprefix("ExecStart="))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_unit_runs_this_installation_by_absolute_path() -> None:
    unit = _unit_from_cli()
    argv = _exec_start(unit)
    assert argv[0] == str(ENTRY) and Path(argv[0]).is_absolute() and os.access(argv[0], os.X_OK)
    assert "@SLURM_ELASTIC@" not in unit
    assert unit == unit_file_source() and installed_entry_point() == ENTRY


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    path = tmp_path / "slurm-elastic.service"
    path.write_text(_unit_from_cli())
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=120)
    # verify also reports on units this one names (network-online.target, slurmctld.service): only
    # lines about our own file count.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if path.name in line]
    assert ours == [], "\n".join(ours)


def _scrape(port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slurm
def test_the_units_command_line_starts_and_serves_metrics_on_loopback(elastic_cluster, tmp_path: Path) -> None:
    cluster = elastic_cluster
    argv = _exec_start(_unit_from_cli())
    port = _free_port()
    argv[argv.index("--metrics-port") + 1] = str(port)   # the shipped 9464 may be taken on this host
    log = tmp_path / "daemon.log"
    env = {**cluster.env, "SLURM_ELASTIC_DAEMON_DIR": str(tmp_path / "state")}
    with open(log, "w") as out:
        st = os.fstat(out.fileno())
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"   # what systemd sets: stderr is the journal
        daemon = subprocess.Popen(argv, env=env, stdout=out, stderr=out, text=True)
    try:
        text = _scrape(port, timeout=90)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert {"slurm_elastic_cycle_seconds", "slurm_elastic_gpus", "slurm_elastic_plans"} <= set(families), \
            sorted(families)
        addresses = tcp_listeners.listeners_on(port)
        assert addresses == ["127.0.0.1"], addresses
        cluster.wait_for(lambda: "reconcile loop started" in log.read_text(), 60, what="a log line")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(120)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert rc == 0, "\n".join(lines[-20:])
    logged = [line for line in lines if not line.startswith("slurm-elastic daemon:")]
    assert logged and all(line[:1] == "<" and line[2:3] == ">" and line[1].isdigit() for line in logged), logged
    assert any(line.startswith("<6>slurm_elastic.control.daemon: reconcile loop started") for line in logged), logged
    assert not any(line[3:7].isdigit() and line[7:8] == "-" for line in logged), "journald stamps time itself"


def test_metrics_on_a_bad_address_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_ELASTIC_DAEMON_DIR": str(tmp_path / "state")}
    proc = subprocess.run([str(ENTRY), "admin", "daemon", "--metrics-port", str(_free_port()),
                           "--metrics-addr", "no-such-host.invalid", "--max-cycles", "1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "cannot serve metrics on no-such-host.invalid" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
