"""Three ranks (spawned); rank DEAD (2 or 0) dies (SIGKILL), WHEN:

- before: once the world is made. The other two then wait, each in turn, for members that include
  it, with every timeout at 40 s:

- barrier, barrier_all: the world's monitored_barrier, without and with wait_all_ranks (rank 0 waits
  for the others' arrival, in order: with rank 2 dead, rank 1 comes to the first only once rank 0 is
  through it; the others wait for rank 0, then for its verdict);
- new_group: dist.new_group([0, 1, 2]);
- split: the world's split_group([0, 1, 2]) (torch 2.15's dist.split_group calls it);
- subgroup: the world's engine Communicator's subgroup([0, 1, 2]).

- broken: as before, once the world broke: the three called different collectives (a mismatch), and
  the collectives' channel of the world (over TCP) said its goodbye to every peer;
- making: inside the making of the world's split_group([0, 1, 2]), at its first exchange, once the
  members agreed (the split is the one step); making_new_group, making_subgroup: the same inside the
  making of new_group([0, 1, 2]) (then the subgroup, its loss known before) or of the engine subgroup
  (then new_group);
- connect (TCP): inside the world's making, once its end is made, before it connects to the others;
- shrink: rank DEAD (1) inside the making of the world's shrink([2]) (rank 2 is left out alive; the
  shrink is rank 0's and rank 1's one step, and rank 0 is the one left to name it); shrink_abort: the
  same with SHRINK_ABORT, which ends the world's calls first (its transport still watches the members
  while the new group is made).

Each must end at once, naming rank DEAD as lost, not at its timeout. Each prints `rank R: WHAT after S
s: TYPE: MESSAGE`; then the two make a group of their own and check an all_reduce on it.

    python tests/faults/lost_member.py shm|tcp DEAD before|broken|connect|making|making_new_group|making_subgroup|shrink|shrink_abort
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from spawned import engine_world, run_ranks, say

TIMEOUT = timedelta(seconds=40)


def rank_main(rank, path, transport, dead, when):
    if when == "connect":   # (over TCP: it dies once its end of the world is made, before it connects)
        if rank == dead:
            import engine._core   # (engine/tcp.py looks TcpComm up at each group)
            engine._core.TcpComm = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            engine_world(rank, 3, path, transport, TIMEOUT)
            say(f"rank {rank}: connect passed without rank {dead}")
        except Exception as exc:
            say(f"rank {rank}: connect after {time.monotonic() - start:.2f} s: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}")
        os._exit(0)
    world, store = engine_world(rank, 3, path, transport, TIMEOUT)
    dist.barrier()
    if when == "broken":
        try:   # (rank 2 broadcasts where the others all-reduce)
            t = torch.ones(4)
            dist.broadcast(t, 0) if rank == 2 else dist.all_reduce(t)
            say(f"rank {rank}: the mismatch passed (unexpected)")
        except Exception as exc:
            say(f"rank {rank}: the world broke: {type(exc).__name__}")
        store.set(f"rank {rank} saw the world break", "")
        store.wait([f"rank {r} saw the world break" for r in range(3)])
    if rank == dead and when in ("before", "broken"):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == dead:
        import engine.communicator   # (the first exchange of a group's making)
        engine.communicator.gather = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    steps = [("barrier", lambda: world.monitored_barrier(TIMEOUT)),
             ("barrier_all", lambda: world.monitored_barrier(TIMEOUT, wait_all_ranks=True)),
             ("new_group", lambda: dist.new_group([0, 1, 2], timeout=TIMEOUT)),
             ("split", lambda: world.split_group([0, 1, 2], timeout=TIMEOUT)),
             ("subgroup", lambda: world.communicator.subgroup([0, 1, 2], name="all-three"))]
    if when == "broken":
        steps = [step for step in steps if step[0] != "split"]   # (torch splits no broken group)
    if when.startswith("making"):   # (the one it dies in first)
        order = {"making": ["split"], "making_new_group": ["new_group", "subgroup"],
                 "making_subgroup": ["subgroup", "new_group"]}[when]
        steps = sorted((step for step in steps if step[0] in order), key=lambda step: order.index(step[0]))
    if when.startswith("shrink"):
        flags = dist.distributed_c10d.SHRINK_ABORT if when == "shrink_abort" else 0
        steps = [("shrink", lambda: world.shrink([2], flags))] if rank != 2 else []
    for what, step in steps:
        if what == "barrier" and dead == 2 and rank == 1:
            store.wait(["rank 0 is through"])   # (rank 0 waits for this rank first: the dead one is behind it)
        start = time.monotonic()
        try:
            step()
            say(f"rank {rank}: {what} passed without rank {dead}")
        except Exception as exc:
            say(f"rank {rank}: {what} after {time.monotonic() - start:.2f} s: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}")
        if what == "barrier" and rank == 0:
            store.set("rank 0 is through", "")
    alive = [r for r in range(3) if r != dead]
    pair = dist.new_group(alive, timeout=TIMEOUT)
    t = torch.full((5,), rank + 1.0)
    dist.all_reduce(t, group=pair)
    assert t.tolist() == [sum(alive) + 2.0] * 5, t
    say(f"rank {rank}: the two made a group and summed")
    os._exit(0)   # (the world lost rank 2: destroying it would only say so again)


if __name__ == "__main__":
    transport, dead, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    run_ranks(rank_main, 3, transport, dead, when, name="lost-member", seconds=300)
