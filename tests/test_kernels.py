"""The C kernels against numpy/torch references (hypothesis over dtypes, lengths and values)."""

import os
import re
import subprocess
import sys

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


@pytest.mark.parametrize("op", list(NUMPY_OPS))
def test_bool_kernels_read_any_nonzero_byte_as_true_and_write_0_or_1(op):
    """A bool tensor may hold bytes other than 0 and 1 (a uint8 mask viewed as bool holds 2s): every
    nonzero byte is True, as torch and MPI's logical ops read it, and each result byte is 0 or 1. The
    bytes were combined as they were: 2 AND 1 gave 0 (False) where torch and Gloo give True."""
    raw_a = np.array([2, 1, 0, 255, 0, 4], np.uint8)
    raw_b = np.array([1, 2, 0, 0, 7, 4], np.uint8)
    out = np.empty(6, np.uint8)
    engine.reduce_into(out.view(np.bool_), raw_a.view(np.bool_), raw_b.view(np.bool_), op)
    a, b = raw_a != 0, raw_b != 0
    expected = {"sum": a | b, "max": a | b, "bor": a | b, "product": a & b, "min": a & b, "band": a & b,
                "bxor": a ^ b}[op]
    np.testing.assert_array_equal(out, expected.astype(np.uint8))


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


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threaded_kernels_give_the_one_thread_bits(threads):
    """A reduction and a copy split over threads (the team of a threaded collective) equal the one
    thread's, at sizes that split into uneven slices and sizes too small to split."""
    for n in (1, 7, 4097, 100_003, (3 << 20) + 5):
        for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "sum"), (torch.int64, "max")):
            a = (torch.randn(n) * 100).to(dtype)
            b = (torch.randn(n) * 100).to(dtype)
            want, got = torch.empty_like(a), torch.empty_like(a)
            engine.kernels.reduce_into(want, a, b, op)
            engine.kernels.reduce_into(got, a, b, op, threads=threads)
            assert torch.equal(got, want), (n, dtype, op)
        dst = torch.empty(n, dtype=torch.uint8)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        engine.kernels.copy_into(dst, src, threads=threads)
        assert torch.equal(dst, src), n
    for bad in (0, -3, engine._core.MAX_THREADS + 1, 10**6):
        # (a million started a million spinning threads: the call did not end in 20 s)
        with pytest.raises(ValueError, match=f"threads={bad}: expected a number of threads from 1 to"):
            engine.kernels.reduce_into(a, a, b, "sum", threads=bad)
        with pytest.raises(ValueError, match=f"threads={bad}: expected"):
            engine.kernels.copy_into(dst, src, threads=bad)


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


SMALL_FLOATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]


@pytest.mark.parametrize("name", SMALL_FLOATS)
def test_small_float_formats_are_read_from_torch_and_dlpack_and_refused_by_every_reduce_op(name):
    """torch's 8- and 4-bit float formats move as bytes (a torch tensor, or DLPack 1.1's codes:
    float4_e2m1fn_x2 comes as 4 bits x 2 lanes), and every reduce op on them names the dtype and the fix."""
    from engine._core import message_info
    t = torch.arange(6, dtype=torch.uint8).view(getattr(torch, name))
    assert message_info(t) == (t.data_ptr(), 6, name)

    class OnlyDLPack:
        def __init__(self, arr):
            self.arr = arr

        def __dlpack__(self, **kw):
            return self.arr.__dlpack__(**kw)

    assert message_info(OnlyDLPack(t)) == (t.data_ptr(), 6, name)
    comm = engine.Communicator.from_store(None, 0, 1, transport="shm")
    try:
        out = torch.zeros(6, dtype=torch.uint8).view(t.dtype)
        comm.allgather(t, out)
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        for op in ("sum", "product", "min", "max", "avg", "band"):
            with pytest.raises(ValueError, match=f"reduce op {op.upper()} is not supported for dtype {name}: the "
                               "engine moves .* reduce in bfloat16 or float32 and cast the result"):
                comm.allreduce(t, op=op)
    finally:
        comm.free()


# ---- every ISA's copy of the kernels computes the same bits ----

def _f32(*bits):
    return np.array(bits, np.uint32).view(np.float32)


# NaNs (quiet, signalling, with payloads, both signs), infinities, zeros of both signs, float32
# denormals, the float16 and bfloat16 edges (largest, overflow, denormals, halfway cases that round to
# even either way) and plain values: every pair of these goes through every kernel.
EDGE_F32 = np.concatenate([
    _f32(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC12345, 0x7FBFFFFF, 0x7F800000, 0xFF800000,
         0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF,
         0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000,      # bfloat16 ties and near ties
         0x3F801000, 0x3F803000, 0x3F800FFF, 0xBF801000),                  # float16 ties and near ties
    np.array([1.0, -1.5, 3.0, 0.1, 65504.0, 65520.0, 65519.99, -65536.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
              2.0 ** -14, 6.0e-5, 3.4e38, -2.5e-39, 1e-45], np.float32)])
FLOAT_OPS = ["sum", "product", "min", "max"]


def _pairs(dtype, rng, n_random):
    """(a, b): every pair of the edge values, then random bit patterns; as a numpy array, or a torch
    tensor for bfloat16."""
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        edge = torch.from_numpy(EDGE_F32).to(getattr(torch, dtype))
        a, b = [t.reshape(-1) for t in torch.meshgrid(edge, edge, indexing="ij")]
        width = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32, "float64": torch.int64}[dtype]
        bits = torch.from_numpy(rng.integers(-2 ** 62, 2 ** 62, size=(2, n_random), dtype=np.int64)).to(width)
        rand = bits.view(getattr(torch, dtype))
        a, b = torch.cat([a, rand[0]]), torch.cat([b, rand[1]])
        return (a, b) if dtype == "bfloat16" else (a.numpy(), b.numpy())
    if dtype == "bool":
        return rng.integers(0, 2, n_random).astype(bool), rng.integers(0, 2, n_random).astype(bool)
    info = np.iinfo(dtype)
    edge = np.array([0, 1, info.min, info.max, info.max - 1, info.min + 1], dtype)
    a, b = [x.reshape(-1) for x in np.meshgrid(edge, edge)]
    rand = rng.integers(info.min, info.max, size=(2, n_random), dtype=dtype, endpoint=True)
    return np.concatenate([a, rand[0]]), np.concatenate([b, rand[1]])


def _bits(x):
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    if t.dtype == torch.bool:
        return t.to(torch.uint8).numpy().copy()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).numpy().copy()


# Lengths that leave every remainder a vector loop can leave (up to 64-byte vectors unrolled four times
# over 1-byte elements), and the unaligned start of each run.
TAIL_LENGTHS = list(range(1, 34)) + [63, 64, 65, 127, 129, 255, 257]


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x.copy()


def _kernel_outputs(rng_seed=7):
    """Every kernel's output on the edge and random inputs, as raw bits: {case: (bits, both-NaN mask)}.
    The long inputs are odd in length and start one element into their buffers; each reduction runs in
    place on either operand and out of place, and again on every length of TAIL_LENGTHS, so the vector
    loops, their remainders and unaligned starts all run."""
    rng = np.random.default_rng(rng_seed)
    out = {}
    dtypes = ["bool"] + INT_DTYPES + ["float16", "bfloat16", "float32", "float64"]
    for dtype in dtypes:
        a, b = _pairs(dtype, rng, 4099)
        a, b = a[1:], b[1:]                      # (an unaligned start)
        if len(a) % 2 == 0:
            a, b = a[:-1], b[:-1]
        assert len(a) % 2 == 1
        both_nan = nan_a = nan_b = None
        if dtype in ("float16", "bfloat16", "float32", "float64"):
            ta, tb = (a, b) if isinstance(a, torch.Tensor) else (torch.from_numpy(a), torch.from_numpy(b))
            nan_a, nan_b = torch.isnan(ta).numpy(), torch.isnan(tb).numpy()
            both_nan = nan_a & nan_b
        ops = list(NUMPY_OPS) if dtype == "bool" or dtype in INT_DTYPES else FLOAT_OPS
        for op in ops:
            dst = _copy(a)
            engine.reduce_into(dst, dst, b, op)   # in place, as the collectives run it
            out[(dtype, op, "a")] = (_bits(dst), both_nan)
            dst = _copy(b)
            engine.reduce_into(dst, a, dst, op)   # in place on the second operand
            out[(dtype, op, "b")] = (_bits(dst), both_nan)
            dst = _copy(a)
            engine.reduce_into(dst, a, b, op)     # out of place
            out[(dtype, op, "new")] = (_bits(dst), both_nan)
            for n in TAIL_LENGTHS:
                dst = _copy(a[3:3 + n])
                engine.reduce_into(dst, dst, b[5:5 + n], op)
                out[(dtype, op, n)] = (_bits(dst), None if nan_a is None else nan_a[3:3 + n] & nan_b[5:5 + n])
        if both_nan is not None:
            for factor, divide in ((3.0, True), (0.1, False), (2.0 ** -20, False)):
                for n in [len(a)] + TAIL_LENGTHS:
                    x = _copy(a[:n])
                    engine.scale(x, factor, divide=divide)
                    out[(dtype, "scale", factor, divide, n)] = (_bits(x), None)
    x32 = torch.from_numpy(_pairs("float32", rng, 4099)[0][1:].copy())
    for tdtype in (torch.float16, torch.bfloat16):
        for factor in (1.0, 0.25, 3.0):
            for n in [len(x32)] + TAIL_LENGTHS:
                narrow = torch.empty(n, dtype=tdtype)
                engine.pack([x32[:min(n, 5)], x32[5:n]], narrow, scale=factor)
                wide = torch.empty(n, dtype=torch.float32)
                engine.unpack(narrow, [wide[:1], wide[1:]], scale=factor)
                out[("pack", tdtype, factor, n)] = (_bits(narrow), None)
                out[("unpack", tdtype, factor, n)] = (_bits(wide), None)
    # every 16-bit pattern (NaNs with payloads, denormals) widened, and scaled in its own dtype
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    for tdtype in (torch.float16, torch.bfloat16):
        half = every.view(tdtype)
        for factor in (1.0, 0.25, 3.0):
            wide = torch.empty(len(half), dtype=torch.float32)
            engine.unpack(half, [wide], scale=factor)
            out[("unpack every", tdtype, factor)] = (_bits(wide), None)
        # (dividing by 0.3 and multiplying by its reciprocal round differently: by 3, never in float16)
        for factor, divide in ((3.0, True), (0.3, True), (0.1, False)):
            x = half.clone()
            engine.scale(x, factor, divide=divide)
            out[("scale every", tdtype, factor, divide)] = (_bits(x), None)
    return out


def test_every_isa_computes_the_same_bits():
    """Each ISA this CPU runs against the baseline, bit for bit, on every kernel. Where both inputs of
    a float SUM or PRODUCT are NaN, only NaN-ness is compared: IEEE 754 leaves open which input's
    payload (and sign) the result carries, and compilers order commutative operands freely."""
    isas = engine.kernels.isas()
    assert isas[0] == "baseline"
    if len(isas) == 1:
        pytest.skip("this CPU runs the baseline kernels only: nothing to compare them with")
    previous = engine.kernels.use_isa("baseline")
    try:
        reference = _kernel_outputs()
        tables = {engine._core._kernel_table()}
        for isa in isas[1:]:
            engine.kernels.use_isa(isa)
            assert engine.kernels.isa() == isa
            tables.add(engine._core._kernel_table())
            assert len(tables) == isas.index(isa) + 1   # another copy of the kernels runs now
            got = _kernel_outputs()
            assert got.keys() == reference.keys()
            for case, (bits, both_nan) in reference.items():
                other = got[case][0]
                if both_nan is not None and case[1] in ("sum", "product"):  # (the sign or payload of NaN + NaN)
                    keep = ~both_nan
                    np.testing.assert_array_equal(other[keep], bits[keep], err_msg=f"{isa} {case}")
                    continue
                np.testing.assert_array_equal(other, bits, err_msg=f"{isa} {case}")
    finally:
        engine.kernels.use_isa(previous)


def test_isa_choice_and_refusals():
    assert engine.kernels.isa() in engine.kernels.isas()
    with pytest.raises(ValueError, match="unknown kernel ISA 'sse9'; expected auto or one of baseline"):
        engine.kernels.use_isa("sse9")
    missing = [name for name in ("avx2", "avx512") if name not in engine.kernels.isas()]
    for name in missing:  # an ISA this CPU (or this build) lacks is refused, never run
        with pytest.raises(RuntimeError, match=f"kernel ISA '{name}' (needs a CPU with|is not in this build)"):
            engine.kernels.use_isa(name)
    assert engine.kernels.use_isa(engine.kernels.isa()) == engine.kernels.isa()


def test_engine_isa_refuses_what_this_cpu_lacks_at_import():
    missing = [name for name in ("avx512", "avx2") if name not in engine.kernels.isas()][:1]
    cases = [("sse9", "unknown kernel ISA")] + [(name, "needs a CPU with|is not in this build") for name in missing]
    for name, expect in cases:
        run = subprocess.run([sys.executable, "-c", "import engine"], env={**os.environ, "ENGINE_ISA": name},
                             capture_output=True, text=True)
        assert run.returncode != 0
        assert f"ENGINE_ISA='{name}'" in run.stderr and "unset ENGINE_ISA to choose automatically" in run.stderr
        assert re.search(expect, run.stderr), run.stderr
    run = subprocess.run([sys.executable, "-c", "import engine.kernels as k; print(k.isa())"],
                         env={**os.environ, "ENGINE_ISA": "baseline"}, capture_output=True, text=True)
    assert run.stdout.strip() == "baseline", run.stderr


def test_parts_read_once_and_refused_by_index():
    parts = [torch.ones(3), torch.ones(0), torch.ones(70)]
    pl = engine._core.parse_parts(parts)
    assert (len(pl), pl.dtype_name, pl.total_bytes, pl.largest_bytes) == (3, "float32", 292, 280)
    flat = torch.empty(73)
    assert engine.pack(pl, flat) == 73                   # a parsed list in place of the list itself
    assert engine._core.parse_parts([torch.ones(2), torch.ones(2, dtype=torch.float64)]) is None
    with pytest.raises(ValueError, match=r"parts\[1\] is not contiguous"):
        engine.pack([torch.ones(2), torch.ones(4, 2).t()], torch.empty(10))
