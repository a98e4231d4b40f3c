"""Rank 2 never calls the second reduce (it blocks on a pipe nobody writes); rank 1 does its part of it
and then (DONE_THEN): `exit`s normally without destroying the group, is gone at once (`kill`: os._exit,
as killed), or `stay`s outside the engine. Rank 0, the root, waits for rank 2 alone: its error must name
rank 2 as the one it waited for, never rank 1, which did its part (it was named as not arrived, or as
the rank the call waited for when it exited)."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

then = os.environ.get("DONE_THEN", "exit")
dist.init_process_group(backend="engine", timeout=timedelta(seconds=5))
rank = dist.get_rank()
t = torch.ones(4)
dist.reduce(t, dst=0)   # everyone: #1
if rank == 2:
    os.read(os.pipe()[0], 1)   # an event that never comes: the others' abort ends this rank
start = time.monotonic()
try:
    dist.reduce(t, dst=0)
    if rank == 1:
        print("rank 1: did its part", flush=True)
        time.sleep(0.5)   # (rank 0 is in its wait)
        if then == "exit":
            sys.exit(0)
        if then == "kill":
            os._exit(0)
        os.read(os.pipe()[0], 1)
    print(f"rank {rank}: reduce returned (unexpected)", flush=True)
    sys.exit(2)
except Exception as exc:
    print(f"rank {rank}: raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
