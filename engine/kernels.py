"""The compiled element-wise kernels, callable on any buffer (each is one GIL-free C call)."""

from . import _core
from ._core import pack, ring_block, ring_schedule, scale, unpack
from .ops import op_code

__all__ = ["pack", "reduce_into", "ring_block", "ring_schedule", "scale", "unpack"]


def reduce_into(dst, a, b, op="sum"):
    """dst = a (op) b element-wise; dst may be a or b. float16/bfloat16 compute in float32 and round once."""
    _core.reduce_into(dst, a, b, op_code(op))
