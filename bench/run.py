"""The sweep: for each size, rounds of every backend interleaved (machine noise hits all alike; the order
rotates each round, so no backend always goes first), each timed as the slowest rank's mean time per
iteration (a collective is done when its last rank is); the median over rounds is reported. Every rank
runs the same iteration counts (agreed through a Gloo control group, so the sweep runs under mpirun and
under torchrun alike)."""

import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

import torchbridge  # noqa: F401  (registers backend "engine" where the checkout is run uninstalled)
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


_CONTROL = []


def control():
    """A Gloo group for the sweep's own agreements, apart from every group it measures."""
    if not _CONTROL:
        _CONTROL.append(dist.new_group(backend="gloo"))
    return _CONTROL[0]


def agreed(value, op="sum"):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=control())
    return t.item()


class Refused(Exception):
    """A backend refused a case when it ran (on any rank): the reason, as the refusing rank gave it."""


def why(exc):
    """An exception in one line: its type and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def measure(case, iters, warmup, budget, sync=None):
    """The slowest rank's mean seconds per call (an idle rank, pingpong's unpaired one, has no say);
    iterations capped so one measurement takes about `budget` seconds (the cap is agreed across ranks).
    Raises Refused on every rank when the warm-up raised on any (a backend refusing the call): the ranks
    agree on it through the estimate (inf), so none goes on to wait in a call the others gave up."""
    error = None
    try:
        timed(case.run, max(1, warmup), sync)
        one = timed(case.run, 1, sync)
    except (RuntimeError, ValueError, TypeError) as exc:
        error, one = exc, float("inf")
    estimate = agreed(one, "max")
    if estimate == float("inf"):
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, None if error is None else why(error), group=control())
        rank, reason = next((r, x) for r, x in enumerate(reasons) if x is not None)
        raise Refused(f"{reason} (rank {rank})")
    n = max(3, min(iters, int(budget / max(estimate, 1e-9))))
    dist.barrier()  # the engine's own barrier: the ranks start within microseconds (Gloo's leaves ~1 ms of skew)
    mine = timed(case.run, n, sync)
    return agreed(float("-inf") if case.idle else mine, "max")


def rotated(keys, r):
    """keys begun r places on: round r's order, so that no backend always runs first (or after the same one)."""
    return keys[r % len(keys):] + keys[:r % len(keys)] if keys else []


def metadata(args, world_size):
    import engine
    import engine.kernels
    from engine.launcher import detect_launcher
    mpi_library = mpi4py_version = None
    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        mpi_library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
        mpi4py_version = sys.modules["mpi4py"].__version__
    launcher = detect_launcher()
    return {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench"] + sys.argv[1:]),
        "world_size": world_size, "host": socket.gethostname(), "cores": os.cpu_count(),
        "launcher": launcher[0] if launcher else ("torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "other"),
        "python": platform.python_version(), "torch": torch.__version__, "mpi4py": mpi4py_version,
        "numpy": __import__("numpy").__version__, "engine": getattr(engine, "__version__", "?"),
        "mpi_library": mpi_library, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "timing": "the slowest rank's mean per call",   # (earlier runs: each rank's, averaged over ranks)
        "dtype": args.dtype, "op": args.op, "root": args.root, "rounds": args.rounds, "algorithm": args.algo,
        "backends": args.backends,
        "oversubscribed": world_size > (os.cpu_count() or 1),
        "kernel_isa": engine.kernels.isa(),
        **{f"cpu_{key}": value for key, value in engine.kernels.cpu().items()},   # cpu_model, cpu_flags
        "deepspeed": getattr(sys.modules.get("deepspeed"), "__version__", None),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def threads_used():
    """The threads rank 0's default group splits its large blocking reductions over (engine.transports.threads:
    ENGINE_THREADS, else the cores shared out), torch's intra-op threads, and the helpers running after
    the sweep (0: the threaded entry never ran)."""
    core = getattr(getattr(dist.group.WORLD, "communicator", None), "core", None)
    return {"engine_threads": getattr(core, "threads", None), "engine_threads_running": getattr(core, "threads_running", None),
            "torch_threads": torch.get_num_threads()}


def sweep(args, collectives):
    if args.algo and args.device == "cuda":
        os.environ["ENGINE_CUDA_ALLREDUCE_ALGO"] = args.algo  # on the CPU the direct backends take it per call
    dist.init_process_group(backend="engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    backends = make_backends(args.backends, args.algo, args.device, control())
    forced = {b.name: getattr(b, "algorithm", None) for b in backends}   # the allreduce entry each really forces
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    rows, not_run = [], []
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
        moved = bytes_moved(coll, count, itemsize, size)
        where = {"size": moved, "count": count, "type": args.dtype, "redop": args.op if coll in REDUCING else "none",
                 "root": root}
        cases = {}
        for b in backends:
            for mode in MODES:
                try:
                    case = b.case(problem, mode)
                except (RuntimeError, ValueError, TypeError) as exc:
                    # a refusal, not "no such form": kept, so the report tells the two apart
                    not_run.append({"backend": b.name, "collective": coll, "mode": mode, **where, "reason": why(exc)})
                    case = None
                if case is not None:
                    cases[(b.name, mode)] = case
        samples = {key: [] for key in cases}
        for r in range(args.rounds):
            for key in rotated(list(cases), r):
                try:
                    samples[key].append(measure(cases[key], iters, warmup, args.budget, sync))
                except Refused as exc:   # every rank drops it together; the rest of the sweep goes on
                    not_run.append({"backend": key[0], "collective": coll, "mode": key[1], **where, "reason": str(exc)})
                    del cases[key]
        for (name, mode), case in cases.items():
            # (nop moves nothing: its results are not checked)
            wrong = int(agreed(case.check())) if args.check and name != "nop" else -1
            t = statistics.median(samples[(name, mode)])
            algbw, busbw = bandwidths(coll, moved, t, size)
            rows.append({"backend": name, "collective": coll, "mode": mode, **where, "time_us": t * 1e6,
                         "algbw": algbw, "busbw": busbw, "wrong": wrong,
                         "samples_us": [s * 1e6 for s in samples[(name, mode)]],
                         "algorithm": forced[name] if coll == "all_reduce" else None})
        bar.step(f"{coll} {nbytes}")
    bar.close()
    meta = dict(metadata(args, size), rank=rank, not_run=not_run, **threads_used())
    # Every group dropped here, not at interpreter exit: a Gloo worker thread that releases a tensor
    # after Python began finalizing aborts the process (std::terminate on its forced unwind).
    backends = cases = None
    _CONTROL.clear()
    dist.destroy_process_group()
    return rows, meta
