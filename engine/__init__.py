"""engine: a communication engine for PyTorch (MPI for CPU tensors, compiled Cython kernels)."""

from mpi4py import MPI  # initialises MPI (thread level MULTIPLE) before the core loads

from ._core import DTYPE_NAMES, EngineError
from .kernels import pack, reduce_into, ring_block, ring_segments, scale, unpack
from .communicator import ANY_SOURCE, ANY_TAG, Communicator
from .ops import ReduceOp
from .udf import UserOp, reduction

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "Communicator", "DTYPE_NAMES", "EngineError", "MPI", "ReduceOp", "UserOp",
    "pack", "reduce_into", "reduction", "ring_block", "ring_segments", "scale", "unpack", "world",
]

_world = None


def world():
    """The Communicator over MPI.COMM_WORLD, created on first use."""
    global _world
    if _world is None:
        _world = Communicator()
    return _world
