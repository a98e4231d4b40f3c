"""Deterministic per-rank data and the reductions every rank computes locally as references."""

from collections import OrderedDict

import numpy as np
import torch

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64"]
INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
OPS = ["sum", "product", "min", "max", "band", "bor", "bxor", "avg"]


# Each rank makes the same arrays again and again (its own, and every peer's for a reference): the most
# recent are kept, up to this many bytes, and copied out (a copy costs a thirtieth of making one; the
# caller writes into its own).
KEPT_BYTES = 256 << 20
_kept = OrderedDict()
_kept_bytes = 0


def rank_data(rank, n, dtype, salt=0):
    """Small integers (-3..3, 0..6 unsigned), so float sums, products and averages stay exact. They
    vary along the array with no short period, and each rank and salt has its own sequence: a block
    moved, repeated or taken from another rank shows (splitmix64 of the position, rank and salt,
    scaled to 0..6 without a division). A new array each call."""
    global _kept_bytes
    key = (rank, n, str(dtype), salt)
    made = _kept.get(key)
    if made is None:
        made = _make(rank, n, dtype, salt)
        made.flags.writeable = False
        _kept[key] = made
        _kept_bytes += made.nbytes
        while _kept_bytes > KEPT_BYTES and len(_kept) > 1:
            _kept_bytes -= _kept.popitem(last=False)[1].nbytes
    else:
        _kept.move_to_end(key)
    return made.copy()


def _make(rank, n, dtype, salt):
    u = np.uint64
    z = np.arange(n, dtype=u)
    z += u((rank * 1_000_003 + salt * 7_919 + 1) * 0x9E3779B97F4A7C15 % 2**64)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z ^= z >> u(shift)
        z *= u(factor)
    z >>= u(48)   # (the top 16 bits)
    z *= u(7)
    v = (z >> u(16)).astype(np.int64)
    if dtype == "bool":
        return (v % 3 == 0)
    if dtype.startswith("uint"):
        return v.astype(dtype)
    return (v - 3).astype(dtype)


def op_supported(op, dtype):
    if op in ("band", "bor", "bxor"):
        return dtype == "bool" or dtype in INT_DTYPES
    if op == "avg":
        return dtype in FLOAT_DTYPES or dtype == "bfloat16"
    return True


def reference(op, arrays):
    """op over a list of same-shape numpy arrays, in their dtype (integers wrap, like the engine)."""
    stack = np.stack(arrays)
    dt = stack.dtype
    if dt == np.bool_:
        return {"sum": np.any, "max": np.any, "bor": np.any, "product": np.all, "min": np.all,
                "band": np.all}.get(op, lambda s, axis: np.logical_xor.reduce(s, axis=axis))(stack, axis=0)
    if op == "avg":
        return (np.add.reduce(stack.astype(np.float64), axis=0).astype(np.float32 if dt == np.float16 else dt)
                / (np.float32 if dt == np.float16 else dt.type)(len(arrays))).astype(dt)
    ufunc = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return ufunc.reduce(stack, axis=0, dtype=dt)


def bf16(a):
    """A torch bfloat16 tensor holding a (exact for the small integers used here)."""
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16)


# torch tensors, for the torch.distributed suites (CPU in tests/mpi, CUDA in tests/gpu).

def torch_data(rank, n, dtype, salt=0):
    """rank_data as a torch tensor of dtype (bfloat16 included)."""
    if dtype == torch.bool:
        return torch.from_numpy(rank_data(rank, n, "bool", salt))
    return torch.from_numpy(rank_data(rank, n, "int64", salt)).to(dtype)


def torch_op_supported(op, dtype):
    if op in ("band", "bor", "bxor"):
        return not dtype.is_floating_point
    if op == "avg":
        return dtype.is_floating_point
    return True


def torch_reference(op, n, dtype, ranks):
    """op over torch_data of `ranks`, as torch computes it (integers wrap)."""
    arrays = [torch_data(r, n, dtype) for r in ranks]
    if dtype == torch.bool:
        return torch.from_numpy(reference(op, [a.numpy() for a in arrays]))
    acc = torch.stack(arrays).to(torch.float64)
    if op == "avg":
        return (acc.sum(0).to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype) / len(ranks)).to(dtype)
    out = {"sum": lambda: acc.sum(0), "product": lambda: acc.prod(0), "min": lambda: acc.min(0).values,
           "max": lambda: acc.max(0).values}.get(op)
    if out is not None:
        return out().to(dtype) if dtype.is_floating_point else _wrap(out(), dtype)
    ints = torch.stack(arrays)
    fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    res = ints[0]
    for x in ints[1:]:
        res = fn(res, x)
    return res


def _wrap(x, dtype):
    return torch.from_numpy(x.to(torch.int64).numpy().astype(str(dtype).split(".")[1]))
