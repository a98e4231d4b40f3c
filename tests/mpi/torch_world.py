"""The default process group on backend "engine" (created once per launch, whichever suite runs first)
and a Gloo group of the same ranks, to compare against."""

import torch.distributed as dist

_gloo = []


def init():
    """(rank, world size, Gloo group); no torchbridge import: torch's entry point registers the backend."""
    if not dist.is_initialized():
        dist.init_process_group(backend="engine")
    if not _gloo:
        _gloo.append(dist.new_group(backend="gloo"))
    return dist.get_rank(), dist.get_world_size(), _gloo[0]
