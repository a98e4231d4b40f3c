"""Rank 1 never joins a collective (SKIP_OP=broadcast, the default, or reduce): at the group timeout
(5 s) the others must name the missing rank and the job must end (mpirun ends non-zero). Over MPI a
broadcast is MPI's own collective waited on by the engine (it raises EngineTimeout like any wait, and
the failure policy then ends the job); a reduce blocks inside MPI, where the watchdog thread names
the missing rank and aborts the job."""
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
if os.environ.get("SKIP_OP", "broadcast") == "reduce":
    dist.reduce(t, dst=0)  # only the root must wait: a sender may leave at once
else:
    dist.broadcast(t, src=0)  # the root may return at once: MPI_Bcast needs no receiver to leave
dist.barrier()
print(f"rank {rank}: returned (unexpected)", flush=True)
