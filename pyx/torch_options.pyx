"""torch's AllreduceOptions read in one C call: the reduce op and asyncOp of the latency path.

Through pybind11, `hash(opts.reduceOp)` and `opts.asyncOp` cost ~0.4 us per call (a wrapper object
and a keep-alive for the first), a third of what the adapter adds to an engine allreduce. pybind11
keeps a simple class's C++ object behind a pointer just after the PyObject header; this module reads
the two fields there, at offsets found and checked at import against pybind's own getters for every
op and both asyncOp values. Where torch's layout differs (another version, another ABI), nothing is
enabled and the adapter reads the options through pybind as before."""

from cpython.object cimport PyObject

cdef extern from *:
    """
    static inline const unsigned char *eng_pybind_value(PyObject *o) {
        /* pybind11's `instance`: PyObject_HEAD, then simple_value_holder[0], the C++ object */
        return *(const unsigned char *const *)((const char *)o + sizeof(PyObject));
    }
    """
    const unsigned char *eng_pybind_value(PyObject *o)

cdef object _type = None         # exactly torch's AllreduceOptions (a subclass could add a layout)
cdef Py_ssize_t _op_at = 0, _async_at = 0
cdef signed char _engine_op[256]  # torch's RedOpType code -> engine op code, -1: not on the fast path


def allreduce_call(opts):
    """engine op * 2 + asyncOp for torch's AllreduceOptions, or -1 (not readable here, or an op the
    fast path leaves to the general one: PREMUL_SUM)."""
    if type(opts) is not _type:
        return -1
    cdef const unsigned char *p = eng_pybind_value(<PyObject *>opts)
    cdef int op = _engine_op[p[_op_at]]
    if op < 0:
        return -1
    return op * 2 + (p[_async_at] != 0)


def enable(opts_type, by_code):
    """Finds and checks the two fields' offsets; by_code[torch code] is the engine op (or None).
    Returns whether the fast read is on."""
    global _type, _op_at, _async_at
    import datetime
    _type = None
    cdef int i
    for i in range(256):
        _engine_op[i] = -1
    samples = []
    for code, op in enumerate(by_code):
        if op is None:
            continue
        for asynchronous in (False, True):
            for minutes in (1, 77):
                o = opts_type()
                o.reduceOp = _torch_op(code)
                o.asyncOp = asynchronous
                o.timeout = datetime.timedelta(minutes=minutes)
                samples.append((o, int(o.reduceOp.op), bool(o.asyncOp)))
    if not samples or len({s[1] for s in samples}) < 2:
        return False
    # Both fields lie in the struct's first 48 bytes (ReduceOp: vtable, refcounts, the op code and a
    # pointer; then the timeout; then asyncOp), and the struct is at least that large.
    for op_at in range(48):
        if not all(eng_pybind_value(<PyObject *>o)[op_at] == code for o, code, _ in samples):
            continue
        for async_at in range(48):
            if async_at != op_at and all((eng_pybind_value(<PyObject *>o)[async_at] != 0) == a
                                         for o, _, a in samples):
                _op_at, _async_at = op_at, async_at
                for code, op in enumerate(by_code):
                    if op is not None:
                        _engine_op[code] = int(op)
                _type = opts_type
                return True
    return False


def _torch_op(code):
    from torch.distributed import ReduceOp
    for name, member in ReduceOp.RedOpType.__members__.items():
        if int(member) == code and name != "PREMUL_SUM":
            return getattr(ReduceOp, name)
    return ReduceOp.SUM
