"""The C kernels against numpy/torch references (hypothesis over dtypes, lengths and values)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import engine
from refdata import INT_DTYPES

LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 31, 127, 8191, 65537]), st.integers(0, 3000))
SETTINGS = settings(max_examples=60, deadline=None)
NUMPY_OPS = {"sum": np.add, "product": np.multiply, "min": np.fmin, "max": np.fmax,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def arrays(dtype, n):
    if dtype == "bool":
        return hnp.arrays(np.bool_, n)
    if dtype in INT_DTYPES:
        return hnp.arrays(dtype, n)
    return hnp.arrays(dtype, n, elements=st.floats(-1e4, 1e4, width=np.dtype(dtype).itemsize * 8))


@st.composite
def operands(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes))
    n = draw(LENGTHS)
    return dtype, draw(arrays(dtype, n)), draw(arrays(dtype, n))


@SETTINGS
@given(operands(INT_DTYPES), st.sampled_from(list(NUMPY_OPS)))
def test_integer_kernels_match_numpy(ops, op):
    dtype, a, b = ops
    out = np.empty_like(a)
    engine.reduce_into(out, a, b, engine.ReduceOp[op.upper()])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, NUMPY_OPS[op](a, b).astype(dtype))


@SETTINGS
@given(operands(["float32", "float64"]), st.sampled_from(["sum", "product", "min", "max"]))
def test_float_kernels_match_numpy(ops, op):
    dtype, a, b = ops
    out = np.empty_like(a)
    engine.reduce_into(out, a, b, op)
    np.testing.assert_array_equal(out, NUMPY_OPS[op](a, b))


@SETTINGS
@given(operands(["bool"]), st.sampled_from(list(NUMPY_OPS)))
def test_bool_kernels_follow_torch_bool_arithmetic(ops, op):
    _, a, b = ops
    out = np.empty_like(a)
    engine.reduce_into(out, a, b, op)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    expected = {"sum": ta | tb, "max": torch.maximum(ta, tb), "bor": ta | tb, "product": ta & tb,
                "min": torch.minimum(ta, tb), "band": ta & tb, "bxor": ta ^ tb}[op]
    np.testing.assert_array_equal(out, expected.numpy())


@SETTINGS
@given(operands(["float32"]), st.sampled_from(["sum", "product", "min", "max"]),
       st.sampled_from([torch.float16, torch.bfloat16]))
def test_half_kernels_round_once_like_torch(ops, op, tdtype):
    _, a, b = ops
    ta, tb = torch.from_numpy(a).to(tdtype), torch.from_numpy(b).to(tdtype)
    out = torch.empty_like(ta)
    engine.reduce_into(out, ta, tb, op)
    expected = {"sum": ta + tb, "product": ta * tb, "min": torch.minimum(ta, tb), "max": torch.maximum(ta, tb)}[op]
    if op in ("min", "max"):  # by value: which zero min(0, -0) returns is unspecified
        assert torch.equal(out, expected)
    else:
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_in_place_aliasing():
    a = np.arange(1000, dtype=np.float32)
    b = np.ones(1000, np.float32)
    engine.reduce_into(a, a, b, "sum")
    np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float32) + 1)


def test_min_max_propagate_nan_like_torch():
    a = np.array([np.nan, 1, 2, np.nan], np.float32)
    b = np.array([0, np.nan, 3, np.nan], np.float32)
    for op, fn in [("min", torch.minimum), ("max", torch.maximum)]:
        out = np.empty_like(a)
        engine.reduce_into(out, a, b, op)
        np.testing.assert_array_equal(out, fn(torch.from_numpy(a), torch.from_numpy(b)).numpy())


def test_every_float16_bit_pattern_converts_like_numpy():
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    zeros = np.zeros(65536, np.float16)
    out = np.empty(65536, np.float16)
    engine.reduce_into(out, halves, zeros, "sum")  # x + 0 round-trips half -> float -> half
    finite = ~np.isnan(halves)
    np.testing.assert_array_equal(out[finite].view(np.uint16), (halves[finite] + zeros[finite]).view(np.uint16))
    assert np.all(np.isnan(out[~finite]))


@SETTINGS
@given(hnp.arrays(np.float32, LENGTHS, elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_float32_to_half_and_bfloat16_round_to_nearest_even(x):
    for tdtype in (torch.float16, torch.bfloat16):
        out = torch.empty(len(x), dtype=tdtype)
        n = engine.pack([x], out)
        assert n == len(x)
        ref = torch.from_numpy(x).to(tdtype)
        same = out.view(torch.int16) == ref.view(torch.int16)
        both_nan = torch.isnan(out) & torch.isnan(ref)
        assert bool(torch.all(same | both_nan))


@SETTINGS
@given(st.lists(LENGTHS, max_size=6), st.sampled_from(["float32", "int64", "uint8", "float16"]))
def test_pack_unpack_round_trip(lengths, dtype):
    rng = np.random.default_rng(sum(lengths))
    parts = [rng.integers(0, 100, n).astype(dtype) for n in lengths]
    flat = np.zeros(sum(lengths) + 3, dtype)  # a flat buffer may be larger than the parts
    assert engine.pack(parts, flat) == sum(lengths)
    np.testing.assert_array_equal(flat[:sum(lengths)], np.concatenate(parts) if parts else [])
    back = [np.zeros_like(p) for p in parts]
    engine.unpack(flat, back)
    for p, q in zip(parts, back):
        np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("tdtype", [torch.float16, torch.bfloat16])
def test_pack_with_fused_cast_and_scale(tdtype):
    parts = [torch.randn(n) for n in (3, 0, 1000, 17)]
    flat = torch.empty(1020, dtype=tdtype)
    engine.pack(parts, flat, scale=0.25)
    assert torch.equal(flat, torch.cat([(p * 0.25).to(tdtype) for p in parts]))
    back = [torch.empty_like(p) for p in parts]
    engine.unpack(flat, back, scale=4.0)
    for p, q in zip(parts, back):
        assert torch.equal(q, (p * 0.25).to(tdtype).float() * 4.0)


def test_pack_errors():
    with pytest.raises(TypeError, match="mixes dtypes"):
        engine.pack([np.ones(2, np.float32), np.ones(2, np.float64)], np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="flat buffer holds 3 elements but the parts need 4"):
        engine.pack([np.ones(2, np.float32), np.ones(2, np.float32)], np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="cannot pack int32 parts with a float16"):
        engine.pack([np.ones(2, np.int32)], np.zeros(2, np.float16))
    with pytest.raises(TypeError, match="scale"):
        engine.pack([np.ones(2, np.int32)], np.zeros(2, np.int32), scale=0.5)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_scale_multiplies_or_divides(dtype):
    x = np.arange(10, dtype=dtype)
    engine.scale(x, 3, divide=True)
    np.testing.assert_array_equal(x, (np.arange(10, dtype=np.float32 if dtype == "float16" else dtype) / 3).astype(dtype))
    with pytest.raises(ValueError, match="floating dtype"):
        engine.scale(np.ones(3, np.int32), 2.0)


@given(st.integers(0, 10**12), st.integers(1, 64))
def test_ring_blocks_tile_the_buffer_in_near_equal_blocks(count, nblocks):
    offset = 0
    lengths = []
    for b in range(nblocks):
        off, length = engine.ring_block(count, nblocks, b)
        assert off == offset
        offset += length
        lengths.append(length)
    assert offset == count
    assert max(lengths) - min(lengths) <= 1


def test_ring_blocks_when_count_is_smaller_than_the_world():
    assert [engine.ring_block(2, 5, b) for b in range(5)] == [(0, 1), (1, 1), (2, 0), (2, 0), (2, 0)]
    with pytest.raises(ValueError):
        engine.ring_block(10, 3, 3)


def test_message_layer_reads_torch_numpy_and_dlpack_without_copies():
    from engine._core import message_info
    t = torch.arange(6, dtype=torch.bfloat16)
    assert message_info(t) == (t.data_ptr(), 6, "bfloat16")
    a = np.arange(6, dtype=np.int16)
    assert message_info(a) == (a.ctypes.data, 6, "int16")
    assert message_info(bytearray(5))[1:] == (5, "uint8")

    class OnlyDLPack:
        def __init__(self, arr):
            self.arr = arr

        def __dlpack__(self, **kw):
            return self.arr.__dlpack__(**kw)

    assert message_info(OnlyDLPack(a)) == (a.ctypes.data, 6, "int16")
    with pytest.raises(ValueError, match="not C-contiguous"):
        message_info(OnlyDLPack(np.ones((4, 4))[:, ::2]))
