"""Times every allreduce algorithm against mpi4py's own Allreduce, interleaved per size.

    mpiexec -n 2 python -m bench.allreduce_algos
"""

import time

import numpy as np
from mpi4py import MPI

import engine

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def timed(fn, nbytes, world):
    iters = 2000 if nbytes <= 8192 else (200 if nbytes <= 1 << 20 else 20)
    for _ in range(max(3, iters // 10)):
        fn()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    return world.allreduce(dt, op=MPI.SUM) / world.size * 1e6  # mean over ranks, us


def main():
    world = MPI.COMM_WORLD
    comm = engine.world()
    if comm.rank == 0:
        print(f"# {comm.size} ranks, float32, us per allreduce (mean over ranks)")
        print(f"{'bytes':>10} {'mpi4py':>10} {'native':>10} {'ring':>10} {'rdouble':>10}")
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        row = [timed(lambda: world.Allreduce(x, y, op=MPI.SUM), nbytes, world)]
        for algo in ("native", "ring", "rdouble"):
            row.append(timed(lambda: comm.allreduce(x, y, algorithm=algo), nbytes, world))
        if comm.rank == 0:
            print(f"{nbytes:>10} " + " ".join(f"{t:>10.1f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
