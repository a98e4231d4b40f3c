import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

# tests/mpi/ and tests/gpu/ run under mpiexec through test_mpi_suites.py and test_gpu_suites.py
# (mpirun.py sets ENGINE_MPI_SUITE), not directly.
if not os.environ.get("ENGINE_MPI_SUITE"):
    collect_ignore = ["mpi", "gpu"]
