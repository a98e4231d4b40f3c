"""Ranks calling different collectives, without ENGINE_DEBUG: each case runs in a group of its own
(every rank of the world), in which the last rank calls something other than the others. Each rank
prints, per case, what its calls did: `CASE <name> rank <r>: returned <values>` or `... raised <type>:
<message>`; then it destroys the case's group, so that a rank still waiting in it is told.

tests/test_faults.py reads the lines: no rank may return something other than what its own call
asks for, and the mismatch must end in EngineMismatch, not in the group's timeout."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)
dist.init_process_group(backend="engine", timeout=TIMEOUT)
R, P = dist.get_rank(), dist.get_world_size()
ODD = R == P - 1          # the rank whose call differs
Op = dist.ReduceOp


def mine(n=8, dtype=torch.float32):
    return torch.arange(n, dtype=dtype) + 10 * R + 1


def kind(g):
    t = mine()
    if ODD:
        dist.broadcast(t, src=0, group=g)
    else:
        dist.all_reduce(t, group=g)
    return [t]


def reduce_op(g):
    t = mine()
    dist.all_reduce(t, op=Op.MAX if ODD else Op.SUM, group=g)
    return [t]


def avg(g):
    t = mine()
    dist.all_reduce(t, op=Op.AVG if ODD else Op.SUM, group=g)
    return [t]


def dtype(g):
    # the same bytes: a size check can't tell them apart
    t = mine(4, torch.float64) if ODD else mine(8, torch.float32)
    dist.all_reduce(t, group=g)
    return [t]


def bitwise_dtype(g):
    # a reduce_scatter's BOR of int16 against one of int64, of the same bytes: over point-to-point the
    # tags' hash gave the two one base, and the ranks returned blocks or'd from both readings
    t = mine(6, torch.int64) if ODD else mine(24, torch.int16)
    out = torch.zeros(t.numel() // P, dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, op=Op.BOR, group=g)
    return [out]


def broadcast_root(g):
    # the odd rank believes it is the root. Over the segment every root checks its readers; over
    # point-to-point a root hears from nobody, so the group's next call (the barrier) is where the
    # difference shows, if a rank's broadcast did not see it.
    t = mine()
    dist.broadcast(t, src=P - 1 if ODD else 0, group=g)
    if os.environ.get("ENGINE_TRANSPORT") == "tcp" or "ENGINE_BROADCAST_ALGO" in os.environ:
        dist.barrier(group=g)
    return [t]


def broadcast_root_large(g):
    # the same, 4 MB: over the segment by single copy, where a reader may copy from a root that left
    # the call (its error names that root); what a rank returns is its first 8 and last 2 elements
    t = mine(1 << 20)
    dist.broadcast(t, src=P - 1 if ODD else 0, group=g)
    if os.environ.get("ENGINE_TRANSPORT") == "tcp" or "ENGINE_BROADCAST_ALGO" in os.environ:
        dist.barrier(group=g)
    return [t[:8], t[-2:]]


def every_rank_root(g):
    # nobody sends: no message can show it (the arrival notes in the store do, after 2 s of waiting)
    t = mine()
    dist.reduce(t, dst=R, group=g)
    return [t]


def allgather_vs_reduce_scatter(g):
    out = torch.zeros(8 * P)
    if ODD:
        dist.reduce_scatter_tensor(out[:8], torch.cat([mine()] * P), group=g)
    else:
        dist.all_gather_into_tensor(out, mine(), group=g)
    return [out]


def count(g):
    # the same call with twice the elements: no key tells them apart, only the sizes
    t = mine(16 if ODD else 8)
    dist.all_reduce(t, group=g)
    return [t]


def alltoall_splits(g):
    # the odd rank sends rank 0 one element too few and rank 1 one too many, and expects 3 from rank 0
    # and 1 from rank 1, where every other rank sends and expects 2 of every rank: every rank meets a
    # block of another size
    even = [2] * P
    out = torch.zeros(2 * P)
    dist.all_to_all_single(out, mine(2 * P), output_split_sizes=[3, 1] + even[2:] if ODD else even,
                           input_split_sizes=[1, 3] + even[2:] if ODD else even, group=g)
    return [out]


CASES = [kind, reduce_op, avg, dtype, bitwise_dtype, broadcast_root, broadcast_root_large, every_rank_root, count, alltoall_splits,
         allgather_vs_reduce_scatter]   # (last: over MPI it blocks inside MPI, and the watchdog ends the job)
only = sys.argv[1:] or os.environ.get("MISMATCH_CASES", "").split()
for case in CASES:
    if only and case.__name__ not in only:
        continue
    g = dist.new_group(list(range(P)), timeout=TIMEOUT)
    try:
        got = case(g)
        print(f"CASE {case.__name__} rank {R}: returned {[t.tolist() for t in got]}", flush=True)
    except Exception as exc:
        print(f"CASE {case.__name__} rank {R}: raised {type(exc).__name__}: {exc}", flush=True)
    dist.destroy_process_group(g)
dist.barrier()
dist.destroy_process_group()
