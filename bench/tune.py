"""python -m engine.bench tune: times every allreduce entry of the registry that the world group can
run (across hosts with several ranks each, the hierarchical ones beside the flat ones) at every size,
on this machine and topology, and writes a tuning file that the engine reads at start
(ENGINE_TUNING_FILE, engine.tuning): the fastest entry's rules per range of sizes.

    mpirun -n 2 python -m engine.bench tune -o tuning.json            # -b 1K -e 64M -f 4 by default
    torchrun --nproc-per-node 2 -m engine.bench tune -o tuning.json   # shared memory, without MPI
    ENGINE_TUNING_FILE=tuning.json mpirun -n 2 python train.py

Rounds of every algorithm are interleaved per size (noise hits all alike); the median over rounds of
the slowest rank's mean time is compared. Buffers come from torch's allocator.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch

from engine import registry, tuning
from engine.registry import EVERY

from .busbw import parse_size, size_sweep
from .progress import Progress


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m engine.bench tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True, help="the tuning file to write (JSON)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (the median is compared)")
    p.add_argument("--budget", type=float, default=0.1, help="seconds one measurement may take")
    return p.parse_args(argv)


def world():
    """engine.world() under an MPI launcher; under torchrun, a group made through torch's TCP store."""
    import engine
    from engine.launcher import detect_launcher
    if detect_launcher() is not None or "WORLD_SIZE" not in os.environ:
        return engine.world()
    from torch.distributed import TCPStore
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0)
    return engine.Communicator.from_store(store, rank, size, prefix="engine/tune", name="tune")


def candidates(comm):
    """(name, algorithm argument) of every allreduce entry this group can run."""
    return [(a, a) for a in comm.core.algorithms]


def slowest_mean(comm, run, budget):
    """The slowest rank's mean seconds per call, with an iteration count every rank agrees on."""
    run()
    run()
    t = torch.zeros(1, dtype=torch.float64)
    t0 = time.perf_counter()
    run()
    t[0] = time.perf_counter() - t0
    comm.allreduce(t, op="max")
    n = max(3, min(2000, int(budget / max(t.item(), 1e-7))))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    t[0] = (time.perf_counter() - t0) / n
    comm.allreduce(t, op="max")
    return t.item()


def measure(comm, sizes, rounds, budget, progress=None):
    """{bytes: {name: median seconds}}, every result checked against the sum each rank computes."""
    names = candidates(comm)
    timings = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = torch.zeros(count)  # timed on zeros: in-place sums stay 0 (no growth to inf, no denormals)
        want = comm.size * (comm.size + 1) / 2
        samples = {name: [] for name, _ in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate: no algorithm always goes first
            for name, algo in order:
                x.zero_()
                samples[name].append(slowest_mean(comm, lambda: comm.allreduce(x, algorithm=algo), budget))
                x.fill_(float(comm.rank + 1))
                comm.allreduce(x, algorithm=algo)
                if not bool((x == want).all()):
                    raise RuntimeError(f"allreduce algorithm {name} gave a wrong sum at {nbytes} bytes")
            if progress:
                progress.step(f"{nbytes} B")
        timings[nbytes] = {name: statistics.median(s) for name, s in samples.items()}
    return timings


def rules_from(timings, ranks, names):
    """Contiguous size ranges with the same fastest entry, as allreduce rules for this group size; a
    range's edges lie halfway (geometrically) between the measured sizes."""
    sizes = sorted(timings)
    best = [min(names, key=lambda n: timings[s][n]) for s in sizes]
    rules, start = [], 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or best[i] != best[start]:
            lo = 0 if start == 0 else int((sizes[start - 1] * sizes[start]) ** 0.5) + 1
            hi = EVERY if i == len(sizes) else int((sizes[i - 1] * sizes[i]) ** 0.5)
            rules.append({"algorithm": best[start], "min_bytes": lo, "max_bytes": hi,
                          "min_ranks": ranks, "max_ranks": ranks})
            start = i
    return rules


def main(argv):
    args = parse_args(argv)
    comm = world()
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    names = [n for n, _ in candidates(comm)]
    progress = Progress(len(sizes) * args.rounds, "tune") if comm.rank == 0 else None
    timings = measure(comm, sizes, args.rounds, args.budget, progress)
    if progress:
        progress.close()
    if comm.rank != 0:
        return
    doc = {"format": tuning.FORMAT,
           "rules": {"allreduce": {comm.transport: rules_from(timings, comm.size, names)}},
           "measured_on": {"host": socket.gethostname(), "cores": os.cpu_count(), "ranks": comm.size,
                           "transport": comm.transport, "entries": names,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                           "command": " ".join(["python", "-m", "engine.bench", "tune"] + list(argv))},
           "timings_us": {str(s): {n: round(t * 1e6, 2) for n, t in timings[s].items()} for s in sorted(timings)}}
    with open(args.output, "w") as f:
        json.dump(doc, f, indent=1)
    registry.tuned(args.output)  # what the engine will read: a file it would refuse fails here, named
    print(f"# allreduce, {comm.size} ranks, transport {comm.transport}, us per call (slowest rank, median of "
          f"{args.rounds} interleaved rounds)")
    print(f"{'bytes':>10} " + " ".join(f"{n:>9}" for n in names) + "   fastest")
    for s in sorted(timings):
        row = timings[s]
        print(f"{s:>10} " + " ".join(f"{row[n] * 1e6:>9.1f}" for n in names) + f"   {min(row, key=row.get)}")
    for r in doc["rules"]["allreduce"][comm.transport]:
        print(f"# rule: {r['algorithm']:>8} for {r['min_bytes']} .. {r['max_bytes']} bytes at {comm.size} ranks")
    print(f"# wrote {args.output}: use it with ENGINE_TUNING_FILE={os.path.abspath(args.output)}")
    sys.stdout.flush()
