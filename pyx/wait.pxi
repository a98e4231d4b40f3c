# Waiting: poll, and between polls back off in three stages: spin (the pause instruction) for a short
# budget while a peer is likely about to answer, then sched_yield() (an oversubscribed core goes to
# whoever needs it), then sleep: shared-memory waits on a futex their peers ring (woken at once, no
# core burnt), MPI waits in naps doubling up to a cap. Once per check interval the wait calls the
# communicator's watch with the GIL (stall warnings, arrival notes, the timeout: it may raise to
# abandon the wait), and a shared-memory wait also asks whether its peers' processes still live.
# Every transport waits only through here, so a peer that never arrives ends in an exception.

cdef extern from *:
    """
    /* Set on threads whose waits should leave the core to others (a progress thread overlapping
       communication with the caller's computation): they spin less before backing off. */
    static __thread int eng_polite_waits;
    """
    int eng_polite_waits

# Seconds; set_wait_policy() changes them (tests, oversubscribed hosts, ENGINE_SPIN_US).
# Measured: a peer's flag arrives within ~1-20 us when both are running, but a step of the segment's
# 512 KB chunks takes 30-100 us; at 50 us, waits yielded mid-step and whole sizes of a sweep ran 4x
# slower in some runs (sched_yield hands the core to any runnable thread for a full slice).
cdef double _spin_s = 250e-6
cdef double _polite_spin_s = 5e-6
cdef double _yield_s = 1e-3
cdef double _nap_max_s = 250e-6
cdef double _alive_interval_s = 0.1


def set_thread_polite(bint polite):
    """Waits on the calling thread spin only briefly before yielding and sleeping when polite: a
    progress thread then leaves the core to the computation it overlaps with."""
    global eng_polite_waits
    eng_polite_waits = polite


def set_wait_policy(spin_us=None, yield_us=None, nap_max_us=None):
    """Process-wide back-off of every wait: spin budget, yield phase, longest sleep (microseconds)."""
    global _spin_s, _yield_s, _nap_max_s, _polite_spin_s
    if spin_us is not None:
        _spin_s = max(0.0, spin_us) * 1e-6
        _polite_spin_s = min(_polite_spin_s, _spin_s)
    if yield_us is not None:
        _yield_s = max(0.0, yield_us) * 1e-6
    if nap_max_us is not None:
        _nap_max_s = max(1.0, nap_max_us) * 1e-6
    return _spin_s * 1e6, _yield_s * 1e6, _nap_max_s * 1e6


cdef void start_wait(WaitCtx *ctx, object hook, double interval) noexcept:
    ctx.hook = <void*>hook if hook is not None else NULL
    ctx.start = eng_now()
    ctx.interval = interval
    ctx.next_check = ctx.start + interval
    ctx.alive = NULL
    ctx.alive_arg = NULL
    ctx.spin = -1


cdef void backoff_init(Backoff *b, double now, WaitCtx *ctx) noexcept nogil:
    cdef double spin = _polite_spin_s if eng_polite_waits else _spin_s
    if ctx != NULL and ctx.spin >= 0 and ctx.spin < spin:
        spin = ctx.spin
    b.spin_until = now + spin
    b.yield_until = b.spin_until + _yield_s
    b.nap = 2e-6
    b.next_alive = now + _alive_interval_s


cdef int call_hook(WaitCtx *ctx, double t) except -1 with gil:
    (<object>ctx.hook)(t - ctx.start)
    return 0


cdef inline bint backoff_asleep(Backoff *b) noexcept nogil:
    """Past spinning and yielding: the wait should sleep (on a futex where it has one)."""
    return eng_now() >= b.yield_until


cdef double backoff_nap(Backoff *b, WaitCtx *ctx) noexcept nogil:
    """How long a futex sleep may last: until the next watch call or liveness check, at most 50 ms."""
    cdef double t = eng_now(), until = t + 0.05
    if ctx != NULL:
        if ctx.hook != NULL:
            until = min(until, ctx.next_check)
        if ctx.alive != NULL:
            until = min(until, b.next_alive)
    return max(until - t, 1e-6)


cdef int backoff_pause(Backoff *b, WaitCtx *ctx) except -1 nogil:
    """One pause between two polls. Returns 0, -1 when the watch raised, or the error code of a
    liveness check (a peer's process is gone)."""
    cdef double t = eng_now()
    if t < b.spin_until:
        eng_cpu_relax()
    elif t < b.yield_until:
        eng_yield()
    else:
        eng_sleep(b.nap)
        if b.nap < _nap_max_s:
            b.nap *= 2
    return backoff_tick(b, ctx, t)


cdef int backoff_tick(Backoff *b, WaitCtx *ctx, double t) except -1 nogil:
    """The watch and the liveness check, when due."""
    cdef int rc
    if ctx != NULL:
        if ctx.hook != NULL and t >= ctx.next_check:
            ctx.next_check = t + ctx.interval
            call_hook(ctx, t)
        if ctx.alive != NULL and t >= b.next_alive:
            b.next_alive = t + _alive_interval_s
            rc = ctx.alive(ctx.alive_arg)
            if rc:
                return rc
    return 0
