"""The torch adapter's latency path, compiled (torchbridge._fastpath): the c10d methods torch calls on
every collective and point-to-point message, each one C call away from the engine's communicator.

METHODS is one table of the c10d methods it serves: a row gives each one's shape, the communicator
call it makes and with what, and its general form. EngineProcessGroup (torchbridge/process_group.py,
plain Python) takes methods() as its methods. Each fast form handles the common case, one CPU tensor
(or an input and an output) with torch's own options and no profiler running; the checks for it are
written once (FastPath.collective, FastPath.message). Everything else (CUDA tensors, PREMUL_SUM,
uneven splits, tensors that aren't contiguous, a profiled call) goes to the row's general form
(`group._broadcast`, ...), which checks and converts.

torch's options are read from the C++ struct behind their pybind object, in one C call: through
pybind, each field read costs about what the whole rest of the adapter does (a wrapper object per read,
a keep-alive for ReduceOp). pybind11 keeps a simple class's C++ object behind a pointer just after the
PyObject header; the offsets of reduceOp's code, rootRank and asyncOp in each options struct are found
at import and checked against pybind's own getters over every op, both asyncOp values and several
roots and timeouts. Where torch's layout differs (another version, another ABI), that struct is read
through pybind, as the general path reads it; tests/test_torch_options.py compares the two.

A synchronous call (torch's async_op=False) runs in the caller's thread through the group's progress
engine (engine.progress.Progress.run: in place when nothing is queued) and returns a completed Work
holding its outputs; an asynchronous one is queued and returns a CollectiveWork. A Work torch has already
dropped is reused for the next call of under REUSED_MAX_BYTES (see _completed, _p2p_work).
"""

from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject
from libc.stdint cimport int64_t

import datetime
import functools
import numbers

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch.autograd import profiler as _profiler

from engine import ReduceOp
from engine._core import NotContiguousError, NotDenseError

from torchbridge.work import _INFLIGHT, UNSET_TIMEOUT, CollectiveWork, CompletedWork, PointToPointWork

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
    """Where one options struct keeps reduceOp's code, rootRank, asyncOp and timeout (offsets into the
    C++ object), or that it is read through pybind (direct False)."""
    cdef readonly object type           # None: this torch's options lack a field; always the general path
    cdef readonly bint has_op, has_root, direct
    cdef readonly Py_ssize_t op_at, root_at, tensor_at, async_at, timeout_at


cdef int _read(_Layout lay, object opts, int64_t *root) except -2:
    """engine op * 2 + asyncOp (op 0 for options without one), the root in *root; -1 for the general
    path: options of another type (None, a subclass), an op the fast path leaves to it (PREMUL_SUM),
    a call's own timeout (torch's unset one is -1 ms), or a rootTensor other than 0 (refused there)."""
    cdef const unsigned char *p
    cdef int op = 0
    cdef Py_ssize_t code
    if type(opts) is not lay.type:
        return -1
    if lay.direct:
        p = eng_pybind_value(<PyObject *>opts)
        if (<const int64_t *>(p + lay.timeout_at))[0] != -1:
            return -1
        if lay.has_op:
            op = _engine_op[p[lay.op_at]]
            if op < 0:
                return -1
        if lay.has_root:
            if (<const int64_t *>(p + lay.tensor_at))[0] != 0:
                return -1
            root[0] = (<const int64_t *>(p + lay.root_at))[0]
        return op * 2 + (p[lay.async_at] != 0)
    if opts.timeout != UNSET_TIMEOUT:
        return -1
    if lay.has_op:
        red = opts.reduceOp
        code = hash(red) if _HASH_IS_CODE else int(red.op)
        op = _engine_op[code] if 0 <= code < 256 else -1
        if op < 0:
            return -1
    if lay.has_root:
        if opts.rootTensor != 0:
            return -1
        root[0] = opts.rootRank
    return op * 2 + (1 if opts.asyncOp else 0)


def _samples(opts_type, bint has_op, bint has_root):
    """Options objects with every engine op, both asyncOp values, several roots, root tensors and
    timeouts: [(object, torch code or -1, asyncOp, root)]."""
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
    cdef Py_ssize_t op_at = -1, root_at = -1, tensor_at = -1, async_at = -1
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
        found = [i for i in range(0, size - 7, 8) if all(int64(o, i) == o.rootTensor for o, _, _, _ in samples)]
        if len(found) != 1:
            return lay
        tensor_at = found[0]
    def follows_async(Py_ssize_t i):
        """Byte i is asyncOp: it follows the flag when pybind's setter flips it. (A padding byte left
        over from freed objects of the same pattern can match the samples, but no setter moves it.)"""
        for o, _, a, _ in samples:
            o.asyncOp = not a
            flipped = (byte(o, i) != 0) == (not a)
            o.asyncOp = a
            if not flipped or (byte(o, i) != 0) != a:
                return False
        return True

    found = [i for i in range(size) if i != op_at and not (0 <= root_at <= i < root_at + 8) and
             not (0 <= tensor_at <= i < tensor_at + 8) and follows_async(i)]
    if len(found) != 1:
        return lay
    async_at = found[0]
    found = [i for i in range(0, size - 7, 8)
             if all(int64(o, i) == round(o.timeout.total_seconds() * 1000) for o, _, _, _ in samples)]
    if len(found) != 1:
        return lay
    lay.op_at, lay.root_at, lay.tensor_at, lay.async_at = op_at, root_at, tensor_at, async_at
    lay.timeout_at, lay.direct = found[0], True
    for o, _, _, _ in samples:   # (unset, as torch leaves them: a set one sends every call to the general path)
        o.timeout = UNSET_TIMEOUT
        if has_root:
            o.rootTensor = 0
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


# Each options type's layout: (type, reduce op, root, the struct's size in torch 2.13)
LAYOUTS = {"allreduce": _layout(_c10d.AllreduceOptions, True, False, 48),
           "broadcast": _layout(_c10d.BroadcastOptions, False, True, 32),
           "reduce": _layout(_c10d.ReduceOptions, True, True, 64),
           "allgather": _layout(_c10d.AllgatherOptions, False, False, 16),
           "reduce_scatter": _layout(_c10d.ReduceScatterOptions, True, False, 48),
           "alltoall": _layout(_c10d.AllToAllOptions, False, False, 16),
           "barrier": _layout(_c10d.BarrierOptions, False, False, 40)}


# ---- the c10d methods: one table ----

# What a communicator call gets, in order (a row's "arguments"): the input tensor (the one tensor of a
# list form), the output, the reduce op, the root; "-" passes None.
cdef enum:
    ARG_NONE, ARG_IN, ARG_OUT, ARG_OP, ARG_ROOT
ARGUMENTS = {"-": ARG_NONE, "in": ARG_IN, "out": ARG_OUT, "op": ARG_OP, "root": ARG_ROOT}

# A row's shape is its method's signature: `tensors` (tensors, opts), `pair` (output, input, opts),
# `splits` all_to_all_single's, `none` (opts), `p2p` (tensors, peer, tag), `anysource` (tensors, tag);
# it runs as the name traces and the flight recorder give it.
METHODS = (
    # torch's names                                  shape        call              arguments      options           runs as                   general form
    (("allreduce",),                                 "tensors",   "allreduce",      "in - op",     "allreduce",      "allreduce",              "_allreduce"),
    (("broadcast",),                                 "tensors",   "broadcast",      "in root",     "broadcast",      "broadcast",              "_broadcast"),
    (("reduce",),                                    "tensors",   "reduce_to_root", "in op root",  "reduce",         "reduce",                 "_reduce"),
    (("all_gather_single", "_allgather_base"),       "pair",      "allgather",      "in out",      "allgather",      "all_gather_into_tensor", "_all_gather_into_tensor"),
    (("reduce_scatter_single", "_reduce_scatter_base"), "pair",   "reduce_scatter", "in out op",   "reduce_scatter", "reduce_scatter_tensor",  "_reduce_scatter_tensor"),
    (("all_to_all_single", "alltoall_base"),         "splits",    "alltoall",       "in out",      "alltoall",       "alltoall_base",          "_alltoall_base"),
    (("barrier",),                                   "none",      "barrier",        "",            "barrier",        "barrier",                "_traced_barrier"),
    (("send",),                                      "p2p",       "isend",          "",            None,             "send",                   "_send"),
    (("recv",),                                      "p2p",       "irecv",          "",            None,             "recv",                   "_recv"),
    (("recv_anysource",),                            "anysource", "irecv",          "",            None,             "recv",                   "_recv_anysource"),
)


cdef class Method:
    """One row of METHODS: what its fast form needs at each call."""
    cdef readonly str name, call, general
    cdef readonly Py_ssize_t index      # its communicator call in FastPath.calls
    cdef _Layout layout
    cdef int nargs
    cdef int args[3]
    cdef bint even_split                # all_to_all_single: a queued call checks divisibility first
    cdef int blocks                     # 1: the output holds the group's inputs (all_gather_into_tensor); -1: the
                                        # input holds its outputs (reduce_scatter_tensor); else 0
    cdef bint reals_only                # reduces, and torch hands it complex tensors as they are (reduce,
                                        # reduce_scatter, a group's own allreduce): the general form reduces
                                        # their real view

    def __init__(self, Py_ssize_t index, str call, str arguments, str options, str name, str general):
        words = arguments.split()
        self.index, self.call, self.name, self.general = index, call, name, general
        self.layout = LAYOUTS[options] if options else None
        self.nargs = len(words)
        self.args = [ARGUMENTS[w] for w in words] + [ARG_NONE] * (3 - len(words))
        self.even_split = call == "alltoall"
        self.blocks = 1 if call == "allgather" else -1 if call == "reduce_scatter" else 0
        self.reals_only = call in ("allreduce", "reduce_to_root", "reduce_scatter")


cdef inline object _arg(int which, t, u, int op, int64_t root):
    if which == ARG_IN:
        return t
    if which == ARG_OUT:
        return u
    if which == ARG_OP:
        return op
    if which == ARG_ROOT:
        return root
    return None


# ---- the latency path ----

cdef inline bint _profiling():
    # torch's own flag, what its compiler checks for the same reason; under the profiler the general
    # path records each call's event
    return _profiler._is_profiler_enabled


cdef enum:
    P2P_WORKS = 4   # point-to-point Works kept for reuse: a batch_isend_irecv to both neighbours holds four
    # The most output bytes a reused Work holds: it keeps them past its call, until the group's next
    # one (a group used once, for the model's first broadcast, would keep them to its end). A larger
    # call's Work is its own, and goes with its caller's last reference, as Gloo's does.
    REUSED_MAX_BYTES = 1 << 20


cdef bint _reusable(outputs):
    cdef Py_ssize_t total = 0
    for t in outputs:
        total += t.nbytes
    return total < REUSED_MAX_BYTES


cpdef Py_ssize_t rows(t):
    """A tensor's rows, what all_to_all_single splits, evenly or by split sizes (a 0-dim tensor: its one
    element); the general form (process_group.all_to_all_counts) reads them here too."""
    return t.shape[0] if t.dim() else 1


cdef class FastPath:
    """One group's state for the latency path: its CPU communicator's calls (METHODS' order) and
    progress engine."""
    cdef bint cuda
    cdef public bint hooked         # the group has collective hooks: every call takes the general form
    cdef object run, submit, check_usable, kick
    cdef list calls
    cdef object reduce
    cdef int size
    cdef list works                 # the last point-to-point Works made, to reuse (see _p2p_work)
    cdef object completed           # the last synchronous call's Work, to reuse (see _completed)
    cdef Py_ssize_t next_work       # the slot of works the next new one takes

    def __init__(self, comm, progress, bint cuda):
        self.cuda = cuda   # True: CUDA exists; every call takes the general path, which routes by device
        self.run, self.submit, self.kick = progress.run, progress.submit, progress.kick
        self.check_usable = comm.check_usable
        # (torch's recv fills its whole tensor: a shorter message fails it)
        self.calls = [self._reduce_to_root if call == "reduce_to_root" else
                      functools.partial(comm.irecv, whole=True) if call == "irecv" else getattr(comm, call)
                      for _, _, call, _, _, _, _ in METHODS]
        self.reduce = comm.reduce
        self.size = comm.size
        self.works = [None] * P2P_WORKS
        self.completed = CompletedWork.of()
        self.next_work = 0

    def _reduce_to_root(self, t, op, root):
        self.reduce(t, None, op, root)

    cdef object collective(self, Method m, t, u, opts, outputs):
        """m's call on t (input) and u (output): run now (a CompletedWork), or queued where torch asked for
        async_op (a CollectiveWork); None: the general form takes it: a tensor that isn't contiguous, an
        even split's count the group size doesn't divide, checked first (the communicator's refusal of
        a call counts as the group's call: the general form could not run it again)."""
        cdef int64_t root = 0
        cdef int call, op
        if self.cuda or self.hooked or _profiling() or (m.reals_only and t.is_complex()):
            return None
        if m.even_split and (rows(t) % self.size or rows(u) % self.size):
            return None   # (split by rows, as torch's backends do: the general form says what is wrong)
        if m.blocks and (u.numel() != t.numel() * self.size if m.blocks > 0 else t.numel() != u.numel() * self.size):
            return None   # (the general form says what is wrong, in torch's words)
        call = _read(m.layout, opts, &root)
        if call < 0:
            return None
        op = call >> 1
        fn = self.calls[m.index]
        a = _arg(m.args[0], t, u, op, root)
        b = _arg(m.args[1], t, u, op, root)
        c = _arg(m.args[2], t, u, op, root)
        try:   # (first: a refusal of the communicator's counts as the group's call, not as a fallback)
            if t is not None and not (t.is_contiguous() and (u is None or u.is_contiguous())):
                return None
        except RuntimeError:   # (a sparse CSR tensor has no such property: the general form says so)
            return None
        if call & 1:
            self.check_usable(m.name)
            return CollectiveWork.of(self.submit(fn, (a, b, c)[:m.nargs], m.name, outputs))
        self.run(fn, a, b, c, m.nargs, m.name)
        return self._completed(outputs)

    cdef object message(self, Method m, tensors, peer, tag):
        """m's point-to-point call, posted at once (never queued behind collectives, as the general
        form does); None: the general form takes it."""
        if len(tensors) != 1 or self.cuda or self.hooked or _profiling() or tag < 0:   # (a negative tag: refused there)
            return None
        if _INFLIGHT is not None and _INFLIGHT():   # (its Work is registered for wait_tensor there; reused ones aren't)
            return None
        try:
            return self._p2p_work(self.calls[m.index](tensors[0], peer, tag), tensors)
        except (NotContiguousError, NotDenseError):
            return None

    cdef object _completed(self, outputs):
        # A synchronous call's Work (its outputs as result and future value), reused as _p2p_work's once
        # nothing but this holds it: torch's synchronous calls (dist.*(async_op=False)) come from Python,
        # which waits and drops the Work.
        cdef PyObject *w = <PyObject *>self.completed
        if not _reusable(outputs):
            return CompletedWork.of(outputs)
        if w.ob_refcnt == 1:
            self.completed._outputs = outputs
        else:
            self.completed = CompletedWork.of(outputs)
        return self.completed

    cdef object _p2p_work(self, request, outputs):
        # A pybind Work costs more than the rest of a message's path. The last few made are reused
        # once nothing but this list holds them: torch calls send/recv on a Python group from Python
        # only (dist.send waits and drops its Work; isend/irecv pairs hold two), never keeping a Work
        # in C++ alone.
        cdef Py_ssize_t i
        cdef PyObject *w
        if not _reusable(outputs):
            return PointToPointWork.of(request, outputs, None, self.kick)
        for i in range(P2P_WORKS):
            w = PyList_GET_ITEM(self.works, i)    # borrowed: when 1, the list's reference is the only one
            if w.ob_refcnt == 1 and w != <PyObject *>None:
                work = <object>w
                old = work._request
                if old is not None:
                    old.detach()   # (a Work dropped in flight: its message still goes)
                work.reset(request, outputs, None, self.kick)
                return work
        work = PointToPointWork.of(request, outputs, None, self.kick)
        self.works[self.next_work] = work
        self.next_work = (self.next_work + 1) % P2P_WORKS
        return work


# torch's ProcessGroup takes these also with one tensor where the list form has a list, then the
# options' fields by position or name (torch/_C/_distributed_c10d.pyi): allreduce(tensor, op) for
# allreduce([tensor], AllreduceOptions) (DDP's join calls it so), gather(outputs, input, root, timeout=None)
# for gather([outputs], [input], GatherOptions). Each: its options, which of its tensor arguments is one
# tensor there (None: the lists stay, and a timeout takes the options' place), and the fields that follow.
# The fast path's methods of shape `tensors` take them here (_overload), the adapter's list methods
# through its other_forms.
OTHER_FORMS = {"allreduce": (_c10d.AllreduceOptions, 0, ("op", "timeout")),
               "broadcast": (_c10d.BroadcastOptions, 0, ("root", "timeout")),
               "reduce": (_c10d.ReduceOptions, 0, ("root", "op", "timeout")),
               "allgather": (_c10d.AllgatherOptions, 1, ("timeout",)),
               "gather": (_c10d.GatherOptions, 1, ("root", "timeout")),
               "scatter": (_c10d.ScatterOptions, 0, ("root", "timeout")),
               "reduce_scatter": (_c10d.ReduceScatterOptions, 0, ("op", "timeout")),
               "alltoall": (_c10d.AllToAllOptions, None, ("timeout",))}


def _overload(str name, options, tensors, positional, named):
    """torch's other forms of a group's allreduce, broadcast and reduce as (tensors, options): one
    tensor (`tensor=`) for the list; for the options none (the defaults), or allreduce's reduce op and
    timeout, broadcast's root and timeout, reduce's root, reduce op and timeout, by position or name."""
    tensor = named.pop("tensor")
    if tensors is None:
        tensors = tensor
    cdef bint single = isinstance(tensors, torch.Tensor)
    if single:
        tensors = [tensors]
    if isinstance(positional[0], options) and not any(v is not None for v in positional[1:] + tuple(named.values())):
        return tensors, positional[0]
    wanted = OTHER_FORMS[name][2]
    return tensors, fill_options(options, wanted, positional, named, f"{name}(): takes (tensors, options) or "
                                 f"(tensor, {', '.join(wanted)})", single)


_FIELD_TYPES = {"op": (dist.ReduceOp, dist.ReduceOp.RedOpType), "root": numbers.Integral,
                "timeout": datetime.timedelta}


def fill_options(options, wanted, positional, named, form, bint other_form=False):
    """options() with the fields a c10d method's other form gives after its tensors (wanted: their
    names, of op, root and timeout), by position (positional) or by name (named); None: unset. Anything
    else is refused, with the method's forms (form), as is the other form (other_form) without the root
    it needs (torch's has no default for it)."""
    given = {k: v for k, v in zip(wanted, positional) if v is not None}
    extra = [v for v in positional[len(wanted):] if v is not None] + [k for k, v in named.items() if v is not None
                                                                       and k not in wanted]
    if extra or any(v is not None and k in given for k, v in named.items()):
        raise TypeError(f"{form}; got {extra or named}")
    given.update((k, v) for k, v in named.items() if v is not None)
    if other_form and "root" in wanted and "root" not in given:
        raise TypeError(f"{form}; got no root")
    wrong = [f"{k}={v!r}" for k, v in given.items() if not isinstance(v, _FIELD_TYPES[k])]
    if wrong:
        raise TypeError(f"{form}; got {', '.join(wrong)}")
    opts = options()
    if "op" in given:
        opts.reduceOp = given["op"]
    if "root" in given:
        opts.rootRank = given["root"]
    if "timeout" in given:
        opts.timeout = given["timeout"]
    return opts


def _timed(options, opts, timeout, form):
    """A method's options, given as torch's other form of it gives them: a timeout (a timedelta, by
    position or name) in their place; options of another type (a subclass) are passed on as they are."""
    if isinstance(opts, options) and timeout is None:
        return opts
    return fill_options(options, ("timeout",), (opts,), dict(timeout=timeout), form)


# The fast form of each shape: a c10d method of the group (its first argument), falling back to the
# group's general form of the same method.

def _fast_form(Method m, str shape, str title):
    general = m.general

    if shape == "tensors":
        options = OTHER_FORMS[m.name][0]

        def method(group, tensors=None, opts=None, third=None, fourth=None, *, tensor=None, op=None, root=None,
                   timeout=None):
            if (type(tensors) is not list or type(opts) is not options or third is not None or fourth is not None
                    or tensor is not None or op is not None or root is not None or timeout is not None):
                tensors, opts = _overload(m.name, options, tensors, (opts, third, fourth),
                                          dict(tensor=tensor, op=op, root=root, timeout=timeout))
            if len(tensors) == 1:
                work = (<FastPath?>group._fast).collective(m, tensors[0], None, opts, tensors)
                if work is not None:
                    return work
            return getattr(group, general)(tensors, opts)
    elif shape == "pair":
        def method(group, output, input, opts=None):
            work = (<FastPath?>group._fast).collective(m, input, output, opts, [output])
            return work if work is not None else getattr(group, general)(output, input, opts)
    elif shape == "splits":
        options = _c10d.AllToAllOptions

        def method(group, output, input, output_split_sizes, input_split_sizes, opts=None, *, timeout=None):
            if (opts is not None and type(opts) is not options) or timeout is not None:
                opts = _timed(options, opts, timeout, f"{title}(): takes (output, input, output_split_sizes, "
                              "input_split_sizes, options or timeout)")
            if not output_split_sizes and not input_split_sizes:
                work = (<FastPath?>group._fast).collective(m, input, output, opts, [output])
                if work is not None:
                    return work
            return getattr(group, general)(output, input, output_split_sizes, input_split_sizes, opts)
    elif shape == "none":
        options = _c10d.BarrierOptions

        def method(group, opts=None, *, timeout=None):
            if (opts is not None and type(opts) is not options) or timeout is not None:
                opts = _timed(options, opts, timeout, f"{title}(): takes (options or timeout)")
            work = (<FastPath?>group._fast).collective(m, None, None, opts, [])
            return work if work is not None else getattr(group, general)(opts)
    elif shape == "p2p":
        def method(group, tensors, peer, tag):
            work = (<FastPath?>group._fast).message(m, tensors, peer, tag)
            return work if work is not None else getattr(group, general)(tensors, peer, tag)
    elif shape == "anysource":
        def method(group, tensors, tag):
            work = (<FastPath?>group._fast).message(m, tensors, None, tag)
            return work if work is not None else getattr(group, general)(tensors, tag)
    else:
        raise ValueError(f"unknown shape {shape!r} of c10d method {m.name}")
    method.__name__ = method.__qualname__ = title
    method.__doc__ = f"{title}, compiled; falls back to the group's {general}"
    return method


def methods():
    """{torch's method name: its fast form}, every row of METHODS, to set on the group class."""
    out = {}
    for index, (names, shape, call, arguments, options, name, general) in enumerate(METHODS):
        form = _fast_form(Method(index, call, arguments, options, name, general), shape, names[0])
        for torch_name in names:
            out[torch_name] = form
    return out
