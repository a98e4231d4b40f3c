"""torch.distributed backend "engine".

After `pip install`, `dist.init_process_group(backend="engine")` works with no import: torch loads
this package's registration through its `torch.backends` entry point. `import torchbridge` registers
too, for those who prefer it explicit. Registration imports neither MPI nor the engine; both load
when the first process group is created.
"""

from ._autoload import register

register()

__all__ = ["DistributedOptimizer", "broadcast_parameters", "hooks", "register"]


def __getattr__(name):
    # Lazy: torch imports this package at `import torch` (for _autoload), which must not load MPI.
    import importlib
    if name in ("DistributedOptimizer", "broadcast_parameters"):
        return getattr(importlib.import_module(".optimizer", __name__), name)
    if name == "hooks":
        return importlib.import_module(".hooks", __name__)
    raise AttributeError(f"module 'torchbridge' has no attribute {name!r}")
