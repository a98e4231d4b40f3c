"""User-defined reductions compiled by Numba, run by every algorithm and by reduce / reduce_scatter."""

import math
import threading

import numpy as np
import pytest

import engine
from engine import failure
from forced_groups import forced_subgroup
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


@engine.reduction
def absmin(a, b):
    return a if abs(a) < abs(b) or (abs(a) == abs(b) and a <= b) else b


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


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_ranks_passing_different_user_ops_fail_with_a_mismatch(collective):
    """The last rank passes absmin where the others pass absmax: every rank raises, and some rank raises
    EngineMismatch naming both calls' user ops, on every algorithm that is the engine's own (MPI's own
    collectives check nothing, as with a different built-in op: docs/robustness.md). Before, each rank
    returned data reduced by both functions, with no error, debug mode's check included."""
    if P < 2:
        pytest.skip("a mismatch needs two ranks")
    if WORLD.transport == "mpi":   # (docs/errors.md: a group with no store to compare notes)
        from mpi4py import MPI
        if P > 2:
            pytest.skip("over MPI without a store, a rank whose peers failed on each other's messages waits out "
                        "its timeout, and its peers' next call with it")
        if WORLD.mpi_comm.Get_attr(MPI.TAG_UB) < 0x7FFFFFFF:
            pytest.skip("this MPI's tags are too narrow to carry the call's number (pyx/call_tags.h): no rank can "
                        "tell a message of another call, and without a store each waits out its timeout")
    assert absmin.fingerprint % 240 != absmax.fingerprint % 240   # (their marks in a call word differ)
    if collective == "allreduce":
        algorithms = [a for a in WORLD.core.algorithms if a != "native"]
    else:   # (the entries forced: over MPI its own MPI_Reduce_scatter would run)
        algorithms = {"shm": ["segment", "ring"]}.get(WORLD.transport, ["ring"])
    for algo in algorithms:
        if collective == "allreduce":
            sub = WORLD.subgroup(list(range(P)))
        else:
            sub = forced_subgroup(WORLD, range(P), None, reduce_scatter=f"{WORLD.transport}:{algo}")
        op = absmin if R == P - 1 else absmax
        mine, block = data(R, 7 * P, "float32"), np.zeros(7, np.float32)
        with pytest.raises((engine.EngineMismatch, engine.EnginePeerLost)) as raised:
            if collective == "allreduce":
                sub.allreduce(mine, op=op, algorithm=algo)
            else:
                sub.reduce_scatter(mine, block, op=op)
        text = f"{type(raised.value).__name__}: {raised.value}"
        mismatched = np.array([isinstance(raised.value, engine.EngineMismatch)], np.int32)
        WORLD.allreduce(mismatched)
        assert mismatched[0] >= 1, (algo, text)
        if "collective mismatch in this group" in text:   # (the segment's words: both ops' marks)
            assert all(f"op user #{op.fingerprint % 240}" in text for op in (absmax, absmin)), text
        sub.free()
        failure.recovered()


def test_debug_modes_check_names_each_ranks_user_op(monkeypatch):
    """ENGINE_DEBUG=1 compares the calls first, user ops by their fingerprints: every rank raises
    EngineMismatch naming both (before, both were 'user op' alike and the call ran)."""
    if P < 2:
        pytest.skip("a mismatch needs two ranks")
    monkeypatch.setenv("ENGINE_DEBUG", "1")
    sub = WORLD.subgroup(list(range(P)))
    monkeypatch.delenv("ENGINE_DEBUG")
    theirs = r"ranks? [\d, ]+: allreduce #1 with 5 float32 elements shape \(5,\) user op \(fingerprint {:08x}\)"
    with pytest.raises(engine.EngineMismatch, match=theirs.format(absmax.fingerprint) + "; "
                       + theirs.format(absmin.fingerprint)):
        sub.allreduce(data(R, 5, "float32"), op=absmin if R == P - 1 else absmax)
    sub.free()
    failure.recovered()


@engine.reduction
def nonnegative_max(a, b):
    if a < 0 or b < 0:
        raise ValueError("a negative input")
    return max(a, b)


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "reduce_scatter", "allreduce_parts"])
def test_a_user_op_that_raises_on_one_rank_fails_the_call_on_every_rank(collective):
    """The last rank's data holds a negative value where the op raises: every rank raises RuntimeError
    naming the ranks whose kernel saw it, on every algorithm, and the group goes on. Before, the kernel
    that raised ended its loop unreported, and each rank returned whatever its buffer held."""
    if P < 2:
        pytest.skip("one rank reduces nothing")
    if collective == "allreduce_parts" and WORLD.transport != "shm":
        pytest.skip("allreduce_parts packs into shared memory")
    algorithms = WORLD.core.algorithms if collective == "allreduce" else [None]
    for algo in algorithms:
        mine = np.arange(1.0, 6 * P + 1, dtype=np.float64) + R
        if R == P - 1:
            mine[-2] = -1.0
        call = collective.removesuffix("_parts")   # (allreduce_parts: an allreduce, as the flight record has it)
        with pytest.raises(RuntimeError, match=rf"^{call} #\d+: the user reduction engine.reduction\("
                                               r"nonnegative_max\) raised on ranks? [\d, ]+ \(Numba .* incomplete on "
                                               r"every rank; make"):
            if collective == "allreduce":
                WORLD.allreduce(mine, op=nonnegative_max, algorithm=algo)
            elif collective == "allreduce_parts":   # (engine.fusion's packed path)
                WORLD.allreduce_parts([mine[:5], mine[5:]], op=nonnegative_max)
            elif collective == "reduce":
                WORLD.reduce(mine, np.zeros_like(mine) if R == 0 else None, op=nonnegative_max, root=0)
            else:
                WORLD.reduce_scatter(mine, np.zeros(6), op=nonnegative_max)
        x = np.arange(1.0, 6 * P + 1, dtype=np.float64) + R
        WORLD.allreduce(x, op=nonnegative_max, algorithm=algo)
        np.testing.assert_array_equal(x, np.arange(1.0, 6 * P + 1) + P - 1)


def test_a_raise_in_one_groups_call_fails_no_call_another_thread_runs_on_another_group():
    """One thread's allreduces on WORLD raise (the last rank's data is negative) while another thread's on
    TINY reduce clean data with the same op: only the first thread's calls raise, on every rank. Before,
    a process-wide count of raises failed every TINY call that overlapped a raise, naming this rank."""
    if P < 2:
        pytest.skip("one rank reduces nothing")
    calls, raised, wrong = 40, [], []
    start = threading.Barrier(2)   # (so that the two threads' calls overlap from the first)

    def raising():
        start.wait()
        for _ in range(calls):
            mine = np.ones(1 << 16)
            if R == P - 1:
                mine[-2] = -1.0
            try:
                WORLD.allreduce(mine, op=nonnegative_max)
            except RuntimeError:
                raised.append(1)
            else:
                wrong.append("a call whose op raised returned")

    def clean():
        start.wait()
        for _ in range(calls):
            x = np.ones(64) + R
            try:
                TINY.allreduce(x, op=nonnegative_max)
            except RuntimeError as exc:
                wrong.append(f"a clean call raised: {exc}")
            else:
                if not (x == P).all():
                    wrong.append(f"a clean call gave {x[:4]}")

    workers = [threading.Thread(target=raising), threading.Thread(target=clean)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not wrong and len(raised) == calls, (wrong[:3], len(raised))


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
