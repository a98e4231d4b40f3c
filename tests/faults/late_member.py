"""Three ranks (spawned). Ranks 0 and 1 make a group of all three with a timeout of 1 s, and give it up
when rank 2 does not come; only then (a key in the store says so) does rank 2 make it, late. Rank 2
must fail at once, saying the others gave the making up, not wait for them in the group's bootstrap
until its own timeout (40 s) and say they never joined. Then every rank makes the group again, and
it must meet and sum. Once for an engine subgroup (Communicator.subgroup), once for torch's new_group.
Each failure prints `rank R: WHAT after S s: TYPE: MESSAGE`.

    python tests/faults/late_member.py shm|tcp
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from spawned import engine_world, run_ranks, say

SHORT, LONG = timedelta(seconds=1), timedelta(seconds=40)


def rank_main(rank, path, transport):
    world, store = engine_world(rank, 3, path, transport, LONG)
    makings = [("subgroup", lambda timeout: world.communicator.subgroup([0, 1, 2], name="late",
                                                                               timeout=timeout.total_seconds())),
               ("new_group", lambda timeout: dist.new_group([0, 1, 2], timeout=timeout))]
    for what, make in makings:
        if rank == 2:
            store.wait([f"test/{what} given up by {r}" for r in (0, 1)])
        start = time.monotonic()
        try:
            make(SHORT if rank != 2 else LONG)
            say(f"rank {rank}: {what} was made without rank 2 in time (unexpected)")
        except Exception as exc:
            say(f"rank {rank}: {what} after {time.monotonic() - start:.2f} s: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}")
        store.set(f"test/{what} given up by {rank}", "")
        dist.barrier()
        group = make(LONG)   # (made again, by all three)
        t = torch.full((3,), rank + 1.0)
        if what == "subgroup":
            group.allreduce(t)
            group.free()
        else:
            dist.all_reduce(t, group=group)
        assert t.tolist() == [6.0] * 3, t
        say(f"rank {rank}: {what} made again and summed")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_ranks(rank_main, 3, sys.argv[1], name="late-member", seconds=120)
