import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

# tests/mpi/ and tests/gpu/ run under a launcher through test_mpi_suites.py, test_launchers.py and
# test_gpu_suites.py (mpirun.py / torchrun.py set ENGINE_MPI_SUITE / ENGINE_TORCHRUN_SUITE), not directly.
if not (os.environ.get("ENGINE_MPI_SUITE") or os.environ.get("ENGINE_TORCHRUN_SUITE")):
    collect_ignore = ["mpi", "gpu"]

# The fast, broad checks run first: a broken kernel, algorithm or collective fails `pytest -x` within
# its first minute or two, before the slower launcher, host and fault scenarios.
FIRST = ("test_kernels.py", "test_fusion_plan.py", "test_tuning.py", "test_mpi_suites.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(FIRST)))  # stable: the rest keep order
