"""Gradient-allreduce time per training step for model-shaped gradient lists, engine fused vs per-tensor
vs Gloo's coalesced allreduce vs DDP (on Gloo and on engine). Rounds interleaved; median, max over ranks.

    mpirun -n 2 python -m bench.fusion
    mpirun -n 2 python -m bench.fusion --flat    # 200 small tensors coalesced against one flat allreduce
"""

import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI


def resnet50_shapes():
    """The 161 parameter tensors of torchvision's resnet50 (25,557,032 parameters)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if b == 0:
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    return shapes + [(1000, 2048), (1000,)]


def small_tensor_shapes(n=200, seed=0):
    """The issue's case: n float32 tensors of 1-64 KiB."""
    g = torch.Generator().manual_seed(seed)
    return [(int(k),) for k in torch.randint(256, 16384 + 1, (n,), generator=g)]


def transformer_shapes(layers=6, d=512, ff=2048):
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (ff, d), (ff,), (d, ff), (d,), (d,), (d,)]
    return per_layer * layers


class Grads(torch.nn.Module):
    """A module whose parameters have the given shapes; backward of forward() gives every one a gradient."""

    def __init__(self, shapes):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes])

    def forward(self):
        return sum(p.sum() for p in self.params)


def timed(fn, n):
    fn()
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return MPI.COMM_WORLD.allreduce((time.perf_counter() - t0) / n, op=MPI.MAX) * 1e3


def check_sums(shapes, reduce, dtype=torch.float32):
    """reduce(tensors) sums each tensor over the ranks: every rank's r + 1 gives size * (size + 1) / 2
    everywhere (a timing of a path that gives wrong answers is worth nothing)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    tensors = [torch.full(s, float(rank + 1), dtype=dtype) for s in shapes]
    reduce(tensors)
    want = size * (size + 1) / 2
    bad = [i for i, t in enumerate(tensors) if not bool((t == want).all())]
    assert not bad, f"tensor {bad[0]} of {len(tensors)} is not the sum {want}: {tensors[bad[0]].reshape(-1)[:4].tolist()}"


def main(rounds=5):
    dist.init_process_group(backend="engine")
    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(f"# gradient allreduce per step, {dist.get_world_size()} ranks, float32, ms (median of {rounds} rounds)")
        print(f"{'model':<24} {'tensors':>7} {'MiB':>7} {'fused':>9} {'per-tensor':>11} {'gloo coal.':>11} "
              f"{'DDP gloo':>9} {'DDP engine':>11}")
    for name, shapes in (("200 tensors of 1-64 KiB", small_tensor_shapes()),
                         ("resnet50 (161 tensors)", resnet50_shapes()), ("transformer 6x512", transformer_shapes())):
        grads = [torch.randn(s) for s in shapes]
        models = {b: Grads(shapes) for b in ("gloo", "engine")}
        ddps = {"gloo": torch.nn.parallel.DistributedDataParallel(models["gloo"], process_group=gloo),
                "engine": torch.nn.parallel.DistributedDataParallel(models["engine"])}

        def ddp_step(which):
            ddps[which].zero_grad()
            ddps[which]().backward()

        cases = {"fused": (lambda: dist.all_reduce_coalesced(grads), 10),
                 "per-tensor": (lambda: [dist.all_reduce(g) for g in grads], 10),
                 "gloo coal.": (lambda: dist.all_reduce_coalesced(grads, group=gloo), 3),
                 "DDP gloo": (lambda: ddp_step("gloo"), 3),
                 "DDP engine": (lambda: ddp_step("engine"), 3)}
        samples = {k: [] for k in cases}
        for _ in range(rounds):
            for k, (fn, n) in cases.items():
                samples[k].append(timed(fn, n))
        med = {k: statistics.median(v) for k, v in samples.items()}
        check_sums(shapes, dist.all_reduce_coalesced)
        check_sums(shapes, lambda ts: [dist.all_reduce(t) for t in ts])
        mb = sum(g.numel() for g in grads) * 4 / 2 ** 20   # MiB, as the flat table's
        if rank == 0:
            print(f"{name:<24} {len(grads):>7} {mb:>7.1f} {med['fused']:>9.2f} {med['per-tensor']:>11.2f} "
                  f"{med['gloo coal.']:>11.2f} {med['DDP gloo']:>9.2f} {med['DDP engine']:>11.2f}   "
                  f"per-tensor/fused {med['per-tensor'] / med['fused']:.2f}, gloo/fused "
                  f"{med['gloo coal.'] / med['fused']:.2f}", flush=True)
    dist.destroy_process_group()


def coalesced_vs_flat(rounds=7):
    """200 small tensors through dist.all_reduce_coalesced against dist.all_reduce of one flat tensor of
    the same bytes; beside them torch's own share of the coalesced call (the do-nothing backend of
    bench.nop) and the same two driven on the engine directly (FusedAllreduce, Communicator.allreduce)."""
    from engine.fusion import FusedAllreduce

    from .nop import nop_group
    dist.init_process_group(backend="engine")
    nop = nop_group()
    comm = dist.distributed_c10d._get_default_group().communicator
    fused = FusedAllreduce(comm)
    rank = dist.get_rank()
    if rank == 0:
        print(f"# 200 tensors: all_reduce_coalesced against one flat all_reduce of the same bytes, "
              f"{dist.get_world_size()} ranks, us (median of {rounds} rounds, max over ranks)")
        print("| tensors | bytes | coalesced | flat | coalesced / flat | torch's share (nop) | engine fused, direct | "
              "engine flat, direct | fused / flat, direct |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shapes, dtype in (("200 x 1 KiB", [(256,)] * 200, torch.float32),
                                ("200 x 16 KiB", [(4096,)] * 200, torch.float32),
                                ("200 of 1-64 KiB", small_tensor_shapes(), torch.float32),
                                ("200 x 16 KiB bf16", [(8192,)] * 200, torch.bfloat16)):
        tensors = [torch.randn(s).to(dtype) for s in shapes]
        flat = torch.randn(sum(t.numel() for t in tensors)).to(dtype)
        cases = {"coalesced": lambda: dist.all_reduce_coalesced(tensors), "flat": lambda: dist.all_reduce(flat),
                 "nop": lambda: dist.all_reduce_coalesced(tensors, group=nop),
                 "fused": lambda: fused.run(tensors), "flat direct": lambda: comm.allreduce(flat)}
        samples = {k: [] for k in cases}
        for _ in range(rounds):
            for k, fn in cases.items():
                samples[k].append(timed(fn, 50) * 1e3)
        med = {k: statistics.median(v) for k, v in samples.items()}
        check_sums(shapes, dist.all_reduce_coalesced, dtype)
        check_sums(shapes, fused.run, dtype)
        if rank == 0:
            print(f"| {name} | {flat.numel() * flat.element_size() / 2 ** 20:.2f} MiB | {med['coalesced']:.1f} | "
                  f"{med['flat']:.1f} | {med['coalesced'] / med['flat']:.2f} | {med['nop']:.1f} | {med['fused']:.1f} | "
                  f"{med['flat direct']:.1f} | {med['fused'] / med['flat direct']:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    coalesced_vs_flat() if "--flat" in sys.argv[1:] else main()
