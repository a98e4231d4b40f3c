"""Fused allreduce equals per-tensor allreduce: bitwise for integers, within tolerance for floats,
over random lists of shapes and dtypes (hypothesis, derandomized so every rank draws the same lists);
a batch the plain path would refuse is refused whole, before any of its data moves."""

import time

import numpy as np
import pytest
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



class Unsegmented:
    """WORLD without shared memory's in-segment packing, so that the flat buffers and the helper thread's
    pipeline run on every transport; it counts the allreduces (one per bucket)."""

    def __init__(self, comm):
        self.comm, self.size, self.calls = comm, comm.size, 0

    def allreduce(self, buf, op=engine.ReduceOp.SUM):
        self.calls += 1
        return self.comm.allreduce(buf, op=op)


PIPELINED = FusedAllreduce(Unsegmented(WORLD), bucket_bytes=256)
LISTS = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), min_size=0, max_size=3)),
                 max_size=12)


def plain_error(t, op):
    """What a plain allreduce of t under op raises (it refuses before any data moves)."""
    with pytest.raises(ValueError) as refused:
        WORLD.allreduce(t.clone(), op=op)
    return str(refused.value)


def assert_refused_whole(fused, tensors, op, message, **kwargs):
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError) as refused:
        fused.run(tensors, op, **kwargs)
    assert str(refused.value) == message
    for got, want in zip(tensors, before):
        assert torch.equal(got, want), (got, want)


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
    for fused in (SMALL_CAP, BIG_CAP, PIPELINED):
        tensors = make(specs, seed)
        expected = [t.clone() for t in tensors]
        integers = [t for t in tensors if not t.is_floating_point()]
        if op == "avg" and integers:  # the plain path's error, for the first integer dtype, and nothing moved
            assert_refused_whole(fused, tensors, op, plain_error(integers[0], op))
            continue
        for t in expected:
            WORLD.allreduce(t, op=op)
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


@pytest.mark.parametrize("fused", [SMALL_CAP, BIG_CAP, PIPELINED], ids=["small-cap", "big-cap", "pipelined"])
def test_avg_of_values_whose_sum_overflows_is_their_mean(fused):
    """AVG near the largest float16, bfloat16 and float32 (alternating sign): the mean, never inf, in
    buckets of many tensors and for a tensor alone."""
    def near_the_largest(dt, big, n):
        t = torch.full((n,), big, dtype=dt)
        t[1::2] = -big
        return t

    for dt, big in ((torch.float16, 40000.0), (torch.bfloat16, 2.0 ** 127), (torch.float32, 2.0 ** 127)):
        for counts in ([5, 3, 7], [1 << 12], [9, 1 << 12]):
            tensors = [near_the_largest(dt, big, n) for n in counts]
            fused.run(tensors, "avg")
            for t, n in zip(tensors, counts):
                assert torch.equal(t, near_the_largest(dt, big, n)), (dt, counts, t)


def test_numpy_arrays_and_a_tensor_larger_than_the_cap():
    arrays = [np.full(1000, R + 1, np.float32), np.full(3, R, np.int64), np.zeros(0, np.float32)]
    SMALL_CAP.run(arrays)
    assert np.all(arrays[0] == P * (P + 1) / 2) and np.all(arrays[1] == P * (P - 1) / 2)


def ints(n, dtype=torch.int32):
    return torch.full((n,), 4 * (R + 1), dtype=dtype)


def floats(n):
    return torch.full((n,), R + 1.0)


@pytest.mark.parametrize("fused", [SMALL_CAP, BIG_CAP, PIPELINED], ids=["small-cap", "big-cap", "pipelined"])
def test_a_batch_the_plain_path_refuses_is_refused_before_any_bucket_moves(fused):
    """AVG of integers (a lone one is reduced in place: it was summed, then the division failed), a
    bitwise op on floats after an integer bucket (which was reduced already), a prescale of integers,
    an empty integer tensor under AVG: the plain path's error (a prescale's: scale()'s), nothing changed."""
    avg_of_int32 = plain_error(ints(1), "avg")
    assert avg_of_int32.startswith("reduce op AVG is not defined for int32")
    for tensors in ([ints(10)], [ints(1 << 17)], [floats(10), ints(10)], [floats(1 << 17), ints(1 << 17)],
                    [floats(3), ints(0)]):
        assert_refused_whole(fused, tensors, "avg", avg_of_int32)
    assert_refused_whole(fused, [ints(10, torch.int64), floats(10)], "avg", plain_error(ints(1, torch.int64), "avg"))
    for n in (10, 1 << 17):
        assert_refused_whole(fused, [ints(n), floats(n)], "band", plain_error(floats(1), "band"))
        assert_refused_whole(fused, [floats(n), ints(n)], "sum", "scale needs a floating dtype, got int32",
                             prescale=0.5)
    tensors = [ints(10), floats(10)]  # the ranks are still in step
    fused.run(tensors, "max")
    assert torch.equal(tensors[0], ints(10).fill_(4 * P)) and torch.equal(tensors[1], floats(10).fill_(P))


def test_a_failed_unpack_returns_after_every_bucket_is_done():
    """Nothing of a call still runs on the helper thread once it raises: the later buckets' unpacks
    (which write the caller's tensors and read the slot buffers the next call packs into) are waited
    for, and the first failure is raised."""
    fused = FusedAllreduce(Unsegmented(WORLD), bucket_bytes=256)
    real, done = fused._unpack, []

    def unpack(flat, scale_after, tensors, bucket):
        if bucket.indices[0] == 0:
            raise RuntimeError("unpack of bucket 0 failed")
        time.sleep(0.2)
        real(flat, scale_after, tensors, bucket)
        done.append(bucket.indices)

    fused._unpack = unpack
    tensors = [floats(32) for _ in range(6)]  # 128 bytes each: three buckets of two
    with pytest.raises(RuntimeError, match="unpack of bucket 0 failed"):
        fused.run(tensors)
    assert done == [(2, 3), (4, 5)]
    del fused._unpack
    tensors = [floats(32) for _ in range(6)]
    fused.run(tensors)
    assert all(torch.equal(t, floats(32).fill_(P * (P + 1) / 2)) for t in tensors)
    fused.close()


def test_bucket_sizes_from_the_environment_are_read_at_each_call(monkeypatch):
    """A fusion made without sizes (a group's, made once with the group) follows ENGINE_BUCKET_BYTES and
    ENGINE_FUSION_DIRECT_BYTES as they are at each call; sizes given stay."""
    comm = Unsegmented(WORLD)
    fused, given = FusedAllreduce(comm), FusedAllreduce(comm, bucket_bytes=1024)
    tensors = [floats(16) for _ in range(8)]  # 64 bytes each
    for env, from_env, from_given in (({"ENGINE_BUCKET_BYTES": "1K"}, 1, 1),
                                      ({"ENGINE_BUCKET_BYTES": "256"}, 2, 1),
                                      ({"ENGINE_FUSION_DIRECT_BYTES": "64"}, 8, 8)):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for f, calls in ((fused, from_env), (given, from_given)):
            comm.calls = 0
            f.run(tensors)
            assert comm.calls == calls, (env, f.bucket_bytes, f.direct_bytes)
    assert (fused.bucket_bytes, fused.direct_bytes, given.bucket_bytes) == (256, 64, 1024)
    assert all(torch.equal(t, floats(16).fill_(P * (P + 1) / 2 * P ** 5)) for t in tensors)
    fused.close()
    given.close()


@pytest.mark.parametrize("fused", [SMALL_CAP, BIG_CAP, PIPELINED, FusedAllreduce(WORLD)],
                         ids=["small-cap", "big-cap", "pipelined", "default"])
@pytest.mark.parametrize("n", [100, 100_000])   # (400 KB: over the 256 KB that travel alone, in place)
def test_the_same_tensor_twice_or_overlapping_views_are_reduced_once(fused, n):
    """[t, t] and overlapping views of one buffer end as one flattened allreduce leaves them (Gloo's
    allreduce_coalesced: every input read, then every result written, in order): reduced once. A part
    reduced in place, or a bucket packed after another's unpack, was reduced again."""
    t = torch.full((n,), R + 1.0)
    fused.run([t, t])
    assert torch.equal(t, torch.full((n,), P * (P + 1) / 2)), t[:4]
    flat = torch.arange(2 * n, dtype=torch.float64) + R
    fused.run([flat[: n + n // 2], flat[n // 2:], torch.ones(3, dtype=torch.float64)])
    want = P * torch.arange(2 * n, dtype=torch.float64) + P * (P - 1) / 2
    assert torch.equal(flat, want), (flat[:4], want[:4])


def test_numpy_buckets_compressed_to_bfloat16_are_refused_before_any_moves_or_run_in_the_segment():
    """numpy has no bfloat16 for a flat buffer: outside shared memory (whose segment is the flat
    buffer) a call compressing numpy float32 buckets to it is refused whole, before its first bucket
    moves (an int32 bucket ahead of it was reduced, then the call failed)."""
    fusion = FusedAllreduce(WORLD, bucket_bytes=64, direct_bytes=32)
    a, b = np.full(3, R + 1, np.int32), np.full(3, R + 1.0, np.float32)
    if WORLD.packs_in_segment:
        fusion.run([a, b], compression="bfloat16")
        assert (a == P * (P + 1) // 2).all() and (b == P * (P + 1) / 2).all()
    else:
        with pytest.raises(TypeError, match="numpy has no bfloat16"):
            fusion.run([a, b], compression="bfloat16")
        assert (a == R + 1).all() and (b == R + 1).all()
    fusion.close()


def test_what_fusion_cannot_take_is_refused_naming_it():
    """An iterator of tensors (read up by the first look: over MPI and TCP nothing was reduced and no
    error raised; over shared memory 'list_iterator' object is not subscriptable), and allreduce_parts
    on a group without a shared segment (a bare AttributeError of the transport's core)."""
    t = torch.ones(3)
    with pytest.raises(TypeError, match="FusedAllreduce.run takes a list or tuple of tensors, got list_iterator"):
        BIG_CAP.run(iter([t]))
    assert torch.equal(t, torch.ones(3))
    if WORLD.packs_in_segment:
        WORLD.allreduce_parts([x := np.ones(3, np.float32)])
        assert np.array_equal(x, np.full(3, P, np.float32))
    else:
        with pytest.raises(NotImplementedError, match=f"allreduce_parts packs into shared memory; this group runs "
                                                      f"over {WORLD.transport}: use engine.fusion.FusedAllreduce"):
            WORLD.allreduce_parts([np.ones(3, np.float32)])
