"""What every client script shares: one model, one data set, and the reference they are held to, one
process trained on the full batches. Each rank trains on its shard of every batch; with a mean loss and
gradients averaged over the ranks that is the full batch's gradient, so the parameters must end up
those of the reference (to the rounding of the average's order)."""

import os
import sys

import torch
import torch.distributed

BATCH, IN, HIDDEN, OUT = 24, 8, 16, 4  # the batch divides evenly by 1, 2, 3 and 4 ranks
STEPS = 4
LR = 0.1
TOLERANCE = 1e-6  # float32; the arithmetic differs from one process only in the order of the sums


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)).to(dtype)


def batches(steps=STEPS, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=gen).to(dtype), torch.randn(BATCH, OUT, generator=gen).to(dtype))
            for _ in range(steps)]


def shard(batch, rank, size):
    x, y = batch
    return x.chunk(size)[rank], y.chunk(size)[rank]


def loss(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)  # a mean: the ranks' average makes it the full batch's


def reference(steps=STEPS, dtype=torch.float32):
    """The parameters of one process trained with SGD on the full batches."""
    net = model(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y in batches(steps, dtype):
        opt.zero_grad()
        loss(net, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def worst_difference(params, steps=STEPS):
    """The largest absolute difference of `params` (tensors or lists) from the reference."""
    ref = reference(steps, dtype=params[0].dtype if torch.is_tensor(params[0]) else torch.float32)
    if len(params) != len(ref):
        raise SystemExit(f"{len(params)} parameters, the reference has {len(ref)}")
    return max((torch.as_tensor(p, dtype=r.dtype).reshape(r.shape) - r).abs().max().item() for p, r in zip(params, ref))


def report(what, params, tolerance=TOLERANCE, steps=STEPS):
    """Prints (on rank 0) the largest difference of every rank's parameters from the reference; exits
    non-zero above the tolerance. Called on every rank with the parameters it ended with; every rank
    judges all of them, so that all ranks exit together: under mpirun with MPI up, a rank leaving alone
    would wait in MPI_Finalize for ranks waiting for it in their next collective."""
    params_of_every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(params_of_every_rank, params)
    worst = max(worst_difference(p, steps) for p in params_of_every_rank)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        if not worst <= tolerance:
            sys.exit(1)
        return
    print(f"CLIENT {what}: {len(params_of_every_rank)} ranks, {steps} steps, largest difference from one process "
          f"on the full batches {worst:.3g}", flush=True)
    if not worst <= tolerance:
        print(f"CLIENT {what} diverged from one process: {worst} > {tolerance}", file=sys.stderr, flush=True)
        sys.exit(1)


def launcher_name():
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return "mpirun"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "spawn"
