"""The GPU path's pure parts and its CPU-only guarantees, checked on any machine."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import registry
from engine.cuda import load_cupy
from engine.cuda.buffers import device_message
from engine.cuda.tables import NCCL_DTYPES, check_reduction, nccl_reduction
from engine.fusion import bucket_scales
from engine.ops import ReduceOp


def test_nccl_codes_are_cupys():
    try:
        _, nccl = load_cupy()
    except ImportError as exc:
        pytest.skip(f"cupy not installed ({exc.__class__.__name__})")
    for name, code in (("int8", nccl.NCCL_INT8), ("uint8", nccl.NCCL_UINT8), ("int32", nccl.NCCL_INT32),
                       ("int64", nccl.NCCL_INT64), ("float16", nccl.NCCL_FLOAT16), ("float32", nccl.NCCL_FLOAT32),
                       ("float64", nccl.NCCL_FLOAT64), ("bfloat16", nccl.NCCL_BFLOAT16)):
        assert NCCL_DTYPES[name] == code
    assert nccl_reduction("float32", ReduceOp.AVG) == (nccl.NCCL_FLOAT32, nccl.NCCL_AVG)


def test_what_nccl_reduces_and_what_the_ring_does():
    assert nccl_reduction("bfloat16", ReduceOp.MAX) == (9, 2)
    assert nccl_reduction("bool", ReduceOp.SUM) == (1, 2)  # OR as max of 0/1
    assert nccl_reduction("bool", ReduceOp.PRODUCT) == (1, 3)
    assert nccl_reduction("int32", ReduceOp.BXOR) is None  # bitwise: the engine's ring
    assert nccl_reduction("int16", ReduceOp.SUM) is None  # NCCL has no int16
    assert nccl_reduction("int64", ReduceOp.AVG) is None
    plan = registry.Plan("nccl", stage=True)
    assert plan.choose("allreduce", 1 << 20, 4, "float32", "sum").name == "nccl"
    assert plan.choose("allreduce", 1 << 20, 4, "int32", "bxor").name == "ring"
    assert plan.choose("allreduce", 1 << 20, 4, "int16", "sum").name == "ring"
    assert plan.choose("reduce_scatter", 1 << 20, 4, "float32", "sum", uneven=True).name == "ring"
    assert plan.choose("allgather", 1 << 20, 4, uneven=True).name == "p2p"


def test_bad_reductions_raise_clear_errors():
    with pytest.raises(TypeError, match="AVG needs a floating dtype"):
        check_reduction("int32", ReduceOp.AVG)
    with pytest.raises(TypeError, match="BXOR needs an integer or bool dtype"):
        check_reduction("float32", ReduceOp.BXOR)
    with pytest.raises(TypeError, match="cannot reduce complex64"):
        check_reduction("complex64", ReduceOp.SUM)
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        with pytest.raises(TypeError, match="does not reduce float8_e4m3fn tensors: it moves them .* reduce in bfloat16"):
            check_reduction("float8_e4m3fn", op)


def test_a_fused_batch_is_checked_whole_before_any_bucket_is_enqueued():
    """A bucket the GPU can't reduce refuses the call before the buckets ahead of it are enqueued (which
    would leave them reduced when it raises); on a stand-in communicator that records what is enqueued."""
    from types import SimpleNamespace

    from engine.cuda.fusion import CudaFusedAllreduce
    enqueued = []

    def record(name):
        return lambda *args: enqueued.append(name)

    comm = SimpleNamespace(size=2, kernels=SimpleNamespace(pack=record("pack"), unpack=record("unpack"),
                                                           scale=record("scale")),
                           _message=lambda buf: buf,   # (pointer, count, item size, dtype, device)
                           _scratch=lambda nbytes, stream: SimpleNamespace(data=SimpleNamespace(ptr=0x9000)),
                           _allreduce=record("allreduce"))
    fused = CudaFusedAllreduce(comm, bucket_bytes=256)
    buffers = [(0x1000, 10, 4, "int32", 0), (0x2000, 10, 4, "float32", 0)]
    with pytest.raises(TypeError, match="BAND needs an integer or bool dtype, got float32"):
        fused.run(buffers, ReduceOp.BAND, stream=0)
    assert enqueued == []
    fused.run(buffers[:1], ReduceOp.BAND, stream=0)
    assert enqueued == ["allreduce"]   # (alone: in place)


@pytest.mark.parametrize("bucket_bytes, direct_bytes", [(256, None), (40, None), (1 << 20, 40)])
def test_a_fused_batch_holding_one_buffer_twice_reduces_it_once(bucket_bytes, direct_bytes):
    """The same buffer twice in a fused allreduce, on a stand-in that keeps device memory in numpy and
    sums as two ranks holding the same data would (doubling): each is read into a copy first, as the
    CPU fusion does. Where its two places went to two buckets, or it travelled alone in place, the
    second reduced the first's result again (4 where 2 is due)."""
    from types import SimpleNamespace

    import numpy as np
    from engine.cuda.fusion import CudaFusedAllreduce
    memory = {0x1000: np.ones(10, np.float32)}

    def at(ptr):
        base = max(p for p in memory if p <= ptr)
        return memory[base][(ptr - base) // 4:]

    def scratch(nbytes, stream):
        ptr = 0x100000 * (len(memory) + 1)
        memory[ptr] = np.zeros(max(nbytes // 4, 1), np.float32)
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    def copy(dst, src, nbytes, stream):
        at(dst)[:nbytes // 4] = at(src)[:nbytes // 4]

    def pack(ptr, wire, parts, dtype, itemsize, stream, before):
        out = at(ptr)
        for p, n in parts:
            out[:n], out = at(p)[:n] * before, out[n:]

    def unpack(ptr, wire, parts, dtype, itemsize, stream, after):
        flat = at(ptr)
        for p, n in parts:
            at(p)[:n], flat = flat[:n] * after, flat[n:]

    def allreduce(ptr, count, itemsize, dtype, op, stream):
        at(ptr)[:count] *= 2

    comm = SimpleNamespace(size=2, kernels=SimpleNamespace(pack=pack, unpack=unpack, scale=None), _copy=copy,
                           _message=lambda buf: buf, _scratch=scratch, _allreduce=allreduce)
    buf = (0x1000, 10, 4, "float32", 0)
    CudaFusedAllreduce(comm, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes).run([buf, buf], stream=0)
    assert (memory[0x1000] == 2).all(), memory[0x1000]


def test_forced_gpu_algorithm(monkeypatch):
    monkeypatch.setenv("ENGINE_CUDA_ALLREDUCE_ALGO", "ring")
    assert registry.Plan("nccl", stage=True).choose("allreduce", 1 << 20, 2, "float32", "sum").name == "ring"
    monkeypatch.delenv("ENGINE_CUDA_ALLREDUCE_ALGO")
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "nccl:ring")
    assert registry.Plan("nccl", stage=True).choose("allreduce", 1 << 20, 2, "float32", "sum").name == "ring"
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "shm:oneshot")  # another transport's: CUDA keeps its own choice
    assert registry.Plan("nccl", stage=True).choose("allreduce", 1 << 20, 2, "float32", "sum").name == "nccl"
    monkeypatch.setenv("ENGINE_CUDA_ALLREDUCE_ALGO", "tree")
    with pytest.raises(ValueError, match="ENGINE_CUDA_ALLREDUCE_ALGO='tree'"):
        registry.Plan("nccl", stage=True)


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # what `import cupy` sees without the extra
    with pytest.raises(ImportError, match=r"pip install engine\[cuda12\]"):
        load_cupy()


def test_buffer_layer_refuses_host_memory():
    with pytest.raises(TypeError, match="expected a CUDA tensor"):
        device_message(torch.ones(3))


def test_bucket_scales_divide_once():
    assert bucket_scales(ReduceOp.AVG, "float32", "float32", 4, 1.0) == (0.25, 1.0)
    assert bucket_scales(ReduceOp.AVG, "float32", "float32", 3, 1.0) == (0.25, 4 / 3)
    assert bucket_scales(ReduceOp.AVG, "float32", "float32", 1, 1.0) == (1.0, 1.0)
    assert bucket_scales(ReduceOp.AVG, "float16", "float32", 4, 2.0) == (0.5, 1.0)
    assert bucket_scales(ReduceOp.SUM, "float16", "float32", 4, 1.0) == (1.0, 1.0)


def test_cpu_job_never_imports_cupy():
    code = ("import sys, torch, torch.distributed as dist\n"
            "dist.init_process_group('engine')\n"
            "t = torch.ones(4); dist.all_reduce(t); assert t.sum() == 4\n"
            "dist.destroy_process_group()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba') or m == 'engine.cuda'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _cuda_setup_exchange(rank, size, port, out):
    try:
        from engine.bootstrap import CommBootstrap, gather
        from engine.cuda.nccl import ranks_sharing_a_device, unique_id_over
        from test_shm_without_mpi import _group
        comm, _store = _group(rank, size, port)
        uid = unique_id_over(comm, make=lambda: bytes(range(7, 135)))   # (rank 0's: the others send none)
        apart = ranks_sharing_a_device(comm, lambda: f"host/gpu-{rank}".encode())
        shared = ranks_sharing_a_device(comm, lambda: f"host/gpu-{min(rank, 1)}".encode())

        def fails_on_the_last():
            if rank == size - 1:
                raise ImportError("cupy is not installed here")
            return b"ok"
        try:
            gather(CommBootstrap(comm, "g"), fails_on_the_last, "run the check")
            failure = None
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        refused = [_hostile_round(comm, length, payload) for length, payload in
                   [(-1, None), (1 << 40, None), (None, pickle.dumps((os.getcwd, None)))]] if size > 1 else []
        comm.free()
        out.put((rank, uid, apart, shared, failure, refused))
    except BaseException as exc:  # reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None, None, None, None))


def _hostile_round(comm, length, payload):
    """One setup exchange where the last rank speaks its protocol by hand (the lengths, then the rows),
    sending `length` or `payload` (a pickle naming a function): what each other rank raised."""
    from engine.bootstrap import CommBootstrap, gather
    if comm.rank < comm.size - 1:
        try:
            gather(CommBootstrap(comm), lambda: b"ok", "run the check")
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    lengths = np.zeros(comm.size, np.int64)
    comm.allgather(np.array([len(payload) if length is None else length], np.int64), lengths)
    if length is None:
        rows = np.zeros((comm.size, int(lengths.max())), np.uint8)
        row = np.zeros(rows.shape[1], np.uint8)
        row[:len(payload)] = np.frombuffer(payload, np.uint8)
        comm.allgather(row, rows.reshape(-1))
    return "hostile"


@pytest.mark.parametrize("size", [1, 3])
def test_a_cuda_side_agrees_on_its_setup_over_the_groups_cpu_communicator(size):
    """How a group's CUDA side is set up among whoever its members are now (a reconfigure's may share
    no store): rank 0's NCCL unique id reaches every rank, ranks that name the same GPU are seen, and a
    rank that fails its part (cupy missing there) fails the exchange on every rank at once, each naming
    it, instead of leaving the others waiting in it; each a collective of the group's CPU communicator
    (spawned ranks, shared memory)."""
    from test_shm_without_mpi import _run
    procs, out = _run(_cuda_setup_exchange, size)
    results = sorted(out.get(timeout=120) for _ in range(size))
    for p in procs:
        p.join(30)
    assert [r[1] for r in results] == [bytes(range(7, 135))] * size, results
    assert [r[2] for r in results] == [False] * size
    assert [r[3] for r in results] == [size > 2] * size
    assert results[-1][4] == "ImportError: cupy is not installed here"
    for r in results[:-1]:
        assert r[4] == (f"RuntimeError: engine: group 'g' was not made: rank {size - 1} could not run the check "
                        "(ImportError: cupy is not installed here)"), r
    # A peer's lengths and pickles are read as the store's values are: bounded, plain data only.
    if size > 1:
        assert results[-1][5] == ["hostile"] * 3
        for r in results[:-1]:
            negative, huge, code = r[5]
            assert negative.startswith(f"RuntimeError: engine: rank {size - 1} sent a length of -1 bytes in the "
                                       "group's setup exchange (1 to 65536 are read)"), negative
            assert huge.startswith(f"RuntimeError: engine: rank {size - 1} sent a length of {1 << 40} bytes"), huge
            assert code.startswith("UnpicklingError: engine: a value of the group's bootstrap names posix.getcwd"), code


def test_unique_id_form_follows_cupys_version():
    from types import SimpleNamespace

    from engine.cuda.nccl import _for_cupy
    uid = bytes(range(0, 256, 2))
    assert _for_cupy(uid, SimpleNamespace(__version__="14.2.0")) == uid
    old = _for_cupy(uid, SimpleNamespace(__version__="13.6.0"))  # a tuple of C chars
    assert isinstance(old, tuple) and old[64] == -128 and bytes(b & 0xFF for b in old) == uid


def test_cpu_only_machines_never_route_to_cuda():
    """Without CUDA the adapter's one CUDA check is a boolean: no CUDA device is ever made."""
    import torchbridge.process_group as pg
    group = pg.EngineProcessGroup.__new__(pg.EngineProcessGroup)
    group._cuda, group._cpu, group._devices = False, "cpu-device", {}
    assert group._device(torch.ones(2)) == "cpu-device" and group._devices == {}


def test_the_cuda_communicator_reads_the_cores_count_tables():
    """The CUDA communicator checks a v-collective's sizes through the core's one table: the same
    counts, displacements and errors as a CPU group."""
    from engine._core import NotDivisibleError, alltoall_table, count_table
    assert count_table(3, 1, None, 5, "sendbuf", 15, "recvbuf", "allgather") == ([5, 5, 5], [0, 5, 10])
    assert count_table(3, 2, [1, 0, 4], 4, "recvbuf", 5, "sendbuf", "reduce_scatter") == ([1, 0, 4], [0, 1, 1])
    assert count_table(2, 1, [3, 2], 2, "sendbuf", None, "recvbuf", "gather") == ([3, 2], [0, 3])
    with pytest.raises(ValueError, match=r"allgather: recvbuf has 14 elements; it needs sendbuf's 5 x 3 ranks"):
        count_table(3, 0, None, 5, "sendbuf", 14, "recvbuf", "allgather")
    with pytest.raises(ValueError, match=r"scatter: counts\[1\] is 2 but this rank's recvbuf has 3"):
        count_table(2, 1, [1, 2], 3, "recvbuf", 3, "sendbuf", "scatter")
    with pytest.raises(ValueError, match="gather counts has 2 entries; it needs one per rank"):
        count_table(3, 0, [1, 2], 1, "sendbuf", 3, "recvbuf", "gather")
    # counts whose sum wraps around a size_t passed as 8 elements, their parts far outside the buffer
    with pytest.raises(ValueError, match=r"gather counts add up to more than \d+ elements at \[1\]"):
        count_table(3, 0, [4, 2 ** 63, 2 ** 63 + 4], 4, "sendbuf", 8, "recvbuf", "gather")
    with pytest.raises(ValueError, match=r"alltoall recv_counts add up to more than \d+ elements at \[2\]"):
        alltoall_table(3, 0, None, 6, [2, 2 ** 59, 2 ** 59], 6)
    assert alltoall_table(3, 0, None, 6, [2, 1, 2], 5) == ([2, 2, 2], [0, 2, 4], [2, 1, 2], [0, 2, 3])
    with pytest.raises(ValueError, match=r"alltoall: rank 1 sends itself 2 elements but receives 1 from itself"):
        alltoall_table(3, 1, None, 6, [2, 1, 2], 5)
    with pytest.raises(NotDivisibleError, match="alltoall: sendbuf has 7 elements, not divisible by the group size 3"):
        alltoall_table(3, 0, None, 7, None, 7)
    with pytest.raises(ValueError, match="alltoall: recv_counts add up to 4 but recvbuf has 5"):
        alltoall_table(2, 0, None, 4, [2, 2], 5)
    for bad in (lambda: count_table(0, 0, None, 1, "sendbuf", 0, "recvbuf", "allgather"),
                lambda: count_table(2, 2, None, 1, "sendbuf", 2, "recvbuf", "allgather"),
                lambda: alltoall_table(0, 0, None, 4, None, 4), lambda: alltoall_table(2, 2, None, 4, None, 4)):
        with pytest.raises(ValueError, match="a group of . ranks has no rank"):
            bad()


def _recording_cuda_communicator(rank=0, size=2):
    """A CudaCommunicator over a stand-in NCCL that records what it is asked to do (no GPU); buffers are
    given as device_message's tuples (pointer, count, itemsize, dtype, device)."""
    from engine.cuda.communicator import CudaCommunicator
    calls = []

    class Recording:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args))
    comm = CudaCommunicator.__new__(CudaCommunicator)
    comm.rank, comm.size, comm.device, comm.comm = rank, size, 0, Recording()
    comm._plan = registry.Plan("nccl", stage=True)
    comm._message = lambda buf: buf
    comm._copy = lambda *args: calls.append(("copy", args))
    return comm, calls


def test_a_cuda_collectives_output_of_another_dtype_is_refused_before_anything_is_enqueued():
    """float32 in, float16 out of the same element count: NCCL writes the input's dtype, past the
    output's end (twice its bytes: all_gather_into_tensor and reduce_scatter_tensor, which torch does
    not check). Refused as the CPU core refuses it, nothing enqueued."""
    comm, calls = _recording_cuda_communicator()
    f32, f16 = (0x1000, 8, 4, "float32", 0), (0x2000, 8, 2, "float16", 0)
    for call in (lambda: comm.allgather((0x1000, 4, 4, "float32", 0), f16, stream=0),
                 lambda: comm.reduce_scatter(f32, (0x2000, 4, 2, "float16", 0), ReduceOp.SUM, stream=0),
                 lambda: comm.reduce(f32, f16, ReduceOp.SUM, 0, stream=0),
                 lambda: comm.alltoall(f32, f16, stream=0),
                 lambda: comm.gather((0x1000, 4, 4, "float32", 0), f16, 0, stream=0),
                 lambda: comm.scatter(f16, (0x1000, 4, 4, "float32", 0), 0, stream=0)):
        with pytest.raises(TypeError, match="send buffer is float.. but receive buffer is float..; they must have"):
            call()
    assert calls == []
    comm.allgather((0x1000, 4, 4, "float32", 0), f32, stream=0)
    assert [name for name, _ in calls] == ["allgather"]


def test_the_watchdog_runs_on_fail_once_then_aborts_and_refuses():
    """A collective whose event never completes: past the timeout the watchdog runs on_fail (the
    group's abort hooks) once, then aborts the communicator, and every later call raises the timeout;
    past a call's own timeout where it has one."""
    import threading
    from engine.cuda.watchdog import Watchdog
    from engine.watch import EngineTimeout

    order, aborted = [], threading.Event()

    class Stuck:
        def query(self):
            return False

    class Comm:
        def check_async_error(self):
            pass

        def abort(self, error):
            order.append("abort")
            aborted.set()

    dog = Watchdog("g", 1, 3, 0.1, on_fail=lambda why: order.append(("hooks", why)))
    dog.watch(Stuck(), "allreduce", Comm())
    dog.watch(Stuck(), "broadcast", Comm())
    assert aborted.wait(5)
    dog.close()
    assert [o[0] if isinstance(o, tuple) else o for o in order] == ["hooks", "abort"], order
    assert "allreduce of group 'g' (rank 1 of 3): Timed out" in order[0][1]
    with pytest.raises(EngineTimeout, match="Timed out"):
        dog.watch(Stuck(), "reduce", Comm())
    # A call with a timeout of its own (opts.timeout) ends then, not at the group's (every call was
    # watched against the group's timeout: a call's own was dropped on CUDA).
    order.clear()
    aborted.clear()
    dog = Watchdog("g", 0, 2, 3600, on_fail=lambda why: order.append(("hooks", why)))
    dog.watch(Stuck(), "allreduce", Comm(), seconds=0.2)
    assert aborted.wait(60)
    dog.close()
    assert "allreduce of group 'g' (rank 0 of 2): Timed out: it did not complete on the GPU within 0.2 s" \
        in order[0][1], order


def test_the_watchdog_fails_the_group_on_a_gpu_error_and_never_waits_on_a_busy_communicator():
    """A CUDA event whose query raises (a sticky error: a kernel's illegal access) fails the group naming
    it, runs on_fail once and aborts (the watchdog's thread died, and later calls were never refused).
    NCCL's error state is not asked while a call holds the communicator's lock (it may be blocked in
    NCCL on a peer that never comes): the deadline still aborts (the watchdog waited on the lock)."""
    import threading
    from engine.cuda.nccl import NcclComm
    from engine.cuda.watchdog import Watchdog
    from engine.watch import EngineTimeout

    class Broken:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class Stuck:
        def query(self):
            return False

    aborted, hooks = [], []

    class Comm:
        def check_async_error(self):
            pass

        def abort(self, error):
            aborted.append(str(error))

    dog = Watchdog("g", 0, 2, 60, on_fail=hooks.append)
    dog.watch(Broken(), "allreduce", Comm())
    for _ in range(500):
        if aborted:
            break
        threading.Event().wait(0.01)
    dog.close()
    assert len(aborted) == 1 and "allreduce of group 'g' (rank 0 of 2) failed on the GPU: CUDA error: an illegal" \
        in aborted[0] and hooks == aborted
    with pytest.raises(EngineTimeout, match="illegal memory access"):
        dog.watch(Stuck(), "reduce", Comm())

    class Nccl:   # cupy's communicator: its error state and abort
        def check_async_error(self):
            raise AssertionError("asked while a call held the lock")

        def abort(self):
            aborted.append("ncclCommAbort")

    comm = object.__new__(NcclComm)   # (its state only: making one needs a GPU)
    comm.lock, comm._comm, comm.error = threading.RLock(), Nccl(), None
    held, release = threading.Event(), threading.Event()

    def call_blocked_in_nccl():
        with comm.lock:
            held.set()
            release.wait(30)

    blocked = threading.Thread(target=call_blocked_in_nccl)
    blocked.start()
    held.wait(5)
    try:
        comm.check_async_error()   # (returns at once)
        dog = Watchdog("g", 0, 2, 0.2)
        dog.watch(Stuck(), "broadcast", comm)
        for _ in range(500):
            if dog.error is not None and aborted[-1] == "ncclCommAbort":
                break
            threading.Event().wait(0.01)
        assert "broadcast of group 'g' (rank 0 of 2): Timed out" in str(dog.error) and aborted[-1] == "ncclCommAbort"
    finally:
        release.set()
        blocked.join()
        dog.close()


def test_a_cuda_send_whose_posting_failed_is_complete_and_raises_and_the_end_waits_for_the_gpu():
    """A deferred send or receive that could not be posted: its Work is complete, gives the failure and
    raises it (its event, never recorded, read as complete: wait() succeeded, the data never moved).
    A group's CUDA device ends after its GPU work, or after the watchdog's abort of it
    (ncclCommDestroy waits for unfinished operations with nothing to end the wait)."""
    import threading
    from engine.cuda.watchdog import Watchdog
    from torchbridge.devices import CudaDevice
    from torchbridge.work import CudaWork

    class Unrecorded:
        def query(self):
            return True

    dog = Watchdog("g", 0, 2, 60)
    work = CudaWork(Unrecorded(), [], 0, dog)
    work.fail(RuntimeError("send to rank 3: no such rank"))
    assert work.is_completed() and not work.is_success()
    assert str(work.exception()) == "send to rank 3: no such rank"
    with pytest.raises(RuntimeError, match="no such rank"):
        work.wait()
    with pytest.raises(RuntimeError, match="no such rank"):
        work.get_future()

    order = []

    class Stuck:
        def query(self):
            return "abort" in order

    class Comm:
        def check_async_error(self):
            pass

        def abort(self, error):
            order.append("abort")

        def free(self):
            order.append("free")

    dog = Watchdog("g", 0, 2, 0.3)
    dog.watch(Stuck(), "send", Comm())
    done = threading.Thread(target=CudaDevice(Comm(), 0, dog).shutdown)
    done.start()
    done.join(30)
    dog.close()
    assert order == ["abort", "free"], order


def test_a_cuda_works_wait_with_a_timeout_waits_on_the_host_and_raises_at_it():
    """Work.wait(timeout) as torch's NCCL Work: the host waits for the work, at most the timeout, then
    raises; a failure the watchdog finds meanwhile is raised instead. (It returned at once, never
    raising, for a collective that would never complete.)"""
    import time
    from datetime import timedelta

    from engine.cuda.watchdog import Watchdog
    from engine.watch import EngineTimeout
    from torchbridge.work import CudaWork

    class Never:
        def query(self):
            return False

    dog = Watchdog("g", 0, 2, 60)
    try:
        work = CudaWork(Never(), [], 0, dog)
        start = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"Work.wait: Timed out after 0.2 s waiting for the collective on the CUDA"):
            work.wait(timedelta(seconds=0.2))
        assert 0.2 <= time.monotonic() - start < 5
        dog.error = RuntimeError("rank 1 never joined allreduce #3")
        with pytest.raises(RuntimeError, match="never joined"):
            work.wait(timedelta(seconds=30))
    finally:
        dog.close()


def test_a_cuda_collective_is_refused_once_the_groups_cpu_side_broke():
    """A CUDA device's collective is refused when it is made once the group's CPU communicator broke (a
    lost peer, a timeout, a mismatch there): NCCL would otherwise wait for the same peer until its
    watchdog's timeout. Messages are refused for the watchdog only, as on the CPU."""
    import torch.distributed as dist
    from engine import Communicator
    from engine._core import EngineError
    from torchbridge.devices import CudaDevice

    class Dog:
        error = None

    called = []
    cpu = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    try:
        dev = CudaDevice(object(), 0, Dog(), cpu_comm=cpu)
        dev._check("allreduce")     # usable: nothing raised
        cpu.watch.core.set_broken("allreduce #2 of group 'g': Timed out after 1.0 s", "an earlier call timed out")
        with pytest.raises(EngineError, match=r"broadcast: this group is unusable after an earlier call timed out "
                                              r"\(allreduce #2 of group 'g': Timed out"):
            dev.launch("broadcast", lambda *a: called.append(a), 1, 2, 3, 3, [], None)
        with pytest.raises(EngineError, match="allreduce_coalesced: this group is unusable"):
            dev.fused([torch.ones(2)], ReduceOp.SUM, None, 1.0, "allreduce_coalesced")
        assert called == []
        dev._check()                # a message: not refused for the CPU side
        Dog.error = RuntimeError("NCCL watchdog: allreduce timed out")
        with pytest.raises(RuntimeError, match="NCCL watchdog"):
            dev._check()
    finally:
        cpu.free()


def test_abort_aborts_the_cuda_side_and_a_reconfigure_sets_it_up_anew():
    """The adapter's wiring, on the CPU (a GPU checks the real thing: tests/gpu/test_cuda_backend.py):
    abort() aborts each CUDA device of the group (ncclCommAbort there) before it is shut down, and its
    watchdog then holds the abort, so the Works of what was enqueued raise it; a reconfigure makes the
    group choose its CUDA transport again, among its new members."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from engine import Communicator
    from engine._core import EngineAborted
    from engine.cuda.watchdog import Watchdog
    from torchbridge.process_group import EngineProcessGroup

    events = []

    class Device:
        def abort(self, error):
            events.append(("abort", str(error)))

        def shutdown(self):
            events.append("shutdown")

    cpu = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(cpu, 0, 1, store=dist.HashStore(), name="g")
    dog = Watchdog("g", 0, 1, 30.0)
    pg._devices, pg._watchdog, pg._cuda_transport = {0: Device()}, dog, "nccl"
    pg.abort()
    assert [e[0] if isinstance(e, tuple) else e for e in events] == ["abort", "shutdown"], events
    assert "process group 'g' was aborted (abort())" in events[0][1]
    with pytest.raises(EngineAborted, match="was aborted"):
        dog.watch(object(), "allreduce", None)
    pg.reconfigure(SimpleNamespace(uuid=1, handles=[pg.get_reconfigure_handle()], timeout=timedelta(seconds=30))).wait()
    assert pg._cuda_transport is None and pg._devices == {} and pg._watchdog is None
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    assert torch.equal(t, torch.ones(3))

    class Unfinished:
        def query(self):
            return False

    # a reconfigure destroys an idle CUDA side after what it ran, and aborts one whose collective has
    # not finished (it may wait on a member that is gone: a destroy would wait with it)
    for uuid, stuck, expected in ((2, False, ["shutdown"]), (3, True, ["abort", "shutdown"])):
        events.clear()
        dog = Watchdog("g", 0, 1, 30.0)
        pg._devices, pg._watchdog = {0: Device()}, dog
        if stuck:
            dog._pending.append((Unfinished(), float("inf"), "allreduce", None))
        pg.reconfigure(SimpleNamespace(uuid=uuid, handles=[pg.get_reconfigure_handle()],
                                       timeout=timedelta(seconds=30))).wait()
        assert [e[0] if isinstance(e, tuple) else e for e in events] == expected, (uuid, events)
        assert (dog.error is not None) == stuck
    assert "was reconfigured or destroyed while a CUDA collective of its earlier members had not finished" in \
        events[0][1]
    pg.shutdown()


def test_a_destroyed_groups_cuda_collective_still_running_finishes_rather_than_is_aborted():
    """destroy_process_group while a healthy collective still runs on the GPU (every CUDA collective
    returns before the GPU is done, synchronous ones too): its device is shut down (which waits for
    its work, to the watchdog's deadline), never aborted (ncclCommAbort: a result saved right after
    the destroy could be half written)."""
    import time

    import torch.distributed as dist
    from engine import Communicator
    from engine.cuda.watchdog import Watchdog
    from torchbridge.process_group import EngineProcessGroup

    events = []

    class Device:
        def abort(self, error):
            events.append("abort")

        def shutdown(self):
            events.append("shutdown")

        def check_async_error(self):
            pass

    class Running:   # (completes 0.5 s later)
        t0 = time.monotonic()

        def query(self):
            return time.monotonic() - self.t0 > 0.5

    cpu = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(cpu, 0, 1, store=dist.HashStore(), name="g")
    dog = Watchdog("g", 0, 1, 30.0)
    pg._devices, pg._watchdog, pg._cuda_transport = {0: Device()}, dog, "nccl"
    dog.watch(Running(), "allreduce", Device())
    pg.shutdown()
    deadline = time.monotonic() + 10
    while "shutdown" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["shutdown"] and dog.error is None, (events, dog.error)


def test_every_cuda_tensor_of_a_call_is_recorded_on_the_stream_it_runs_on():
    """Each CUDA tensor among a call's arguments and outputs, lists of them included, is recorded on the
    stream the call is enqueued on (ProcessGroupNCCL's record_stream): freed before the work ends, an
    input allocated on another stream was handed out again while NCCL still read it. On stand-ins."""
    from torchbridge.devices import used_on

    class Tensor:
        def __init__(self, is_cuda):
            self.is_cuda, self.streams = is_cuda, []

        def record_stream(self, stream):
            self.streams.append(stream)

    a, b, c, host = Tensor(True), Tensor(True), Tensor(True), Tensor(False)
    used_on("s1", (a, [b, [c]], None, 3, host), [a])
    assert a.streams == ["s1", "s1"] and b.streams == c.streams == ["s1"] and host.streams == []


def test_a_barrier_posts_the_sends_and_receives_a_cuda_device_deferred():
    """isend on a CUDA tensor, then dist.barrier(), then wait(): the deferred send is posted by the
    barrier (a peer may wait on it, its recv then .item(), before it reaches the barrier: it was posted
    only at the wait, after the barrier both then waited in until the timeout). A group with CUDA
    takes the general barrier, which flushes every CUDA device, on stand-ins."""
    import torch.distributed as dist
    from engine import Communicator
    from torchbridge.process_group import EngineProcessGroup

    flushed = []

    class Device:
        def flush(self):
            flushed.append(True)

        def shutdown(self):
            pass

    cpu = Communicator.from_store(dist.HashStore(), 0, 1, transport="shm", name="g")
    pg = EngineProcessGroup(cpu, 0, 1, store=dist.HashStore(), name="g")
    pg._devices = {0: Device()}
    pg._traced_barrier().wait()
    assert flushed == [True]
    pg._devices = {}
    pg.shutdown()


def test_a_setup_blocked_inside_nccl_ends_the_process_at_the_timeout():
    """ncclCommInitRank waits for every rank, before any watchdog exists: one that got the id and then
    died would hold the others there for good. The setup runs under failure.blocked_in, which ends the
    process at the group's timeout, naming the call (here a stand-in that blocks, without MPI: the
    process exits, and torchrun's agent ends the job)."""
    code = ("import time\nfrom engine import failure\n"
            "with failure.blocked_in('NCCL', \"making group 'g''s NCCL communicator (ncclCommInitRank)\", 1, 0.5):\n"
            "    time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3, proc
    assert ("engine: rank 1: making group 'g''s NCCL communicator (ncclCommInitRank): Timed out after 0.5 s "
            "(timeout 0.5 s)") in proc.stderr and "blocked inside NCCL" in proc.stderr, proc.stderr


def test_a_staged_calls_device_copies_go_on_the_callers_stream_and_are_done_when_it_returns(monkeypatch):
    """The staged path's Work is complete when made: the call's device copies (its outputs written back)
    are issued on the caller's stream even where the progress thread runs it, and that stream is
    synchronized after (they went on the progress thread's stream, unsynchronized: a reader on
    another stream after wait() read stale outputs). On stand-ins for torch's streams."""
    import threading
    from types import SimpleNamespace

    from torchbridge.devices import StagedDevice

    events = []

    class Stream:
        def synchronize(self):
            events.append("synchronize")

    caller = Stream()

    class Using:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            events.append(("stream", self.stream is caller))

        def __exit__(self, *exc):
            events.append("left")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: caller)
    monkeypatch.setattr(torch.cuda, "stream", Using)

    class Progress:   # (runs the call on another thread, as behind queued calls)
        def run(self, fn, a, b, c, nargs, name):
            t = threading.Thread(target=fn, args=(a, b, c)[:nargs])
            t.start()
            t.join()

    cpu = SimpleNamespace(progress=Progress(), comm=None)
    work = StagedDevice(cpu).launch("allreduce", lambda x: events.append(("copies", x)), 7, None, None, 1, ["out"],
                                    None)
    assert events == ["synchronize", ("stream", True), ("copies", 7), "left", "synchronize"], events
    assert work.result() == ["out"]
