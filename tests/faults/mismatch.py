"""Under ENGINE_DEBUG=1, at 2 ranks:
1. calls whose sizes differ between the ranks by design (all_gather of uneven tensors, all_to_all_single
   with uneven splits, the engine's gather and scatter with counts on the root) pass the signature
   check, as torch's own DETAIL checks pass them, and so does an all_gather_into_tensor whose output is
   contiguous on one rank only (the other's goes through a copy), even counts given by one rank
   only (the call without counts on the other), and an all_to_all_single split evenly on one rank
   only; a rank whose size is not what the root's counts say
   fails it;
2. rank 1 never calls an all_reduce of a group with a 1 s timeout: rank 0's signature check ends at that
   timeout, not never;
3. rank 0 all_reduces 100 elements and rank 1 200: every rank must raise a mismatch error that says
   which ranks differ and how."""
import datetime
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine")
rank = dist.get_rank()

uneven = dist.new_group([0, 1])
outs = [torch.empty(r + 1) for r in range(2)]
dist.all_gather(outs, torch.full((rank + 1,), float(rank)), group=uneven)
out = torch.empty(3)   # rank r sends r + 1 elements to rank 0 and 2 - r to rank 1
dist.all_to_all_single(out, torch.full((3,), float(rank)), [rank + 1, 2 - rank], [rank + 1, 2 - rank], group=uneven)
ok = all(torch.equal(outs[r], torch.full((r + 1,), float(r))) for r in range(2)) and \
    torch.equal(out, torch.tensor([0.0] * (1 + rank) + [1.0] * (2 - rank)))
whole = torch.empty(2, 4) if rank == 0 else torch.empty(4, 2).t()   # rank 1's output not contiguous
dist.all_gather_into_tensor(whole, torch.full((4,), float(rank)), group=uneven)   # (its check runs once)
ok = ok and torch.equal(whole, torch.tensor([[0.0] * 4, [1.0] * 4]))
comm = uneven.communicator   # (the engine's own gather and scatter take counts on the root only)
got = torch.full((3,), -1.0)
comm.gather(torch.full((rank + 1,), float(rank)), got if rank == 0 else None, root=0, counts=[1, 2] if rank == 0 else None)
part = torch.empty(rank + 1)
comm.scatter(torch.tensor([5.0, 6.0, 7.0]) if rank == 1 else None, part, root=1, counts=[1, 2] if rank == 1 else None)
ok = ok and (rank != 0 or torch.equal(got, torch.tensor([0.0, 1.0, 1.0]))) and \
    torch.equal(part, torch.tensor([5.0]) if rank == 0 else torch.tensor([6.0, 7.0]))
mixed, both, mine = torch.empty(4), torch.empty(4), torch.empty(2)   # (even counts on rank 0 only)
dist.all_to_all_single(mixed, torch.full((4,), float(rank)), [2, 2] if rank == 0 else None,
                       [2, 2] if rank == 0 else None, group=uneven)
comm.allgather(torch.full((2,), float(rank)), both, counts=[2, 2] if rank == 0 else None)
comm.reduce_scatter(torch.ones(4), mine, counts=[2, 2] if rank == 0 else None)
ok = ok and torch.equal(mixed, torch.tensor([0.0, 0.0, 1.0, 1.0])) and torch.equal(both, mixed) and \
    torch.equal(mine, torch.full((2,), 2.0))
splits = [2, 2] if rank == 0 else [2, 1]   # (rank 0's even, rank 1's not: the alltoall is valid)
part = torch.empty(sum(splits))
dist.all_to_all_single(part, torch.full((sum(splits),), float(rank)), splits, splits, group=uneven)
ok = ok and torch.equal(part, torch.tensor([0.0, 0.0, 1.0, 1.0] if rank == 0 else [0.0, 0.0, 1.0]))
print(f"rank {rank}: uneven calls {'ok' if ok else 'WRONG'}", flush=True)
try:   # rank 1 gives 3 elements where the root's counts say 2
    dist.new_group([0, 1]).communicator.gather(torch.ones(1 + 2 * rank), torch.empty(4) if rank == 0 else None, root=0,
                                                counts=[1, 2] if rank == 0 else None)
    print(f"rank {rank}: a gather against the root's counts returned (unexpected)", flush=True)
except Exception as exc:
    print(f"rank {rank}: counts: {type(exc).__name__}: {exc}", flush=True)

short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
if rank == 0:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3), group=short)
        print(f"rank {rank}: all_reduce without rank 1 returned (unexpected)", flush=True)
    except Exception as exc:
        print(f"rank {rank}: alone, raised after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}",
              flush=True)
dist.barrier()

mismatched = dist.new_group([0, 1])
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(100 if rank == 0 else 200), group=mismatched)
    print(f"rank {rank}: no error (unexpected)", flush=True)
    sys.exit(2)
except Exception as exc:
    print(f"rank {rank}: raised after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
