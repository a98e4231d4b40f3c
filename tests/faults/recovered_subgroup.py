"""Rank 2 skips an all_reduce on a subgroup of every rank: ranks 0 and 1 time out there (the group
failed: under MPI the job would end at exit), then shrink the subgroup without rank 2 and run a
collective on the new group. The failed group was replaced: every rank exits normally, none aborts
the job (the policy forgot a failure only when the world was replaced). RECOVER=world: the ranks
destroy the world instead and make it again (init_process_group): that world spans the job, so the
failure is forgotten too (the job was aborted at exit)."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine", timeout=timedelta(seconds=60))
rank = dist.get_rank()
sub = dist.new_group([0, 1, 2], timeout=timedelta(seconds=2))
dist.all_reduce(torch.ones(2), group=sub)
if rank < 2:
    try:
        dist.all_reduce(torch.ones(2), group=sub)
        raise SystemExit(f"rank {rank}: the all_reduce without rank 2 returned")
    except RuntimeError as exc:
        assert "rank 2 did not arrive" in str(exc), exc
    if os.environ.get("RECOVER") != "world":
        shrunk = sub._get_backend(torch.device("cpu")).shrink([2])
        t = torch.full((3,), rank + 1.0)
        shrunk.allreduce([t]).wait()
        assert torch.equal(t, torch.full((3,), 3.0)), t
        shrunk.shutdown()
dist.barrier()
if os.environ.get("RECOVER") == "world":
    dist.destroy_process_group()
    dist.init_process_group(backend="engine", timeout=timedelta(seconds=60))
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 6.0)), t
print(f"rank {rank}: recovered", flush=True)
dist.destroy_process_group()
