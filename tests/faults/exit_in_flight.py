"""A rank whose script ends with asynchronous collectives still queued and running (never waited) must
exit 0, as must its peers. The group's progress thread runs them in torch's tensor ops and completes
their futures through torch's C++ (both release the GIL); a daemon thread still doing so when Python
finalizes dies as it takes the GIL back, and torch's C++ runtime aborts the process ("terminate
called without an active exception", SIGABRT). The engine runs what is queued at exit instead.
Run under torchrun (a normal interpreter exit: multiprocessing's children leave through os._exit)."""

import torch
import torch.distributed as dist

dist.init_process_group("engine")
rank, size = dist.get_rank(), dist.get_world_size()
n = 1 << 20
works = []
for i in range(16):
    outs = [torch.empty(n) for _ in range(size)]       # a list: the general path, torch's copies in the thread
    work = dist.all_gather(outs, torch.full((n,), float(rank + i)), async_op=True)
    work.get_future().then(lambda fut: [t.sum() for t in fut.value()])   # torch's C++ calls it in the thread
    works.append(work)
print(f"rank {rank}: leaving with {sum(not w.is_completed() for w in works)} of {len(works)} collectives in flight",
      flush=True)
