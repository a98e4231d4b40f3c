"""The last rank skips an all_reduce on a subgroup of every rank: the others time out there (the group
failed: under MPI the job would end at exit), then shrink the subgroup without the last rank and run a
collective on the new group. The failed group was replaced: every rank exits normally, none aborts
the job (the policy forgot a failure only when the world was replaced). RECOVER=abort: they abort the
subgroup first (torchft's order), which takes its communicator off before the shrink replaces it.
RECOVER=world: the ranks destroy the world instead and make it again (init_process_group): that world
spans the job, so the failure is forgotten too (the job was aborted at exit). Under ENGINE_SOCKETS=2 at
4 ranks the subgroup has a hierarchy, and the timeout is a stage's."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine", timeout=timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
last = size - 1
recover = os.environ.get("RECOVER", "shrink")
sub = dist.new_group(list(range(size)), timeout=timedelta(seconds=2))
dist.all_reduce(torch.ones(1 << 16), group=sub)   # (256 KB: over a hierarchy's threshold)
if rank < last:
    try:
        dist.all_reduce(torch.ones(1 << 16), group=sub)
        raise SystemExit(f"rank {rank}: the all_reduce without rank {last} returned")
    except RuntimeError as exc:
        assert "did not arrive" in str(exc) or "gave the group up" in str(exc), exc   # (a stage names its own)
    if recover != "world":
        backend = sub._get_backend(torch.device("cpu"))
        if recover == "abort":
            backend.abort()
        shrunk = backend.shrink([last])
        t = torch.full((3,), rank + 1.0)
        shrunk.allreduce([t]).wait()
        assert torch.equal(t, torch.full((3,), last * (last + 1) / 2)), t
        shrunk.shutdown()
dist.barrier()
if recover == "world":
    dist.destroy_process_group()
    dist.init_process_group(backend="engine", timeout=timedelta(seconds=60))
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), size * (size + 1) / 2)), t
print(f"rank {rank}: recovered", flush=True)
dist.destroy_process_group()
