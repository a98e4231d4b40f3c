"""Fused allreduce equals per-tensor allreduce: bitwise for integers, within tolerance for floats,
over random lists of shapes and dtypes (hypothesis, derandomized so every rank draws the same lists)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.fusion import FusedAllreduce

WORLD = engine.world()
R, P = WORLD.rank, WORLD.size
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]
SMALL_CAP = FusedAllreduce(WORLD, bucket_bytes=256)  # many buckets, lone tensors over the cap, pipelining
BIG_CAP = FusedAllreduce(WORLD, bucket_bytes=1 << 20)

LISTS = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), min_size=0, max_size=3)),
                 max_size=12)


def make(specs, seed):
    g = torch.Generator().manual_seed(seed * 1000 + R)
    out = []
    for dtype, shape in specs:
        x = torch.randint(-20, 20, shape, generator=g) if not dtype.is_floating_point else torch.randn(shape, generator=g)
        out.append(x.to(dtype))
    return out


@settings(derandomize=True, max_examples=40, deadline=None, database=None)
@given(LISTS, st.sampled_from(["sum", "avg", "max"]), st.integers(0, 3))
def test_fused_equals_per_tensor(specs, op, seed):
    for fused in (SMALL_CAP, BIG_CAP):
        tensors = make(specs, seed)
        expected = [t.clone() for t in tensors]
        for t in expected:
            if op == "avg" and not t.is_floating_point():
                continue
            WORLD.allreduce(t, op=op)
        if op == "avg":
            ints = [i for i, t in enumerate(tensors) if not t.is_floating_point()]
            tensors = [t for t in tensors if t.is_floating_point()]
            expected = [t for i, t in enumerate(expected) if i not in ints]
        fused.run(tensors, op)
        for got, want in zip(tensors, expected):
            if got.is_floating_point():
                tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-6)
                assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (op, got, want)
            else:
                assert torch.equal(got, want)


def test_compression_casts_on_pack_and_back_on_unpack():
    for compression, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        ts = make([(torch.float32, [100]), (torch.float32, [3, 5]), (torch.int64, [4])], seed=7)
        expected = [t.clone() for t in ts]
        for t in expected[:2]:  # float32 travels compressed: reference reduces the rounded values
            t.copy_(t.to(dtype).float())
        for t in expected:
            WORLD.allreduce(t)
        SMALL_CAP.run(ts, "sum", compression=compression)
        tol = 1e-2 if dtype == torch.float16 else 5e-2
        for got, want in zip(ts[:2], expected[:2]):
            assert got.dtype == torch.float32
            assert torch.allclose(got, want, rtol=tol, atol=tol * P)
        assert torch.equal(ts[2], expected[2])  # integers are never compressed


def test_numpy_arrays_and_a_tensor_larger_than_the_cap():
    arrays = [np.full(1000, R + 1, np.float32), np.full(3, R, np.int64), np.zeros(0, np.float32)]
    SMALL_CAP.run(arrays)
    assert np.all(arrays[0] == P * (P + 1) / 2) and np.all(arrays[1] == P * (P - 1) / 2)
