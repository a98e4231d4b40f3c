"""Under mpiexec at 2 ranks: rank 0 all-reduces while rank 1 sleeps for ever, under a long timeout:
tests/test_faults.py's check that a fault script's launch past its timeout shows where each rank waited
(tests/mpirun.py: ask_for_stacks sends it the engine's SIGUSR1: every thread's stack, then the flight
recorders)."""

import time

import numpy as np

import engine

world = engine.world()
print(f"rank {world.rank}: made", flush=True)
if world.rank == 0:
    world.allreduce(np.ones(4, np.float32))
else:
    time.sleep(3600)
