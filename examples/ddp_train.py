"""DDP training on backend "engine". It differs from a Gloo script only in the backend name:

    mpirun -n 2 python examples/ddp_train.py          # engine, MPI launch, no env vars needed
    (torchrun --nproc-per-node 2 with backend="gloo" runs the same script on Gloo)
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = os.environ.get("BACKEND", "engine")


def main(steps=30):
    dist.init_process_group(backend=BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A fixed regression task; each rank draws its own shard of the data.
    teacher = torch.nn.Linear(32, 1)
    gen = torch.Generator().manual_seed(1 + rank)
    window = torch.zeros(1)
    for step in range(1, steps + 1):
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        window += loss.detach()
        if step % 5 == 0:  # mean loss of the last 5 steps over all ranks
            dist.all_reduce(window, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"steps {step - 4:3d}-{step:3d}  loss {window.item() / 5:.5f}  "
                      f"({world} ranks, backend {dist.get_backend()})", flush=True)
            window.zero_()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
