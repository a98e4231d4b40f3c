"""The engine's main job in miniature: allreduce float32 tensors across ranks and time it.

    mpirun -n 2 python examples/allreduce_demo.py
"""

import time

import numpy as np
import torch
from mpi4py import MPI

import engine

comm = engine.world()
for nbytes in (1 << 10, 256 << 10, 4 << 20, 64 << 20):
    x = torch.full((nbytes // 4,), float(comm.rank + 1))
    iters = 200 if nbytes <= 256 << 10 else 10
    comm.allreduce(x)  # warm-up
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(x)
    dt = (time.perf_counter() - t0) / iters
    dt = MPI.COMM_WORLD.allreduce(dt, op=MPI.MAX)
    ok = bool(torch.all(x == x[0]))  # every element got the same reduction
    if comm.rank == 0:
        print(f"allreduce {nbytes:>9} B on {comm.size} ranks: {dt * 1e6:10.1f} us  "
              f"({comm.algorithm_for(nbytes)})  {'ok' if ok else 'WRONG'}")
assert np.isfinite(dt)
