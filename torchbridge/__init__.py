"""torch.distributed backend "engine".

After `pip install`, `dist.init_process_group(backend="engine")` works with no import: torch loads
this package's registration through its `torch.backends` entry point. `import torchbridge` registers
too, for those who prefer it explicit. Registration imports neither MPI nor the engine; both load
when the first process group is created.
"""

from ._autoload import register

register()

__all__ = ["register"]
