# Waiting: one loop, wait_until(), for every wait of every transport (a posted request, a peer's step
# flag, MPI's own request, a TCP socket). A transport that sleeps in its own poll (TCP) yields only
# briefly first, _doze_yield_s: a reply due within it comes sooner than the scheduler wakes a sleeper on
# a busy core, but yielding longer keeps a rank runnable while the kernel's network processing needs
# the core. The watch and the peers' liveness are checked when due, so a peer that never arrives ends
# in an exception, whatever the transport.

cdef extern from *:
    """
    /* Set on threads whose waits should leave the core to others (a progress thread overlapping
       communication with the caller's computation): they spin less before backing off. */
    static __thread int eng_polite_waits;
    """
    int eng_polite_waits

# Seconds (a communicator's set_spin() sets its own spin budget: ENGINE_SPIN_US).
# The spin budget outlasts a whole step of the segment's chunks: a wait that yields in the middle of
# a step hands the core to any runnable thread for a full slice, stalling the peers that wait on it.
cdef double _spin_s = 250e-6
cdef double _polite_spin_s = 5e-6
cdef double _yield_s = 1e-3
cdef double _nap_max_s = 250e-6
cdef double _doze_yield_s = 100e-6     # a transport that sleeps in its own poll yields this long first
cdef double _alive_interval_s = 0.1
cdef double _side_nap_s = 1e-3          # the longest sleep while another channel's messages need moving


def set_thread_polite(bint polite):
    """Waits on the calling thread spin only briefly before yielding and sleeping when polite: a
    progress thread then leaves the core to the computation it overlaps with."""
    global eng_polite_waits
    eng_polite_waits = polite


cdef struct Backoff:
    double spin_until   # spin (pause instruction) until then,
    double yield_until  # then sched_yield() until then,
    double nap          # then sleep, doubling up to a cap
    double next_alive
    bint side_busy      # ctx.side asked to be called again soon


cdef void start_wait(WaitCtx *ctx, object hook, double interval) noexcept:
    ctx.hook = <void*>hook if hook is not None else NULL
    ctx.start = eng_now()
    ctx.interval = interval
    ctx.next_check = ctx.start + interval
    ctx.alive = NULL
    ctx.alive_arg = NULL
    ctx.spin = -1
    ctx.abort = NULL
    ctx.busy_poll = False
    ctx.side = NULL
    ctx.side_arg = NULL


cdef double spin_budget(double group_spin) noexcept nogil:
    """Seconds a wait on this thread spins before yielding: the group's own budget (ENGINE_SPIN_US, or 0
    where its ranks fill the cores), else the process's; a polite thread never spins longer than its own."""
    cdef double spin = group_spin if group_spin >= 0 else _spin_s
    return min(spin, _polite_spin_s) if eng_polite_waits else spin


cdef void backoff_init(Backoff *b, double now, WaitCtx *ctx) noexcept nogil:
    b.spin_until = now + spin_budget(ctx.spin if ctx != NULL else -1)
    b.yield_until = b.spin_until + _yield_s
    if ctx != NULL and ctx.busy_poll:
        b.yield_until = INFINITY   # a sleeping poller stalls the transfer: yield the core, as MPI's own waits do
    b.nap = 2e-6
    b.next_alive = now + _alive_interval_s
    b.side_busy = False


def _signal_handlers_run(double elapsed):
    """The hook of a wait without a watch on a thread that may be the main one (a group's connecting): a
    signal's handler (an abort()) runs there only when that thread runs Python, or is asked to, here."""
    PyErr_CheckSignals()


cdef int call_hook(WaitCtx *ctx, double t) except -1 with gil:
    (<object>ctx.hook)(t - ctx.start)
    return 0


cdef double backoff_nap(Backoff *b, WaitCtx *ctx) noexcept nogil:
    """How long one sleep may last: until the next watch call or liveness check, at most 50 ms
    (a futex sleep), and at most the nap that doubles up to _nap_max_s (without one)."""
    cdef double t = eng_now(), until = t + 0.05
    if ctx != NULL:
        if ctx.hook != NULL:
            until = min(until, ctx.next_check)
        if ctx.alive != NULL:
            until = min(until, b.next_alive)
    if b.side_busy:
        until = min(until, t + _side_nap_s)
    return max(until - t, 1e-6)


cdef int backoff_tick(Backoff *b, WaitCtx *ctx, double t) except -1 nogil:
    """The abort flag (every round past the spin: abort() must end a wait soon, whatever the wait sleeps
    on; a spinning wait leaves the flag unread, at most the spin budget), the other channel's messages
    (ctx.side, on the same rounds), then the watch and the liveness check, when due."""
    cdef int rc
    if ctx != NULL:
        if ctx.abort != NULL and t >= b.spin_until and eng_load32(ctx.abort):
            return ENG_ERR_ABORTED
        if ctx.side != NULL and t >= b.spin_until:
            b.side_busy = ctx.side(ctx.side_arg)
        if ctx.hook != NULL and t >= ctx.next_check:
            ctx.next_check = t + ctx.interval
            call_hook(ctx, t)
        if ctx.alive != NULL and t >= b.next_alive:
            b.next_alive = t + _alive_interval_s
            rc = ctx.alive(ctx.alive_arg)
            if rc:
                return rc
    return 0


cdef uint32_t doze_begin(Doorbell *d) noexcept nogil:
    """Marks this rank asleep on its doorbell; the caller checks its condition once more, then doze_end()s.
    (A count: the rank's threads share the doorbell, and one waking must not unmark another still asleep.)"""
    cdef uint32_t seq = eng_load32(d.bell)
    if d.asleep != NULL:
        eng_add32(d.asleep)
    return seq


cdef void doze_end(Doorbell *d, uint32_t seq, bint sleep, double seconds) noexcept nogil:
    """Sleeps (unless told not to) until the bell moves from seq or seconds pass."""
    if sleep:
        if d.doze != NULL:
            d.doze(d.doze_obj, seq, seconds)
        else:
            eng_futex_wait(d.bell, seq, seconds)
    if d.asleep != NULL:
        eng_sub32(d.asleep)


cdef int wait_until(poll_fn poll, void *obj, void *arg, WaitCtx *ctx, Doorbell *door) except -1 nogil:
    """The one wait of the engine: polls until poll says done (or returns an error code), backing
    off between polls: spin, yield, then sleep, on door where there is one (its futex: a publisher
    rings it, the asleep mark and the publication ordered by full fences; or its transport's doze,
    which returns at once once the bell moved from what it read before the last poll: either way no
    wake-up is lost), else in naps. The watch and the liveness check run when due. Returns 0, -1
    (the watch raised) or an error code."""
    cdef bint done = False
    cdef int ierr = poll(obj, arg, &done)
    cdef Backoff b
    cdef double t
    cdef uint32_t seq
    if ierr or done:
        return ierr
    backoff_init(&b, eng_now(), ctx)
    if door != NULL and door.doze != NULL:
        b.yield_until = b.spin_until + min(_yield_s, _doze_yield_s)
    while True:
        t = eng_now()
        if t < b.spin_until:
            eng_cpu_relax()
        elif t < b.yield_until:
            eng_yield()
        elif door != NULL:
            seq = doze_begin(door)
            ierr = poll(obj, arg, &done)
            doze_end(door, seq, not (ierr or done), backoff_nap(&b, ctx))
            if ierr or done:
                return ierr
            t = eng_now()
        else:
            eng_sleep(min(b.nap, backoff_nap(&b, ctx)))
            if b.nap < _nap_max_s:
                b.nap *= 2
        ierr = backoff_tick(&b, ctx, t)
        if ierr == ENG_ERR_PEER_DEAD or ierr == ENG_ERR_PEER_LEFT:
            # a peer that ended after doing its part: what it published before it went counts
            if poll(obj, arg, &done) == 0 and done:
                return 0
        if ierr:
            return ierr
        ierr = poll(obj, arg, &done)
        if ierr or done:
            return ierr
