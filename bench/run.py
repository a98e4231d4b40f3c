"""The sweep: for each size, rounds of every backend interleaved (machine noise hits all alike), each
timed as nccl-tests does (mean time per iteration on each rank, averaged over ranks); the median over
rounds is reported. Every rank runs the same iteration counts (agreed through MPI)."""

import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from .backends import DTYPES, Problem, make_backends
from .busbw import REDUCING, ROOTED, bandwidths, bytes_moved, per_rank_count, size_sweep
from .progress import Progress

MODES = ("out-of-place", "in-place")


def default_iters(nbytes):
    """OSU's defaults: 1000 iterations / 100 warm-up up to 8 KB, 100 / 10 above."""
    return (1000, 100) if nbytes <= 8192 else (100, 10)


def timed(run, iters, sync=None):
    """Mean seconds per call; sync (CUDA) waits for the device, whose work the calls only enqueue."""
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / iters


def agreed(value, op):
    return MPI.COMM_WORLD.allreduce(value, op=op)


def measure(case, iters, warmup, budget, sync=None):
    """Mean seconds per call, averaged over ranks; iterations capped so one measurement takes about
    `budget` seconds (the cap is agreed across ranks)."""
    timed(case.run, max(1, warmup), sync)
    estimate = agreed(timed(case.run, 1, sync), MPI.MAX)
    n = max(3, min(iters, int(budget / max(estimate, 1e-9))))
    MPI.COMM_WORLD.Barrier()
    return agreed(timed(case.run, n, sync), MPI.SUM) / MPI.COMM_WORLD.Get_size()


def metadata(args):
    import engine
    return {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench"] + sys.argv[1:]),
        "world_size": MPI.COMM_WORLD.Get_size(), "host": socket.gethostname(), "cores": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "mpi4py": __import__("mpi4py").__version__,
        "numpy": __import__("numpy").__version__, "engine": getattr(engine, "__version__", "0.1.0"),
        "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "dtype": args.dtype, "op": args.op, "root": args.root, "rounds": args.rounds, "algorithm": args.algo,
        "backends": args.backends,
        "oversubscribed": MPI.COMM_WORLD.Get_size() > (os.cpu_count() or 1),
    }


def sweep(args, collectives):
    if args.algo:
        os.environ["ENGINE_CUDA_ALLREDUCE_ALGO" if args.device == "cuda" else "ENGINE_ALLREDUCE_ALGO"] = args.algo
    dist.init_process_group(backend="engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    backends = make_backends(args.backends, args.algo, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    rows = []
    plan = [(c, s) for c in collectives for s in (sizes if c != "barrier" else [0])]
    bar = Progress(len(plan), "bench", enabled=rank == 0)
    for coll, nbytes in plan:
        count = per_rank_count(coll, nbytes, itemsize, size) if coll != "barrier" else 0
        if coll != "barrier" and count == 0:
            bar.step(f"{coll} skip")
            continue
        root = args.root if coll in ROOTED else -1
        problem = Problem(coll, count, dtype, args.op, max(root, 0), rank, size)
        iters, warmup = default_iters(nbytes)
        iters, warmup = args.iters or iters, args.warmup if args.warmup is not None else warmup
        cases = {}
        for b in backends:
            for mode in MODES:
                try:
                    case = b.case(problem, mode)
                except (RuntimeError, ValueError, TypeError):
                    case = None
                if case is not None:
                    cases[(b.name, mode)] = case
        samples = {key: [] for key in cases}
        for _ in range(args.rounds):
            for key, case in cases.items():
                samples[key].append(measure(case, iters, warmup, args.budget, sync))
        moved = bytes_moved(coll, count, itemsize, size)
        for (name, mode), case in cases.items():
            wrong = agreed(case.check(), MPI.SUM) if args.check else -1
            t = statistics.median(samples[(name, mode)])
            algbw, busbw = bandwidths(coll, moved, t, size)
            rows.append({"backend": name, "collective": coll, "mode": mode, "size": moved, "count": count,
                         "type": args.dtype, "redop": args.op if coll in REDUCING else "none", "root": root,
                         "time_us": t * 1e6, "algbw": algbw, "busbw": busbw, "wrong": wrong,
                         "samples_us": [s * 1e6 for s in samples[(name, mode)]]})
        bar.step(f"{coll} {nbytes}")
    bar.close()
    dist.destroy_process_group()
    return rows
