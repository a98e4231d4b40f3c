"""Three ranks (spawned), debug mode (ENGINE_DEBUG=1): rank 2 dies (SIGKILL) once the world is made,
and the others all-reduce. Debug mode's check of the ranks' calls (an allgather of their signatures)
is where the loss is seen: the error must name the user's call, not only the check's allgather. Each
survivor prints `rank R: TYPE: MESSAGE`.

    python tests/faults/debug_lost.py shm|tcp
"""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from spawned import engine_world, run_ranks, say


def rank_main(rank, path, transport):
    os.environ["ENGINE_DEBUG"] = "1"
    world, store = engine_world(rank, 3, path, transport, timedelta(seconds=40))
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(4))
        say(f"rank {rank}: the all_reduce passed without rank 2 (unexpected)")
    except Exception as exc:
        say(f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    os._exit(0)   # (the world lost rank 2: destroying it would only say so again)


if __name__ == "__main__":
    run_ranks(rank_main, 3, sys.argv[1], name="debug-lost", seconds=120)
