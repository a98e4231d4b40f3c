"""Under mpirun, over MPI's transport: rank 0's allreduce is interrupted (SIGINT while it waits for
rank 1, which comes late); rank 0 catches the KeyboardInterrupt, destroys its group and leaves, as a
script that saves its work on ^C does. The call ended midway: the group is broken there, and no word
of it reaches rank 1 over MPI. So it is the group's failure: rank 0's exit ends the job (after
ENGINE_ABORT_GRACE_SECONDS), where rank 1 waited in its next allreduce the group's whole timeout (60 s
here; torch's default is 30 minutes) and rank 0 in MPI_Finalize."""

import os
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine", timeout=timedelta(seconds=60))
rank = dist.get_rank()
dist.all_reduce(torch.ones(4))
if rank == 0:
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        dist.all_reduce(torch.ones(1000))
    except KeyboardInterrupt:
        print("rank 0: interrupted in its allreduce", flush=True)
    dist.destroy_process_group()
    print("rank 0: destroyed its group, leaving", flush=True)
else:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # (the launcher's ^C is rank 0's alone here)
    threading.Event().wait(3.0)                    # (late: rank 0 is interrupted while it waits)
    for call in ("allreduce", "next allreduce"):   # (the first may meet what rank 0 sent before its ^C)
        t = torch.ones(1000)
        try:
            dist.all_reduce(t)
            print(f"rank 1: {call} returned {t[0].item()}", flush=True)
        except Exception as exc:
            print(f"rank 1: {call} raised {type(exc).__name__}: {exc}", flush=True)
    dist.destroy_process_group()
