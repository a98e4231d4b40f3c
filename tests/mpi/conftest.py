import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import pytest  # noqa: E402

from mpirun import STACKS_SIGNAL  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _kernels_of_engine_isa():
    """Under ENGINE_ISA (tests/test_mpi_suites.py) every rank runs those kernels, in engine._core and
    in engine._mpi alike."""
    wanted = os.environ.get("ENGINE_ISA")
    if wanted:
        import engine.kernels
        from engine import _core, mpi
        assert engine.kernels.isa() == wanted
        assert mpi.core()._kernel_table() == _core._kernel_table()
    yield


def pytest_configure(config):
    """A launch past its timeout asks each rank for every thread's stack before it kills the job
    (tests/mpirun.py: ask_for_stacks), so a hang seen once in CI shows where each rank waited. They go
    to the rank's stderr as it was before pytest captured it (here, between its captures)."""
    faulthandler.register(STACKS_SIGNAL, file=os.dup(2), all_threads=True)


def pytest_collection_finish(session):
    """Each rank says how many tests it collected, so a launcher's test derives the count it expects
    (tests/mpirun.py: assert_every_rank_passed) instead of typing it in."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"engine-suite: collected {len(session.items)}")
