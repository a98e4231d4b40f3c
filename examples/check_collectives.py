"""Every c10d collective on backend engine, checked against results each rank computes itself.
Runs under any launcher:

    torchrun --nproc-per-node 3 examples/check_collectives.py
    mpirun -n 3 python examples/check_collectives.py       # (fewer cores, Open MPI: mpirun --oversubscribe)
    python examples/check_collectives.py                      # a world of one

Prints one PASS line per collective on rank 0 and exits non-zero on the first wrong result. Under
torchrun it also checks that MPI was never imported.
"""

import os
import sys

import torch
import torch.distributed as dist

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def data(rank, n, dtype=torch.float32, salt=0):
    """Small integers: sums, products and averages stay exact."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 13 + salt) % 7 - 3).to(dtype)


def everyone(n, dtype=torch.float32, salt=0):
    return [data(r, n, dtype, salt) for r in range(dist.get_world_size())]


def same(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.reshape(-1)[:8].tolist()}, want {want.reshape(-1)[:8].tolist()}")


R = P = 0
# torch 2.13 renamed the tensor forms; older releases have only the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@check
def all_reduce():
    stack = torch.stack(everyone(1031, torch.float64))
    for op, ref in ((dist.ReduceOp.SUM, stack.sum(0)), (dist.ReduceOp.PRODUCT, stack.prod(0)),
                    (dist.ReduceOp.MIN, stack.min(0).values), (dist.ReduceOp.MAX, stack.max(0).values),
                    (dist.ReduceOp.AVG, stack.sum(0) / P)):
        t = data(R, 1031, torch.float64)
        dist.all_reduce(t, op=op)
        same(t, ref, f"all_reduce {op}")
    ints = torch.stack(everyone(64, torch.int32))
    for op, fn in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                   (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        want = ints[0]
        for x in ints[1:]:
            want = fn(want, x)
        t = data(R, 64, torch.int32)
        dist.all_reduce(t, op=op)
        same(t, want, f"all_reduce {op}")
    work = dist.all_reduce(t := data(R, 300_000), async_op=True)
    work.wait()
    same(t, torch.stack(everyone(300_000)).sum(0), "all_reduce async, 300k elements")


@check
def all_reduce_coalesced():
    ts = [data(R, n, salt=n) for n in (3, 1000, 70_000)]
    dist.all_reduce_coalesced(ts)
    for t, n in zip(ts, (3, 1000, 70_000)):
        same(t, torch.stack(everyone(n, salt=n)).sum(0), "all_reduce_coalesced")


@check
def broadcast():
    for root in range(P):
        t = data(R, 5000, torch.int64)
        dist.broadcast(t, src=root)
        same(t, data(root, 5000, torch.int64), f"broadcast root {root}")


@check
def reduce():
    for root in range(P):
        t = data(R, 777)
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if R == root:
            same(t, torch.stack(everyone(777)).sum(0), f"reduce root {root}")


@check
def all_gather():
    outs = [torch.empty(11) for _ in range(P)]
    dist.all_gather(outs, data(R, 11))
    same(torch.cat(outs), torch.cat(everyone(11)), "all_gather")
    uneven = [torch.empty(r + 1) for r in range(P)]
    dist.all_gather(uneven, data(R, R + 1))
    same(torch.cat(uneven), torch.cat([data(r, r + 1) for r in range(P)]), "all_gather uneven")


@check
def all_gather_into_tensor():
    out = torch.empty(13 * P)
    all_gather_single(out, data(R, 13))
    same(out, torch.cat(everyone(13)), "all_gather_into_tensor")


@check
def gather():
    for root in range(P):
        outs = [torch.empty(9) for _ in range(P)] if R == root else None
        dist.gather(data(R, 9), outs, dst=root)
        if R == root:
            same(torch.cat(outs), torch.cat(everyone(9)), f"gather root {root}")


@check
def scatter():
    for root in range(P):
        out = torch.empty(6)
        dist.scatter(out, [data(q, 6, salt=root) for q in range(P)] if R == root else None, src=root)
        same(out, data(R, 6, salt=root), f"scatter root {root}")


@check
def reduce_scatter():
    out = torch.empty(10)
    dist.reduce_scatter(out, [data(R, 10, salt=q) for q in range(P)])
    same(out, torch.stack([data(r, 10, salt=R) for r in range(P)]).sum(0), "reduce_scatter")


@check
def reduce_scatter_tensor():
    out = torch.empty(8)
    reduce_scatter_single(out, data(R, 8 * P))
    same(out, torch.stack(everyone(8 * P)).sum(0)[R * 8:(R + 1) * 8], "reduce_scatter_tensor")


@check
def all_to_all():
    outs = [torch.empty(q + 2) for q in range(P)]
    dist.all_to_all(outs, [data(R, R + 2, salt=q) for q in range(P)])
    same(torch.cat(outs), torch.cat([data(q, q + 2, salt=R) for q in range(P)]), "all_to_all uneven")


@check
def all_to_all_single():
    out = torch.empty(4 * P)
    dist.all_to_all_single(out, data(R, 4 * P))
    same(out, torch.cat([data(q, 4 * P)[R * 4:(R + 1) * 4] for q in range(P)]), "all_to_all_single")


@check
def barrier():
    for _ in range(3):
        dist.barrier()


@check
def send_recv():
    if P == 1:
        return
    right, left = (R + 1) % P, (R - 1) % P
    got = torch.empty(100)
    ops = [dist.P2POp(dist.isend, data(R, 100), right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    same(got, data(left, 100), "batch_isend_irecv")
    if R == 0:
        seen = set()
        for _ in range(P - 1):
            t = torch.empty(3)
            seen.add(dist.recv(t))  # any source
        assert seen == set(range(1, P)), seen
    else:
        dist.send(torch.full((3,), float(R)), dst=0)


@check
def objects():
    objs = [None] * P
    dist.all_gather_object(objs, {"rank": R})
    assert objs == [{"rank": r} for r in range(P)], objs
    lst = [f"from {R}"] if R == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0"], lst


@check
def subgroups():
    evens = dist.new_group(list(range(0, P, 2)))
    if R % 2 == 0:
        t = data(R, 50)
        dist.all_reduce(t, group=evens)
        same(t, torch.stack([data(r, 50) for r in range(0, P, 2)]).sum(0), "all_reduce on a sub-group")
    dist.destroy_process_group(evens)


def main():
    global R, P
    dist.init_process_group(backend="engine")
    R, P = dist.get_rank(), dist.get_world_size()
    for fn in CHECKS:
        fn()
        dist.barrier()
        if R == 0:
            print(f"PASS {fn.__name__} ({P} ranks)", flush=True)
    mpi = "mpi4py" in sys.modules
    if R == 0:
        print(f"ALL PASS: {len(CHECKS)} collectives on {P} ranks, transport "
              f"{dist.distributed_c10d._get_default_group().communicator.transport}, MPI imported: {mpi}", flush=True)
    launched_by_mpi = any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"))
    if mpi and not launched_by_mpi:
        sys.exit("MPI was imported by a job no MPI launcher started")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
