"""The fault soak (scripts/fault_soak.py), short: generations of random traffic on 3 ranks, each broken
by a fault drawn at random (an abort on one rank or on all, a rank that stalls, a mismatched collective,
a rank sitting a generation out) and recovered by a reconfigure. Every result a call returned is
checked, every failure bounded in time, and nothing is left: descriptors and threads as before the
group, /dev/shm as before the job. The long run and its numbers: docs/fault-tolerance.md."""

import json
import os
import sys

import pytest

from mpirun import run_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_fault_soak(transport):
    proc = run_launcher([sys.executable, "-W", "ignore", os.path.join(ROOT, "scripts", "fault_soak.py"),
                         "--ranks", "3", "--generations", "24", "--seed", "5", "--transport", transport,
                         "--timeout", "2", "--hang", "60"], 300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("FAULT SOAK ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(line[len("FAULT SOAK "):])
    assert proc.returncode == 0 and not summary["problems"], (summary, proc.stderr[-5000:])
    # every kind of fault struck, and calls both failed and returned (checked) under them
    assert summary["checked_results_all_ranks"] > 300 and summary["failed_calls_all_ranks"] > 0, summary
    assert summary["faults"] == sorted(["none", "abort_one", "abort_all", "stall", "mismatch", "sit_out"]), summary
