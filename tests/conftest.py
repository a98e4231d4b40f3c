import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

# tests/mpi/ and tests/gpu/ run under a launcher through test_mpi_suites.py, test_launchers.py and
# test_gpu_suites.py (mpirun.py / torchrun.py set ENGINE_MPI_SUITE / ENGINE_TORCHRUN_SUITE), not directly.
if not (os.environ.get("ENGINE_MPI_SUITE") or os.environ.get("ENGINE_TORCHRUN_SUITE")):
    collect_ignore = ["mpi", "gpu"]
