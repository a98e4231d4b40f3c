"""Launches without MPI: torchrun and torch.multiprocessing.spawn (the ranks meet through torch's
store and talk through shared memory; MPI is never imported), and torch's own test harness."""

import os
import re
import sys
from importlib.metadata import version

import pytest

import mpirun
from mpirun import assert_every_rank_passed, run_launcher, suite_report
from torchrun import clean_env, run_pytest, torchrun_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TORCH_SUITES = [os.path.join(HERE, "mpi", f) for f in ("test_torch_backend.py", "test_torch_training.py",
                                                        "test_matrix.py")]


# (values of their own, none another threshold's default: the matrix finds each among its collective's bounds)
HIER_MOVED = dict(ENGINE_HIER_ALLREDUCE_MIN_BYTES="8K", ENGINE_HIER_BROADCAST_MIN_BYTES="4K",
                  ENGINE_HIER_ALLGATHER_MIN_BYTES="24K", ENGINE_HIER_REDUCE_SCATTER_MIN_BYTES="12K")


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_torch_suites_under_torchrun(nranks):
    """The torch suites and the conformance matrix's shared-memory rows (tests/mpi/test_matrix.py), with
    two threads a rank (ENGINE_THREADS): the threaded rows run, and the suites' large blocking
    reductions split over them. At 4 ranks two forced sockets (ENGINE_SOCKETS) of two make every group
    of the world's ranks hierarchical inside the host, its stages split through torch's store, with the
    hierarchy's thresholds moved (HIER_MOVED: the matrix checks the rules lie there); at 2
    and 3 ranks (no two equal sockets of 2+) the hierarchy's rows are deselected."""
    env = {"ENGINE_TIMEOUT": "20", "ENGINE_THREADS": "2"}
    extra = []
    if nranks == 4:   # (the hierarchy's thresholds moved off their defaults: the matrix walks their edges there)
        env.update(ENGINE_SOCKETS="2", **HIER_MOVED)
    elif nranks > 1:
        extra = ["-k", "not hier and not leader"]
    proc = run_pytest(nranks, TORCH_SUITES, timeout=420, extra=extra, env=env)
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    # every rank ran what it collected, passes only (at one rank point-to-point and single copy skip: no peer)
    assert_every_rank_passed(proc.stdout, nranks, skips=nranks == 1)


def test_torch_backend_suite_in_debug_mode_under_torchrun():
    """tests/mpi/test_torch_backend.py with ENGINE_DEBUG=1 (every collective's signature compared
    first), 2 ranks: the signature check must neither hang nor flag what the suite calls alike
    (uneven calls, a copied output, a call's own timeout) as a mismatch."""
    proc = run_pytest(2, [os.path.join(HERE, "mpi", "test_torch_backend.py")], timeout=300,
                      env={"ENGINE_TIMEOUT": "20", "ENGINE_DEBUG": "1"})
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    assert_every_rank_passed(proc.stdout, 2)


def test_matrix_over_tcp_under_torchrun():
    """The conformance matrix's TCP rows on one host without MPI (ENGINE_TRANSPORT=tcp), 3 ranks."""
    proc = run_pytest(3, [os.path.join(HERE, "mpi", "test_matrix.py")], timeout=300,
                      env={"ENGINE_TIMEOUT": "20", "ENGINE_TRANSPORT": "tcp"})
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    assert_every_rank_passed(proc.stdout, 3)


def test_tcp_suite_over_lazy_connections_under_torchrun():
    """tests/mpi/tcp_suite.py (across hosts in tests/test_hosts.py) on one host over connections made at
    first use (ENGINE_TCP_CONNECT=lazy), 3 ranks: among them a rank that gives its part to a gather and
    leaves, whose listener is gone when the root, never connected to it, posts its receive (the
    refused connection failed that receive at once, though the part had come)."""
    proc = run_pytest(3, [os.path.join(HERE, "mpi", "tcp_suite.py")], timeout=300,
                      env={"ENGINE_TIMEOUT": "20", "ENGINE_TRANSPORT": "tcp", "ENGINE_TCP_CONNECT": "lazy"})
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    assert_every_rank_passed(proc.stdout, 3)


def test_torch_parallelism_under_torchrun():
    """DeviceMesh (2-D at 4 ranks), FSDP2, tensor and pipeline parallelism, DCP, without MPI."""
    proc = run_pytest(4, [os.path.join(HERE, "mpi", "parallel_suite.py")], timeout=300, env={"ENGINE_TIMEOUT": "20"})
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    assert_every_rank_passed(proc.stdout, 4, skips=False)


@pytest.mark.skipif(tuple(map(int, version("torch").split(".")[:2])) < (2, 15),
                    reason="torch splits CPU groups from 2.15 on (before: only on an accelerator)")
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun-shm", "torchrun-tcp"])
def test_split_group(launcher):
    """tests/mpi/split_suite.py at 3 ranks: under mpiexec the world's splits are made through MPI, under
    torchrun through torch's store (over shared memory, and over TCP)."""
    suite = os.path.join(HERE, "mpi", "split_suite.py")
    if launcher == "mpiexec":
        proc = mpirun.run_pytest(3, suite, timeout=300, env={"ENGINE_TIMEOUT": "20"})
    else:
        proc = run_pytest(3, suite, timeout=300, env={"ENGINE_TIMEOUT": "20", "ENGINE_TRANSPORT": launcher[9:]})
    assert proc.returncode == 0, suite_report(proc.stdout, proc.stderr)
    assert_every_rank_passed(proc.stdout, 3, skips=False)


def test_ranks_with_different_settings_refuse_a_torch_group_naming_the_setting():
    """tests/faults/mismatched_settings.py under torchrun, 4 ranks in two forced sockets: each case a
    new_group(backend="engine") made through torch's store, refused on every rank naming the setting
    (or the rank that can't use its own), as under mpiexec (tests/test_faults.py)."""
    from faults.mismatched_settings import check
    before = set(os.listdir("/dev/shm"))
    proc = run_launcher(torchrun_command(4) + [os.path.join(HERE, "faults", "mismatched_settings.py")],
                        300, env=clean_env(ENGINE_SOCKETS="2"))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    check(proc.stdout, mpi=False)
    assert set(os.listdir("/dev/shm")) <= before


def test_every_collective_under_torchrun_without_mpi():
    proc = run_launcher(torchrun_command(3) + [os.path.join(ROOT, "examples", "check_collectives.py")],
                        300, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "ALL PASS: 16 collectives on 3 ranks, transport shm, MPI imported: False" in proc.stdout, proc.stdout


def test_script_ending_with_collectives_in_flight_exits_cleanly_on_every_rank():
    """tests/faults/exit_in_flight.py, 3 ranks: each script ends with 16 asynchronous all_gathers (and a
    future callback each) never waited. Unless the engine drains its progress threads at exit, a rank
    aborts as Python finalizes (SIGABRT, "terminate called without an active exception")."""
    script = os.path.join(HERE, "faults", "exit_in_flight.py")
    proc = run_launcher(torchrun_command(3) + [script], 300, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-5000:]
    assert len(re.findall(r"rank \d: leaving with \d+ of 16 collectives in flight", out)) == 3, out[-5000:]


def test_ddp_over_mp_spawn_trains_like_one_process():
    proc = run_launcher([sys.executable, os.path.join(ROOT, "examples", "ddp_exact.py"), "--ranks", "3"], 300,
                        env=clean_env())
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "DDP over 3 spawned processes (shm), 20 steps" in proc.stdout, proc.stdout


# A subset of torch's distributed test suite (tests/torch_suite.py, torch's spawn harness, 3 ranks) with
# the suite's name gates open (TORCH_SUITE_GATES=open: it runs Gloo's set, every group on the engine).
# One test of each collective it runs on a CPU backend other than MPI at 3 ranks (its group tests need 8
# ranks, its all_to_all tests MPI or NCCL), point-to-point and DDP; then tests it runs only for backends
# it names, one of each feature: coalesced all_reduce, batch_isend_irecv, futures and DDP comm hooks,
# object collectives, the barrier's timeout, the monitored barrier, sparse all_reduce.
# `make torch-suite` runs all of it (docs/torch-suite.md).
TORCH_SUITE_SUBSET = ["test_all_reduce_sum", "test_broadcast", "test_reduce_sum", "test_all_gather", "test_gather",
                      "test_scatter", "test_all_gather_coalesced_simple", "test_barrier", "test_isend", "test_irecv",
                      "test_send_recv_any_source", "test_DistributedDataParallelCPU",
                      "test_all_reduce_coalesced_max", "test_batch_isend_irecv_gloo_tags", "test_get_future",
                      "test_accumulate_gradients_no_sync_allreduce_with_then_hook", "test_all_gather_object_subgroup",
                      "test_scatter_object_list", "test_grads_same_across_ranks_with_no_sync",
                      "test_barrier_timeout_full_group", "test_monitored_barrier_gloo",
                      "test_monitored_barrier_gloo_subgroup", "test_monitored_barrier_gloo_rank_0_timeout",
                      "test_sparse_all_reduce_sum"]


def test_torch_distributed_suite_subset_with_gates_open():
    ids = [f"{os.path.join(HERE, 'torch_suite.py')}::TestDistBackendWithFork::{name}" for name in TORCH_SUITE_SUBSET]
    proc = run_launcher([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ids], 900,
                        env=clean_env(TORCH_SUITE_GATES="open", WORLD_SIZE="3"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert f"{len(TORCH_SUITE_SUBSET)} passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
