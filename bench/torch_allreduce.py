"""dist.all_reduce on backend engine vs a Gloo group vs raw mpi4py Allreduce (out of place, and in place
like dist.all_reduce), same job, rounds interleaved so machine noise hits all alike. Median over rounds
of the per-round time, max over ranks.

    mpirun -n 2 python -m bench.torch_allreduce
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

SIZES = [1 << 10, 256 << 10, 4 << 20, 64 << 20]


def timed(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main(sizes=SIZES, rounds=5):
    dist.init_process_group(backend="engine")
    gloo = dist.new_group(backend="gloo")
    world = MPI.COMM_WORLD
    rank = dist.get_rank()
    if rank == 0:
        print(f"# dist.all_reduce, float32, {dist.get_world_size()} ranks, torch {torch.__version__}, "
              f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0]}")
        print(f"{'bytes':>10} {'engine us':>11} {'gloo us':>11} {'mpi4py us':>11} {'mpi4py-ip us':>13} "
              f"{'gloo/engine':>12} {'engine/mpi4py':>14} {'engine/mpi4py-ip':>17}")
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        a = t.numpy()
        b = torch.empty_like(t).numpy()   # (every buffer from torch's allocator, as the engine's)
        iters = 2000 if nbytes <= 4096 else (100 if nbytes <= 1 << 20 else (20 if nbytes <= 8 << 20 else 3))
        gloo_iters = max(3, iters // 20) if nbytes <= 1 << 20 else iters
        cases = {
            "engine": (lambda: dist.all_reduce(t), iters),
            "gloo": (lambda: dist.all_reduce(t, group=gloo), gloo_iters),
            "mpi4py": (lambda: world.Allreduce(a, b, op=MPI.SUM), iters),
            "mpi4py-ip": (lambda: world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM), iters),  # in place, as dist's
        }
        samples = {k: [] for k in cases}
        for fn, n in cases.values():
            timed(fn, max(2, n // 10))  # warm-up
        for _ in range(rounds):
            for name, (fn, n) in cases.items():
                world.Barrier()
                samples[name].append(world.allreduce(timed(fn, n), op=MPI.MAX))
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        if rank == 0:
            print(f"{nbytes:>10} {med['engine']:>11.1f} {med['gloo']:>11.1f} {med['mpi4py']:>11.1f} "
                  f"{med['mpi4py-ip']:>13.1f} {med['gloo'] / med['engine']:>12.1f} "
                  f"{med['engine'] / med['mpi4py']:>14.2f} {med['engine'] / med['mpi4py-ip']:>17.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or SIZES)
