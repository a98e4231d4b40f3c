"""Training with torchbridge.DistributedOptimizer matches DDP on Gloo; gradient accumulation; the first
buckets launch during backward; the engine's DDP comm hooks match torch's own on Gloo."""

import time

import pytest
import torch
import torch.distributed as dist

import torch_world
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import torchbridge

R, P, GLOO = torch_world.init()


def make_model(seed=0):
    torch.manual_seed(seed + R * 17)  # different on each rank: broadcast_parameters must fix that
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(steps, micro=1, rank=R):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [[(torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(micro)]
            for _ in range(steps)]


def train(model, opt, data):
    """Steps of micro-batches with a DistributedOptimizer, then its hooks removed."""
    for step in data:
        opt.zero_grad()
        for x, y in step:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.remove_hooks()


def gloo_ddp_reference(data, micro=1, hook=None):
    model = make_model()
    for p in model.parameters():  # DDP broadcasts rank 0's parameters
        dist.broadcast(p.data, 0, group=GLOO)
    ddp = DDP(model, process_group=GLOO, bucket_cap_mb=0.0005)
    if hook is not None:
        ddp.register_comm_hook(GLOO, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in data:
        opt.zero_grad()
        for i, (x, y) in enumerate(step):
            if i < micro - 1:
                with ddp.no_sync():
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
            else:
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [1, 3])
def test_distributed_optimizer_matches_ddp_on_gloo(micro):
    data = batches(20, micro)
    model = make_model()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                           bucket_bytes=512, backward_passes_per_step=micro)
    torchbridge.broadcast_parameters(model, opt)
    assert len(opt.buckets) > 2
    train(model, opt, data)
    for a, b in zip(model.parameters(), gloo_ddp_reference(data, micro)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_first_buckets_launch_before_backward_ends():
    model = make_model()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, bucket_bytes=256)
    x, y = batches(1)[0][0]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    backward_end = time.perf_counter()
    launched_during_backward = [k for k, t in opt.launch_times if t < backward_end]
    opt.step()
    opt.remove_hooks()
    assert len(opt.buckets) >= 3 and launched_during_backward[:1] == [0]
    assert len(launched_during_backward) >= len(opt.buckets) - 1  # all but the last are in flight by then


@pytest.mark.parametrize("bad", [dict(backward_passes_per_step=0), dict(backward_passes_per_step=-1),
                                 dict(backward_passes_per_step=2.5), dict(backward_passes_per_step="2"),
                                 dict(compression="fp16")])
def test_the_optimizers_arguments_are_checked_when_it_is_made(bad):
    """(0 passes said gradients were computed more than backward_passes_per_step times; -1 and 2.5
    passed; "2" raised a bare TypeError; a misspelt compression was found at the first step.)"""
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=rf"DistributedOptimizer: {name} must be .*got {value!r}"):
        torchbridge.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.01), **bad)


def test_bucket_cap_follows_engine_bucket_bytes(monkeypatch):
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    given = torchbridge.DistributedOptimizer(sgd, model, bucket_bytes=256)
    monkeypatch.setenv("ENGINE_BUCKET_BYTES", "256")
    from_env = torchbridge.DistributedOptimizer(sgd, model)
    for opt in (given, from_env):
        opt.remove_hooks()
    assert len(given.buckets) >= 3
    assert [[id(p) for p in b] for b in from_env.buckets] == [[id(p) for p in b] for b in given.buckets]


class WithAnEmptyParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.net(x) + self.empty.sum()


def test_a_parameter_without_elements_trains_with_the_others():
    """Its gradient hook fires in backward, but it has no bucket (nothing to average): it keeps the empty
    gradient torch gives it, and the others are averaged as one process would on every rank's batch."""
    model = WithAnEmptyParameter()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, bucket_bytes=512)
    torchbridge.broadcast_parameters(model, opt)
    alone = WithAnEmptyParameter()
    alone.load_state_dict(model.state_dict())
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.05)
    every_rank = [batches(3, rank=r) for r in range(P)]
    train(model, opt, every_rank[R])
    for step in zip(*every_rank):
        alone_opt.zero_grad()
        x, y = (torch.cat(t) for t in zip(*(s[0] for s in step)))
        torch.nn.functional.mse_loss(alone(x), y).backward()
        alone_opt.step()
    assert model.empty.grad is not None and model.empty.grad.shape == (0,)
    for a, b in zip(model.parameters(), alone.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_a_backward_more_than_backward_passes_per_step_is_refused_and_the_first_still_steps():
    """With backward_passes_per_step=1 the first backward's buckets are in flight, writing the gradients
    in place, when a second backward would add to them (a race: the ranks would step apart). The second
    is refused before it adds to any gradient, once the first's buckets are done; step() applies the
    first's average, and training goes on as DDP's on Gloo."""
    data = batches(2)
    model = make_model()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                           bucket_bytes=512)
    torchbridge.broadcast_parameters(model, opt)
    (x, y), = data[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"Gradients were computed more than backward_passes_per_step times "
                                           r"before call to step\(\)\. Increase backward_passes_per_step"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(w is not None and w.is_completed() for w in opt._works)   # nothing left in flight
    opt.step()
    train(model, opt, data[1:])
    for a, b in zip(model.parameters(), gloo_ddp_reference(data)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_launch_times_are_the_last_steps():
    model = make_model()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, bucket_bytes=256)
    train(model, opt, batches(3))
    assert [k for k, _ in opt.launch_times] == list(range(len(opt.buckets)))


def test_step_without_backward_is_an_error():
    model = make_model()
    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.step()
    opt.remove_hooks()


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_compressed_training_stays_close(compression):
    data = batches(10)
    results = []
    for comp in (None, compression):
        model = make_model()
        opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                               bucket_bytes=1024, compression=comp)
        torchbridge.broadcast_parameters(model, opt)
        train(model, opt, data)
        results.append([p.detach() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=2e-2, rtol=0)


@pytest.mark.parametrize("ours,theirs", [
    (torchbridge.hooks.allreduce_hook, default_hooks.allreduce_hook),
    (torchbridge.hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    # torch's bf16_compress_hook is refused on CPU (DDP checks for NCCL); the logic it wraps runs on Gloo
    (torchbridge.hooks.bf16_compress_hook, "torch_bf16_logic")])
def test_comm_hooks_match_torch_hooks_on_gloo(ours, theirs):
    if theirs == "torch_bf16_logic":
        def torch_bf16_logic(state, bucket):
            return default_hooks._compress_hook(torch.bfloat16, state, bucket)
        theirs = torch_bf16_logic
    data = batches(10)
    model = make_model()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    ddp = DDP(model, bucket_cap_mb=0.0005)
    ddp.register_comm_hook(None, ours)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(step[0][0]), step[0][1]).backward()
        opt.step()
    ref = gloo_ddp_reference(data, hook=theirs)
    tol = 1e-6 if theirs is default_hooks.allreduce_hook else 1e-3
    for a, b in zip(model.parameters(), ref):
        assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max()


def test_torchs_powersgd_hook_with_several_buckets_trains_as_on_gloo():
    """torch's PowerSGD hook chains their allreduces in Future callbacks and waits there for the next
    one (`.get_future().wait()` inside `then`). The engine runs what a callback issues on the thread
    that runs the callback, at once: before, the allreduce waited for that very thread and the job hung
    at the first compressed step. With several buckets the callbacks issue their allreduces while
    backward issues the next buckets', on each rank at its own pace; the engine runs a task's callbacks,
    and what they issue, before the next task (pyx/progress.pyx), so every rank issues them in one order.
    Before, the ranks' orders differed (a collective mismatch, or a silent mix-up of two calls of one
    size); Gloo hangs there. The parameters match the same hook's training on Gloo with each bucket's
    allreduces waited for before backward goes on (one order on any backend)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    gen = torch.Generator().manual_seed(1000 + R)
    data = [(torch.randn(8, 48, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(5)]

    def sequential(state, bucket):
        fut = powerSGD.powerSGD_hook(state, bucket)
        fut.wait()
        return fut

    def trained(group, hook):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(5)], torch.nn.Linear(48, 3))
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)   # (3 buckets from the second step)
        state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       min_compression_rate=0.5, random_seed=0)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for x, y in data:   # (compressed from the third step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        assert len(ddp.reducer._get_zeros_like_grad_buckets()) >= 3
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(trained(None, powerSGD.powerSGD_hook), trained(GLOO, sequential)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
