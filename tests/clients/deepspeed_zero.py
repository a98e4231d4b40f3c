"""DeepSpeed ZeRO on the engine, on CPU: stages 1, 2 and 3 train like one process on the full batches.

    DS_ACCELERATOR=cpu mpirun -n 3 python tests/clients/deepspeed_zero.py 1 2 3
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 3 tests/clients/deepspeed_zero.py 1 2 3

Under mpirun, DeepSpeed's own MPI discovery sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (the port from DS_PORT here, so parallel jobs don't meet); its LOCAL_RANK counts the earlier
ranks with the same processor name, which may differ from Open MPI's local rank."""

import os
import sys

import torch
import torch.distributed as dist

import common

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402


def train(stage):
    rank, size = dist.get_rank(), dist.get_world_size()
    config = {
        "train_batch_size": common.BATCH,
        "train_micro_batch_size_per_gpu": common.BATCH // size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the reference doesn't clip
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    net = common.model()
    opt = torch.optim.SGD(net.parameters(), lr=common.LR)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    for batch in common.batches():
        x, y = common.shard(batch, rank, size)
        loss = common.loss(engine, x, y)
        engine.backward(loss)
        engine.step()
    params = list(engine.module.parameters())
    if stage == 3:  # partitioned: gather each parameter whole to read it
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def main():
    stages = [int(s) for s in sys.argv[1:]] or [1, 2, 3]
    # DeepSpeed compiles its own CPU shared-memory allreduce at init when it can (~45 s on 2 cores, once
    # per machine). Only its inference_all_reduce uses it; training goes through torch.distributed, the
    # engine, which is what this checks.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="engine", distributed_port=int(os.environ.get("DS_PORT", "29500")))
    assert dist.get_backend() == "engine", dist.get_backend()
    for stage in stages:
        params = train(stage)
        common.report(f"deepspeed zero-{stage} {common.launcher_name()}", params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
