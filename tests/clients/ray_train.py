"""Ray Train's TorchTrainer with TorchConfig(backend="engine") on one host: Ray calls
init_process_group(backend="engine") in each worker (torch's entry-point autoload registered the name
there), and DDP over it trains like one process on the full batches.

    python tests/clients/ray_train.py [workers]
"""

import json
import os
import sys
import tempfile

import ray
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def train_loop(config):
    sys.path.insert(0, config["here"])
    import common
    from ray import train
    from torch.nn.parallel import DistributedDataParallel as DDP
    assert dist.get_backend() == "engine", dist.get_backend()
    rank, size = dist.get_rank(), dist.get_world_size()
    net = DDP(common.model())
    opt = torch.optim.SGD(net.parameters(), lr=common.LR)
    for batch in common.batches():
        x, y = common.shard(batch, rank, size)
        opt.zero_grad()
        common.loss(net, x, y).backward()
        opt.step()
    everyone = [None] * size
    dist.all_gather_object(everyone, [p.detach().clone() for p in net.module.parameters()])
    if rank == 0:  # Ray Train keeps reported metrics only with a checkpoint: the driver reads a file
        worst = max(common.worst_difference(p) for p in everyone)
        with open(config["result"], "w") as f:
            json.dump({"worst": worst, "ranks": size, "backend": dist.get_backend()}, f)
    train.report({})


def main():
    sys.path.insert(0, HERE)
    import common
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    # One host, small: no dashboard, logical CPUs enough for the workers and the trainer (the machine may
    # have fewer cores than workers; they are mostly idle).
    with tempfile.TemporaryDirectory(prefix="engine-ray-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        ray.init(num_cpus=workers + 1, include_dashboard=False, _temp_dir=os.path.join(tmp, "ray"))
        try:
            trainer = TorchTrainer(train_loop, train_loop_config={"here": HERE, "result": result_file},
                                   scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                                   torch_config=TorchConfig(backend="engine"),
                                   run_config=RunConfig(storage_path=tmp))
            trainer.fit()
        finally:
            ray.shutdown()
        with open(result_file) as f:
            metrics = json.load(f)
    print(f"CLIENT ray train torchtrainer: {metrics['ranks']} ranks ({metrics['backend']}), {common.STEPS} steps, "
          f"largest difference from one process on the full batches {metrics['worst']:.3g}", flush=True)
    if metrics["backend"] != "engine" or metrics["ranks"] != workers or not metrics["worst"] <= common.TOLERANCE:
        raise SystemExit(f"ray train diverged or ran elsewhere: {metrics}")


if __name__ == "__main__":
    main()
