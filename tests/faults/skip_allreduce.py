"""Rank SKIP never calls the second all_reduce (it blocks on a pipe nobody writes, until the job ends);
the others must raise at the group timeout (5 s), naming the missing rank, and end the job. SKIP_API=engine:
the same on engine.world() (a group without a store: ENGINE_TIMEOUT=5)."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SKIP = int(os.environ.get("SKIP_RANK", "1"))
if os.environ.get("SKIP_API") == "engine":
    import engine
    world = engine.world()
    rank, all_reduce = world.rank, world.allreduce
else:
    dist.init_process_group(backend="engine", timeout=timedelta(seconds=5))
    rank, all_reduce = dist.get_rank(), dist.all_reduce
t = torch.ones(4)
all_reduce(t)  # everyone: #1
if rank == SKIP:
    print(f"rank {rank}: skips the all_reduce", flush=True)
    os.read(os.pipe()[0], 1)  # an event that never comes: the others' abort ends this rank
start = time.monotonic()
try:
    all_reduce(t)
    print(f"rank {rank}: all_reduce returned (unexpected)", flush=True)
    sys.exit(2)
except Exception as exc:
    print(f"rank {rank}: raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
