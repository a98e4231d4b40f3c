# dtype and reduce-op tables: names and item sizes (kernels.h has the codes), and the reduce op of
# a (op, dtype) pair, resolved once and cached. The MPI datatypes and ops live in engine._mpi.

DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
               "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
               "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
               "float4_e2m1fn_x2")   # (torch's names: its tensors are looked up by them)
DTYPE_ITEMSIZES = tuple(eng_itemsize[i] for i in range(ENG_NDTYPES))
DTYPE_CODES = {name: i for i, name in enumerate(DTYPE_NAMES)}

# Reduce ops as the Python layer names them; AVG is SUM followed by one division by the group size.
OP_NAMES = ("sum", "product", "min", "max", "band", "bor", "bxor", "avg")
cdef enum:
    OP_AVG = 7
cdef dict _OP_BY_NAME = {name: i for i, name in enumerate(OP_NAMES)}

cdef inline bint _is_float(int dtype) noexcept nogil:
    return ENG_FLOAT16 <= dtype <= ENG_FLOAT64


cdef double avg_before(Call *c, int rank, int size, void **spare, size_t *spare_cap) except -1 nogil:
    """AVG of an allreduce, reduce or reduce_scatter, where its algorithm doesn't divide inside its
    reduction (eng_reduce_many does the same there), divides its input before the sum by the power of
    two at or over the group's size, and the sum by what is left after it (avg_after), so a mean that
    fits its dtype never comes back as an overflowed sum (inf: float16 overflows at 65504; NCCL
    premultiplies too). A power of two divides exactly: wherever the plain sum fits and no input
    divided by it falls below the dtype's normal range (float16: 6.1e-5; such an input keeps fewer
    bits, down to 0 for one under that times 2**-11), the bits are those of summing, then dividing. The
    divided input goes where this rank's result will (an allreduce, a reduce's root) and the call runs
    in place; an input the call must leave as it was (a reduce's elsewhere, a reduce_scatter's) is
    divided into *spare, grown to fit (spare_cap: its bytes), and read from there. Returns the power of
    two, or 0 where c is no such call."""
    cdef double spread
    cdef size_t n = c.count, isz = eng_itemsize[c.dtype], i
    cdef char *divided = c.dst
    if c.red == NULL or not c.red.avg or c.aux != NULL or size < 2:
        return 0.0
    if c.op == OP_REDUCE_SCATTER:
        n = 0
        for i in range(<size_t>size):
            n = max(n, c.displs[i] + c.counts[i])
        divided = NULL
    elif c.op == OP_REDUCE:
        divided = c.dst if rank == c.root else NULL
    elif c.op != OP_ALLREDUCE or c.dst == NULL:
        return 0.0
    if n == 0:
        return 0.0
    if divided == NULL:
        grow(spare, spare_cap, n * isz, 1, "AVG's divided input")
        divided = <char*>spare[0]
    spread = eng_avg_spread(size)
    if c.src != divided:
        memmove(divided, c.src, n * isz)
        c.src = divided
    eng_scale(divided, n, c.dtype, 1.0 / spread, 0)   # (a power of two: its inverse multiplies exactly)
    return spread


cdef void avg_after(Call *c, int size, double spread) noexcept nogil:
    """AVG's division of the sum in c's output: by the size, or by what avg_before left (spread)."""
    if not spread:
        eng_scale(c.dst, c.count, c.dtype, size, 1)
    elif spread != size:
        eng_scale(c.dst, c.count, c.dtype, size / spread, 1)


cdef class Reduction:
    """A reduce op resolved for one dtype: the engine kernel (and, for MPI, which MPI op matches)."""


cdef list _BUILTIN = [None] * ((OP_AVG + 1) * ENG_NDTYPES)   # (op, dtype) -> Reduction, filled on use


cdef void forget_resolved_ops() noexcept:
    """Empties the cache of resolved built-in ops (the kernels changed: engine.kernels.use_isa)."""
    cdef Py_ssize_t i
    for i in range(len(_BUILTIN)):
        _BUILTIN[i] = None


cdef Reduction _builtin(int code, int dtype):
    cdef Reduction red = Reduction.__new__(Reduction)
    cdef int base = ENG_SUM if code == OP_AVG else code
    if dtype >= ENG_FLOAT8_E4M3FN:
        raise ValueError(
            f"reduce op {OP_NAMES[code].upper()} is not supported for dtype {DTYPE_NAMES[dtype]}: the engine moves "
            "8- and 4-bit float formats (all_gather, broadcast, all_to_all, scatter, gather, send/recv) but does "
            "not reduce them; reduce in bfloat16 or float32 and cast the result")
    red.c.dtype = dtype
    red.c.code = base
    if code == OP_AVG:
        if not _is_float(dtype):
            raise ValueError(
                f"reduce op AVG is not defined for {DTYPE_NAMES[dtype]}: it needs a floating dtype; "
                "use SUM and divide, or cast to float first")
        red.c.avg = True
    red.c.fn = eng_reduce_lookup(dtype, base)
    if red.c.fn == NULL:
        raise ValueError(
            f"reduce op {OP_NAMES[base].upper()} is not supported for dtype {DTYPE_NAMES[dtype]}"
            + ("; bitwise ops need an integer or bool dtype" if base >= ENG_BAND else ""))
    return red


cdef Reduction resolve_op(object op, int dtype):
    """op: an int code (engine.ReduceOp), its name, or a user op with ._address(dtype_name)."""
    cdef int code
    cdef Reduction red
    if isinstance(op, int):
        if type(op) is bool:    # (True is int 1, PRODUCT: a flag passed for op, as engine.ops.op_code refuses it)
            raise TypeError(f"op must be an engine.ReduceOp, its name, or a user op made with engine.reduction; "
                            f"got {op!r}")
        if op < 0 or op > OP_AVG:   # (before the C int: a code past one would raise an OverflowError)
            raise ValueError(f"unknown reduce op code {op}; expected one of {OP_NAMES}")
        code = op
        red = _BUILTIN[code * ENG_NDTYPES + dtype]
        if red is None:
            red = _BUILTIN[code * ENG_NDTYPES + dtype] = _builtin(code, dtype)
        return red
    if isinstance(op, str):
        code = _OP_BY_NAME.get(op.lower(), -1)
        if code < 0:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(n.upper() for n in OP_NAMES)} "
                             "or a user op (engine.reduction)")
        return resolve_op(code, dtype)
    if not hasattr(op, "_address"):
        raise TypeError(f"op must be an engine.ReduceOp, its name, or a user op made with engine.reduction; got {op!r}")
    address = op._address(DTYPE_NAMES[dtype])
    if not isinstance(address, int) or address <= 0:   # (it is called as a C function: never a NULL one)
        raise TypeError(f"op {op!r}: _address() gave {address!r}, not a function's address; make user ops with "
                        "engine.reduction")
    red = Reduction.__new__(Reduction)
    red.c.fn = <eng_reduce_fn><void*><size_t>address
    red.c.code = -1
    red.c.dtype = dtype
    red.c.ident = getattr(op, "fingerprint", 1) & 0xffffffff   # (an object of another kind: unchecked)
    red.keep = op
    return red
