"""DDP training in which rank KILL sends itself SIGKILL after a few steps: mpirun must end non-zero."""
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

KILL = int(os.environ.get("KILL_RANK", "1"))
dist.init_process_group(backend="engine")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1000):
    if step == 5 and rank == KILL:
        print(f"rank {rank}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.randn(32, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {rank}: finished all steps (unexpected)", flush=True)
