"""The engine-core acceptance case: allreduce SUM of 10,000,003 float32 values is exact (small-integer
values) through whichever algorithm ENGINE_ALLREDUCE_ALGO forces.

    for a in ring native rdouble auto; do ENGINE_ALLREDUCE_ALGO=$a mpiexec -n 3 python scripts/exact_allreduce.py; done
"""

import os

import numpy as np

import engine

c = engine.world()
N = 10_000_003
i = np.arange(N, dtype=np.int64)
x = ((i * 7 + c.rank) % 1000).astype(np.float32)
c.allreduce(x)
ref = sum(((i * 7 + r) % 1000) for r in range(c.size)).astype(np.float32)
ok = c.mpi_comm.allreduce(bool(np.array_equal(x, ref)), op=engine.MPI.LAND)
if c.rank == 0:
    print(f"ENGINE_ALLREDUCE_ALGO={os.environ.get('ENGINE_ALLREDUCE_ALGO')} ranks={c.size} N={N} "
          f"chosen={c.algorithm_for(N * 4)} exact={ok}")
raise SystemExit(0 if ok else 1)
