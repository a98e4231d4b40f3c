# MPI's view of the engine's dtypes and reduce ops, in one place: the MPI datatype of each dtype,
# the MPI op of each (op, dtype), and MPI user ops for what MPI cannot reduce itself (float16,
# bfloat16, Numba user ops) or does not reduce right, which call the engine's own kernels. Open MPI
# 5.0.11's op/avx component sums 8- and 16-bit integers with saturating instructions (uint8 253 + 3
# + 2 gives 255, not 2) once a message is a few hundred bytes long: their SUM and PRODUCT go through
# the engine's kernels, which wrap as C and torch do (the conformance matrix caught it). Its
# MPI_MIN/MPI_MAX of float32/64 keep a NaN only where it is the accumulator's, not the incoming
# operand's (a rank's NaN vanished): they go through the engine's kernels too, which keep it.

cdef MPI_Datatype MPI_TYPES[ENG_NDTYPES]
cdef MPI_Op MPI_OPS_STD[7]    # ENG_NOPS, for integers and float32/64
cdef MPI_Op MPI_OPS_BOOL[7]   # the logical twins for bool
cdef MPI_Datatype ENG_MPI_FLOAT16 = MPI_DATATYPE_NULL   # two distinct 2-byte types, so the user-op
cdef MPI_Datatype ENG_MPI_BFLOAT16 = MPI_DATATYPE_NULL  # callback can tell float16 from bfloat16
cdef MPI_Op MPI_ENGINE_OPS[4]                         # SUM, PRODUCT, MIN, MAX by the engine's kernels
cdef MPI_Op MPI_USER_OP = MPI_OP_NULL                 # trampoline to the caller thread's user kernel

cdef extern from *:
    """
    /* The user (Numba) kernel of the collective running on this thread, read by MPI's callback. */
    static __thread eng_reduce_fn eng_current_user_fn;
    """
    eng_reduce_fn eng_current_user_fn

cdef inline int _engine_dtype(MPI_Datatype t) noexcept nogil:
    """The engine dtype of an MPI datatype an engine op is used with."""
    if t == ENG_MPI_FLOAT16:
        return ENG_FLOAT16
    if t == ENG_MPI_BFLOAT16:
        return ENG_BFLOAT16
    if t == MPI_INT8_T:
        return ENG_INT8
    if t == MPI_UINT8_T:
        return ENG_UINT8
    if t == MPI_INT16_T:
        return ENG_INT16
    if t == MPI_FLOAT:
        return ENG_FLOAT32
    if t == MPI_DOUBLE:
        return ENG_FLOAT64
    return ENG_UINT16

# MPI user functions compute inoutvec = invec (op) inoutvec.
cdef void _mpi_eng_sum(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_engine_dtype(t[0]), ENG_SUM)(inoutv, inv, inoutv, n[0])
cdef void _mpi_eng_prod(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_engine_dtype(t[0]), ENG_PRODUCT)(inoutv, inv, inoutv, n[0])
cdef void _mpi_eng_min(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_engine_dtype(t[0]), ENG_MIN)(inoutv, inv, inoutv, n[0])
cdef void _mpi_eng_max(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_reduce_lookup(_engine_dtype(t[0]), ENG_MAX)(inoutv, inv, inoutv, n[0])
cdef void _mpi_user(void *inv, void *inoutv, int *n, MPI_Datatype *t) noexcept nogil:
    eng_current_user_fn(inoutv, inv, inoutv, n[0])

cdef int _init_mpi_tables() except -1:
    global ENG_MPI_FLOAT16, ENG_MPI_BFLOAT16, MPI_USER_OP
    check(MPI_Type_contiguous(2, MPI_BYTE, &ENG_MPI_FLOAT16), "MPI_Type_contiguous")
    check(MPI_Type_commit(&ENG_MPI_FLOAT16), "MPI_Type_commit")
    check(MPI_Type_contiguous(2, MPI_BYTE, &ENG_MPI_BFLOAT16), "MPI_Type_contiguous")
    check(MPI_Type_commit(&ENG_MPI_BFLOAT16), "MPI_Type_commit")
    # In the order of enum eng_dtype (kernels.h): bool, int8 .. uint64, float16, bfloat16, float32 .. complex128,
    # then the 8- and 4-bit float formats, which only move (bytes)
    MPI_TYPES[:] = [MPI_C_BOOL, MPI_INT8_T, MPI_UINT8_T, MPI_INT16_T, MPI_UINT16_T, MPI_INT32_T, MPI_UINT32_T,
                    MPI_INT64_T, MPI_UINT64_T, ENG_MPI_FLOAT16, ENG_MPI_BFLOAT16, MPI_FLOAT, MPI_DOUBLE,
                    MPI_C_FLOAT_COMPLEX, MPI_C_DOUBLE_COMPLEX, MPI_BYTE, MPI_BYTE, MPI_BYTE, MPI_BYTE, MPI_BYTE, MPI_BYTE]
    MPI_OPS_STD[:] = [MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR]
    MPI_OPS_BOOL[:] = [MPI_LOR, MPI_LAND, MPI_LAND, MPI_LOR, MPI_LAND, MPI_LOR, MPI_LXOR]
    check(MPI_Op_create(_mpi_eng_sum, 1, &MPI_ENGINE_OPS[0]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_eng_prod, 1, &MPI_ENGINE_OPS[1]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_eng_min, 1, &MPI_ENGINE_OPS[2]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_eng_max, 1, &MPI_ENGINE_OPS[3]), "MPI_Op_create")
    check(MPI_Op_create(_mpi_user, 1, &MPI_USER_OP), "MPI_Op_create")
    return 0


cdef inline MPI_Op mpi_op(RedC *red) noexcept nogil:
    """The MPI op of a resolved reduction; for user ops it also arms this thread's trampoline."""
    global eng_current_user_fn
    if red.code < 0:
        eng_current_user_fn = red.fn
        return MPI_USER_OP
    if red.dtype == ENG_BOOL:
        return MPI_OPS_BOOL[red.code]
    if red.dtype == ENG_FLOAT16 or red.dtype == ENG_BFLOAT16:
        return MPI_ENGINE_OPS[red.code]
    if ENG_INT8 <= red.dtype <= ENG_UINT16 and red.code <= ENG_PRODUCT:   # MPI's may saturate (above)
        return MPI_ENGINE_OPS[red.code]
    if (red.dtype == ENG_FLOAT32 or red.dtype == ENG_FLOAT64) and (red.code == ENG_MIN or red.code == ENG_MAX):
        return MPI_ENGINE_OPS[red.code]   # (MPI's lose a NaN: above)
    return MPI_OPS_STD[red.code]


cdef int check(int ierr, str what) except -1:
    if ierr == 0:
        return 0
    raise EngineError(f"{what} failed: {mpi_error_text(ierr)}")


cdef str mpi_error_text(int ierr):
    cdef int cls = ierr, n = 0
    cdef char msg[512]
    MPI_Error_class(ierr, &cls)
    if cls == MPI_ERR_TRUNCATE:
        return ("message truncated: a peer sent more elements than the receive buffer holds; the buffer sizes "
                "on the ranks do not match")
    if MPI_Error_string(ierr, msg, &n) != 0:
        return f"MPI error {ierr}"
    return msg[:n].decode(errors="replace")
