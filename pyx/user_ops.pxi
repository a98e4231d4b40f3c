# A user (Numba) op that raises: Numba can't carry the exception out of the compiled kernel, whose loop
# ends at that element. The generated kernel (engine/udf.py) calls eng_user_op_raised() there instead,
# linked by its symbol, and it counts on the counter of the call it ran for: a call that ran a user op
# watches its counter (raise_watch_begin/end) and raises, alone or with its group's other ranks.

cdef extern from *:
    """
    /* A raise counts on the counter of the call whose kernel ran it (team.h's eng_raise_counter). One in a
     * thread that runs no call's kernels (an MPI library's own thread, say) counts here, and every call
     * with a user op running then takes it as its own: a spurious error rather than a wrong result. */
    static uint64_t eng_unowned_raises;
    static void eng_user_op_raised(void) {
      uint64_t *c = eng_raise_counter;
      __atomic_add_fetch(c ? c : &eng_unowned_raises, 1, __ATOMIC_RELAXED);
    }
    static uint64_t eng_unowned_user_op_raises(void) {
      return __atomic_load_n(&eng_unowned_raises, __ATOMIC_RELAXED);
    }
    """
    void eng_user_op_raised() noexcept nogil
    uint64_t eng_unowned_user_op_raises() noexcept nogil


cdef void raise_watch_begin(RaiseWatch *w, bint on) noexcept nogil:
    """on: counts the raises of the user kernels this thread runs, and its team's helpers run for it, in w
    until raise_watch_end(w), which must follow (in a finally), with w where it is (a call's local). A
    call without a user op watches nothing: a hierarchy's stages count for the call that runs them."""
    w.on, w.raised, w.own = on, False, 0
    if on:
        w.unowned = eng_unowned_user_op_raises()
        w.outer = eng_raise_counter_swap(&w.own)


cdef void raise_watch_end(RaiseWatch *w) noexcept nogil:
    """Puts the thread's counter back; w.raised: whether a user kernel raised since raise_watch_begin(w)."""
    if w.on:
        eng_raise_counter_swap(w.outer)
        w.raised = w.own != 0 or eng_unowned_user_op_raises() != w.unowned   # (helpers' adds precede the join)


def user_op_raised_address():
    """The address of what a user kernel calls where its function raised (engine/udf.py links it)."""
    return <size_t><void*>eng_user_op_raised


cdef int user_op_check(Reduction red, bint raised, str what) except -1:
    """A local reduction (reduce_into): raises where its user op raised (RaiseWatch.raised), which left
    the rest of the output unreduced."""
    if raised:
        raise RuntimeError(_raised_text(red, what, None))
    return 0


cdef int user_op_agree(CoreComm comm, Reduction red, bint raised, str what) except -1:
    """After a collective with a user op: where its function raised on some rank, the result is
    incomplete wherever that rank's part flowed. So every rank learns which ranks saw a raise (an
    allreduce of one flag a rank, after each call with a user op) and raises alike, naming them."""
    cdef uint64_t seq = comm.log.seq   # (the call's number: the flags' allreduce takes the next)
    flags = array.array("i", bytes(4 * comm.size))
    flags[comm.rank] = raised
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
