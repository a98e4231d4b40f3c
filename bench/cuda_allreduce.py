"""GPU allreduce times on CUDA tensors, 1 MB to 1 GB: the engine's ncclAllReduce, the engine's ring
(NCCL send/recv + its own reduction kernel), torch's nccl backend, and the host-staged MPI path.
CUDA events time the device; each number is the median of --rounds rounds (interleaved across
the methods), in microseconds.

    mpirun -n 1 python -m bench.cuda_allreduce        # one GPU: world size 1
    mpirun -n 2 python -m bench.cuda_allreduce        # one GPU per rank
    mpirun -n 2 python -m bench.cuda_allreduce --only staged   # two ranks sharing one GPU
"""

import argparse
import statistics

import torch
import torch.distributed as dist

from engine import registry

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
ENGINE_ALGOS = tuple(e.name for e in registry.entries("allreduce", "nccl"))   # the engine's GPU allreduces
METHODS = ENGINE_ALGOS + ("torch-nccl", "staged")


def time_calls(fn, iters, stream):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # us


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.cuda_allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=SIZES[-1])
    args = p.parse_args(argv)
    methods = [m for m in args.only.split(",") if m]

    dist.init_process_group(backend="engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    stream = torch.cuda.current_stream(dev)
    pg = dist.distributed_c10d._get_default_group()
    from torchbridge.devices import StagedDevice
    runners = {}
    if set(methods) & set(ENGINE_ALGOS):
        cc = pg._cuda_device(dev.index).cc
        for algo in ENGINE_ALGOS:
            if algo in methods:
                runners[algo] = lambda t, a=algo: cc.allreduce(t, "sum", stream=stream.cuda_stream, algorithm=a)
    if "torch-nccl" in methods:
        group = dist.new_group(backend="nccl")
        runners["torch-nccl"] = lambda t: dist.all_reduce(t, group=group)
    if "staged" in methods:
        staged = StagedDevice(pg._cpu)
        runners["staged"] = lambda t: staged.launch("allreduce", staged.comm.allreduce, t, None, "sum", 3, [t], None)

    if rank == 0:
        print(f"# allreduce float32 SUM, {size} rank(s), {torch.cuda.get_device_name(dev)}, us per call "
              f"(median of {args.rounds} rounds; CUDA events)")
        print(f"{'bytes':>12} " + " ".join(f"{m:>12}" for m in runners) + f" {'busbw GB/s (' + next(iter(runners)) + ')':>24}")
    for nbytes in [s for s in SIZES if s <= args.max_bytes]:
        buf = torch.ones(nbytes // 4, device=dev)
        iters = max(3, min(50, (256 << 20) // nbytes))
        for fn in runners.values():
            fn(buf)  # warm-up (and, the first time, communicator set-up)
        samples = {name: [] for name in runners}
        for _ in range(args.rounds):   # rounds interleaved: the device's clocks and the host's noise hit all alike
            for name, fn in runners.items():
                samples[name].append(time_calls(lambda: fn(buf), iters, stream))
        row = {name: statistics.median(v) for name, v in samples.items()}
        check = torch.ones(8, device=dev)
        next(iter(runners.values()))(check)
        assert torch.all(check == size), check
        first = next(iter(row.values()))
        busbw = nbytes / (first * 1e-6) * 2 * (size - 1) / size / 1e9
        if rank == 0:
            print(f"{nbytes:>12} " + " ".join(f"{row[m]:>12.1f}" for m in runners) + f" {busbw:>24.1f}", flush=True)
        buf = None
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
