"""torch's own distributed test suite (DistributedTest._DistTestBase, torch 2.13) on backend engine,
through torch's spawn harness: every test starts WORLD_SIZE processes with multiprocessing, which
meet through a FileStore (no MPI launcher: the engine runs over shared memory).

    make torch-suite                               # the whole suite: engine, engine with gates open, gloo
    BACKEND=engine WORLD_SIZE=3 python -m pytest tests/torch_suite.py -k "test_all_reduce_sum"
    TORCH_SUITE_GATES=open WORLD_SIZE=3 python -m pytest tests/torch_suite.py   # name gates forced open
    BACKEND=gloo ...                               # the same runner on Gloo, as the reference

Like torch_ucc's test/torch_tests.py, it declares what the backend supports before importing the
suite (its skip decorators read these sets at import). Many tests the suite runs only for backends it
names (gloo, nccl, ucc, mpi); those skip with its own message.

TORCH_SUITE_GATES=open forces those gates open: the suite is told its backend is Gloo (BACKEND=gloo
before it is imported) and runs Gloo's whole set, while every group it makes, in every spawned
process, is an engine group (init_process_group and new_group map backend "gloo", or none, to
"engine"). dist.get_backend() still answers "engine", so the tests that compare it with the name
"gloo" fail, and so do torch's checks gated on it (the profiling checks skip). dist.monitored_barrier,
which torch itself runs only for a group named "gloo", calls the engine group's monitored_barrier.
docs/torch-suite.md has the results of every mode.
(Not collected by `pytest tests`: the file name does not start with test_.)
"""

import functools
import inspect
import os
import sys

GATES_OPEN = os.environ.get("TORCH_SUITE_GATES", "") == "open"
if GATES_OPEN:
    os.environ["BACKEND"] = "gloo"  # what the suite's gates read; the groups are the engine's (below)
os.environ.setdefault("BACKEND", "engine")
os.environ.setdefault("WORLD_SIZE", "3")

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
if BACKEND == "engine":
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("engine")
if BACKEND == "engine" or GATES_OPEN:
    import torchbridge  # noqa: F401  (registers the backend in every spawned process too)


def _on_engine(create):
    """init_process_group / new_group with backend "gloo", or none, made on backend "engine"."""
    signature = inspect.signature(create)

    @functools.wraps(create)
    def on_engine(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        backend = call.arguments.get("backend")
        if backend is None or str(backend).lower() == "gloo":
            call.arguments["backend"] = "engine"
        return create(*call.args, **call.kwargs)

    return on_engine


def _monitored_barrier(torch_monitored_barrier):
    """torch's dist.monitored_barrier refuses every group whose backend is not named "gloo"; for an
    engine group, the steps it takes after that check (the timeout as a timedelta, the group's own
    monitored_barrier)."""

    @functools.wraps(torch_monitored_barrier)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group) or dist.get_backend(group) != "engine":
            return torch_monitored_barrier(group, timeout, wait_all_ranks)
        if isinstance(timeout, (int, float)):
            from datetime import timedelta
            timeout = timedelta(seconds=timeout)
        pg = c10d._get_default_group() if group is None else group
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    return monitored_barrier


if GATES_OPEN:
    for _name in ("init_process_group", "new_group"):
        setattr(c10d, _name, _on_engine(getattr(c10d, _name)))
        setattr(dist, _name, getattr(c10d, _name))
    c10d.monitored_barrier = dist.monitored_barrier = _monitored_barrier(c10d.monitored_barrier)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    """The same tests in forked processes (torch's test_distributed_fork): they start without importing
    torch and the suite again, which is most of a spawned test's time on 2 cores."""

    def setUp(self):
        super().setUp()
        import torch.multiprocessing
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests
    if not dist.is_available():
        sys.exit(0)
    run_tests()
