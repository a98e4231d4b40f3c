# A posted point-to-point message (isend / irecv) as Python sees it.

cdef list _LIMBO = []   # buffers a cancelled request may still be touched through (MPI sends): kept alive


cdef class Request:
    """A pending isend / irecv; keeps its buffer alive until it completes. While it is waited on, the
    request itself is the wait's watch: past the group's timeout it raises, naming its peer."""

    def __call__(self, double elapsed):
        watch = self.comm.p2p_watch
        if watch is not None:
            watch.peer_timeout(self.what, None if self.peer == ANY_PEER else self.peer, self.tag, elapsed)
        if self.deadline:
            if eng_now() >= self.deadline:
                raise EngineTimeout(f"Work.wait: Timed out after {self.limit:g} s waiting for {self.what} to complete "
                                    "(it stays posted: wait on it again; the group's timeout ends it if its peer "
                                    "never comes)")
            self.ctx.next_check = min(self.ctx.next_check, self.deadline)

    def __dealloc__(self):
        # (a forked child's copy of a request stays: cancelling touches the parent's transport)
        if req_active(&self.req) and self.tp is not None and self.comm.orphaned is None:
            if self.tp.cancel(&self.req):
                _LIMBO.append(self.msg)

    def detach(self):
        """The Work holding this request was dropped while it is in flight: the message still goes (as
        MPI_Request_free leaves it; cancelling a send not yet begun would withdraw it, and the peer's
        receive would take the next message in its place), its buffer kept alive. The group holds it
        until it is done (post_request looks, for each new message); its release cancels the rest."""
        if not self.done and req_active(&self.req) and self.comm.orphaned is None and not self.comm.released:
            self.comm.detached.append(self)

    def wait(self, timeout=None):
        """Blocks (without the GIL) until complete; returns (source, tag, count) for receives. timeout
        (seconds): raises EngineTimeout after it, the request still posted."""
        cdef int ierr = 0
        if self.error is not None:
            raise self.error
        if not self.done:   # aborted: the transport may be released already, so it is not touched
            _request_check(self, ENG_ERR_ABORTED if self.comm.aborted else 0)
            if timeout is not None:
                self.limit = max(<double>timeout, 1e-6)
                self.deadline = eng_now() + self.limit
                self.ctx.next_check = min(self.ctx.next_check, self.deadline)
            self.comm.busy += 1
            try:
                eng_add32(&self.tp.waiting)   # (the progress thread leaves the channel to this wait)
                try:
                    with nogil:
                        ierr = self.tp.wait(&self.req, &self.st, &self.ctx)
                finally:
                    eng_sub32(&self.tp.waiting)
                _request_check(self, ierr, True)
            finally:
                self.deadline = 0
                self.comm.call_left()
            self.done = True
        return self._result()

    def test(self):
        """True once complete (then wait() returns at once); raises how it failed, then and later."""
        cdef bint flag = False
        if self.error is not None:
            raise self.error
        if not self.done:
            _request_check(self, ENG_ERR_ABORTED if self.comm.aborted else self.tp.test(&self.req, &flag, &self.st),
                           True)
            self.done = flag
        return self.done

    def _result(self):
        if not self.is_recv:
            return None
        if self.st.nbytes % self.msg.itemsize:   # (a message carries no type, as MPI's: this much shows a wrong one)
            raise ValueError(f"{self.what} from rank {self.st.source}: {self.st.nbytes} bytes arrived, not a whole "
                             f"number of the receive buffer's {self.msg.itemsize}-byte elements: the sender sent "
                             "another dtype; send and receive the same dtype")
        if self.whole and self.st.nbytes != self.msg.count * self.msg.itemsize:
            raise ValueError(f"{self.what} from rank {self.st.source}: {self.st.nbytes} bytes arrived, but the receive "
                             f"buffer holds {self.msg.count * self.msg.itemsize}, and the rest would be left as it "
                             "was: send a tensor of the receive's size, or receive into one of the sent size")
        return (self.st.source, self.st.tag, self.st.nbytes // self.msg.itemsize)


cdef int _request_check(Request r, int ierr, bint keep=False) except -1:   # raises the error for ierr (0: none)
    if ierr:
        exc = _message_error(r.comm, ierr, "irecv" if r.is_recv else "isend", r.tp)
        if keep and not req_active(&r.req):   # (spent by its failure: a later wait would find nothing to wait on)
            r.done, r.error = True, exc
        raise exc
    return 0


cdef object _message_error(CoreComm comm, int ierr, str what, Transport tp):
    """A message's exception for ierr. Where the failure broke the group (a lost peer, a corrupt frame),
    the group's watch hears of it as of a failed collective: the abort hooks run, the job's failure
    policy notes it."""
    exc = comm.error(ierr, what, tp)
    if comm.log.broken is not None and comm.p2p_watch is not None:
        comm.p2p_watch.message_failed(exc)
    return exc


cdef Request post_request(CoreComm comm, Transport tp, object buf, int peer, int tag, bint recv, str what):
    """One isend / irecv of buf (a buffer, or a Message made of one) posted on tp, its wait watched by the
    request itself."""
    cdef Request r = Request.__new__(Request)
    cdef int ierr
    r.msg = buf if type(buf) is Message else as_message(buf, recv, "buffer")
    r.tp, r.comm, r.is_recv, r.peer, r.tag, r.what = tp, comm, recv, peer, tag, what
    comm.start(&r.ctx)
    r.ctx.hook = <void*>r
    if r.ctx.alive == peers_alive:   # (a rank that left fails only its own messages, and wildcard receives once all left)
        r.watch.peers, r.watch.peer = <Peers*>r.ctx.alive_arg, peer
        r.ctx.alive, r.ctx.alive_arg = peer_alive, &r.watch
    if comm.aborted:
        raise comm.error(ENG_ERR_ABORTED, what, tp)
    if comm.detached:
        comm.detached = [d for d in comm.detached if not _finished(d)]
    if recv:
        ierr = tp.irecv(r.msg.ptr, r.msg.count * r.msg.itemsize, peer, tag, &r.req)
    else:
        ierr = tp.isend(r.msg.ptr, r.msg.count * r.msg.itemsize, peer, tag, &r.req)
    if ierr:
        raise _message_error(comm, ierr, what, tp)
    return r


cdef Request whole_message(Request r, bint whole):
    r.whole = whole
    return r


cdef bint _finished(Request r):
    """Whether a detached request is done (or failed: its failure reached the group's watch, where it
    broke the group, as any message's does)."""
    try:
        return r.test()
    except Exception:
        return True
