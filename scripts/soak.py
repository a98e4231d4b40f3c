"""Soak: N seeded random operations (op, size, dtype, sync or async) over two groups, every result
checked against a reference each rank computes; resident memory and open file descriptors tracked.

    mpirun -n 3 python scripts/soak.py --ops 20000          # the long run (docs/robustness.md)
    (tests/test_soak.py runs a short one; scripts/fault_soak.py draws its traffic from draw_op)

Prints one line per rank and, on rank 0, a JSON summary; exits non-zero on any wrong result, on
resident memory growth over --max-rss-mb, or on a change in open descriptors.
"""

import argparse
import json
import os
import random
import sys
import time
from collections import namedtuple

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]
KINDS = ["all_reduce", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "alltoall", "barrier", "sendrecv"]
# What draw_op issued: its works, what its result should be (verify() returns None when right, else what
# is wrong), and whether the caller may leave it in flight.
Op = namedtuple("Op", "works verify asynchronous")


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def value(rank, n, dtype, salt):
    return ((torch.arange(n, dtype=torch.int64) * 3 + rank * 7 + salt) % 5 + 1).to(dtype)


def _same(got, want, what):
    return None if torch.equal(got, want) else what


def draw_op(rng, rank, ranks, group, max_elems, label, large=0.2):
    """Draws one operation from rng and issues it on `group` if `rank` is among its members `ranks`
    (world ranks, as torch names them). Every rank draws the same stream, members or not, so each draw
    is the same operation everywhere. Returns an Op, or None where this rank takes no part."""
    kind = rng.choice(KINDS)
    dtype = rng.choice(DTYPES)
    n = rng.randint(1, max_elems) if rng.random() < large else rng.randint(1, 64)
    asynchronous = rng.random() < 0.5
    salt = rng.randint(0, 1000)
    if rank not in ranks or (kind == "sendrecv" and len(ranks) == 1):   # (a group of one has no peer)
        return None
    g, me = len(ranks), ranks.index(rank)
    what = f"{label} {kind} of {n} {dtype}"
    if kind == "all_reduce":
        t = value(rank, n, dtype, salt)
        want = sum(value(r, n, torch.int64, salt) for r in ranks).to(dtype)
        return Op([dist.all_reduce(t, group=group, async_op=asynchronous)], lambda: _same(t, want, what), asynchronous)
    if kind == "broadcast":
        root = ranks[salt % g]
        t = value(rank, n, dtype, salt)
        work = dist.broadcast(t, src=root, group=group, async_op=asynchronous)
        return Op([work], lambda: _same(t, value(root, n, dtype, salt), what), asynchronous)
    if kind == "all_gather":
        out = torch.empty(n * g, dtype=dtype)
        work = dist.all_gather_into_tensor(out, value(rank, n, dtype, salt), group=group, async_op=asynchronous)
        want = torch.cat([value(r, n, dtype, salt) for r in ranks])
        return Op([work], lambda: _same(out, want, what), asynchronous)
    if kind == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        work = dist.reduce_scatter_tensor(out, value(rank, n * g, dtype, salt), group=group, async_op=asynchronous)
        want = sum(value(r, n * g, torch.int64, salt) for r in ranks)[me * n:(me + 1) * n].to(dtype)
        return Op([work], lambda: _same(out, want, what), asynchronous)
    if kind == "alltoall":
        out = torch.empty(n * g, dtype=dtype)
        work = dist.all_to_all_single(out, value(rank, n * g, dtype, salt), group=group, async_op=asynchronous)
        want = torch.cat([value(r, n * g, dtype, salt)[me * n:(me + 1) * n] for r in ranks])
        return Op([work], lambda: _same(out, want, what), asynchronous)
    if kind == "barrier":
        return Op([dist.barrier(group=group, async_op=asynchronous)], lambda: None, asynchronous)
    right, left = ranks[(me + 1) % g], ranks[(me - 1) % g]   # sendrecv around the group's ring
    inbox = torch.empty(n, dtype=dtype)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, value(rank, n, dtype, salt), right, group),
                                    dist.P2POp(dist.irecv, inbox, left, group)])
    return Op(works, lambda: _same(inbox, value(left, n, dtype, salt), what), asynchronous)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-elems", type=int, default=1 << 16)
    ap.add_argument("--max-rss-mb", type=float, default=50.0)
    args = ap.parse_args()

    dist.init_process_group(backend="engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    members = [r for r in range(size) if r % 2 == 0]  # the second group: even ranks
    second = dist.new_group(members)
    rng = random.Random(args.seed)  # same stream on every rank: same ops in the same order
    pending, wrong, done = [], 0, 0
    rss0 = fds0 = None
    start = time.monotonic()

    def drain():
        nonlocal done, wrong
        for op in pending:
            for work in op.works:
                if work is not None:
                    work.wait()
            problem = op.verify()
            if problem:
                wrong += 1
                print(f"rank {rank}: WRONG {problem}", file=sys.stderr, flush=True)
            done += 1
        pending.clear()

    for i in range(args.ops):
        if i == min(1000, args.ops // 10):  # after warm-up: buffers, caches and threads exist
            rss0, fds0 = rss_mb(), open_fds()
        use_second = rng.random() < 0.3
        group, ranks = (second, members) if use_second else (None, list(range(size)))
        op = draw_op(rng, rank, ranks, group, args.max_elems, f"op {i}")
        if op is None:
            continue
        pending.append(op)
        if not op.asynchronous or len(pending) > 16:
            drain()
    drain()
    dist.barrier()
    elapsed = time.monotonic() - start
    growth = rss_mb() - (rss0 or rss_mb())
    fd_delta = open_fds() - (fds0 or open_fds())
    stats = torch.tensor([growth, float(fd_delta), float(wrong), float(done)], dtype=torch.float64)
    everyone = [torch.empty_like(stats) for _ in range(size)]
    dist.all_gather(everyone, stats)
    print(f"rank {rank}: {done} checked results, {wrong} wrong, RSS growth {growth:.1f} MB, fds {fd_delta:+d}",
          flush=True)
    if rank == 0:
        summary = {"ranks": size, "ops": args.ops, "seed": args.seed, "seconds": round(elapsed, 1),
                   "checked_results_all_ranks": int(sum(float(s[3]) for s in everyone)),
                   "wrong": int(sum(float(s[2]) for s in everyone)),
                   "max_rss_growth_mb": round(max(float(s[0]) for s in everyone), 2),
                   "max_fd_delta": int(max(abs(float(s[1])) for s in everyone))}
        print("SOAK " + json.dumps(summary), flush=True)
    ok = all(float(s[2]) == 0 and float(s[0]) < args.max_rss_mb and float(s[1]) == 0 for s in everyone)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
