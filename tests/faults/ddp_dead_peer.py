"""DDP whose gradient bucket's allreduce fails while in flight: two spawned ranks (no launcher to kill
the survivor first), rank 1 leaves after two steps, and rank 0's next backward must raise an error
naming rank 1 rather than crash (DDP's reducer reads the failed Work's future in C++). Prints
`rank 0 raised: ...` or `rank 0: backward passed` and exits 0."""

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, port):
    import torchbridge  # noqa: F401  (registers the backend)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("engine", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    net = DDP(torch.nn.Linear(8, 8))
    for _ in range(2):   # the second step rebuilds the buckets (a broadcast from rank 0): the next call is the bucket's
        net(torch.ones(4, 8)).sum().backward()
    dist.barrier()
    if rank == 1:
        os._exit(0)
    try:
        net(torch.ones(4, 8)).sum().backward()
        print("rank 0: backward passed", flush=True)
    except Exception as exc:
        print(f"rank 0 raised: {type(exc).__name__}: {exc}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [mp.get_context("spawn").Process(target=worker, args=(r, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    print("exit codes", [p.exitcode for p in procs], flush=True)
