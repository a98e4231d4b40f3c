# The MPI transport: byte messages posted as nonblocking MPI point-to-point on one communicator.
# Messages over 2**31 - 1 bytes travel as one message of a derived type of bytes (MPI counts are ints).

cdef inline MPI_Request *_mreq(Req *r) noexcept nogil:
    return <MPI_Request*>&r.w[1]


cdef int _byte_type(size_t nbytes, int *count, MPI_Datatype *dt) noexcept nogil:
    """(count, datatype) for nbytes bytes; a committed derived type (to free after posting) past INT_MAX."""
    cdef MPI_Datatype block, types[2]
    cdef int lens[2]
    cdef MPI_Aint displs[2]
    cdef size_t unit = 1 << 20
    cdef int ierr
    if nbytes <= <size_t>INT_MAX:
        count[0] = <int>nbytes
        dt[0] = MPI_BYTE
        return 0
    ierr = MPI_Type_contiguous(<int>unit, MPI_BYTE, &block)
    if ierr:
        return ierr
    lens[0] = <int>(nbytes // unit)
    lens[1] = <int>(nbytes % unit)
    displs[0] = 0
    displs[1] = <MPI_Aint>(nbytes // unit * unit)
    types[0] = block
    types[1] = MPI_BYTE
    ierr = MPI_Type_create_struct(2, lens, displs, types, dt)
    MPI_Type_free(&block)
    if not ierr:
        ierr = MPI_Type_commit(dt)
    count[0] = 1
    return ierr


# A receive from any rank that waits for a probe to find its message (req.w[0]'s low byte; the tag
# above it, the buffer in w[1], its size in w[3]), and one whose probed message could not be taken
# (MPI's code in w[2]); 1 and 2 are a posted send and receive. Every test of a message on the group
# (the user's, the algorithms' and MPI's own collectives') probes for them: MPI would move a posted
# receive while the rank waits on something else (a send whose receiver waits on its own send).
cdef size_t _PROBING = 3
cdef size_t _PROBE_FAILED = 4


cdef inline int _probing_tag(const Req *req) noexcept nogil:
    return <int><unsigned int>(req.w[0] >> 32)


cdef class MpiTransport(Transport):
    cdef MPI_Comm comm
    cdef int mpi_code   # MPI's own code of the last failed call (ENG_ERR_MPI stands for it; as err_peer,
                        # the latest of threads failing at once)
    cdef bint probes    # a wait on a peer also looks at what it sent that nobody took (stray())
    cdef object pycomm  # mpi4py's: the fault-tolerance calls (ULFM), on the way to an error only
    cdef readonly bint probe_any  # a receive from any rank is not posted: MPI_Improbe finds its message,
                                  # MPI_Imrecv takes it (engine.mpi.any_source_by_probe says where)
    cdef MpiTransport probed      # the transport whose probing receives this one's tests move too (or None)
    cdef pthread_mutex_t probing_lock
    cdef Req **probing            # the probing receives, oldest first
    cdef size_t nprobing, probing_cap
    cdef uint32_t posted          # messages posted and not yet seen complete or cancelled (in_flight)
    cdef int awaited_peer         # the peer of the message a wait is on (its source or destination), or -1
    cdef bint awaited_send        # (for a timeout's report: MpiComm.waiting_on)
    cdef readonly int max_tag     # the largest tag it may use: MPI's, or ENGINE_MPI_TAG_UB below it (0: unknown)

    def __cinit__(self, Comm comm, bint algorithms=False, int max_tag=0):
        """algorithms: the engine's algorithms' channel (tags carry the call, pyx/call_tags.h). max_tag > 0:
        run as if MPI's largest tag were that (the tests emulate an MPI with fewer bits)."""
        cdef int flag = 0
        cdef int *tag_ub = NULL
        self.comm = comm.ob_mpi
        self.pycomm = comm
        pthread_mutex_init(&self.probing_lock, NULL)
        self.err_peer = self.awaited_peer = -1
        check(MPI_Comm_rank(self.comm, &self.rank), "MPI_Comm_rank")
        check(MPI_Comm_size(self.comm, &self.size), "MPI_Comm_size")
        # (MPI attaches its largest tag to the world only: a split or a dup of it may not carry it)
        check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag), "MPI_Comm_get_attr")
        if not flag or tag_ub == NULL:
            max_tag = 0
        elif max_tag <= 0 or tag_ub[0] < max_tag:
            max_tag = tag_ub[0]
        # Room for the call's number: tags of 31 bits (Open MPI's ob1), where MPI promises only 15
        self.max_tag = max_tag
        self.wide_tags = max_tag >= 0x7FFFFFFF
        self.probes = algorithms and self.wide_tags

    def __dealloc__(self):
        free(self.probing)
        pthread_mutex_destroy(&self.probing_lock)

    cdef int probe_any_source(self, bint on, MpiTransport mover) except -1:
        """Receives from any rank probe (on) or are posted; mover's tests (the algorithms' transport)
        move the probing ones too. Set before the group's first message."""
        if self.nprobing:
            raise RuntimeError("receives from any rank are waiting: their mode can't change now")
        self.probe_any = on
        if mover is not None:
            mover.probed = self if on else None
        return 0

    cdef int failed(self, int ierr) noexcept nogil:
        """0, or ENG_ERR_MPI for MPI's code ierr (kept for error_text and classify): MPI's codes are the
        library's, and MPICH's may equal any of the engine's."""
        if ierr:
            self.mpi_code = ierr
            return ENG_ERR_MPI
        return 0

    cdef int _post(self, void *buf, size_t nbytes, int peer, int tag, Req *req, bint recv) noexcept nogil:
        cdef int count, ierr
        cdef MPI_Datatype dt
        tag = posted_tag(self, tag)
        if recv and peer == ANY_PEER and self.probe_any:
            ierr = self._add_probing(buf, nbytes, tag, req)
            if not ierr:
                eng_add32(&self.posted)
            return ierr
        ierr = _byte_type(nbytes, &count, &dt)
        if ierr:
            return self.failed(ierr)
        if recv:
            ierr = MPI_Irecv(buf, count, dt, MPI_ANY_SOURCE if peer == ANY_PEER else peer,
                             MPI_ANY_TAG if tag == ANY_TAG_ else tag, self.comm, _mreq(req))
        else:
            ierr = MPI_Isend(buf, count, dt, peer, tag, self.comm, _mreq(req))
        if dt != MPI_BYTE:
            MPI_Type_free(&dt)
        if not ierr:
            req.w[0] = 2 if recv else 1
            req.w[2] = <size_t>(peer + 1) if recv and peer != ANY_PEER else 0
            req.w[3] = <size_t>(peer + 1) if peer != ANY_PEER else 0   # (whom a wait on it waits on)
            eng_add32(&self.posted)
        return self.failed(ierr)

    cdef int isend(self, const void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        return self._post(<void*>buf, nbytes, peer, tag, req, False)

    cdef int irecv(self, void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        return self._post(buf, nbytes, peer, tag, req, True)

    cdef int test(self, Req *req, bint *done, Status *st) except -1 nogil:
        cdef int flag = 0, ierr
        cdef MPI_Status status
        cdef MPI_Count n = 0
        if not req_active(req):
            done[0] = True
            return 0
        ierr = self.move_probed()
        if ierr:
            return ierr
        if self.probe_any or req.w[0] & 0xFF >= _PROBING:
            pthread_mutex_lock(&self.probing_lock)
            ierr = self._probe_all()
            flag = req.w[0] & 0xFF
            if flag == _PROBE_FAILED:   # (its message taken by a probe but not received: it fails, every time asked)
                ierr = <int>req.w[2]
            pthread_mutex_unlock(&self.probing_lock)
            if ierr or flag >= _PROBING:
                done[0] = False
                return self.failed(ierr)
        ierr = MPI_Test(_mreq(req), &flag, &status)
        done[0] = flag != 0
        if ierr:
            return self._message_failed(req, ierr, &status)
        if not flag:
            return 0
        if st != NULL and req.w[0] == 2:
            MPI_Get_elements_x(&status, MPI_BYTE, &n)
            st.source = status.MPI_SOURCE
            st.tag = status.MPI_TAG
            st.nbytes = <size_t>n
        req.w[0] = 0
        eng_sub32(&self.posted)
        return 0

    cdef int _message_failed(self, Req *req, int ierr, MPI_Status *status) noexcept nogil:
        """The engine's code for a message MPI ended in error: a receive longer than its buffer is the
        engine's truncation, naming its sender (a receive from any rank: the status's), as over shared
        memory and TCP. One MPI freed (MPICH does) is spent: a later test must not find it complete."""
        cdef int cls = 0
        cdef int peer = <int>req.w[2] - 1
        cdef bint recv = req.w[0] == 2
        if recv and 0 <= status.MPI_SOURCE < self.size:
            peer = status.MPI_SOURCE
        if _mreq(req)[0] == MPI_REQUEST_NULL:
            req.w[0] = 0
            eng_sub32(&self.posted)
        if recv and MPI_Error_class(ierr, &cls) == 0 and cls == MPI_ERR_TRUNCATE:
            self.err_peer = peer
            return ENG_ERR_TRUNCATE
        return self.failed(ierr)

    cdef void drain(self) noexcept nogil:
        """Receives and drops every message sent on this channel that nobody took, before its
        communicator is freed. Open MPI gives a freed communicator's context to the next one made,
        and a message still queued for the old one (a peer's send whose receive this rank never
        posted: a call that failed there, a message the user left) was matched by a receive of the
        new group, its data taken for that group's."""
        cdef int flag = 1, count
        cdef MPI_Message msg
        cdef MPI_Status status
        cdef MPI_Count n = 0
        cdef MPI_Datatype dt
        cdef void *buf
        while flag:
            flag = 0
            if MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, self.comm, &flag, &msg, &status) != 0 or not flag:
                return
            MPI_Get_elements_x(&status, MPI_BYTE, &n)
            buf = malloc(<size_t>n if n > 0 else 1)
            if buf == NULL or _byte_type(<size_t>n, &count, &dt) != 0:
                MPI_Mrecv(NULL, 0, MPI_BYTE, &msg, MPI_STATUS_IGNORE)   # (its end, truncated: it goes)
                free(buf)
                continue
            MPI_Mrecv(buf, count, dt, &msg, MPI_STATUS_IGNORE)
            if dt != MPI_BYTE:
                MPI_Type_free(&dt)
            free(buf)

    cdef int _add_probing(self, void *buf, size_t nbytes, int tag, Req *req) noexcept nogil:
        cdef Req **grown
        pthread_mutex_lock(&self.probing_lock)
        if self.nprobing == self.probing_cap:
            grown = <Req**>realloc(self.probing, (2 * self.probing_cap + 4) * sizeof(Req*))
            if grown == NULL:
                pthread_mutex_unlock(&self.probing_lock)
                return ENG_ERR_NOMEM
            self.probing, self.probing_cap = grown, 2 * self.probing_cap + 4
        req.w[0] = _PROBING | <size_t>(<unsigned int>tag) << 32
        req.w[1] = <size_t>buf
        req.w[2] = 0
        req.w[3] = nbytes
        self.probing[self.nprobing] = req
        self.nprobing += 1
        pthread_mutex_unlock(&self.probing_lock)
        return 0

    cdef void _drop_probing(self, size_t i) noexcept nogil:   # (the lock held)
        self.nprobing -= 1
        while i < self.nprobing:
            self.probing[i] = self.probing[i + 1]
            i += 1

    cdef int move_probed(self) noexcept nogil:
        """The probing receives of the transport this one's tests move (probed), moved; an engine code."""
        return self.failed(self.probed.move_probing()) if self.probed is not None else 0

    cdef int move_probing(self) noexcept nogil:
        """_probe_all, from another transport's test; MPI's code."""
        cdef int ierr = 0
        if self.nprobing:   # (read unlocked: one missed here is probed at the next test)
            pthread_mutex_lock(&self.probing_lock)
            ierr = self._probe_all()
            pthread_mutex_unlock(&self.probing_lock)
        return ierr

    cdef int _probe_all(self) noexcept nogil:
        """Takes every message a probe finds for the probing receives, as MPI's matching would give it
        (all are from any rank), the lock held; each receive that gets one becomes a posted receive
        (MPI_Imrecv). Returns MPI's code of a failed probe. A matched probe (MPI_Improbe) takes the
        message out of MPI's queue for that receive alone: no other receive, nor another thread's
        probe, can take it.

        With a receive of any tag waiting, every message is one of theirs: the next message of MPI's
        queue (of any source and tag: a sender's earliest) goes to the oldest receive that matches its
        tag. Otherwise each receive probes for its tag, oldest first (the receives older than one that
        got a message probe again), and a message found goes to the oldest receive of that tag."""
        cdef size_t i = 0, j
        cdef int flag, ierr
        cdef bint any_tag
        cdef MPI_Message msg
        cdef MPI_Status status
        while i < self.nprobing:
            flag = 0
            any_tag = self._any_tag_probing()
            ierr = MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG if any_tag else _probing_tag(self.probing[i]), self.comm,
                               &flag, &msg, &status)
            if ierr:
                return ierr
            if not flag:
                if any_tag:
                    return 0
                i += 1
                continue
            j = 0
            while _probing_tag(self.probing[j]) not in (ANY_TAG_, status.MPI_TAG):
                j += 1
            self._receive_probed(j, &msg)
            i = 0
        return 0

    cdef bint _any_tag_probing(self) noexcept nogil:
        cdef size_t i
        for i in range(self.nprobing):
            if _probing_tag(self.probing[i]) == ANY_TAG_:
                return True
        return False

    cdef void _receive_probed(self, size_t j, MPI_Message *msg) noexcept nogil:
        """Probing receive j takes msg (MPI_Imrecv) and leaves the list: a posted receive, or one that
        failed (MPI's code in w[2]) if the message can't be received."""
        cdef Req *req = self.probing[j]
        cdef int count
        cdef MPI_Datatype dt
        cdef int ierr = _byte_type(req.w[3], &count, &dt)
        self._drop_probing(j)
        if not ierr:
            ierr = MPI_Imrecv(<void*>req.w[1], count, dt, msg, _mreq(req))
            if dt != MPI_BYTE:
                MPI_Type_free(&dt)
        if ierr:
            req.w[2], req.w[0] = <size_t>ierr, _PROBE_FAILED
        else:
            req.w[0], req.w[3] = 2, 0   # (a receive from any rank: whom a wait on it waits on is not known)

    cdef int in_flight(self) noexcept nogil:
        # MPI moves a message only inside its calls (a large one's rendezvous needs its sender's): a
        # probe runs its progress engine, and moves the probing receives.
        cdef int flag = 0
        if eng_load32(&self.posted) == 0:
            return 0
        if self.nprobing:
            self.move_probing()
        else:
            MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, self.comm, &flag, MPI_STATUS_IGNORE)
        return 1

    cdef int wait(self, Req *req, Status *st, WaitCtx *ctx) except -1 nogil:
        cdef MpiWait w
        if not req_active(req):
            return 0
        cdef int ierr
        w.req, w.st, w.probe_at = req, st, 0
        if req.w[0] == 1 or req.w[0] == 2:   # (a message posted to MPI, not a probing receive)
            self.awaited_peer, self.awaited_send = <int>req.w[3] - 1, req.w[0] == 1
        ierr = wait_until(_poll_probing, <void*>self, &w, ctx, self.door)
        self.awaited_peer = -1
        return ierr

    cdef int stray(self, int peer) noexcept nogil:
        """ENG_ERR_OTHER_CALL naming peer if a message from peer that nobody took shows it in another
        collective (pyx/call_tags.h: this call's number with another hash, or an earlier call's), else 0.
        A peer ahead, whose next call's message arrived before this one's receive completed, is not."""
        cdef int flag = 0
        cdef MPI_Status status
        if self.tag_base == 0 or MPI_Iprobe(peer, MPI_ANY_TAG, self.comm, &flag, &status) or not flag:
            return 0
        if not eng_other_call(self.tag_base, status.MPI_TAG):
            return 0
        self.err_peer = peer
        return ENG_ERR_OTHER_CALL

    cdef int cancel(self, Req *req) noexcept nogil:
        """A receive is cancelled and waited for (briefly); whatever MPI may still touch (a send, a
        receive already under way) is freed and reported (1), so the caller keeps its buffer alive."""
        cdef int flag = 0
        cdef double until
        cdef size_t i, state
        if not req_active(req):
            return 0
        eng_sub32(&self.posted)   # (every way on leaves it inactive)
        if self.probe_any or req.w[0] & 0xFF >= _PROBING:
            pthread_mutex_lock(&self.probing_lock)
            state = req.w[0] & 0xFF
            if state == _PROBING:   # (nothing posted)
                for i in range(self.nprobing):
                    if self.probing[i] == req:
                        self._drop_probing(i)
                        break
            if state >= _PROBING:
                req.w[0] = 0
            pthread_mutex_unlock(&self.probing_lock)
            if not req_active(req):
                return 0
        if req.w[0] == 2:
            MPI_Cancel(_mreq(req))
            until = eng_now() + 0.1
            while not flag and eng_now() < until:
                MPI_Test(_mreq(req), &flag, MPI_STATUS_IGNORE)
            if flag:
                req.w[0] = 0
                return 0
        MPI_Request_free(_mreq(req))
        req.w[0] = 0
        return 1

    cdef object error_text(self, int code):
        if code == ENG_ERR_PEER_LEFT and self.err_peer < 0:
            return ("another rank gave the group up (a lost peer, a timeout or a mismatch there) and revoked its "
                    "MPI communicators while this rank waited")
        if code == ENG_ERR_MPI:
            return mpi_error_text(self.mpi_code)
        return Transport.error_text(self, code)

    cdef int classify(self, int code) noexcept:
        """Under an MPI whose job outlives a rank (ULFM: `mpiexec --with-ft ulfm`), an operation with a
        failed process ends with MPI_ERR_PROC_FAILED, and one on a communicator another rank revoked
        (its group broke there: engine.watch revokes a broken group's communicators) with
        MPI_ERR_REVOKED: a lost peer, naming the first failed rank MPI knows of (ENG_ERR_PEER_DEAD), else
        a peer that gave the group up (ENG_ERR_PEER_LEFT)."""
        cdef int cls = 0
        if code != ENG_ERR_MPI or MPI_Error_class(self.mpi_code, &cls) != 0:
            return code
        if cls == MPI_ERR_TRUNCATE:   # (an MPI collective's, whose sender MPI does not say)
            self.err_peer = -1
            return ENG_ERR_TRUNCATE
        if cls not in _FAILURE_CLASSES:
            return code
        ranks = []
        try:
            failed, mine = self.pycomm.Get_failed(), self.pycomm.Get_group()
            ranks = [r for r in _MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), mine) if r >= 0]
            failed.Free()
            mine.Free()
        except Exception:   # (an MPI without Get_failed: the failure stays unnamed)
            pass
        self.err_peer = ranks[0] if ranks else -1
        return ENG_ERR_PEER_DEAD if ranks else ENG_ERR_PEER_LEFT


# MPI's error classes for a failed process and a revoked communicator, where the library has them
# (mpi4py gives MPI_ERR_UNKNOWN for those it lacks).
_FAILURE_CLASSES = frozenset(c for c in (_MPI.ERR_PROC_FAILED, _MPI.ERR_PROC_FAILED_PENDING, _MPI.ERR_REVOKED)
                             if c != _MPI.ERR_UNKNOWN)


# A receive from one peer that is not done at its first test, and then every _PROBE_EVERY_S, looks at
# the messages that peer sent which no receive took: one of another collective ends the wait
# (MpiTransport.stray), where MPI would hold it unmatched until the group's timeout.
cdef double _PROBE_EVERY_S = 0.1


cdef struct MpiWait:
    Req *req
    Status *st
    double probe_at


cdef int _poll_probing(void *obj, void *arg, bint *done) except -1 nogil:
    cdef MpiWait *w = <MpiWait*>arg
    cdef int ierr = (<MpiTransport>obj).test(w.req, done, w.st)
    cdef double t
    if ierr or done[0] or not (<MpiTransport>obj).probes or w.req.w[2] == 0:
        return ierr
    t = eng_now()
    if t < w.probe_at:
        return 0
    w.probe_at = t + _PROBE_EVERY_S
    return (<MpiTransport>obj).stray(<int>w.req.w[2] - 1)
