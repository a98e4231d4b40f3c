"""Under ENGINE_DEBUG=1, rank 0 all_reduces 100 elements and the others 200: every rank must raise a
mismatch error that says which ranks differ and how."""
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine")
rank = dist.get_rank()
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(100 if rank == 0 else 200))
    print(f"rank {rank}: no error (unexpected)", flush=True)
    sys.exit(2)
except Exception as exc:
    print(f"rank {rank}: raised after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
