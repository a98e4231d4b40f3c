"""Every file in tests/mpi/ under mpiexec with 1, 2, 3 and 4 ranks (3 and 4 oversubscribe 2 cores)."""

import glob
import os

import pytest

from mpirun import run_pytest

HERE = os.path.dirname(__file__)
SUITES = sorted(glob.glob(os.path.join(HERE, "mpi", "test_*.py")))


# The torch suite (Gloo beside the engine, DDP) runs at the 2 and 3 ranks, and alone.
RANKS = {"test_torch_backend": [1, 2, 3], "test_torch_training": [2, 3]}
CASES = [(s, n) for s in SUITES for n in RANKS.get(os.path.basename(s)[:-3], [1, 2, 3, 4])]


@pytest.mark.parametrize("suite,nranks", CASES, ids=[f"{os.path.basename(s)[:-3]}-{n}" for s, n in CASES])
def test_suite_under_mpiexec(suite, nranks):
    proc = run_pytest(nranks, suite, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{os.path.basename(suite)} failed with {nranks} ranks (exit {proc.returncode}):\n"
                    f"{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}", pytrace=False)


def test_collectives_with_tiny_mpi_chunks():
    """ENGINE_MPI_CHUNK_ELEMENTS=7 sends every element-wise native collective through its chunk loop
    (the path of messages over 2**31 elements), on 3 ranks."""
    suite = os.path.join(HERE, "mpi", "test_collectives.py")
    proc = run_pytest(3, suite, timeout=300, env={"ENGINE_MPI_CHUNK_ELEMENTS": "7"})
    if proc.returncode != 0:
        pytest.fail(f"chunked collectives failed:\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}", pytrace=False)
