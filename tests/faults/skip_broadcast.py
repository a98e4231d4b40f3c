"""Rank 1 never joins a broadcast, a native MPI collective that blocks inside MPI: at the group timeout
(5 s) the others' watchdog must name the missing rank and abort the job (mpirun ends non-zero)."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine", timeout=timedelta(seconds=5))
rank = dist.get_rank()
t = torch.ones(4)
dist.broadcast(t, src=0)
if rank == 1:
    os.read(os.pipe()[0], 1)  # an event that never comes: the others' abort ends this rank
dist.broadcast(t, src=0)  # the root may return at once: MPI_Bcast needs no receiver to leave
dist.barrier()
print(f"rank {rank}: returned (unexpected)", flush=True)
