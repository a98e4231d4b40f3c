"""Four ranks (spawned). Ranks 0 and 1 make a group of all four with a timeout of 1 s, and give it up
when ranks 2 and 3 do not come; only then (a key in the store says so) does rank 2 make it, late, and
once rank 2 has failed, rank 3. Rank 2 must fail at once, saying the others gave the making up, not
wait for rank 3's list until its own timeout (40 s) and say it never came; rank 3 must fail at once
too, not wait for the others in the group's bootstrap and say they never joined. Then every rank
makes the group again, and it must meet and sum. Once for an engine subgroup (Communicator.subgroup),
once for torch's new_group. Then ("waited"): only rank 0 has the short timeout, ranks 1 and 2 come in
time with 40 s, and rank 3 comes after all three failed: ranks 1 and 2 must fail once rank 0 gave up,
not at their own timeout. Each failure prints `rank R: WHAT after S s: TYPE: MESSAGE`.

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
    world, store = engine_world(rank, 4, path, transport, LONG)
    subgroup = lambda timeout: world.communicator.subgroup([0, 1, 2, 3], name="late", timeout=timeout.total_seconds())
    new_group = lambda timeout: dist.new_group([0, 1, 2, 3], timeout=timeout)
    # (what, make, the ranks with the short timeout, the ranks that come late: each once those before it failed)
    makings = [("subgroup", subgroup, (0, 1), (2, 3)), ("new_group", new_group, (0, 1), (2, 3)),
               ("waited", subgroup, (0,), (3,))]
    for what, make, short, late in makings:
        if rank in late:
            store.wait([f"test/{what} given up by {r}" for r in range(rank)])
        start = time.monotonic()
        try:
            make(SHORT if rank in short else LONG)
            say(f"rank {rank}: {what} was made without ranks {late} in time (unexpected)")
        except Exception as exc:
            say(f"rank {rank}: {what} after {time.monotonic() - start:.2f} s: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}")
        store.set(f"test/{what} given up by {rank}", "")
        dist.barrier()
        group = make(LONG)   # (made again, by all four)
        t = torch.full((3,), rank + 1.0)
        if make is subgroup:
            group.allreduce(t)
            group.free()
        else:
            dist.all_reduce(t, group=group)
        assert t.tolist() == [10.0] * 3, t
        say(f"rank {rank}: {what} made again and summed")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_ranks(rank_main, 4, sys.argv[1], name="late-member", seconds=120)
