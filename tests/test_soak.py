"""The short soak: 3,000 mixed operations on 2-3 ranks and every transport, every result checked, memory and fds steady.
The long one (20,000) is scripts/soak.py; its result is in docs/robustness.md."""

import json
import os
import sys

import pytest

from mpirun import mpi_env, mpiexec_command, run_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("transport, nranks", [("shm", 3), ("mpi", 3), ("tcp", 3), ("tcp", 2)])
def test_short_soak(transport, nranks):
    """On 2 ranks the second group (the even ranks) is a group of one."""
    cmd = mpiexec_command(nranks) + [sys.executable, "-W", "ignore", os.path.join(ROOT, "scripts", "soak.py"),
                                "--ops", "3000", "--seed", "7"]
    proc = run_launcher(cmd, 300, env={**mpi_env(), "ENGINE_TRANSPORT": transport})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if "SOAK " in l)
    summary = json.loads(line.split("SOAK ", 1)[1])
    assert summary["wrong"] == 0 and summary["checked_results_all_ranks"] > 3000
    assert summary["max_rss_growth_mb"] < 50 and summary["max_fd_delta"] == 0
