# The transport seam: what the engine's algorithms may ask of a transport. Byte messages to a peer
# rank with a tag are posted (isend / irecv) into a caller-owned Req, then tested, waited on (through
# the back-off and the watch) or cancelled. MPI (engine._mpi.MpiTransport) and shared memory
# (ShmTransport below) implement it; no algorithm calls either directly.
#
# Return values: 0, -1 with a Python exception set (the watch raised), or a positive error code that
# error_text() explains (MPI's own codes, or the ENG_ERR_* codes of _core.pxd).


cdef int nudge_transport(void *tp) noexcept nogil:
    """A WaitCtx's side: Transport.nudge of tp (borrowed: its communicator holds it)."""
    return (<Transport>tp).nudge()


cdef int drive_transport(void *tp, double seconds) noexcept nogil:
    """What a progress thread with nothing to run calls on its group's user channel (CoreComm.driver):
    the messages the user left in flight there move while the rank computes or waits outside the
    engine (Gloo's own threads move them), so a peer blocked on one is not held up by this rank's
    Python. Moves them now (Transport.in_flight), unless a thread waits on the channel; where some are
    still under way, naps for seconds (never on the channel's own wake-ups: sleeping in TCP's poll, or
    on the shared segment's doorbell, would take them from the waits of the rank's own threads).
    Returns in_flight()'s answer: 0 none under way, 2 some moved (the caller naps less), 1 neither. tp is
    borrowed: the progress thread holds its transport and ends before the transport is released
    (torchbridge's CpuDevice.shutdown)."""
    cdef int busy = 1
    if not eng_load32(&(<Transport>tp).waiting):   # (a wait on the channel moves it: this would only contend)
        busy = (<Transport>tp).in_flight()
    if busy:
        eng_sleep(seconds)
    return busy


cdef class Transport:
    """Abstract: subclasses implement isend, irecv, test and cancel."""

    cdef int isend(self, const void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int irecv(self, void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int test(self, Req *req, bint *done, Status *st) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int cancel(self, Req *req) noexcept nogil:
        """Best effort: afterwards the request is inactive and the transport no longer touches its
        buffer, or (a send already under way) the transport keeps what it needs itself."""
        return 0

    cdef int wait(self, Req *req, Status *st, WaitCtx *ctx) except -1 nogil:
        cdef RequestWait w
        if not req_active(req):
            return 0
        w.req, w.st = req, st
        if ctx != NULL and ctx.side_arg == <void*>self:
            ctx.side = NULL   # (its polls move this channel: nudging it too would only cut the sleeps short)
        return wait_until(_poll_request, <void*>self, &w, ctx, self.door)

    cdef void cancel_all(self, Req *reqs, size_t n) noexcept nogil:
        cdef size_t i
        for i in range(n):
            if req_active(&reqs[i]):
                self.cancel(&reqs[i])

    cdef void begin_call(self, int base) noexcept nogil:
        """The collective about to run adds base to its tags (pyx/call_tags.h; 0: none runs)."""
        self.tag_base = base

    cdef int nudge(self) noexcept nogil:
        """Moves this channel's messages in flight now, unless another thread is moving them, without
        waiting; returns whether it must be called again soon (nothing else would wake the wait that
        calls it). The waits of a group's collectives call it on the user's channel: a send or a
        receive the user posted goes on while this rank waits in a collective, as MPI's progress rule
        asks, since a peer may wait for that message before it joins the collective. A transport whose
        data moves by itself (MPI's) has nothing to do."""
        return 0

    cdef int in_flight(self) noexcept nogil:
        """Moves this channel's messages now, unless another thread is moving them, without waiting;
        returns whether a message posted here still needs this rank (a send not all written, a receive
        whose data is still to come; 1 too where another thread holds the channel; 2 where some moved
        just now). drive_transport's question."""
        return 0

    cdef void group_broke(self, bint timed_out, int lost=-1, bint between=False) noexcept:
        """Its group failed here (a call broke it, a timeout, a lost peer, a mismatch) or was aborted: none of
        its collectives can end now (timed_out: a call timed out here, which says nothing of the peers' calls;
        lost: the rank whose loss broke it, in the whole group's numbering (serve()), or -1; between: it broke
        while no call of it ran here, so every one begun here had ended). CoreComm tells the algorithms'
        transport; one that can tell the peers (shared memory's gave-up word, TCP's goodbye) does so at once,
        and a peer's collective that still needs this rank fails then, naming it (and the rank lost), rather
        than at its timeout."""
        pass

    cdef int lost_rank(self, int code) noexcept:
        """The rank whose loss (its process or link gone) error code of this transport's last failed
        request tells of, seen here or named by a peer that saw it, in the whole group's numbering
        (serve()); -1 where it tells of none."""
        return -1

    cdef int serve(self, tuple whole, int whole_size, str name) except -1:
        """A stage of a hierarchy: whole[q] is rank q's rank in group `name` of whole_size ranks, the
        group it serves. A lost rank is named in that numbering (lost_rank(), group_broke()): a peer
        of this stage may have given the group up over a rank lost in another stage of it."""
        if len(whole) != self.size or not all(0 <= w < whole_size for w in whole):
            raise ValueError(f"a stage of {self.size} ranks given ranks {whole} of group {name!r} ({whole_size})")
        self.whole, self.whole_size, self.whole_name = whole, whole_size, name
        return 0

    cdef int in_whole(self, int w) noexcept:
        """Whether w is a rank of the whole group (a lost rank read from a peer is checked)."""
        return 0 <= w < (self.size if self.whole is None else self.whole_size)

    cdef int whole_rank(self, int q):
        """Rank q of this group in the whole group's numbering."""
        return q if self.whole is None or not 0 <= q < self.size else self.whole[q]

    cdef int member(self, int w):
        """This group's rank that is rank w of the whole group (whole_rank's inverse), or -1: none (a rank
        of another stage of it, named "rank w of group '{whole_name}'")."""
        if self.whole is None:
            return w if 0 <= w < self.size else -1
        return self.whole.index(w) if w in self.whole else -1

    cdef str who(self, int peer):
        """Rank peer of this group as errors name it (a transport adds where it lives: a pid, an address)."""
        return f"rank {peer}"

    cdef str whole_who(self, int w):
        """Rank w of the whole group a stage serves (a peer's word's numbering), as who() names this
        group's ranks, or by its number there where it is a rank of another stage."""
        cdef int m = self.member(w)
        return self.who(m) if m >= 0 else f"rank {w} of group '{self.whole_name}'"

    cdef void release(self) noexcept:
        """Frees what the transport holds of the operating system (descriptors, buffers) now; called
        once, by CoreComm.release, when no call is inside. Nothing of it is used afterwards."""
        pass

    cdef int mismatch(self, int peer) noexcept nogil:
        """What an algorithm returns when peer's message is not the size this rank expects (the call
        differs there): ENG_ERR_MISMATCH, naming peer in the error."""
        self.err_peer = peer
        return ENG_ERR_MISMATCH

    cdef object error_text(self, int code):
        return _engine_error_text(code, self.err_peer)

    cdef int classify(self, int code) noexcept:
        """The engine's code for a code of the transport's own library where one fits (MPI's for a
        failed process: a lost peer), else code; on the way to an exception (the GIL held)."""
        return code


cdef int peer_exchange(Transport tp, const void *sbuf, size_t sn, int to, void *rbuf, size_t rn, int frm,
                       int tag, WaitCtx *ctx) except -1 nogil:
    """The algorithms' one exchange with peers: receives exactly rn bytes from frm while sending sn
    bytes to `to` (-1: skip that side), waiting through the watch. A message of another length is a
    mismatch naming its sender (the ranks are in different calls); on any failure nothing stays posted."""
    cdef Req reqs[2]
    cdef Status st
    cdef int ierr = 0
    cdef bint clean = False
    memset(reqs, 0, sizeof(reqs))
    st.nbytes = rn
    try:
        if frm >= 0:
            ierr = tp.irecv(rbuf, rn, frm, tag, &reqs[0])
        if not ierr and to >= 0:
            ierr = tp.isend(sbuf, sn, to, tag, &reqs[1])
        if not ierr:
            ierr = tp.wait(&reqs[0], &st, ctx)
        if not ierr and st.nbytes != rn:
            ierr = tp.mismatch(frm)
        if not ierr:
            ierr = tp.wait(&reqs[1], NULL, ctx)
        clean = not ierr
    finally:
        if not clean:
            tp.cancel_all(reqs, 2)
    return ierr


cdef struct RequestWait:
    Req *req
    Status *st


cdef int _poll_request(void *tp, void *arg, bint *done) except -1 nogil:
    cdef RequestWait *w = <RequestWait*>arg
    return (<Transport>tp).test(w.req, done, w.st)


_ERROR_TEXTS = {   # {who}: the peer the transport blames
    ENG_ERR_PEER_DEAD: "{who} exited (its process is gone) while this rank waited for it",
    ENG_ERR_PEER_LEFT: "{who} left the group while this rank still waited for it",
    ENG_ERR_PEER_TIMED_OUT: "{who} gave the group up after its call timed out, while this rank still waited for it",
    ENG_ERR_TRUNCATE: ("message truncated: {who} sent more bytes than the receive buffer holds; the buffer sizes "
                       "on the ranks do not match"),
    ENG_ERR_CORRUPT: ("the shared segment holds an out-of-bounds entry written by {who}: refusing to read it (a "
                      "bug, a dying peer, or another process of this user writing into it)"),
    ENG_ERR_NOMEM: "out of memory",
    ENG_ERR_ABORTED: ("the group was aborted (ProcessGroup.abort() or Communicator.abort()): it ends the waits "
                      "under way and refuses every later call"),
    ENG_ERR_CMA: ("a single copy from or to {who}'s memory (process_vm_readv / writev) failed: {who} left this "
                  "call (it failed there, or the ranks called different collectives) or is exiting; where it is "
                  "alive and in this call, set ENGINE_SHM_CMA=0 to move data through the shared segment only"),
    ENG_ERR_MISMATCH: ("{who} sent a message of another size than this rank expects: the ranks are in different "
                       "collectives, or passed different counts"),
    ENG_ERR_OTHER_CALL: ("{who} sent a message of another collective while this rank waited for its part of this "
                         "one: the ranks called different collectives, or the same one with another dtype, reduce "
                         "op or root (ENGINE_DEBUG=1 names each rank's call)"),
}


cdef str _engine_error_text(int code, int peer, str who=None):
    text = _ERROR_TEXTS.get(code)
    if text is None:
        return f"error code {code}"
    return text.format(who=who or (f"rank {peer}" if peer >= 0 else "a peer"))
