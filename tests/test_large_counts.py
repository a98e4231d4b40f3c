"""Tensors over 2**31 elements: correct through the ring and the chunked native collectives (2 ranks,
about 2 GiB per buffer per rank)."""

import os
import sys

import pytest

from mpirun import mpi_env, mpiexec_command, run_launcher

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("transport", ["shm", "mpi"])
def test_over_two_billion_elements(transport):
    proc = run_launcher(mpiexec_command(2) + [sys.executable, os.path.join(HERE, "mpi", "large_counts.py")],
                        600, env={**mpi_env(), "ENGINE_TRANSPORT": transport})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for what in ("allreduce", "broadcast"):
        assert proc.stdout.count(f": {what} ok") == 2, proc.stdout
    assert "rank 0: reduce ok" in proc.stdout
