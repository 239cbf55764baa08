"""A model on which HiGHS aborted the whole process (heap corruption in free()) solves: the controller
must not die inside its solver. The model is one the progress objective built in the simulator (workload 1,
fixed batches), kept with the feasible warm start that triggered the abort."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODEL = Path(__file__).parent / "data" / "highs_warm_start_abort.npz"

SOLVE = """
import sys
import numpy as np
from slurm_elastic.allocate import highs
d = np.load(sys.argv[1], allow_pickle=False)
m = highs.Model()
for c, lo, hi, integer in zip(d["cost"], d["lower"], d["upper"], d["integer"]):
    m.add_col(float(c), float(lo), float(hi), bool(integer))
m.add_rows(len(d["row_lo"]), d["row_lo"].tolist(), d["row_hi"].tolist())
m.add_entries(d["rows"], d["cols"], d["vals"])
m.offset = float(d["offset"])
r = highs.solve(m, limits=highs.Limits(max_nodes=1000, threads=1, seed=0), mip_rel_gap=float(d["mip_rel_gap"]),
                warm=d["warm"])
print(r.status, r.objective, m.objective_of(d["warm"]))
"""


def test_the_model_that_aborted_highs_solves_to_optimal_at_least_as_good_as_its_warm_start():
    run = subprocess.run([sys.executable, "-c", SOLVE, str(MODEL)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    status, objective, warm = run.stdout.split()[-3:]
    assert status == "Optimal" and float(objective) >= float(warm) - 1e-6, run.stdout
