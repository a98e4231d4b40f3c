"""engine: a communication engine for PyTorch: shared memory between ranks on one host, MPI between
hosts, NCCL for CUDA tensors; compiled Cython kernels. MPI is imported only by groups that use it."""

try:
    from ._core import DTYPE_NAMES, EngineAborted, EngineError, EngineMismatch, EnginePeerLost, EngineTimeout
except ImportError as exc:  # a source tree whose extensions were never built
    import os as _os
    _here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.exists(_os.path.join(_os.path.dirname(_here), "pyx", "_core.pyx")):
        raise ImportError(f"engine's compiled core is not built in this source tree ({_here}): run "
                          "`pip install -e .` (or `python setup.py build_ext --inplace`) here, or install the "
                          f"package with `pip install .` and run from another directory ({exc})") from exc
    raise

from .kernels import pack, reduce_into, ring_block, ring_schedule, scale, unpack
from .communicator import ANY_SOURCE, ANY_TAG, Communicator
from .ops import ReduceOp
from .udf import UserOp, reduction

__version__ = "0.2.0"
__all__ = [
    "ANY_SOURCE", "ANY_TAG", "Communicator", "DTYPE_NAMES", "EngineAborted", "EngineError", "EngineMismatch", "EnginePeerLost",
    "EngineTimeout", "ReduceOp", "UserOp", "pack", "reduce_into", "reduction", "ring_block", "ring_schedule",
    "scale", "unpack", "world",
]

_world = None


def world():
    """The group of every rank of this job, created on first use: under an MPI launcher, a Dup of
    MPI.COMM_WORLD (shared memory when every rank is on this host, ENGINE_TRANSPORT says otherwise);
    started alone (plain `python script.py`), a group of one without MPI."""
    global _world
    if _world is None:
        from .launcher import MPIRUN_HINT, detect_launcher
        import os
        if detect_launcher() is not None or os.environ.get("ENGINE_TRANSPORT", "").strip().lower() == "mpi":
            _world = Communicator()
        elif _world_size() > 1:
            raise RuntimeError("engine.world() needs an MPI launch to find its peers (WORLD_SIZE is set, but no MPI "
                               f"launcher started this process); {MPIRUN_HINT}, or use torch.distributed with "
                               "backend 'engine' (torchrun, mp.spawn), or engine.Communicator.from_store()")
        else:
            _world = Communicator.single()
    return _world


def _world_size():
    """WORLD_SIZE as a launcher sets it (unset or empty: 1)."""
    import os
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        return int(raw) if raw else 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} is not a number of ranks: a launcher sets it (torchrun, mp.spawn); "
                         "unset it to run alone") from None


def __getattr__(name):
    if name == "MPI":  # mpi4py's MPI module, loaded on demand
        from . import mpi
        return mpi.load()
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
