"""Every file in tests/mpi/ under mpiexec, on both transports (shared memory and MPI), with 1, 2, 3 and
4 ranks (3 and 4 oversubscribe 2 cores). One launch per (transport, ranks) runs all the files; a short
engine timeout makes a rank that falls out of step fail within seconds, showing the assertion."""

import glob
import os
import re
import sys

import pytest

from engine import registry
from mpirun import (assert_every_rank_passed, launcher_output, mpi_env, mpiexec_command, run_launcher, run_pytest,
                    suite_report, under_open_mpi)

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.abspath(HERE))
SUITES = sorted(glob.glob(os.path.join(HERE, "mpi", "test_*.py")))
# At 4 ranks (twice the cores) the suites whose schedules depend on the group size; the others (errors,
# large counts, observability, training, user ops) run at 1-3 ranks (SUITES_AT).
SIZED = [os.path.join(HERE, "mpi", f) for f in ("test_collectives.py", "test_fusion.py", "test_matrix.py",
                                                "test_torch_backend.py")]
COLLECTIVES = os.path.join(HERE, "mpi", "test_collectives.py")
SUITE_TIMEOUT = "10"  # seconds a single operation may take inside the suites (ENGINE_TIMEOUT)
# Two ranks first (the broadest check per second: `pytest -x` stops at a broken collective soonest).
# One rank on shared memory only: a group of one runs the same path on every transport (CoreComm.run_alone);
# `python tests/matrix.py` runs MPI and TCP at one rank too.
CASES = [(t, n) for n in (2, 3, 4) for t in ("shm", "mpi")] + [("shm", 1)]
# Which suites a case runs where not all: at 4 ranks the sized ones; over MPI at 3 ranks the sized ones
# too (the others run over MPI at 2 and over shared memory at 3); at one and two ranks on shared memory
# all but the torch suites and the matrix, which tests/test_launchers.py runs at 1-4 ranks under
# torchrun, on shared memory too (under mpiexec they run on it at 3 ranks, over MPI at 2-4).
TORCH_SUITES = ("test_torch_backend.py", "test_torch_training.py", "test_matrix.py")
BUT_TORCH = [s for s in SUITES if os.path.basename(s) not in TORCH_SUITES]
SUITES_AT = {("shm", 4): SIZED, ("mpi", 4): SIZED, ("mpi", 3): SIZED, ("shm", 1): BUT_TORCH, ("shm", 2): BUT_TORCH}


def run(nranks, paths, extra=(), **env):
    proc = run_pytest(nranks, paths, timeout=420, extra=list(extra), env={"ENGINE_TIMEOUT": SUITE_TIMEOUT, **env})
    if proc.returncode != 0:
        pytest.fail(f"{nranks} ranks, {env}: exit {proc.returncode}:\n{suite_report(proc.stdout, proc.stderr)}",
                    pytrace=False)
    return proc


@pytest.mark.parametrize("transport,nranks", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_suites_under_mpiexec(transport, nranks):
    """The suites of SUITES_AT (every suite where it names none); at 3 ranks on shared memory, on the
    baseline kernels (ENGINE_ISA), which a CPU with AVX2 never runs otherwise (tests/mpi/conftest.py
    checks that every rank runs them; tests/test_kernels.py compares every kernel across ISAs bit for
    bit), with single copy required (ENGINE_SHM_CMA=1: every group has it, or is refused); at 3 ranks
    over MPI, with receives from any rank probing for their message (ENGINE_MPI_ANY_SOURCE=probe,
    MPICH's UCX module's default), the conformance matrix's among them."""
    forced = {("shm", 3): {"ENGINE_ISA": "baseline", "ENGINE_SHM_CMA": "1"},
              ("mpi", 3): {"ENGINE_MPI_ANY_SOURCE": "probe"}}
    proc = run(nranks, SUITES_AT.get((transport, nranks), SUITES), ENGINE_TRANSPORT=transport,
               **forced.get((transport, nranks), {}))
    assert_every_rank_passed(proc.stdout, nranks)


@pytest.mark.parametrize("transport,nranks", [("shm", 3), ("mpi", 2)])
def test_torch_parallelism_under_mpiexec(transport, nranks):
    """DeviceMesh, FSDP2 (HSDP too), FSDP1, ZeRO, tensor and pipeline parallelism, DCP
    (tests/mpi/parallel_suite.py)."""
    proc = run(nranks, [os.path.join(HERE, "mpi", "parallel_suite.py")], ENGINE_TRANSPORT=transport)
    assert_every_rank_passed(proc.stdout, nranks, skips=False)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_matrix_over_tcp_on_one_host(nranks):
    """The conformance matrix over the engine's own sockets on one host (ENGINE_TRANSPORT=tcp): every
    TCP entry, the algorithms over point-to-point among them, at 2-4 ranks (one rank: CASES above)."""
    proc = run(nranks, [os.path.join(HERE, "mpi", "test_matrix.py")], ENGINE_TRANSPORT="tcp")
    assert_every_rank_passed(proc.stdout, nranks)


def test_matrix_with_threads():
    """ENGINE_THREADS=4 on 2 ranks (8 threads on 2 cores): the threaded entries, forced, through the
    matrix, each kernel split over the rank's threads down to cache-line slices (the matrix's
    ENGINE_SHM_THREAD_SLICE_BYTES); asynchronous calls keep one thread."""
    proc = run(2, [os.path.join(HERE, "mpi", "test_matrix.py")], extra=["-k", "threads"], ENGINE_TRANSPORT="shm",
               ENGINE_THREADS="4")
    assert_every_rank_passed(proc.stdout, 2)


MOVED = {"shm": dict(ENGINE_SHM_ONESHOT_MAX_BYTES="4K", ENGINE_SHM_REDUCE_ONESHOT_MAX_BYTES="64K",
                     ENGINE_SHM_THREADS_MIN_BYTES="64K", ENGINE_SHM_CMA_MIN_BYTES="8K", ENGINE_SHM_CMA_MAX_BYTES="1M",
                     ENGINE_THREADS="2"),
         "mpi": dict(ENGINE_RDOUBLE_MAX_BYTES="64K", ENGINE_RING_MIN_BYTES="8K", ENGINE_RING_SEGMENT_BYTES="4K"),
         "tcp": dict(ENGINE_TCP_RDOUBLE_MAX_BYTES="16K", ENGINE_TCP_TREE_MAX_BYTES="16K",
                     ENGINE_RING_SEGMENT_BYTES="4K")}


@pytest.mark.parametrize("transport", sorted(MOVED))
def test_the_automatic_choice_at_thresholds_moved_by_their_variables(transport):
    """The thresholds' variables moved from their defaults, on 3 ranks: the group's rules lie at the
    moved values, and at each of their edges the entry the rules name runs (the matrix's automatic
    choice; its default run covers the defaults)."""
    assert set(MOVED[transport]) - {"ENGINE_THREADS"} <= {t.env for t in registry.tunables()}
    proc = run(3, [os.path.join(HERE, "mpi", "test_matrix.py")], extra=["-k", "automatic or thresholds"],
               ENGINE_TRANSPORT=transport, **MOVED[transport])
    assert_every_rank_passed(proc.stdout, 3, skips=False)


def test_every_collective_at_16_ranks():
    """16 ranks on one host (8 a core here, oversubscribed): every c10d collective against what each
    rank computes (examples/check_collectives.py), the waits yielding (more ranks than cores)."""
    proc = run_launcher(mpiexec_command(16) + [sys.executable, os.path.join(ROOT, "examples", "check_collectives.py")],
                        300, env={**mpi_env(), "ENGINE_TIMEOUT": "60", "ENGINE_TRANSPORT": "shm"})
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert "ALL PASS" in proc.stdout and "on 16 ranks" in proc.stdout, proc.stdout[-3000:]


def test_collectives_with_tiny_mpi_chunks():
    """ENGINE_MPI_CHUNK_ELEMENTS=7 sends every element-wise native collective through its chunk loop
    (the path of messages over 2**31 elements), on 3 ranks; on the baseline kernels (ENGINE_ISA), which
    MPI's own reductions of 16-bit floats call too; as over an MPI whose tags have the 15 bits MPI
    promises (ENGINE_MPI_TAG_UB), where the engine's algorithms fold the call's number into the hash;
    with receives from any rank probing for their message, as under MPICH's UCX module
    (ENGINE_MPI_ANY_SOURCE). Not the shared-memory thresholds' tests ("around"): their 65,535 to 262,147
    elements are 9,000 to 37,000 pieces of 7, each an MPI collective all 3 ranks must be scheduled for,
    which on 2 busy cores outlast the suite's timeout (one reduce took 3.5 s, the next over 10)."""
    run(3, [COLLECTIVES], ["-k", "not around"], ENGINE_TRANSPORT="mpi", ENGINE_MPI_CHUNK_ELEMENTS="7", ENGINE_ISA="baseline",
        ENGINE_MPI_TAG_UB="32767", ENGINE_MPI_ANY_SOURCE="probe")


@pytest.mark.parametrize("mode", ["post", "probe"])
def test_receives_from_any_rank_over_mpi(mode):
    """tests/mpi/any_source.py at 4 ranks over MPI: receives from any rank, each after its send was
    waited for, posted as MPI_ANY_SOURCE receives or probing for their message (ENGINE_MPI_ANY_SOURCE);
    then, in a job of its own, one left pending across the collectives that block inside MPI.
    Under MPICH (make test-mpich), with its network module between every pair of ranks
    (MPIR_CVAR_NOLOCAL=1), the engine's own choice, which must be to probe: MPICH's UCX module misses
    messages to posted any-source receives there (the script's `plain` mode, mpi4py alone, shows it)."""
    env = {"ENGINE_MPI_ANY_SOURCE": mode}
    if not under_open_mpi():
        if mode == "post":
            pytest.skip("MPICH's UCX module misses messages to posted any-source receives across its network module")
        env = {"MPIR_CVAR_NOLOCAL": "1", "ENGINE_MPI_ANY_SOURCE": ""}   # (unset: the engine's own choice)
    for part, says in (([], "any-source"), (["collectives"], "any-source across collectives")):
        proc = run_launcher(mpiexec_command(4) + [sys.executable, os.path.join(HERE, "mpi", "any_source.py"), *part],
                            240, env={**mpi_env(), "ENGINE_TIMEOUT": SUITE_TIMEOUT, **env})
        out = launcher_output(proc.stdout + proc.stderr)
        assert proc.returncode == 0, out[-5000:]
        assert sorted(re.findall(rf"{says}: ok (\w+) rank (\d)", out)) == [(mode, str(r)) for r in range(4)], \
            out[-5000:]


@pytest.mark.parametrize("single_copy", ["0", "auto"])
def test_collectives_through_a_tiny_segment(single_copy):
    """4 KiB slots and queues: every shared-memory collective and point-to-point message is larger
    than the segment and goes in many steps and frames (ring wrap-around included), on 3 ranks; with
    single copy on, every piece of 64 bytes and up moves by process_vm_readv instead."""
    run(3, [COLLECTIVES], ENGINE_TRANSPORT="shm", ENGINE_SHM_SLOT_BYTES="4096", ENGINE_SHM_QUEUE_BYTES="4096",
        ENGINE_SHM_CHUNK_BYTES="256", ENGINE_SHM_CMA=single_copy, ENGINE_SHM_CMA_MIN_BYTES="64")


@pytest.mark.parametrize("transport", ["shm", "mpi"])
def test_a_rank_out_of_step_fails_its_suite_within_seconds(transport):
    """A suite where one rank fails an assertion: the run ends (not at the 120 s hang guard), showing
    the assertion."""
    proc = run_pytest(3, [os.path.join(HERE, "faults", "desync_suite.py")], timeout=120,
                      env={"ENGINE_TIMEOUT": "3", "ENGINE_TRANSPORT": transport})
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout, proc.stdout[-3000:]
