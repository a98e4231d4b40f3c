# dtype and reduce-op tables: names, item sizes, MPI datatypes and MPI ops, in one place.

DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
               "float16", "bfloat16", "float32", "float64", "complex64", "complex128")
DTYPE_ITEMSIZES = (1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 8, 16)
cdef size_t ITEMSIZE[15]  # ENG_NDTYPES
ITEMSIZE[:] = DTYPE_ITEMSIZES

# Reduce ops as the Python layer names them; AVG is SUM followed by one division pass.
OP_NAMES = ("sum", "product", "min", "max", "band", "bor", "bxor", "avg")
cdef enum:
    OP_AVG = 7

cdef MPI_Datatype MPI_TYPES[15]  # ENG_NDTYPES
cdef MPI_Op MPI_OPS_STD[7]    # ENG_NOPS, for integers and float32/64
cdef MPI_Op MPI_OPS_BOOL[7]   # the logical twins for bool
cdef MPI_Datatype ENG_MPI_FLOAT16 = MPI_DATATYPE_NULL   # two distinct 2-byte types, so the user-op
cdef MPI_Datatype ENG_MPI_BFLOAT16 = MPI_DATATYPE_NULL  # callback can tell float16 from bfloat16
cdef MPI_Op MPI_HALF_OPS[4]                           # SUM, PRODUCT, MIN, MAX on those two types
cdef MPI_Op MPI_USER_OP = MPI_OP_NULL                 # trampoline to the caller thread's user kernel

cdef extern from *:
    """
    /* The user (Numba) kernel of the collective running on this thread, read by MPI's callback. */
    static __thread eng_reduce_fn eng_current_user_fn;
    """
    eng_reduce_fn eng_current_user_fn

cdef inline int _half_dtype(MPI_Datatype t) noexcept nogil:
    return ENG_FLOAT16 if t == ENG_MPI_FLOAT16 else ENG_BFLOAT16

# MPI user functions compute inoutvec = invec (op) inoutvec.
cdef void _mpi_half_sum(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_half_dtype(t[0]), ENG_SUM)(inoutv, inv, inoutv, n[0])
cdef void _mpi_half_prod(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_half_dtype(t[0]), ENG_PRODUCT)(inoutv, inv, inoutv, n[0])
cdef void _mpi_half_min(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_half_dtype(t[0]), ENG_MIN)(inoutv, inv, inoutv, n[0])
cdef void _mpi_half_max(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_half_dtype(t[0]), ENG_MAX)(inoutv, inv, inoutv, n[0])
cdef void _mpi_user(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_current_user_fn(inoutv, inv, inoutv, n[0])

cdef int _init_mpi_tables() except -1:
    global ENG_MPI_FLOAT16, ENG_MPI_BFLOAT16, MPI_USER_OP
    check(MPI_Type_contiguous(2, MPI_BYTE, &ENG_MPI_FLOAT16), "MPI_Type_contiguous")
    check(MPI_Type_commit(&ENG_MPI_FLOAT16), "MPI_Type_commit")
    check(MPI_Type_contiguous(2, MPI_BYTE, &ENG_MPI_BFLOAT16), "MPI_Type_contiguous")
    check(MPI_Type_commit(&ENG_MPI_BFLOAT16), "MPI_Type_commit")
    MPI_TYPES[ENG_BOOL] = MPI_C_BOOL
    MPI_TYPES[ENG_INT8] = MPI_INT8_T
    MPI_TYPES[ENG_UINT8] = MPI_UINT8_T
    MPI_TYPES[ENG_INT16] = MPI_INT16_T
    MPI_TYPES[ENG_UINT16] = MPI_UINT16_T
    MPI_TYPES[ENG_INT32] = MPI_INT32_T
    MPI_TYPES[ENG_UINT32] = MPI_UINT32_T
    MPI_TYPES[ENG_INT64] = MPI_INT64_T
    MPI_TYPES[ENG_UINT64] = MPI_UINT64_T
    MPI_TYPES[ENG_FLOAT16] = ENG_MPI_FLOAT16
    MPI_TYPES[ENG_BFLOAT16] = ENG_MPI_BFLOAT16
    MPI_TYPES[ENG_FLOAT32] = MPI_FLOAT
    MPI_TYPES[ENG_FLOAT64] = MPI_DOUBLE
    MPI_TYPES[ENG_COMPLEX64] = MPI_C_FLOAT_COMPLEX
    MPI_TYPES[ENG_COMPLEX128] = MPI_C_DOUBLE_COMPLEX
    MPI_OPS_STD[:] = [MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR]
    MPI_OPS_BOOL[:] = [MPI_LOR, MPI_LAND, MPI_LAND, MPI_LOR, MPI_LAND, MPI_LOR, MPI_LXOR]
    check(MPI_Op_create(_mpi_half_sum, 1, &MPI_HALF_OPS[0]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_half_prod, 1, &MPI_HALF_OPS[1]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_half_min, 1, &MPI_HALF_OPS[2]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_half_max, 1, &MPI_HALF_OPS[3]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_user, 1, &MPI_USER_OP), "MPI_Op_create")
    return 0

cdef inline bint _is_int(int dtype) noexcept nogil:
    return ENG_INT8 <= dtype <= ENG_UINT64

cdef inline bint _is_float(int dtype) noexcept nogil:
    return ENG_FLOAT16 <= dtype <= ENG_FLOAT64


cdef class Reduction:
    """A reduce op resolved for one dtype: the engine kernel and the matching MPI op."""
    cdef eng_reduce_fn fn       # engine kernel (ring, recursive doubling)
    cdef MPI_Op mpi_op          # for the native MPI collectives
    cdef bint user              # MPI_USER_OP: set eng_current_user_fn before the MPI call
    cdef bint avg               # divide by the group size afterwards
    cdef int dtype
    cdef object keep            # keeps a user op's compiled code alive

    cdef inline void arm(self) noexcept nogil:
        global eng_current_user_fn
        if self.user:
            eng_current_user_fn = self.fn


cdef MPI_Op _mpi_builtin_op(int dtype, int code) noexcept:
    if dtype == ENG_BOOL:
        return MPI_OPS_BOOL[code]
    if dtype == ENG_FLOAT16 or dtype == ENG_BFLOAT16:
        return MPI_HALF_OPS[code]
    return MPI_OPS_STD[code]


cdef Reduction resolve_op(object op, int dtype):
    """Resolves op (an int code from OP_NAMES, or a user op with ._address(dtype_name))."""
    cdef Reduction red = Reduction.__new__(Reduction)
    cdef int code
    cdef size_t addr
    red.dtype = dtype
    if isinstance(op, int):
        code = op
        if code == OP_AVG:
            if not _is_float(dtype):
                raise ValueError(
                    f"reduce op AVG is not defined for {DTYPE_NAMES[dtype]}: it needs a floating dtype; "
                    "use SUM and divide, or cast to float first")
            red.avg = True
            code = ENG_SUM
        if code < 0 or code >= ENG_NOPS:
            raise ValueError(f"unknown reduce op code {op}; expected one of {OP_NAMES}")
        red.fn = eng_reduce_lookup(dtype, code)
        if red.fn == NULL:
            raise ValueError(
                f"reduce op {OP_NAMES[code].upper()} is not supported for dtype {DTYPE_NAMES[dtype]}"
                + ("; bitwise ops need an integer or bool dtype" if code >= ENG_BAND else ""))
        red.mpi_op = _mpi_builtin_op(dtype, code)
        return red
    addr = op._address(DTYPE_NAMES[dtype])
    red.fn = <eng_reduce_fn><void*>addr
    red.mpi_op = MPI_USER_OP
    red.user = True
    red.keep = op
    return red
