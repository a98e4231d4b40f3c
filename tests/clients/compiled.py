"""torch.compile on the engine: a fullgraph=True function of functional collectives gives the eager
results (which the references each rank computes itself confirm), as each collective and bucketed by
inductor (whose bucketed all-gather gathers in place, through all_gather_into_tensor_out); a
compiled batch_isend_irecv gives what was sent; and a compiled DDP model trains like one process on
the full batches.

    torchrun --nproc-per-node 3 tests/clients/compiled.py [inductor|aot_eager]
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel as DDP

import common

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "inductor"
COUNT = 5  # elements per rank (a reduce_scatter input has COUNT * size)


def collectives(x, group):
    """all_reduce, all_gather_tensor (two, which inductor can bucket) and reduce_scatter_tensor, with
    arithmetic around them."""
    total = funcol.all_reduce(x * 2, "sum", group)
    gathered = funcol.all_gather_tensor(x + 1, 0, group)
    squares = funcol.all_gather_tensor(x * x, 0, group)
    scattered = funcol.reduce_scatter_tensor(gathered * 3, "sum", 0, group)
    return total + 1, gathered, squares, scattered - total


def check_functional_collectives(rank, size):
    group = dist.group.WORLD
    x = torch.arange(COUNT, dtype=torch.float32) + 10 * rank
    eager = collectives(x, group)
    inputs = [torch.arange(COUNT, dtype=torch.float32) + 10 * r for r in range(size)]
    total = sum(t * 2 for t in inputs)
    gathered = torch.cat([t + 1 for t in inputs])
    expected = (total + 1, gathered, torch.cat([t * t for t in inputs]),
                size * 3 * gathered.view(size, COUNT)[rank] - total)
    import torch._inductor.config as inductor
    for how, settings in (("", {}), (" bucketed", {"bucket_all_gathers_fx": "all"})):
        torch._dynamo.reset()
        with inductor.patch(settings):
            compiled = torch.compile(collectives, fullgraph=True, backend=BACKEND)(x, group)
        for name, got, want, ref in zip(("all_reduce", "all_gather_tensor", "all_gather_tensor", "reduce_scatter_tensor"),
                                        compiled, eager, expected):
            if not (torch.equal(got, want) and torch.equal(got, ref)):
                raise SystemExit(f"rank {rank}: compiled{how} {name} gave {got.tolist()}, eager {want.tolist()}, "
                                 f"expected {ref.tolist()}")


def ring(send, recv, rank, size):
    """batch_isend_irecv to the next rank, from the one before; compiled, one batch_p2p_ops."""
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % size), dist.P2POp(dist.irecv, recv, (rank - 1) % size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv * 2


def check_compiled_batch_isend_irecv(rank, size):
    if size == 1 or not hasattr(torch._dynamo.config, "enable_p2p_compilation"):
        return
    with torch._dynamo.config.patch(enable_p2p_compilation=True):
        got = torch.compile(ring, fullgraph=True, backend=BACKEND)(torch.full((4,), float(rank)), torch.zeros(4),
                                                                  rank, size)
    if not torch.equal(got, torch.full((4,), 2.0 * ((rank - 1) % size))):
        raise SystemExit(f"rank {rank}: compiled batch_isend_irecv gave {got.tolist()}")


def train_compiled_ddp(rank, size):
    """DDP over the compiled model, which Dynamo's DDPOptimizer splits at DDP's buckets. (The other
    form, torch.compile(DDP(model)), compiles nothing in torch 2.13-2.15: Dynamo breaks the graph at
    DDP's logger and skips DDP's forward, so that model runs eagerly.)"""
    from torch._dynamo.utils import counters
    model = common.model()
    net = DDP(torch.compile(model, backend=BACKEND))
    opt = torch.optim.SGD(net.parameters(), lr=common.LR)
    counters.clear()
    for batch in common.batches():
        x, y = common.shard(batch, rank, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    if counters["stats"]["unique_graphs"] < 1:
        raise SystemExit(f"rank {rank}: compiled DDP compiled nothing: {dict(counters['graph_break'])}")
    return [p.detach().clone() for p in model.parameters()]


def main():
    dist.init_process_group(backend="engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    check_functional_collectives(rank, size)
    check_compiled_batch_isend_irecv(rank, size)
    if rank == 0:
        print(f"CLIENT torch.compile({BACKEND}) fullgraph functional collectives: {size} ranks, equal to eager and to "
              "the references", flush=True)
    params = train_compiled_ddp(rank, size)
    common.report(f"torch.compile({BACKEND}) ddp {common.launcher_name()}", params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
