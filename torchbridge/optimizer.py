"""Training without DDP, Horovod-style: DistributedOptimizer averages gradients across ranks during
backward.

    opt = torchbridge.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    torchbridge.broadcast_parameters(model, opt)      # everyone starts from rank 0's state
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()               # buckets are reduced while backward runs
        opt.step()                                    # waits for the last buckets, then steps

Parameters are planned into buckets once (engine.fusion.plan_buckets, in reverse registration order,
which is roughly the order gradients become ready). A post-accumulate-grad hook counts ready gradients;
a full bucket is launched asynchronously (fused pack, one allreduce, unpack, on the group's progress
thread) as soon as it and every bucket before it are complete, so all ranks launch the same buckets in
the same order. With backward_passes_per_step=N nothing is communicated until the N-th backward; one
more before step() is refused (its gradients would be added to those being averaged).
"""

import functools
import numbers
import time

import torch
import torch.distributed as dist

from engine.fusion import COMPRESSIONS, bucket_sizes, plan_buckets
from engine.ops import ReduceOp


class DistributedOptimizer:
    """Wraps an optimizer: gradients are averaged over `group` (default: the world) before step()."""

    def __init__(self, optimizer, model=None, *, params=None, group=None, bucket_bytes=None,
                 compression=None, backward_passes_per_step=1, overlap=True):
        self.optimizer = optimizer
        self.group = group or dist.group.WORLD
        if not hasattr(self.group, "fused_allreduce_async"):
            raise TypeError("DistributedOptimizer needs a process group on backend 'engine' "
                            f"(got {dist.get_backend(self.group)!r})")
        if params is None:
            params = model.parameters() if model is not None else \
                [p for g in optimizer.param_groups for p in g["params"]]
        self.params = [p for p in params if p.requires_grad]
        if compression not in COMPRESSIONS:   # (here, not at the first step)
            raise ValueError(f"DistributedOptimizer: compression must be one of {COMPRESSIONS}, got {compression!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, numbers.Integral) \
                or backward_passes_per_step < 1:
            raise ValueError("DistributedOptimizer: backward_passes_per_step must be a whole number of backward "
                             f"passes, 1 or more, got {backward_passes_per_step!r}")
        self.compression = compression
        self.passes = int(backward_passes_per_step)
        self.overlap = overlap
        order = list(reversed(self.params))  # gradients of late layers are ready first
        specs = [(p.numel(), str(p.dtype), p.element_size(), str(p.device)) for p in order]
        cap, _ = bucket_sizes(bucket_bytes)   # (ENGINE_BUCKET_BYTES when not given)
        self.buckets = [[order[i] for i in b.indices] for b in plan_buckets(specs, cap)]
        self.bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.launch_times = []  # (bucket index, time.perf_counter()) of the last step, for overlap reports
        self._reset()
        # A parameter without elements has no bucket (nothing to average): no hook either, so its empty
        # gradient stays as torch made it. A leaf's tensor hook runs before its gradient is accumulated.
        bucketed = [p for p in self.params if id(p) in self.bucket_of]
        self._hooks = [p.register_hook(functools.partial(self._check_not_reduced, p)) for p in bucketed] + \
                      [p.register_post_accumulate_grad_hook(self._grad_ready) for p in bucketed]

    def _reset(self):
        self._ready = [0] * len(self.buckets)
        self._counts = {}
        self._works = [None] * len(self.buckets)
        self._next = 0

    def _check_not_reduced(self, p, grad):
        """Refuses a gradient beyond backward_passes_per_step before it is added to p.grad, which the
        step's averaging (on the progress thread) may be writing: ranks would step apart."""
        if self._counts.get(id(p), 0) == self.passes:
            self._wait_launched()   # (the error leaves no bucket of this step in flight)
            raise RuntimeError("Gradients were computed more than backward_passes_per_step times before call to "
                               "step(). Increase backward_passes_per_step to accumulate gradients locally.")

    def _grad_ready(self, p):
        n = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
        if n != self.passes:
            return  # accumulating micro-batches: communicate after the last one only
        k = self.bucket_of[id(p)]
        self._ready[k] += 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self, force=False):
        while self._next < len(self.buckets) and (force or self._ready[self._next] == len(self.buckets[self._next])):
            k = self._next
            for p in self.buckets[k]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in self.buckets[k]]
            if k == 0:
                self.launch_times = []
            self.launch_times.append((k, time.perf_counter()))
            self._works[k] = self.group.fused_allreduce_async(grads, ReduceOp.AVG, compression=self.compression,
                                                              name=f"gradient bucket {k}")
            self._next += 1

    def synchronize(self):
        """Launches what is left (parameters without gradients get zeros) and waits for every bucket."""
        self._launch_ready(force=True)
        self._wait_launched()

    def _wait_launched(self):
        for w in self._works[:self._next]:
            w.wait()

    def step(self, closure=None):
        if not self._counts:   # (a gradient counted in _ready is in _counts)
            raise RuntimeError("DistributedOptimizer.step() before any backward(): nothing to reduce")
        if any(n < self.passes for n in self._counts.values()):
            raise RuntimeError(f"DistributedOptimizer.step() after {min(self._counts.values())} of "
                               f"{self.passes} backward passes (backward_passes_per_step)")
        self.synchronize()
        self._reset()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()


def broadcast_parameters(model, optimizer=None, root=0, group=None):
    """Every rank takes rank `root`'s parameters and buffers (and optimizer state, if given)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=root, group=group)
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        state = [inner.state_dict() if dist.get_rank() == root else None]
        dist.broadcast_object_list(state, src=root, group=group)
        inner.load_state_dict(state[0])
