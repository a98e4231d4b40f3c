"""NCCL's datatype and reduction codes, and which (dtype, op) pairs NCCL reduces itself: in one place.

The codes are NCCL's ABI (nccl.h: ncclDataType_t, ncclRedOp_t), the same numbers cupy.cuda.nccl
exports, kept here as ints so planning never imports cupy.
"""

from ..ops import ReduceOp

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

# dtype name -> NCCL datatype, for the dtypes NCCL reduces. bool travels as uint8 (0/1).
NCCL_DTYPES = {
    "int8": NCCL_INT8, "uint8": NCCL_UINT8, "bool": NCCL_UINT8, "int32": NCCL_INT32, "int64": NCCL_INT64,
    "float16": NCCL_FLOAT16, "float32": NCCL_FLOAT32, "float64": NCCL_FLOAT64, "bfloat16": NCCL_BFLOAT16,
}
FLOATING = frozenset(("float16", "bfloat16", "float32", "float64"))

_OPS = {ReduceOp.SUM: NCCL_SUM, ReduceOp.PRODUCT: NCCL_PROD, ReduceOp.MIN: NCCL_MIN, ReduceOp.MAX: NCCL_MAX,
        ReduceOp.AVG: NCCL_AVG}
# torch's bool arithmetic on 0/1 bytes: SUM and MAX are OR (max), PRODUCT and MIN are AND (min).
_BOOL_OPS = {ReduceOp.SUM: NCCL_MAX, ReduceOp.PRODUCT: NCCL_MIN, ReduceOp.MIN: NCCL_MIN, ReduceOp.MAX: NCCL_MAX,
             ReduceOp.BOR: NCCL_MAX, ReduceOp.BAND: NCCL_MIN}

# dtypes the engine's own GPU reduction kernels handle (engine/cuda/kernels.cu).
KERNEL_DTYPES = frozenset(("bool", "int8", "uint8", "int16", "int32", "int64",
                           "float16", "bfloat16", "float32", "float64"))
OP_NAMES = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
            ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}


def nccl_reduction(dtype, op):
    """(NCCL datatype, NCCL op) when NCCL reduces this pair itself, else None (the engine's ring does)."""
    nccl_dtype = NCCL_DTYPES.get(dtype)
    if nccl_dtype is None:
        return None
    nccl_op = (_BOOL_OPS if dtype == "bool" else _OPS).get(op)
    if nccl_op is None or (op == ReduceOp.AVG and dtype not in FLOATING):
        return None
    return nccl_dtype, nccl_op


def check_reduction(dtype, op):
    """Raises a clear error for a pair no GPU path reduces."""
    if dtype.startswith(("float8", "float4")):
        raise TypeError(f"the engine does not reduce {dtype} tensors: it moves them (all_gather, "
                        "broadcast, all_to_all, send/recv); reduce in bfloat16 or float32 and cast the result")
    if op == ReduceOp.AVG:
        if dtype not in FLOATING:
            raise TypeError(f"ReduceOp.AVG needs a floating dtype, got {dtype}; use SUM and divide yourself")
        return
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"the engine cannot reduce {dtype} tensors on the GPU; supported: "
                        f"{', '.join(sorted(KERNEL_DTYPES))} (complex and unsigned 16-64 bit types only move)")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype in FLOATING:
        raise TypeError(f"{ReduceOp(op).name} needs an integer or bool dtype, got {dtype}")
