"""The torch adapter's latency path, compiled (torchbridge._fastpath): the c10d methods torch calls on
every collective and point-to-point message, each one C call away from the engine's communicator.

EngineProcessGroup (torchbridge/process_group.py, plain Python) takes these functions as its methods
allreduce, broadcast, reduce, all_gather_single, reduce_scatter_single, all_to_all_single (and the
older names _allgather_base, _reduce_scatter_base, alltoall_base), barrier, send, recv and
recv_anysource. Each handles the common case, one CPU tensor (or an input and an output) with
torch's own options and no profiler running, and hands everything else (CUDA tensors, PREMUL_SUM,
uneven splits, tensors that aren't contiguous, a profiled call) to the group's general method of the
same collective (`group._broadcast`, ...), which checks and converts.

torch's options are read from the C++ struct behind their pybind object, in one C call: through
pybind, each field read costs about what the whole rest of the adapter does (a wrapper object per read,
a keep-alive for ReduceOp). pybind11 keeps a simple class's C++ object behind a pointer just after the
PyObject header; the offsets of reduceOp's code, rootRank and asyncOp in each options struct are found
at import and checked against pybind's own getters over every op, both asyncOp values and several
roots and timeouts. Where torch's layout differs (another version, another ABI), that struct is read
through pybind, as the general path reads it; tests/test_torch_options.py compares the two.

A synchronous call (torch's async_op=False) runs in the caller's thread through the group's progress
engine (engine.progress.Progress.run: in place when nothing is queued) and returns the shared completed
Work; an asynchronous one is queued and returns a CollectiveWork. A point-to-point Work torch has
already dropped is reused for the next message (see _p2p_work).
"""

from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject
from libc.stdint cimport int64_t

import datetime

import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch.autograd import profiler as _profiler

from engine import ReduceOp
from engine._core import NotContiguousError, NotDivisibleError

from torchbridge.devices import COMPLETED
from torchbridge.work import CollectiveWork, PointToPointWork

cdef extern from *:
    """
    static inline const unsigned char *eng_pybind_value(PyObject *o) {
        /* pybind11's `instance`: PyObject_HEAD, then simple_value_holder[0], the C++ object */
        return *(const unsigned char *const *)((const char *)o + sizeof(PyObject));
    }
    """
    const unsigned char *eng_pybind_value(PyObject *o)


# ---- torch's reduce ops ----

_RED = dist.ReduceOp.RedOpType
PREMUL = int(_RED.PREMUL_SUM)
# torch's reduce op -> the engine's, indexed by the op's code.
BY_CODE = [None] * (max(int(v) for v in _RED.__members__.values()) + 1)
for _name, _op in (("SUM", ReduceOp.SUM), ("PRODUCT", ReduceOp.PRODUCT), ("MIN", ReduceOp.MIN),
                   ("MAX", ReduceOp.MAX), ("BAND", ReduceOp.BAND), ("BOR", ReduceOp.BOR), ("BXOR", ReduceOp.BXOR),
                   ("AVG", ReduceOp.AVG)):
    BY_CODE[int(getattr(_RED, _name))] = _op

cdef signed char _engine_op[256]  # torch's code -> engine op, -1: not on the fast path (PREMUL_SUM)
for _i in range(256):
    _engine_op[_i] = -1 if _i >= len(BY_CODE) or BY_CODE[_i] is None else int(BY_CODE[_i])


def _torch_op(code):
    for name, member in _RED.__members__.items():
        if int(member) == code and name != "PREMUL_SUM":
            return getattr(dist.ReduceOp, name)
    return dist.ReduceOp.SUM


def _hash_is_code():
    """torch's ReduceOp hashes to its code, which reads it with one pybind access instead of two
    (red.op costs twice that); checked here, with the slow read as the fallback."""
    opts = dist.AllreduceOptions()
    for code, op in enumerate(BY_CODE):
        if op is not None:
            opts.reduceOp = _torch_op(code)
            if hash(opts.reduceOp) != int(opts.reduceOp.op):
                return False
    return True


cdef bint _HASH_IS_CODE = _hash_is_code()


def op_of(red):
    """(torch's code, engine op or None) of a torch ReduceOp, read through pybind."""
    cdef Py_ssize_t code = hash(red) if _HASH_IS_CODE else int(red.op)
    return code, (BY_CODE[code] if 0 <= code < len(BY_CODE) else None)


# ---- torch's options, read in one C call ----

cdef class _Layout:
    """Where one options struct keeps reduceOp's code, rootRank and asyncOp (offsets into the C++
    object), or that it is read through pybind (direct False)."""
    cdef readonly object type           # None: this torch's options lack a field; always the general path
    cdef readonly bint has_op, has_root, direct
    cdef readonly Py_ssize_t op_at, root_at, async_at


cdef int _read(_Layout lay, object opts, int64_t *root) except -2:
    """engine op * 2 + asyncOp (op 0 for options without one), the root in *root; -1 for the general
    path: options of another type (None, a subclass) or an op the fast path leaves to it (PREMUL_SUM)."""
    cdef const unsigned char *p
    cdef int op = 0
    cdef Py_ssize_t code
    if type(opts) is not lay.type:
        return -1
    if lay.direct:
        p = eng_pybind_value(<PyObject *>opts)
        if lay.has_op:
            op = _engine_op[p[lay.op_at]]
            if op < 0:
                return -1
        if lay.has_root:
            root[0] = (<const int64_t *>(p + lay.root_at))[0]
        return op * 2 + (p[lay.async_at] != 0)
    if lay.has_op:
        red = opts.reduceOp
        code = hash(red) if _HASH_IS_CODE else int(red.op)
        op = _engine_op[code] if 0 <= code < 256 else -1
        if op < 0:
            return -1
    if lay.has_root:
        root[0] = opts.rootRank
    return op * 2 + (1 if opts.asyncOp else 0)


def _samples(opts_type, bint has_op, bint has_root):
    """Options objects with every engine op, both asyncOp values, several roots and timeouts:
    [(object, torch code or -1, asyncOp, root)]."""
    out = []
    codes = [code for code, op in enumerate(BY_CODE) if op is not None] if has_op else [-1]
    roots = (0, 1, 5, 300, 70000, 2 ** 40 + 3) if has_root else (0,)
    for code in codes:
        for asynchronous in (False, True):
            for i, root in enumerate(roots):
                o = opts_type()
                if has_op:
                    o.reduceOp = _torch_op(code)
                if has_root:
                    o.rootRank = root
                    o.rootTensor = (root * 7 + i + 3) % 13
                o.timeout = datetime.timedelta(minutes=1 + 76 * ((i + code) % 2))
                o.asyncOp = asynchronous
                out.append((o, code, asynchronous, root))
    return out


def _layout(opts_type, bint has_op, bint has_root, Py_ssize_t size):
    """Finds and checks the offsets of opts_type's fields within its first `size` bytes (no larger
    than the struct: torch 2.13's sizes) against pybind's getters; read through pybind where any is
    missing or ambiguous."""
    cdef _Layout lay = _Layout.__new__(_Layout)
    cdef Py_ssize_t op_at = -1, root_at = -1, async_at = -1
    lay.has_op, lay.has_root = has_op, has_root
    try:
        samples = _samples(opts_type, has_op, has_root)
    except (AttributeError, TypeError):   # (an older torch: no asyncOp)
        return lay
    lay.type = opts_type

    def byte(o, Py_ssize_t i):
        return eng_pybind_value(<PyObject *>o)[i]

    def int64(o, Py_ssize_t i):
        return (<const int64_t *>(eng_pybind_value(<PyObject *>o) + i))[0]

    if has_op:
        found = [i for i in range(size) if all(byte(o, i) == code for o, code, _, _ in samples)]
        if len(found) != 1:
            return lay
        op_at = found[0]
    if has_root:
        found = [i for i in range(0, size - 7, 8) if all(int64(o, i) == root for o, _, _, root in samples)]
        if len(found) != 1:
            return lay
        root_at = found[0]
    found = [i for i in range(size) if i != op_at and not (root_at <= i < root_at + 8)
             and all((byte(o, i) != 0) == a for o, _, a, _ in samples)]
    if len(found) != 1:
        return lay
    async_at = found[0]
    lay.op_at, lay.root_at, lay.async_at, lay.direct = op_at, root_at, async_at, True
    # Every sample once more through the reader, against pybind's getters.
    if [read_options(lay, o) for o, _, _, _ in samples] != [read_options(lay, o, True) for o, _, _, _ in samples]:
        lay.direct = False
    return lay


def read_options(_Layout lay, opts, bint pybind=False):
    """(engine op or None, root, asyncOp) as the fast path reads opts (pybind: through pybind's
    getters, even where the struct is read directly), or None (the general path)."""
    cdef int64_t root = 0
    cdef bint direct = lay.direct
    lay.direct = direct and not pybind
    try:
        call = _read(lay, opts, &root)
    finally:
        lay.direct = direct
    if call < 0:
        return None
    return ReduceOp(call >> 1) if lay.has_op else None, root, bool(call & 1)


# (type, reduce op, root, the struct's size in torch 2.13)
cdef _Layout _ALLREDUCE = _layout(_c10d.AllreduceOptions, True, False, 48)
cdef _Layout _BROADCAST = _layout(_c10d.BroadcastOptions, False, True, 32)
cdef _Layout _REDUCE = _layout(_c10d.ReduceOptions, True, True, 64)
cdef _Layout _ALLGATHER = _layout(_c10d.AllgatherOptions, False, False, 16)
cdef _Layout _REDUCE_SCATTER = _layout(_c10d.ReduceScatterOptions, True, False, 48)
cdef _Layout _ALLTOALL = _layout(_c10d.AllToAllOptions, False, False, 16)
cdef _Layout _BARRIER = _layout(_c10d.BarrierOptions, False, False, 40)
LAYOUTS = {"allreduce": _ALLREDUCE, "broadcast": _BROADCAST, "reduce": _REDUCE, "allgather": _ALLGATHER,
           "reduce_scatter": _REDUCE_SCATTER, "alltoall": _ALLTOALL, "barrier": _BARRIER}


# ---- the latency path ----

cdef inline bint _profiling():
    # torch's own flag, what its compiler checks for the same reason; under the profiler the general
    # path records each call's event
    return _profiler._is_profiler_enabled


cdef enum:
    P2P_WORKS = 4   # point-to-point Works kept for reuse: a batch_isend_irecv to both neighbours holds four


cdef class FastPath:
    """One group's state for the latency path: its CPU communicator's methods and progress engine."""
    cdef bint cuda
    cdef int size
    cdef object run, submit
    cdef object allreduce, broadcast, reduce, allgather, reduce_scatter, alltoall, barrier, isend, irecv
    cdef object check_even_split
    cdef object reduce_to_root      # self._reduce_to_root, bound once
    cdef list works                 # the last point-to-point Works made, to reuse (see _p2p_work)
    cdef Py_ssize_t next_work       # the slot of works the next new one takes

    def __init__(self, comm, progress, bint cuda):
        self.cuda = cuda   # True: CUDA exists; every call takes the general path, which routes by device
        self.size = comm.size
        self.run, self.submit = progress.run, progress.submit
        self.allreduce, self.broadcast, self.reduce = comm.allreduce, comm.broadcast, comm.reduce
        self.allgather, self.reduce_scatter, self.alltoall = comm.allgather, comm.reduce_scatter, comm.alltoall
        self.check_even_split = comm.check_even_split
        self.barrier, self.isend, self.irecv = comm.barrier, comm.isend, comm.irecv
        self.reduce_to_root = self._reduce_to_root
        self.works = [None] * P2P_WORKS
        self.next_work = 0

    def _reduce_to_root(self, t, op, root):
        self.reduce(t, None, op, root)

    cdef object queue(self, fn, tuple args, str name, outputs):
        return CollectiveWork.of(self.submit(fn, args, name, outputs))

    cdef object collective(self, int call, fn, a, b, c, int nargs, str name, outputs, t, u):
        """fn on the first nargs of (a, b, c): run now (COMPLETED), or queued where torch asked for
        async_op (call & 1: a CollectiveWork). None: the general path takes it, because a tensor (t, or
        u where not None) isn't contiguous, or an even split's count isn't divisible by the group size
        (the general path says so in torch's terms). A run finds either out before anything moves; a
        queued call can't fall back once queued, so contiguity is checked here first, and
        all_to_all_single, the one even split, has the core check divisibility before queuing."""
        if call & 1:
            if t.is_contiguous() and (u is None or u.is_contiguous()):
                return self.queue(fn, (a, b, c)[:nargs], name, outputs)
            return None
        try:
            self.run(fn, a, b, c, nargs, name)
            return COMPLETED
        except (NotContiguousError, NotDivisibleError):
            return None

    cdef object _p2p_work(self, request, outputs):
        # A pybind Work costs more than the rest of a message's path. The last few made are reused
        # once nothing but this list holds them: torch calls send/recv on a Python group from Python
        # only (dist.send waits and drops its Work; isend/irecv pairs hold two), never keeping a Work
        # in C++ alone.
        cdef Py_ssize_t i
        cdef PyObject *w
        for i in range(P2P_WORKS):
            w = PyList_GET_ITEM(self.works, i)    # borrowed: when 1, the list's reference is the only one
            if w.ob_refcnt == 1 and w != <PyObject *>None:
                work = <object>w
                work.reset(request, outputs)
                return work
        work = PointToPointWork.of(request, outputs)
        self.works[self.next_work] = work
        self.next_work = (self.next_work + 1) % P2P_WORKS
        return work


cdef inline FastPath _fast(group):
    return <FastPath?>group._fast


def allreduce(group, tensors, opts=None):
    """Falls back to group._allreduce."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if len(tensors) == 1 and not f.cuda and not _profiling():
        call = _read(_ALLREDUCE, opts, &root)
        if call >= 0:
            t = tensors[0]
            work = f.collective(call, f.allreduce, t, None, call >> 1, 3, "allreduce", tensors, t, None)
            if work is not None:
                return work
    return group._allreduce(tensors, opts)


def broadcast(group, tensors, opts):
    """Falls back to group._broadcast."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if len(tensors) == 1 and not f.cuda and not _profiling():
        call = _read(_BROADCAST, opts, &root)
        if call >= 0:
            t = tensors[0]
            work = f.collective(call, f.broadcast, t, root, None, 2, "broadcast", tensors, t, None)
            if work is not None:
                return work
    return group._broadcast(tensors, opts)


def reduce(group, tensors, opts):
    """Falls back to group._reduce."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if len(tensors) == 1 and not f.cuda and not _profiling():
        call = _read(_REDUCE, opts, &root)
        if call >= 0:
            t = tensors[0]
            work = f.collective(call, f.reduce_to_root, t, call >> 1, root, 3, "reduce", tensors, t, None)
            if work is not None:
                return work
    return group._reduce(tensors, opts)


def all_gather_single(group, output, input, opts=None):
    """all_gather_into_tensor; falls back to group._all_gather_into_tensor."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if not f.cuda and not _profiling():
        call = _read(_ALLGATHER, opts, &root)
        if call >= 0:
            work = f.collective(call, f.allgather, input, output, None, 2, "all_gather_into_tensor", [output],
                                input, output)
            if work is not None:
                return work
    return group._all_gather_into_tensor(output, input, opts)


def reduce_scatter_single(group, output, input, opts=None):
    """reduce_scatter_tensor; falls back to group._reduce_scatter_tensor."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if not f.cuda and not _profiling():
        call = _read(_REDUCE_SCATTER, opts, &root)
        if call >= 0:
            work = f.collective(call, f.reduce_scatter, input, output, call >> 1, 3, "reduce_scatter_tensor",
                                [output], input, output)
            if work is not None:
                return work
    return group._reduce_scatter_tensor(output, input, opts)


def alltoall_base(group, output, input, output_split_sizes, input_split_sizes, opts=None):
    """all_to_all_single without split sizes; falls back to group._alltoall_base (which also names
    what is wrong with counts the group size doesn't divide)."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if not f.cuda and not output_split_sizes and not input_split_sizes and not _profiling():
        call = _read(_ALLTOALL, opts, &root)
        if call >= 0:
            if call & 1:    # queued: can't fall back, so a count the group size doesn't divide is named here
                f.check_even_split(input.numel(), "send")
                f.check_even_split(output.numel(), "recv")
            work = f.collective(call, f.alltoall, input, output, None, 2, "alltoall_base", [output], input, output)
            if work is not None:
                return work
    return group._alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)


def barrier(group, opts=None):
    """Falls back to group._traced_barrier (no options: queued, as the general path does)."""
    cdef FastPath f = _fast(group)
    cdef int64_t root
    cdef int call
    if not _profiling():
        call = _read(_BARRIER, opts, &root)
        if call == 0:
            f.run(f.barrier, None, None, None, 0, "barrier")
            return COMPLETED
        if call == 1:
            return f.queue(f.barrier, (), "barrier", [])
    return group._traced_barrier(opts)


# Point-to-point is posted at once, never queued behind collectives (as the general path does).

def send(group, tensors, dst, tag):
    """Falls back to group._send."""
    cdef FastPath f = _fast(group)
    if len(tensors) == 1 and not f.cuda and not _profiling():
        try:
            return f._p2p_work(f.isend(tensors[0], dst, tag), tensors)
        except NotContiguousError:
            pass
    return group._send(tensors, dst, tag)


def recv(group, tensors, src, tag):
    """Falls back to group._recv."""
    cdef FastPath f = _fast(group)
    if len(tensors) == 1 and not f.cuda and not _profiling():
        try:
            return f._p2p_work(f.irecv(tensors[0], src, tag), tensors)
        except NotContiguousError:
            pass
    return group._recv(tensors, src, tag)


def recv_anysource(group, tensors, tag):
    """Falls back to group._recv_anysource."""
    cdef FastPath f = _fast(group)
    if len(tensors) == 1 and not f.cuda and not _profiling():
        try:
            return f._p2p_work(f.irecv(tensors[0], None, tag), tensors)
        except NotContiguousError:
            pass
    return group._recv_anysource(tensors, tag)
