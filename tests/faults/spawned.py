"""What the fault scripts that start their own ranks (spawned, beside a file store) share."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def say(text):
    """One line in one write: the ranks share the output pipe, and print() writes the newline apart."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def engine_world(rank, size, path, transport, timeout):
    """(this rank's engine group of the world, over `transport`, its FileStore at path)."""
    os.environ["ENGINE_TRANSPORT"] = transport
    store = dist.FileStore(path, size)
    dist.init_process_group("engine", rank=rank, world_size=size, store=store, timeout=timeout)
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")), store


def run_ranks(rank_main, size, *args, name, seconds):
    """rank_main(rank, path, *args) in `size` spawned processes, path a fresh file for their FileStore
    (removed at the end); prints their exit codes (a rank still running `seconds` after the one
    before it ended is killed)."""
    fd, path = tempfile.mkstemp(prefix=f"engine-test-{name}-")
    os.close(fd)
    os.remove(path)
    try:
        procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, path, *args)) for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(seconds)
            if p.exitcode is None:
                p.kill()
        print("exit codes", [p.exitcode for p in procs], flush=True)
    finally:
        if os.path.exists(path):
            os.remove(path)
