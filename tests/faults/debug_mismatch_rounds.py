"""In debug mode (ENGINE_DEBUG=1, or the setting DEBUG_SETTING names: TORCH_DISTRIBUTED_DEBUG=DETAIL),
under mpiexec at 4 ranks: ROUNDS times, a group of every rank all-reduces 2
elements where the last rank passes 3. Every rank must raise EngineMismatch naming both calls, every
round: a rank whose ring of signatures ended first gives the group up while the others still wait on
the ring's last steps, and they must finish the check, not fail naming that rank as lost. Each rank
prints `rank R: round K: TYPE: MESSAGE`."""

import os

import numpy as np

import engine
from engine import failure

ROUNDS = 8
NAME, VALUE = os.environ.get("DEBUG_SETTING", "ENGINE_DEBUG=1").split("=")

world = engine.world()
rank, size = world.rank, world.size
for k in range(ROUNDS):
    os.environ[NAME] = VALUE   # (read when a group is made)
    group = world.subgroup(list(range(size)))
    del os.environ[NAME]
    try:
        group.allreduce(np.ones(3 if rank == size - 1 else 2, np.float32))
        print(f"rank {rank}: round {k}: passed (unexpected)", flush=True)
    except Exception as exc:
        print(f"rank {rank}: round {k}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    group.free()
    failure.recovered()   # (handled: the process need not end the job at its exit)
    world.barrier()   # (the next round's group: every rank made with the last one)
print(f"rank {rank}: done", flush=True)
