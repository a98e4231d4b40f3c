"""HF Accelerate on the engine: the process group is made first with backend "engine"; the
Accelerator then uses it (Accelerate 1.15 refuses backend names it does not know, so
Accelerator(backend="engine") would not do). Trains like one process on the full batches.

    torchrun --nproc-per-node 3 tests/clients/accelerate_ddp.py
"""

import torch
import torch.distributed as dist

import common
from accelerate import Accelerator


def main():
    dist.init_process_group(backend="engine")
    accelerator = Accelerator(cpu=True)
    assert dist.get_backend() == "engine", dist.get_backend()  # the group Accelerate trains over
    rank, size = accelerator.process_index, accelerator.num_processes
    assert (rank, size) == (dist.get_rank(), dist.get_world_size())
    net = common.model()
    opt = torch.optim.SGD(net.parameters(), lr=common.LR)
    net, opt = accelerator.prepare(net, opt)
    assert isinstance(net, torch.nn.parallel.DistributedDataParallel), type(net)
    for batch in common.batches():
        x, y = common.shard(batch, rank, size)
        opt.zero_grad()
        accelerator.backward(common.loss(net, x, y))
        opt.step()
    params = [p.detach().clone() for p in accelerator.unwrap_model(net).parameters()]
    common.report(f"accelerate ddp {common.launcher_name()}", params)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
