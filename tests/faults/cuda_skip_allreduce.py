"""On 2 GPUs: rank 1 skips the second all_reduce. The GPU path must not hang: the watchdog aborts the
NCCL communicator after the group timeout (5 s) and rank 0's next call raises EngineTimeout."""
import datetime
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine", timeout=datetime.timedelta(seconds=5))
rank = dist.get_rank()
torch.cuda.set_device(rank)
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
if rank == 1:
    time.sleep(float(os.environ.get("SKIP_SLEEP", "12")))
else:
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()  # returns once the watchdog has aborted the stuck kernel
        dist.all_reduce(t)
        print(f"rank {rank}: no error", flush=True)
    except Exception as exc:
        print(f"rank {rank}: raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
os._exit(0)
