"""The bad inputs of docs/errors.md, each on a fresh group (a mismatch leaves its group unusable).
Run with ENGINE_DEBUG=1 on 2 ranks; prints one 'CASE name: ExceptionType: message' line per case."""
import datetime
import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group(backend="engine")
rank = dist.get_rank()


def case(name, fn):
    try:
        fn()
        print(f"CASE {name}: no error", flush=True)
    except Exception as exc:
        print(f"CASE {name}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)


def fresh():
    return dist.new_group(list(range(dist.get_world_size())))


g = fresh()
case("dtype mismatch", lambda: dist.all_reduce(torch.ones(8, dtype=torch.float32 if rank == 0 else torch.float64),
                                               group=g))
g = fresh()
case("shape mismatch", lambda: dist.all_reduce(torch.ones(2, 4) if rank == 0 else torch.ones(4, 2), group=g))
g = fresh()
case("root mismatch", lambda: dist.broadcast(torch.ones(4), src=rank, group=g))
g = fresh()
case("op mismatch", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
                                            group=g))
case("wrong device", lambda: dist.all_reduce(torch.ones(4, device="meta")))
case("invalid rank", lambda: dist.send(torch.ones(2), dst=99))
case("unsupported op", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND))
case("second init", lambda: dist.init_process_group(backend="engine"))
c10d = dist.distributed_c10d


def options(kind, **fields):
    opts = getattr(c10d, kind)()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


pg = c10d._get_default_group()   # (the options torch's functions never set, a caller of the group's own sets)
case("reduce root tensor", lambda: pg.reduce([torch.ones(4)], options("ReduceOptions", rootTensor=1)))
case("broadcast root tensor", lambda: pg.broadcast([torch.ones(4)], options("BroadcastOptions", rootTensor=3)))
lists = [[torch.zeros(2) for _ in range(2)] for _ in range(2)]
case(f"gather lists rank {rank}", lambda: pg.gather(lists if rank == 0 else lists[:1], [torch.ones(2)]))
case(f"scatter lists rank {rank}", lambda: pg.scatter([torch.zeros(2)], lists if rank == 0 else lists[:1]))
for seconds in (0, -2):
    late = datetime.timedelta(seconds=seconds)
    case(f"timeout {seconds}", lambda: pg.allreduce([torch.ones(4)], options("AllreduceOptions", timeout=late)))
    case(f"barrier timeout {seconds}", lambda: pg.barrier(options("BarrierOptions", timeout=late)))
    case(f"coalesced timeout {seconds}",
         lambda: pg.allreduce_coalesced([torch.ones(4)], options("AllreduceCoalescedOptions", timeout=late)))
g = fresh()
if rank == 0:   # (rank 1 never calls it: the call's own timeout ends it)
    case("coalesced own timeout", lambda: g.allreduce_coalesced(
        [torch.ones(4), torch.ones(3)], options("AllreduceCoalescedOptions", timeout=datetime.timedelta(seconds=0.5),
                                                asyncOp=False)))
z = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
zs = [z.clone(), z[:1].clone()]
pg.allreduce([z]).wait()
pg.allreduce_coalesced(zs).wait()
print(f"CASE complex sums: {z.tolist()} {[t.tolist() for t in zs]}", flush=True)
case("complex max", lambda: pg.allreduce([z], options("AllreduceOptions", reduceOp=dist.ReduceOp.MAX)))
outside = dist.new_group([0])
if rank != 0:  # torch skips a collective on a group the rank is not in (with a warning): nothing is reduced
    t = torch.ones(4)
    case("outside group", lambda: dist.all_reduce(t, group=outside))
    print(f"CASE outside group result: {t.tolist()} in_group={dist.get_rank(outside)}", flush=True)
t = torch.ones(4)
dist.all_reduce(t)
print(f"CASE default group still works: {t.tolist()}", flush=True)
os.kill(os.getpid(), signal.SIGUSR1)  # dumps the flight recorders to stderr
dist.destroy_process_group()
case("use after destroy", lambda: dist.all_reduce(torch.ones(4)))
