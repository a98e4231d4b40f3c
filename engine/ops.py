"""Reduce operations: the built-in ones and how an op argument is read."""

import enum


class ReduceOp(enum.IntEnum):
    """Built-in reductions. Values are the compiled core's op codes (pyx/kernels.h, dtypes.pxi).

    bool follows torch's bool arithmetic: SUM and MAX are OR, PRODUCT and MIN are AND.
    AVG is SUM followed by one division by the group size (floating dtypes only).
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7


def op_code(op):
    """An int code for a built-in op (ReduceOp, or its name in any case), or a user op unchanged."""
    if isinstance(op, ReduceOp):
        return int(op)
    if type(op) is int and 0 <= op < len(ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return int(ReduceOp[op.upper()])
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; expected one of "
                             f"{', '.join(m.name for m in ReduceOp)} or a user op (engine.reduction)") from None
    if hasattr(op, "_address"):
        return op
    raise TypeError(f"op must be an engine.ReduceOp, its name, or a user op made with engine.reduction; got {op!r}")
