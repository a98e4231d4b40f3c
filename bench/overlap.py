"""DistributedOptimizer with and without overlap (buckets launched during backward vs all at step()),
on an 8 x Linear(1024, 1024) MLP, batch 128, one intra-op thread per rank. Median step time, ms.

    mpirun -n 2 python -m bench.overlap
"""

import statistics
import time

import torch
import torch.distributed as dist

import torchbridge


def main(rounds=4, steps=10):
    torch.set_num_threads(1)
    dist.init_process_group(backend="engine")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.randn(128, 1024)
    results = {True: [], False: []}
    for _ in range(rounds):
        for overlap in (True, False):
            opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), model,
                                                   bucket_bytes=4 << 20, overlap=overlap)
            times, first_launch, backward = [], [], []
            for _ in range(steps):
                opt.zero_grad()
                opt.launch_times.clear()
                dist.barrier()
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                t1 = time.perf_counter()
                first_launch.append(opt.launch_times[0][1] - t0 if opt.launch_times else float("nan"))
                backward.append(t1 - t0)
                opt.step()
                times.append(time.perf_counter() - t0)
            opt.remove_hooks()
            results[overlap].append((statistics.median(times), statistics.median(first_launch),
                                     statistics.median(backward)))
    if dist.get_rank() == 0:
        for overlap in (True, False):
            step, first, bwd = (statistics.median(r[i] for r in results[overlap]) * 1e3 for i in range(3))
            print(f"overlap={overlap!s:<5}  step {step:7.2f} ms   backward {bwd:6.2f} ms   first bucket launched "
                  f"{'%.2f ms into backward' % first if overlap else 'at step()'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
