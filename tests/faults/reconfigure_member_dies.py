"""Three ranks (spawned); rank 2 dies (SIGKILL) in a reconfigure of all three, WHEN:

- before: it handed out its handle, then died before it reconfigured;
- making: inside the new group's making, after the first member took its hello (its store keys unset).

Ranks 0 and 1 (0: the hub, 1: a member) must fail at once, naming rank 2 as member 2, not at the
reconfigure's timeout (40 s). Each prints `rank R: failed after S s: TYPE: MESSAGE`; then both
reconfigure again, the two of them, and check an all_reduce (the handles stay valid).

    python tests/faults/reconfigure_member_dies.py before|making shm|tcp
"""

import os
import signal
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from spawned import engine_world, run_ranks, say

TIMEOUT = timedelta(seconds=40)


def rank_main(rank, path, when, transport):
    backend, store = engine_world(rank, 3, path, transport, TIMEOUT)
    store.set(f"handle{rank}", backend.get_reconfigure_handle())
    handles = [store.get(f"handle{r}").decode() for r in range(3)]
    if rank == 2:
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        import engine.bootstrap
        import engine.tcp
        for module in (engine.bootstrap, engine.tcp):   # (the first exchange of the new group's making)
            module.gather = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        backend.reconfigure(SimpleNamespace(uuid=1, handles=handles, timeout=TIMEOUT))
        say(f"rank {rank}: the reconfigure passed without rank 2")
        os._exit(1)
    except Exception as exc:
        say(f"rank {rank}: failed after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}")
    backend.reconfigure(SimpleNamespace(uuid=2, handles=handles[:2], timeout=TIMEOUT))
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 3, t
    say(f"rank {rank}: the two reconfigured and summed")
    dist.destroy_process_group()


if __name__ == "__main__":
    when, transport = sys.argv[1], sys.argv[2]
    run_ranks(rank_main, 3, when, transport, name="reconfigure", seconds=120)
