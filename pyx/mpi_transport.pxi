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


cdef class MpiTransport(Transport):
    cdef MPI_Comm comm
    cdef int mpi_code   # MPI's own code of the last failed call (ENG_ERR_MPI stands for it; as err_peer,
                        # the latest of threads failing at once)
    cdef bint probes    # a wait on a peer also looks at what it sent that nobody took (stray())
    cdef object pycomm  # mpi4py's: the fault-tolerance calls (ULFM), on the way to an error only

    def __cinit__(self, Comm comm, bint algorithms=False, int max_tag=0):
        """algorithms: the engine's algorithms' channel (tags carry the call, pyx/call_tags.h). max_tag > 0:
        run as if MPI's largest tag were that (the tests emulate an MPI with fewer bits)."""
        cdef int flag = 0
        cdef int *tag_ub = NULL
        self.comm = comm.ob_mpi
        self.pycomm = comm
        self.err_peer = -1
        check(MPI_Comm_rank(self.comm, &self.rank), "MPI_Comm_rank")
        check(MPI_Comm_size(self.comm, &self.size), "MPI_Comm_size")
        # (MPI attaches its largest tag to the world only: a split or a dup of it may not carry it)
        check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag), "MPI_Comm_get_attr")
        if not flag or tag_ub == NULL:
            max_tag = 0
        elif max_tag <= 0 or tag_ub[0] < max_tag:
            max_tag = tag_ub[0]
        # Room for the call's number: tags of 31 bits (Open MPI's ob1), where MPI promises only 15
        self.wide_tags = max_tag >= 0x7FFFFFFF
        self.probes = algorithms and self.wide_tags

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
        ierr = MPI_Test(_mreq(req), &flag, &status)
        done[0] = flag != 0
        if ierr or not flag:
            return self.failed(ierr)
        if st != NULL and req.w[0] == 2:
            MPI_Get_elements_x(&status, MPI_BYTE, &n)
            st.source = status.MPI_SOURCE
            st.tag = status.MPI_TAG
            st.nbytes = <size_t>n
        req.w[0] = 0
        return 0

    cdef int wait(self, Req *req, Status *st, WaitCtx *ctx) except -1 nogil:
        cdef MpiWait w
        if not req_active(req):
            return 0
        w.req, w.st, w.probe_at = req, st, 0
        return wait_until(_poll_probing, <void*>self, &w, ctx, self.door)

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
        if code != ENG_ERR_MPI or MPI_Error_class(self.mpi_code, &cls) != 0 or cls not in _FAILURE_CLASSES:
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
