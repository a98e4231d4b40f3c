"""Training across ranks ends exactly where one process on the full batches does (float64; the only
difference allowed is the rounding of the gradient average's order): DDP, and DDP over a model
compiled with torch.compile (its graph broken at the buckets by Dynamo's DDPOptimizer).
FSDP2's check is tests/mpi/parallel_suite.py's. Runs under any launcher (tests/test_hosts.py: torchrun
on each of two namespace hosts)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import ddp_exact  # noqa: E402

R, P, _ = torch_world.init()
STEPS = 8


def wide():
    """2.1 MiB of float64 parameters: DDP's buckets (at least 1 MiB each, torch's first bucket's size)
    split them, so the compiled graph breaks between buckets."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(ddp_exact.IN, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, ddp_exact.OUT)).double()


def worst_difference(params, model=ddp_exact.model):
    reference = ddp_exact.train(model(), ddp_exact.batches(STEPS))
    return max((p - ref).abs().max().item() for p, ref in zip(params, reference))


def test_ddp_trains_like_one_process_on_the_full_batches():
    params = ddp_exact.train(DDP(ddp_exact.model()), ddp_exact.batches(STEPS), shard=(R, P))
    assert worst_difference(params) <= 1e-12


def test_compiled_ddp_trains_like_one_process_on_the_full_batches():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    # bucket_cap_mb 1 (torch's DDPOptimizer refuses less than its first bucket's 1 MiB): the gradients
    # fill several buckets, so the graph is split and each bucket's all_reduce is issued as its part of
    # the backward is done. DDP over the compiled model: torch.compile(DDP(model)) compiles nothing in
    # torch 2.13-2.15 (Dynamo breaks the graph at DDP's logger and skips DDP's forward).
    net = DDP(torch.compile(wide(), backend=os.environ.get("ENGINE_CLIENTS_COMPILE_BACKEND", "inductor")),
              bucket_cap_mb=1)
    params = ddp_exact.train(net, ddp_exact.batches(STEPS), shard=(R, P))
    assert counters["stats"]["unique_graphs"] >= 1, f"nothing was compiled: {dict(counters['graph_break'])}"
    assert worst_difference(params, wide) <= 1e-12
    if R == 0:
        print(f"compiled DDP over {P} ranks ({dist.distributed_c10d._get_default_group().communicator.transport}) "
              f"matches one process", flush=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ddp_gradients_are_the_average_in_every_dtype(dtype):
    torch.manual_seed(R)
    net = DDP(torch.nn.Linear(64, 3).to(dtype))
    x = torch.full((4, 64), float(R + 1), dtype=dtype)
    net(x).sum().backward()
    want = sum(torch.full((3, 64), 4.0 * (q + 1), dtype=torch.float64) for q in range(P)) / P
    torch.testing.assert_close(net.module.weight.grad.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=0)
