"""DDP under `torchrun --max-restarts 1`: on the first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1
kills itself with SIGKILL at step 2; its peers' collective fails naming it, torchrun restarts every
worker, and the second attempt, meeting through the same store, trains like one process on the full
batches. Rank 0 prints `attempt N: largest difference from one process D`."""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from ddp_exact import batches, model, worst_difference  # noqa: E402

STEPS = 8


def main():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("engine", timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    net = DDP(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches(STEPS)):
        if attempt == 0 and rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        opt.step()
    params = [p.detach().tolist() for p in net.parameters()]
    everyone = [None] * size
    dist.all_gather_object(everyone, params)
    if rank == 0:
        worst = max(worst_difference(p, STEPS) for p in everyone)
        print(f"attempt {attempt}: largest difference from one process {worst:.3g} "
              f"({size} ranks, {dist.distributed_c10d._get_default_group().communicator.transport})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
