"""DDP trains exactly like one process on the full batches: each rank trains on its shard of every
batch, and the parameters must end up those of one process trained on the full batches (float64: the
only difference is the rounding of the gradient average's order).

    python examples/ddp_exact.py [--ranks 3] [--steps 20]   # torch.multiprocessing.spawn, init tcp://
    mpirun -n 4 python examples/ddp_exact.py                 # an MPI launch (also across hosts)
    torchrun --nproc-per-node 3 examples/ddp_exact.py

Spawned, the ranks meet through torch's TCPStore and talk through shared memory (no MPI).
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH, IN, OUT = 24, 16, 4  # the batch divides evenly by 1, 2, 3, 4 ranks


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, OUT)).double()


def batches(steps):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=gen, dtype=torch.float64),
             torch.randn(BATCH, OUT, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def train(net, data, shard=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        if shard is not None:
            rank, size = shard
            x, y = x.chunk(size)[rank], y.chunk(size)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()  # a mean: DDP's average makes it the full batch's
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def worker(rank, size, port, steps, results):
    dist.init_process_group("engine", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    params = train(DDP(model()), batches(steps), shard=(rank, size))
    results.put((rank, [p.tolist() for p in params],
                 dist.distributed_c10d._get_default_group().communicator.transport))
    dist.destroy_process_group()


def worst_difference(params, steps):
    reference = train(model(), batches(steps))
    return max((torch.tensor(p, dtype=torch.float64) - ref).abs().max().item() for p, ref in zip(params, reference))


def launched():
    """Each rank runs on its own (MPI launch, torchrun): rank 0 compares every rank's result."""
    dist.init_process_group("engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    params = [p.tolist() for p in train(DDP(model()), batches(STEPS), shard=(rank, size))]
    everyone = [None] * size
    dist.all_gather_object(everyone, params)
    transport = dist.distributed_c10d._get_default_group().communicator.transport
    if rank == 0:
        report(size, transport, max(worst_difference(p, STEPS) for p in everyone), "processes")
    dist.destroy_process_group()


def report(size, transport, worst, how):
    print(f"DDP over {size} {how} ({transport}), {STEPS} steps: largest difference from one process on the full "
          f"batches {worst:.3g}", flush=True)
    if worst > 1e-12:
        raise SystemExit(f"DDP diverged from single-process training by {worst}")


STEPS = 20


def main():
    global STEPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    STEPS = args.steps
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID")):
        return launched()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(args.ranks, port, args.steps, results), nprocs=args.ranks)
    got = [results.get() for _ in range(args.ranks)]
    report(args.ranks, got[0][2], max(worst_difference(params, STEPS) for _, params, _ in got), "spawned processes")


if __name__ == "__main__":
    main()
