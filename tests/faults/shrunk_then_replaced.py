"""A world shrunk past a dead rank, then joined through reconfigure by a process that took that rank's
place, then made again on the store. 3 ranks over a TCPStore this script hosts, enable_reconfigure=True,
group timeout 10 s, ENGINE_TRANSPORT=argv[1]. Rank 2 exits after one all_reduce; ranks 0 and 1 shrink
the world without it; a new process takes rank 2 on the same store (its init_process_group counts its
making ahead of the others': the dead one counted too), and the three reconfigure; then every member
destroys its world and makes it again with its rank from the reconfigure. The reconfigure counts every
member's makings of the world up to the most among them: a shrunk world counted them in the shrink's
part of the store, where the world is never made again, and the world made again met in two makings.

Prints `rank <r> <step>: ok` or `rank <r> <step>: FAILED ...` (tests/test_fault_tolerance.py)."""

import os
from datetime import timedelta

from replaced_rank import TIMEOUT, start


def worker(port, rank, replacement, transport):
    store = start(port, rank, transport)
    import torch
    import torch.distributed as dist

    def summed(want):
        t = torch.full((4,), dist.get_rank() + 1.0)
        dist.all_reduce(t)
        assert t[0].item() == want, (t[0].item(), want)

    def step(name, fn):
        try:
            fn()
            print(f"rank {rank} {name}: ok", flush=True)
        except Exception as exc:
            print(f"rank {rank} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)

    if not replacement:
        store.set(f"h/1/{rank}", dist._get_reconfigure_handle())
        handles = [store.get(f"h/1/{r}").decode() for r in range(3)]
        dist._reconfigure(1, handles, timeout=timedelta(seconds=30)).wait()
        summed(6.0)
        if rank == 2:
            os._exit(1)
        step("shrink", lambda: (dist.shrink_group([2]), summed(3.0)))
        store.set(f"shrunk/{rank}", "1")
    else:
        store.wait(["shrunk/0", "shrunk/1"], timedelta(seconds=60))
    store.set(f"h/2/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"h/2/{r}").decode() for r in range(3)]
    step("reconfigure", lambda: (dist._reconfigure(2, handles, timeout=timedelta(seconds=30)).wait(), summed(6.0)))

    def made_again():
        again = dist.get_rank()
        dist.destroy_process_group()
        dist.init_process_group("engine", store=store, rank=again, world_size=3, timeout=timedelta(seconds=TIMEOUT))
        summed(6.0)

    step("world_made_again", made_again)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(3)], timedelta(seconds=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    from replaced_rank import run
    run(worker)
