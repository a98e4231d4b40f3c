"""init_process_group and destroy_process_group three times in one process under mpiexec, env://
with nothing set (the engine fills MASTER_ADDR and MASTER_PORT): rank 0 holds each world (and its
store) a second longer than the others, so they reach their next init_process_group while its store
is still up, and it goes before rank 0 makes the next. Each rank prints `world I rank R port P sum S`."""

import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

for i in range(3):
    dist.init_process_group("engine", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"world {i} rank {rank} port {os.environ['MASTER_PORT']} sum {t.tolist()}", flush=True)
    if rank == 0:
        time.sleep(1.0)
    dist.destroy_process_group()
    gc.collect()   # (rank 0: its store's server goes now, after the others reached it)
