"""User-defined reductions compiled by Numba, run by every algorithm and by reduce / reduce_scatter."""

import math

import numpy as np
import pytest

import engine
from refdata import rank_data

WORLD = engine.world()
R, P = WORLD.rank, WORLD.size
TINY = engine.Communicator(ring_segment_bytes=64)
SCALE = 2


@engine.reduction
def absmax(a, b):  # commutative, as MPI requires of user ops: ties go to the larger value
    return a if abs(a) > abs(b) or (abs(a) == abs(b) and a >= b) else b


@engine.reduction
def scaled_hypot(a, b):
    return math.sqrt(a * a + b * b) * SCALE / SCALE


def ref(fn, arrays):
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = np.array([fn.fn(x, y) for x, y in zip(out, a)], dtype=out.dtype)
    return out


def data(rank, n, dtype):
    return (rank_data(rank, n, "int64") * (1 if rank % 2 else -1) * (rank + 1)).astype(dtype)


@pytest.mark.parametrize("algo", WORLD.core.algorithms)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint8"])
def test_user_op_allreduce(algo, dtype):
    for n in [0, 1, 5, 257]:
        expected = ref(absmax, [data(r, n, dtype) for r in range(P)])
        x = data(R, n, dtype)
        TINY.allreduce(x, op=absmax, algorithm=algo)
        np.testing.assert_array_equal(x, expected, err_msg=f"{algo} {dtype} {n}")


def test_user_op_with_module_globals():
    x = np.full(10, 3.0, np.float64) * (R + 1)
    WORLD.allreduce(x, op=scaled_hypot, algorithm="ring")
    np.testing.assert_allclose(x, np.full(10, math.sqrt(sum((3.0 * (r + 1)) ** 2 for r in range(P)))))


def test_user_op_reduce_and_reduce_scatter():
    expected = ref(absmax, [data(r, 4 * P, "float32") for r in range(P)])
    out = np.zeros(4 * P, np.float32) if R == 0 else None
    WORLD.reduce(data(R, 4 * P, "float32"), out, op=absmax, root=0)
    if R == 0:
        np.testing.assert_array_equal(out, expected)
    block = np.zeros(4, np.float32)
    WORLD.reduce_scatter(data(R, 4 * P, "float32"), block, op=absmax)
    np.testing.assert_array_equal(block, expected[4 * R:4 * R + 4])


def test_lambda_user_op_compiles_uncached():
    op = engine.reduction(lambda a, b: a + 2 * b - b)
    x = np.full(6, R + 1, np.int64)
    WORLD.allreduce(x, op=op)
    assert np.all(x == P * (P + 1) // 2)


def test_user_op_on_float16_is_a_clear_error():
    with pytest.raises(TypeError, match="can't run on float16"):
        WORLD.allreduce(np.ones(4, np.float16), op=absmax)
    x = np.ones(2, np.float32)
    WORLD.allreduce(x)
    assert np.all(x == P)


def test_compiled_kernels_are_cached_on_disk(tmp_path, monkeypatch):
    import os
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))

    @engine.reduction
    def absmin(a, b):
        return a if abs(a) < abs(b) or (abs(a) == abs(b) and a <= b) else b

    x = data(R, 9, "float64")
    WORLD.allreduce(x, op=absmin)
    np.testing.assert_array_equal(x, ref(absmin, [data(r, 9, "float64") for r in range(P)]))
    names = os.listdir(tmp_path)
    assert any(n.startswith("engine_udf_") and n.endswith(".py") for n in names), names
    assert os.listdir(tmp_path / "__pycache__")
