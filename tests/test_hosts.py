"""Across hosts made from network namespaces (tests/hosts.py): mpirun over two hosts (MPI between
them, shared memory inside each), and a torchrun spanning two hosts, which must fail at once saying
that multi-host jobs launch with mpirun. Skipped, with the reason, where namespaces can't be made."""

import os
import subprocess
import sys
import time

import pytest

from hosts import Hosts, mpirun_across
from mpirun import mpi_env
from torchrun import clean_env, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = Hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def test_torchrun_across_hosts_fails_at_once_naming_mpirun():
    port = str(free_port())
    with Hosts(2) as hosts:
        start = time.monotonic()
        procs = [hosts.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                 "1", "--node-rank", str(i), "--master-addr", hosts.addrs[0], "--master-port", port,
                                 os.path.join(ROOT, "examples", "check_collectives.py")],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        elapsed = time.monotonic() - start
    for p, out in zip(procs, outs):
        assert p.returncode != 0, out[-3000:]
        assert "group's ranks are on 2 hosts" in out and "multi-host jobs launch with mpirun" in out, out[-3000:]
    assert elapsed < 120, elapsed


# check_collectives: every c10d collective against references each rank computes; ddp_exact: DDP across
# the hosts trains exactly like one process on the full batch.
EXAMPLES = {"check_collectives.py": "ALL PASS: 16 collectives on {n} ranks, transport mpi",
            "ddp_exact.py": "DDP over {n} processes (mpi), 20 steps"}


@pytest.mark.parametrize("per_host", [1, 2])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_across_hosts(example, per_host):
    with Hosts(2) as hosts:
        proc = mpirun_across(hosts, per_host, [sys.executable, os.path.join(ROOT, "examples", example)])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert EXAMPLES[example].format(n=2 * per_host) in proc.stdout, proc.stdout[-3000:]


# The conformance matrix's rows across hosts (tests/mpi/test_matrix.py): every MPI entry forced in
# turn, the hierarchical ones where hosts have two ranks, in the ENGINE_HIER modes that make different
# plans (auto and slice make the same one: tests/test_registry.py; `python tests/matrix.py` runs all).
MATRIX_CONFIGS = [(1, "auto"), (2, "auto"), (2, "leader"), (2, "off")]


@pytest.mark.parametrize("per_host,mode", MATRIX_CONFIGS, ids=[f"2x{n}-{m}" for n, m in MATRIX_CONFIGS])
def test_conformance_matrix_across_hosts(per_host, mode):
    from matrix import RANK_FILE, outcomes
    with Hosts(2) as hosts:
        proc = mpirun_across(hosts, per_host, [sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p",
                                               "no:cacheprovider", "-o", "addopts=", "--color=no", RANK_FILE],
                             timeout=600, ENGINE_TIMEOUT="30", ENGINE_MPI_SUITE="1", ENGINE_HIER=mode)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    from engine import registry
    got = outcomes(proc.stdout)
    hierarchical = {e.key for e in registry.ENTRIES if "hierarchy" in e.needs}
    assert set(got.values()) == {"PASSED"}, got
    assert (hierarchical <= set(got)) == (per_host == 2 and mode != "off"), got


@pytest.mark.parametrize("per_host", [1, 2])
def test_bench_across_hosts_checks_every_result(per_host):
    with Hosts(2) as hosts:
        proc = mpirun_across(hosts, per_host, [sys.executable, "-m", "bench", "all_reduce", "-b", "1K", "-e", "4M",
                                               "-f", "64", "--backends", "engine,gloo,mpi4py", "-c", "1", "--rounds",
                                               "1", "--budget", "0.05"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "# Out of bounds values : 0 OK" in proc.stdout and "FAILED" not in proc.stdout, proc.stdout[-3000:]
