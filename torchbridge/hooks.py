"""DDP communication hooks on the engine's fused path. Each returns a Future at once and never blocks:
the work is queued on the group's progress thread (torch's default_hooks pattern).

    model.register_comm_hook(None, torchbridge.hooks.fp16_compress_hook)    # or bfloat16_compress_hook

They match torch's own allreduce_hook / fp16_compress_hook / bf16_compress_hook: gradients averaged,
compressed ones cast to half precision on the way in (with the division by the world size fused into
the cast) and back to the bucket's dtype on the way out, inside the engine's pack/unpack kernels.
"""

import torch.distributed as dist

from engine.ops import ReduceOp


def _group(state):
    group = state if state is not None else dist.group.WORLD
    if not hasattr(group, "fused_allreduce_async"):
        raise TypeError("engine comm hooks need a process group on backend 'engine' as state (None: the world)")
    return group


def _hook(state, bucket, compression):
    buffer = bucket.buffer()
    work = _group(state).fused_allreduce_async([buffer], ReduceOp.AVG, compression=compression,
                                               name="ddp bucket")
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(state, bucket):
    """Averages the bucket in place (full precision)."""
    return _hook(state, bucket, None)


def fp16_compress_hook(state, bucket):
    """float32 gradients travel as float16."""
    return _hook(state, bucket, "float16")


def bfloat16_compress_hook(state, bucket):
    """float32 gradients travel as bfloat16. (Named so: DDP refuses any hook *named*
    bf16_compress_hook unless CUDA and NCCL are present, whatever it does.)"""
    return _hook(state, bucket, "bfloat16")


bf16_compress_hook = bfloat16_compress_hook  # torch's name; __name__ stays bfloat16_compress_hook
