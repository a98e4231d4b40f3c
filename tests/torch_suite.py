"""torch's own distributed test suite (DistributedTest._DistTestBase, torch 2.13) on backend engine,
through torch's spawn harness: every test starts WORLD_SIZE processes with multiprocessing, which
meet through a FileStore (no MPI launcher: the engine runs over shared memory).

    make torch-suite                               # the whole suite, engine then gloo (~1 h on 2 cores)
    BACKEND=engine WORLD_SIZE=3 python -m pytest tests/torch_suite.py -k "test_all_reduce_sum"
    BACKEND=gloo ...                               # the same runner on Gloo, as the reference

Like torch_ucc's test/torch_tests.py, it declares what the backend supports before importing the
suite (its skip decorators read these sets at import). Tests the suite itself runs only for backends
it names (gloo, nccl, mpi) skip with its own message; docs/torch-suite.md lists every skip and failure.
(Not collected by `pytest tests`: the file name does not start with test_.)
"""

import os
import sys

os.environ.setdefault("BACKEND", "engine")
os.environ.setdefault("WORLD_SIZE", "3")

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
if BACKEND == "engine":
    import torchbridge  # noqa: F401  (registers the backend in every spawned process too)
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("engine")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests
    if not dist.is_available():
        sys.exit(0)
    run_tests()
