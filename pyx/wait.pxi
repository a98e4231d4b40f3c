# Waiting with a watch: MPI_Test in a loop, and once per check interval a call into Python (the
# communicator's watch: stall warnings, arrival notes, the timeout) that may raise to abandon the wait.
# Engine-owned schedules (the ring, recursive doubling, point-to-point) wait only through here, so a
# peer that never arrives ends in an exception instead of a hang.

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, nanosleep, timespec

cdef extern from *:
    """
    /* Set on threads whose waits should leave the core to others (a progress thread overlapping
       communication with the caller's computation): they sleep between polls after a short spin. */
    static __thread int eng_polite_waits;
    """
    int eng_polite_waits


def set_thread_polite(bint polite):
    """Waits on the calling thread sleep between MPI polls (after ~50 us of spinning) when polite:
    a progress thread then leaves the core to the computation it overlaps with."""
    global eng_polite_waits
    eng_polite_waits = polite


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef struct WaitCtx:
    void *hook          # a Python callable hook(elapsed_seconds), borrowed; NULL: plain MPI_Wait
    double start        # when the operation began
    double interval     # seconds between hook calls
    double next_check


cdef int call_hook(WaitCtx *ctx, double t) except -1 with gil:
    (<object>ctx.hook)(t - ctx.start)
    return 0


cdef int wait_req(MPI_Request *req, WaitCtx *ctx) except -1 nogil:
    """0 when *req completed, a positive MPI error code, or -1 with the hook's exception set."""
    return wait_req_status(req, MPI_STATUS_IGNORE, ctx)


cdef int wait_req_status(MPI_Request *req, MPI_Status *status, WaitCtx *ctx) except -1 nogil:
    cdef int flag = 0, ierr
    cdef double t, spin_until = 0
    cdef timespec nap
    nap.tv_sec = 0
    nap.tv_nsec = 20000
    if ctx == NULL or ctx.hook == NULL:
        return MPI_Wait(req, status)
    while True:
        ierr = MPI_Test(req, &flag, status)
        if ierr or flag:
            return ierr
        t = monotonic()
        if eng_polite_waits:
            if spin_until == 0:
                spin_until = t + 50e-6
            elif t > spin_until:
                nanosleep(&nap, NULL)
        if t >= ctx.next_check:
            ctx.next_check = t + ctx.interval
            call_hook(ctx, t)


cdef int wait_all(MPI_Request *reqs, size_t n, WaitCtx *ctx) except -1 nogil:
    cdef size_t i
    cdef int ierr
    for i in range(n):
        ierr = wait_req(&reqs[i], ctx)
        if ierr:
            return ierr
    return 0
