# A user (Numba) op that raises: Numba can't carry the exception out of the compiled kernel, whose loop
# ends at that element. The generated kernel (engine/udf.py) calls eng_user_op_raised() there instead,
# linked by its symbol; the calls that ran a user op read the count before and after, and raise.

cdef extern from *:
    """
    /* How many times a user kernel's function raised in this process (any thread: a team's, MPI's). */
    static uint64_t eng_user_raises;
    static void eng_user_op_raised(void) { __atomic_add_fetch(&eng_user_raises, 1, __ATOMIC_RELAXED); }
    static uint64_t eng_user_op_raises(void) { return __atomic_load_n(&eng_user_raises, __ATOMIC_RELAXED); }
    """
    void eng_user_op_raised() noexcept nogil
    uint64_t eng_user_op_raises() noexcept nogil


def user_op_raised_address():
    """The address of what a user kernel calls where its function raised (engine/udf.py links it)."""
    return <size_t><void*>eng_user_op_raised


cdef int user_op_check(Reduction red, uint64_t before, str what) except -1:
    """A local reduction (reduce_into): raises where its user op raised since eng_user_op_raises() read
    `before`, which left the rest of the output unreduced."""
    if red.c.code < 0 and eng_user_op_raises() != before:
        raise RuntimeError(_raised_text(red, what, None))
    return 0


cdef int user_op_agree(CoreComm comm, Reduction red, uint64_t before, str what) except -1:
    """After a collective with a user op: where its function raised on some rank, the result is
    incomplete wherever that rank's part flowed. So every rank learns which ranks saw a raise (an
    allreduce of one flag a rank, after each call with a user op) and raises alike, naming them."""
    if red.c.code >= 0:
        return 0
    cdef uint64_t seq = comm.log.seq   # (the call's number: the flags' allreduce takes the next)
    flags = array.array("i", bytes(4 * comm.size))
    flags[comm.rank] = eng_user_op_raises() != before
    if comm.size > 1:
        comm.allreduce(flags, op=ENG_MAX)
    ranks = [q for q in range(comm.size) if flags[q]]
    if ranks:
        raise RuntimeError(_raised_text(red, f"{what} #{seq}", ranks))
    return 0


cdef str _raised_text(Reduction red, str what, list ranks):
    where = "" if ranks is None else f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return (f"{what}: the user reduction {red.keep!r} raised{where} (Numba can't carry the exception out of "
            "its compiled kernel: call the op's .fn on the same values in Python to see it), so the kernel's loop "
            "ended early and the result is incomplete" + ("" if ranks is None else " on every rank")
            + "; make the function return a value for every input")
