"""The issue's acceptance case: allreduce of 10,000,003 float32 values gives the exact SUM through
every algorithm (exact because the values are small integers)."""

import numpy as np
import pytest

import engine

WORLD = engine.world()
R, P = WORLD.rank, WORLD.size
N = 10_000_003


@pytest.fixture(scope="module")
def values():
    """This rank's values and their sum over the ranks, made once for every algorithm."""
    i = np.arange(N, dtype=np.int32)
    ref = np.zeros(N, np.float32)
    for r in range(P):
        ref += (i + r) & 1023   # (small integers: every sum exact in float32)
    return ((i + R) & 1023).astype(np.float32), ref


@pytest.mark.parametrize("algo", WORLD.core.algorithms)
def test_allreduce_10M_float32_exact(algo, values):
    mine, ref = values
    x = mine.copy()
    WORLD.allreduce(x, algorithm=algo)
    assert np.array_equal(x, ref)


def test_forced_by_environment_variable(monkeypatch):
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "ring")
    comm = engine.Communicator()
    assert comm.algorithm_for(4) == "ring"
    x = np.full(N, R + 1, np.float32)
    comm.allreduce(x)
    assert np.all(x == P * (P + 1) / 2)
    comm.free()
