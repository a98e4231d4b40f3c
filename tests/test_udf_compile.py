"""User reductions (engine/udf.py) compiled in one process: what the cached path writes into its
generated module, and when it steps aside for the uncached compile (cache=False's). Their use by every
algorithm across ranks is tests/mpi/test_udf.py."""

import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("numba")

import engine
from engine.kernels import reduce_into
from mpirun import run_launcher


def reduced(op, a, b):
    out = np.empty_like(a)
    reduce_into(out, a, b, op)
    return out


def generated(folder):
    return [n for n in os.listdir(folder) if n.startswith("engine_udf_") and n.endswith(".py")]


def clipped(limit):
    @engine.reduction
    def clipsum(a, b):
        return min(a + b, limit)
    return clipsum


def test_captured_infinities_and_numpy_scalars_compile_to_their_values(tmp_path, monkeypatch):
    """A closure capturing float('inf') (written as `inf`: not defined in the generated module) and
    one capturing np.float64(2.5) (written as `np.float64(2.5)`: `np` not defined) both failed to
    compile; now each gives its value's result, the infinity from the cache, the numpy scalar uncached."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    a, b = np.array([1.0, -2.0, 3.0]), np.array([4.0, 5.0, -6.0])
    np.testing.assert_array_equal(reduced(clipped(float("inf")), a, b), [5.0, 3.0, -3.0])
    assert len(generated(tmp_path)) == 1
    np.testing.assert_array_equal(reduced(clipped(float("-inf")), a, b), [-math.inf] * 3)
    np.testing.assert_array_equal(reduced(clipped(np.float64(2.5)), a, b), [2.5, 2.5, -3.0])
    np.testing.assert_array_equal(reduced(clipped(0.1), a, b), [0.1, 0.1, -3.0])   # (exactly 0.1's bits)


def test_default_arguments_keep_their_values(tmp_path, monkeypatch):
    """def wsum(a, b, k=k) made in a loop: each op adds its own k (the generated module's copy
    evaluated `k=k` where no k was defined, and both failed to compile)."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    ops = []
    for k in (1.0, 2.0):
        def wsum(a, b, k=k):
            return a + k * b
        ops.append(engine.reduction(wsum))
    ones = np.ones(3)
    assert [reduced(op, ones, ones).tolist() for op in ops] == [[2.0] * 3, [3.0] * 3]


@pytest.mark.parametrize("xdg", [True, False])
def test_without_engine_cache_dir_ops_are_cached_in_the_users_cache_folder(tmp_path, monkeypatch, xdg):
    """ENGINE_CACHE_DIR unset (README's default): $XDG_CACHE_HOME/engine/udf, else ~/.cache/engine/udf,
    under umask 002 too (a user private group's): before, the folders made above the cache's own were
    group-writable, so the cache was refused and every op compiled uncached."""
    monkeypatch.delenv("ENGINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    limit = 7.5 if xdg else 8.5   # (an op of its own: one compiled already in this process is reused)
    umask = os.umask(0o002)
    try:
        np.testing.assert_array_equal(reduced(clipped(limit), np.ones(3), np.ones(3)), [2.0] * 3)
    finally:
        os.umask(umask)
    folder = tmp_path / "xdg" / "engine" / "udf" if xdg else tmp_path / "home" / ".cache" / "engine" / "udf"
    assert len(generated(folder)) == 1


def test_a_cache_folder_that_cant_be_made_compiles_uncached(tmp_path, monkeypatch):
    """ENGINE_CACHE_DIR under a plain file (no folder can be made there, even by root): the op still
    works, compiled as cache=False compiles it (the error ended the call)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "file" / "udf"))

    @engine.reduction
    def larger(a, b):
        return a if a > b else b

    np.testing.assert_array_equal(reduced(larger, np.arange(4.0), np.ones(4)), [1.0, 1.0, 2.0, 3.0])


def test_a_generated_file_that_holds_something_else_is_written_again_not_run(tmp_path, monkeypatch):
    """The cache's file of an op holds other code (put there by someone, or left half written): it is
    written again from the op's source before it is imported (it was imported as found); a cache
    folder that others may write (it was made this user's alone: a shared folder lost its write bits), or
    one of another user's, is not used and left as it is (the op compiles uncached, saying so)."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "udf"))

    def plus_three(a, b):
        return a + b + 3

    np.testing.assert_array_equal(reduced(engine.reduction(plus_three), np.ones(2), np.ones(2)), [5.0, 5.0])
    name, = generated(tmp_path / "udf")
    honest = (tmp_path / "udf" / name).read_text()
    (tmp_path / "udf" / name).write_text("raise SystemExit('ran a file the engine did not write')\n")
    monkeypatch.delitem(sys.modules, name[:-3])   # (as in a new process: nothing loaded yet)
    np.testing.assert_array_equal(reduced(engine.reduction(plus_three), np.ones(2), np.ones(2)), [5.0, 5.0])
    assert (tmp_path / "udf" / name).read_text() == honest

    def plus_four(a, b):
        return a + b + 4

    for mode in (0o775, 0o1777):   # this user's, group-writable; shared as /tmp is
        shared = tmp_path / f"shared-{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        monkeypatch.setenv("ENGINE_CACHE_DIR", str(shared))
        with pytest.warns(RuntimeWarning, match=f"cache folder .*shared-{mode:o} may be written by others: they "
                                                "compile without it"):
            np.testing.assert_array_equal(reduced(engine.reduction(plus_four), np.ones(2), np.ones(2)), [6.0, 6.0])
        assert generated(shared) == [] and shared.stat().st_mode & 0o7777 == mode
    if os.geteuid() == 0:   # (only root can give a folder away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv("ENGINE_CACHE_DIR", str(theirs))

        def plus_five(a, b):
            return a + b + 5

        with pytest.warns(RuntimeWarning, match="cache folder .*theirs belongs to another user: they compile without it"):
            np.testing.assert_array_equal(reduced(engine.reduction(plus_five), np.ones(2), np.ones(2)), [7.0, 7.0])
        assert generated(theirs) == []

    def plus_six(a, b):
        return a + b + 6

    # this user's 0700 folder in one that others may write (not sticky: they may rename it away and put
    # theirs in its place): refused too (before, only the folder itself was checked)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    mine = tmp_path / "open" / "mine"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(mine))
    with pytest.warns(RuntimeWarning, match="cache folder .*open/mine lies in .*open, which others may write: they "
                                            "compile without it"):
        np.testing.assert_array_equal(reduced(engine.reduction(plus_six), np.ones(2), np.ones(2)), [8.0, 8.0])
    assert generated(mine) == []


def test_a_function_of_other_than_two_arguments_or_an_unsupported_dtype_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"engine.reduction: plus_three must take two arguments, the two elements it "
                                        r"combines \(f\(a, b\) -> value\); it takes \(a, b, c\)"):
        @engine.reduction
        def plus_three(a, b, c):
            return a + b + c
    op = engine.reduction(lambda a, b: a | b)
    for dtype, fix in [("bool", "cast to uint8 first"), ("complex64", "reduce it with a built-in op, or its real and imaginary"),
                       ("float16", "cast to float32 first \\(Numba has no CPU float16")]:
        with pytest.raises(TypeError, match=f"can't run on {dtype}: .*; {fix}"):
            reduced(op, np.ones(2, dtype), np.ones(2, dtype))


def test_threads_compiling_one_op_at_once_all_succeed(tmp_path, monkeypatch):
    """Eight threads compile the same function (eight op objects) at once into an empty cache folder,
    for each of three dtypes: each gets a working kernel, and one generated file per dtype is left
    (they wrote one temporary file named by the process id: some read it half written or found it
    moved, and failed)."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))

    def plus_one_more(a, b):
        return a + b + 1

    errors = []
    for dtype in ("float64", "float32", "int64"):
        start = threading.Barrier(8)

        def compile_one():
            op = engine.reduction(plus_one_more)
            start.wait()
            try:
                np.testing.assert_array_equal(reduced(op, np.ones(2, dtype), np.ones(2, dtype)), [3, 3])
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=compile_one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert len(generated(tmp_path)) == 3 and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def bumpmax(a, b):
    return a if a > b else b + 1


def bumpmax_exact(a, b):
    return a if a > b else b + np.uint64(1)


@pytest.mark.parametrize("cache", [True, False])
def test_a_reduction_that_gives_floats_for_integers_is_refused_by_name(tmp_path, monkeypatch, cache):
    """Numba makes uint64 with a signed integer (the literal 1) a float64: the kernel stored it back
    rounded (2**63 + 3, bumped, came back 2**63). Such a function is refused for integer elements,
    naming the type it gives; written in the element type it reduces exactly."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    a, b = np.array([2**63 + 1], np.uint64), np.array([2**63 + 3], np.uint64)
    with pytest.raises(TypeError, match=r"user reduction 'bumpmax' gives float64 for uint64 elements.*numpy.uint64\(1\)"):
        reduced(engine.reduction(bumpmax, cache=cache), a, b)
    assert reduced(engine.reduction(bumpmax_exact, cache=cache), a, b).tolist() == [2**63 + 4]
    assert reduced(engine.reduction(bumpmax, cache=cache), np.array([5], np.int64), np.array([7], np.int64)).tolist() == [8]


def ratio(a, b):
    return a / b


def floor_ratio(a, b):
    return a // b


@pytest.mark.parametrize("cache", [True, False])
def test_a_division_by_zero_gives_numpys_result_for_every_element(tmp_path, monkeypatch, cache):
    """A user op dividing by zero: numpy's results (inf, nan; 0 for integers), every element written.
    Under Numba's Python error model the kernel stopped at that element, printing 'Exception ignored',
    and left the rest of the output as it was: each rank went on with what its buffer held."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    a, b = [10, 20, 30, 0, 50], [2, 5, 0, 0, 5]
    with np.errstate(divide="ignore", invalid="ignore"):
        for fn, dtype, want in ((ratio, np.float32, None), (ratio, np.float64, None),
                                (floor_ratio, np.int32, [5, 4, 0, 0, 10]), (floor_ratio, np.int64, [5, 4, 0, 0, 10])):
            x, y = np.array(a, dtype), np.array(b, dtype)
            out = np.full(5, -7, dtype)
            reduce_into(out, x, y, engine.reduction(fn, cache=cache))
            np.testing.assert_array_equal(out, x / y if want is None else np.array(want, dtype), err_msg=f"{dtype}")


@pytest.mark.parametrize("cache", [True, False])
def test_a_function_numba_compiled_already_makes_a_reduction(tmp_path, monkeypatch, cache):
    """@engine.reduction over @numba.njit: its Python function is compiled as any other (it failed with
    AttributeError: 'CPUDispatcher' object has no attribute '__kwdefaults__')."""
    import numba
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))

    @numba.njit
    def wider(a, b):
        return a if abs(a) > abs(b) else b
    op = engine.reduction(wider, cache=cache)
    np.testing.assert_array_equal(reduced(op, np.array([1.0, -5.0, 2.0]), np.array([-3.0, 4.0, 2.5])),
                                  [-3.0, -5.0, 2.5])


FINGERPRINTS = """
import sys, engine
sys.path.insert(0, {here!r})
from test_udf_compile import clipped
ops = [clipped(1.0), clipped(2.0), engine.reduction(lambda a, b: a + b), engine.reduction(lambda a, b: a * b)]
print(" ".join(str(op.fingerprint) for op in ops))
"""


def test_a_user_ops_fingerprint_is_what_it_computes_alike_in_every_process():
    """The collectives' signatures carry a user op's fingerprint (ranks passing different ops fail with
    EngineMismatch: tests/mpi/test_udf.py): the same in two processes for the same function, a lambda's
    too (its bytecode, nothing that holds an address), and another for other code or captured values."""
    script = FINGERPRINTS.format(here=os.path.dirname(os.path.abspath(__file__)))
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    first, second = (r.stdout.split() for r in runs)
    assert first == second, (first, second)
    assert len(set(first)) == 4 and all(0 < int(f) < 2 ** 32 for f in first), first
    assert clipped(1.0).fingerprint == int(first[0]) and clipped(3.0).fingerprint != int(first[0])


def test_a_fork_while_another_thread_compiles_leaves_a_child_that_compiles(tmp_path, monkeypatch):
    """A thread compiles a user op while the main thread forks: the child compiles and runs another op.
    Before, the child inherited the compile's locks (the op's, the generated module's, Numba's) held by
    a thread it doesn't have, and waited on them forever; now the fork waits for the compile."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    busy, other = clipped(5.0), clipped(7.0)
    thread = threading.Thread(target=reduced, args=(busy, np.ones(3), np.ones(3)))
    thread.start()
    deadline = time.monotonic() + 30
    while busy._lock.acquire(blocking=False):   # (until the thread holds the op's lock: compiling)
        busy._lock.release()
        assert time.monotonic() < deadline and thread.is_alive(), "the thread never compiled"
        time.sleep(0.0005)
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = reduced(other, np.full(3, 4.0), np.full(3, 4.0)).tolist() == [7.0] * 3
        finally:
            os._exit(0 if ok else 1)
    thread.join(60)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's compile never finished (it waited on locks the fork copied held)")
    assert os.waitstatus_to_exitcode(done[1]) == 0


FORKING_THREADS = """
import os, sys, threading
import engine
sys.setswitchinterval(1e-6)   # (threads take turns often: the races below come within a few forks)
made, forking = [], [3]
def make():   # ops made meanwhile: the set of ops the fork hook locks changes under it
    i = 0
    while forking[0]:
        made.append(engine.reduction(eval(f"lambda a, b: a + b * {i}")))
        if len(made) > 400:
            del made[:200]
        i += 1
def fork():
    for _ in range(150):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    forking[0] -= 1
threads = [threading.Thread(target=make, daemon=True)] + [threading.Thread(target=fork, daemon=True) for _ in range(3)]
for t in threads:
    t.start()
for t in threads[1:]:
    t.join(30)
print("forks done" if not any(t.is_alive() for t in threads[1:]) else "a fork hangs", flush=True)
os._exit(0)
"""


def test_threads_forking_at_once_while_ops_are_made_each_hold_and_release_their_own_locks():
    """Three threads fork in a loop while a fourth makes ops. Before, the fork hook kept one list of
    held locks for every thread: one thread's release loop popped a lock another had just taken
    ("cannot release un-acquired lock", leaving it held), and a set of ops changed by another thread
    could break the hook's walk over it."""
    proc = run_launcher([sys.executable, "-c", FORKING_THREADS], 120)   # (a fork that hung is killed with it)
    assert proc.stdout == "forks done\n" and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


def nonnegative_sum_op():
    """A sum that raises at a negative first value (made after a test points ENGINE_CACHE_DIR at its own folder)."""
    @engine.reduction
    def nonnegative_sum(a, b):
        if a < 0:
            raise ValueError("a negative input")
        return a + b
    return nonnegative_sum


@pytest.mark.parametrize("threads", [1, 2])
def test_a_reduction_that_raises_is_reported_not_left_half_done(tmp_path, monkeypatch, threads):
    """The function raises at one element (of the second thread's slice with 2): reduce_into raises
    RuntimeError naming the op. Before, the kernel's loop ended there unreported and left the rest of
    the output as it was."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    nonnegative_sum = nonnegative_sum_op()

    a, b = np.ones(1 << 16), np.ones(1 << 16)
    a[-3] = -1.0
    with pytest.raises(RuntimeError, match=r"^reduce_into: the user reduction engine.reduction\(nonnegative_sum\) "
                                           r"raised \(Numba can't carry .* the result is incomplete; make"):
        reduce_into(np.zeros_like(a), a, b, nonnegative_sum, threads=threads)
    a[-3] = 1.0
    out = np.zeros_like(a)
    reduce_into(out, a, b, nonnegative_sum, threads=threads)
    assert (out == 2.0).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_raise_in_one_threads_reduction_fails_only_that_threads_call(tmp_path, monkeypatch, threads):
    """One thread's op raises on every call while another thread reduces clean data with it: only the first
    thread's calls raise. Before, a process-wide count of raises told every call that overlapped a raise
    that its own op had raised. With 2 threads the raise falls in a helper's slice and still counts for
    the call whose slice it was."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    nonnegative_sum = nonnegative_sum_op()

    n = 1 << 16
    bad, good = np.ones(n), np.ones(n)
    bad[-3] = -1.0
    clean_done, raised, wrong = threading.Event(), [], []

    def raising():
        while not clean_done.is_set():
            try:
                reduce_into(np.zeros(n), bad, good, nonnegative_sum, threads=threads)
            except RuntimeError:
                raised.append(1)
            else:
                wrong.append("a call whose op raised returned")

    def clean():
        try:
            for _ in range(300):
                out = np.zeros(n)
                reduce_into(out, good, good, nonnegative_sum, threads=threads)
                if not (out == 2.0).all():
                    wrong.append("a clean call gave a wrong result")
        except RuntimeError as exc:
            wrong.append(f"a clean call raised: {exc}")
        finally:
            clean_done.set()

    workers = [threading.Thread(target=raising), threading.Thread(target=clean)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers), "a thread still runs after 120 s"
    assert not wrong and raised, (wrong[:3], len(raised))
