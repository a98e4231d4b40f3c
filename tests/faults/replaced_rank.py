"""A process that replaces a dead rank and joins its group through reconfigure, then every call that meets
in the group's store: monitored_barrier, new_group, split_group, shrink_group, a new group of the shrunk
world, and the world made again on the store. 3 ranks over a TCPStore this script hosts (it outlives the
dead rank), enable_reconfigure=True, group timeout 10 s, ENGINE_TRANSPORT=argv[1]. Rank 2 takes part in
one reconfigure and all_reduce, then exits; a new process takes rank 2 on the same store (its
init_process_group counts its making ahead of the others': the dead one counted too), and the three
reconfigure under a fresh uuid. Before, each of those calls met under keys of each member's own making
(or count of worlds) and ended at the timeout (split_group and new_group without one: torch's 30
minutes); now they meet under the reconfigure's membership, and the world's shrinks after it, which
every member names alike.

Prints `rank <r> <call>: ok <seconds>` or `rank <r> <call>: FAILED ...` (tests/test_fault_tolerance.py)."""

import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

TIMEOUT = 10


def start(port, rank, transport):
    """This process's rank of the world of 3 over the script's store (enable_reconfigure=True): the store."""
    os.environ["ENGINE_TRANSPORT"] = transport
    import torch.distributed as dist
    import torchbridge  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("engine", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=TIMEOUT),
                            enable_reconfigure=True)
    return store


def worker(port, rank, replacement, transport):
    store = start(port, rank, transport)
    import torch
    import torch.distributed as dist

    def handles(gen):
        store.set(f"h/{gen}/{rank}", dist._get_reconfigure_handle())
        return [store.get(f"h/{gen}/{r}").decode() for r in range(3)]

    def summed(group=None):
        t = torch.full((4,), dist.get_rank() + 1.0)
        dist.all_reduce(t, group=group)
        return t[0].item()

    if not replacement:
        dist._reconfigure(1, handles(1), timeout=timedelta(seconds=30)).wait()
        assert summed() == 6.0
        if rank == 2:
            os._exit(1)
    dist._reconfigure(2, handles(2), timeout=timedelta(seconds=30)).wait()
    assert summed() == 6.0

    def call(name, fn):
        start = time.monotonic()
        try:
            fn()
            print(f"rank {rank} {name}: ok {time.monotonic() - start:.2f}", flush=True)
        except Exception as exc:
            print(f"rank {rank} {name}: FAILED after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}",
                  flush=True)

    def new_group():
        group = dist.new_group([0, 2])
        if rank != 1:
            assert summed(group) == 1.0 + 3.0

    def split():
        group = dist.split_group(split_ranks=[[0, 2], [1]])
        assert summed(group) == (4.0 if rank != 1 else 2.0), summed(group)

    def shrink():
        if rank != 1:
            group = dist.shrink_group([1])
            assert summed(group) == 1.0 + 2.0

    def new_group_of_the_shrunk_world():
        if rank != 1:   # (the world is the shrunk group now, of ranks 0 and 1)
            group = dist.new_group([0, 1])
            assert summed(group) == 1.0 + 2.0

    call("monitored_barrier", lambda: dist.monitored_barrier(timeout=timedelta(seconds=TIMEOUT)))
    call("new_group", new_group)
    if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 15):   # (torch 2.14 splits no CPU group)
        call("split_group", split)
    call("shrink_group", shrink)
    call("new_group_after_shrink", new_group_of_the_shrunk_world)

    def world_made_again():
        dist.destroy_process_group()
        dist.init_process_group("engine", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=TIMEOUT))
        assert summed() == 6.0

    call("world_made_again", world_made_again)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(3)], timedelta(seconds=60))
    os._exit(0)   # (the shrunk-out rank's world: no collective destroy to meet in)


def run(worker):
    """Ranks 0-2 run worker(port, rank, False, argv[1]) over a TCPStore hosted here; once rank 2 has
    exited, a new process takes its place: worker(port, 2, True, argv[1])."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(store.port, r, False, sys.argv[1])) for r in range(3)]
    for p in procs:
        p.start()
    procs[2].join(120)
    procs[2] = ctx.Process(target=worker, args=(store.port, 2, True, sys.argv[1]))
    procs[2].start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            print(f"a rank still ran after 120 s: killed (pid {p.pid})", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    run(worker)
