# The communicator core: every collective and point-to-point call, each short: parse the buffers,
# check what can be checked locally, then one MPI call (or one engine algorithm) without the GIL.

from libc.limits cimport INT_MAX

cdef enum:
    ALGO_NATIVE = 0
    ALGO_RING = 1
    ALGO_RDOUBLE = 2

ALGORITHM_CODES = {"native": ALGO_NATIVE, "ring": ALGO_RING, "rdouble": ALGO_RDOUBLE}


cdef int as_int_count(size_t n, str what) except -1:
    if n > <size_t>INT_MAX:
        raise ValueError(f"{what}: {n} elements exceed MPI's int count limit (2**31 - 1) for this collective; "
                         "allreduce, broadcast and reduce take any size; split this buffer into smaller calls")
    return <int>n


cdef class Request:
    """A pending isend/irecv; keeps its buffer alive until it completes."""
    cdef MPI_Request req
    cdef Message msg
    cdef MPI_Status status
    cdef bint done
    cdef str what
    cdef object hook        # the communicator's watch, called while wait() polls
    cdef WaitCtx ctx

    def __dealloc__(self):
        if self.req != MPI_REQUEST_NULL:  # never completed: cancel rather than leak the request
            MPI_Cancel(&self.req)
            MPI_Request_free(&self.req)

    def wait(self):
        """Blocks (without the GIL) until complete; returns (source, tag, count) for receives."""
        cdef int ierr = 0, flag = 0
        if not self.done:
            with nogil:
                ierr = wait_req_status(&self.req, &self.status, &self.ctx)
            check(ierr, self.what)
            self.done = True
        return self._result()

    def test(self):
        """True once complete (then wait() returns at once)."""
        cdef int flag = 0, ierr = 0
        if not self.done:
            ierr = MPI_Test(&self.req, &flag, &self.status)
            check(ierr, self.what)
            self.done = flag != 0
        return self.done

    def _result(self):
        cdef int n = 0
        if self.what != "MPI_Irecv":
            return None
        MPI_Get_count(&self.status, MPI_TYPES[self.msg.dtype], &n)
        return (self.status.MPI_SOURCE, self.status.MPI_TAG, n)


cdef class CoreComm:
    """Collectives over one group. `coll` runs native MPI collectives, `algo` the engine's own
    algorithms (point-to-point kept apart from user traffic), `p2p` the user's send/recv."""
    cdef MPI_Comm coll, p2p
    cdef readonly int rank, size
    cdef RingAllreduce ring
    cdef RecursiveDoubling rdouble
    cdef int *ibuf     # 4 * size ints: counts and displacements of the v-collectives
    cdef object hook   # watch(elapsed) called while engine-owned waits poll; None: plain MPI_Wait
    cdef double interval
    cdef readonly size_t chunk  # element-wise native collectives go in pieces of at most this many elements

    def __cinit__(self, Comm coll, Comm algo, Comm p2p, size_t ring_segment_bytes):
        self.coll = coll.ob_mpi
        self.p2p = p2p.ob_mpi
        check(MPI_Comm_rank(self.coll, &self.rank), "MPI_Comm_rank")
        check(MPI_Comm_size(self.coll, &self.size), "MPI_Comm_size")
        self.ring = RingAllreduce(algo, ring_segment_bytes)
        self.rdouble = RecursiveDoubling(algo)
        self.ibuf = <int*>malloc(4 * self.size * sizeof(int))
        if self.ibuf == NULL:
            raise MemoryError()
        self.chunk = 1 << 30  # MPI counts are ints: larger messages are cut (no large-count MPI-4 calls here)

    def set_chunk(self, size_t elements):
        """Largest piece of an element-wise native collective (tests make it tiny to reach the loop)."""
        if elements == 0 or elements > <size_t>INT_MAX:
            raise ValueError(f"chunk must be in 1..{INT_MAX} elements")
        self.chunk = elements

    def __dealloc__(self):
        free(self.ibuf)

    @property
    def ring_segment_bytes(self):
        return self.ring.seg_bytes

    def set_watch(self, hook, double interval=1.0):
        """hook(elapsed_seconds) runs every `interval` s while an engine-owned wait polls; it may raise
        (a timeout) to abandon the operation. None restores plain blocking waits."""
        if interval <= 0:
            raise ValueError("watch interval must be positive")
        self.hook = hook
        self.interval = interval

    cdef inline void start_ctx(self, WaitCtx *ctx, object hook=None) noexcept:
        if hook is None:
            hook = self.hook
        ctx.hook = <void*>hook if hook is not None else NULL
        ctx.start = monotonic()
        ctx.interval = self.interval
        ctx.next_check = ctx.start + self.interval

    cdef int _root(self, int root) except -1:
        if root < 0 or root >= self.size:
            raise ValueError(f"root {root} is out of range for a group of size {self.size} (valid: 0..{self.size - 1})")
        return 0

    cdef size_t _counts(self, object counts, int *out, int *displs, str role) except? 0:
        """Fills out/displs from a list of per-rank counts; returns their sum."""
        cdef size_t total = 0
        cdef int i
        if len(counts) != self.size:
            raise ValueError(f"{role} has {len(counts)} entries; it needs one per rank ({self.size})")
        for i in range(self.size):
            c = counts[i]
            if c < 0:
                raise ValueError(f"{role}[{i}] is negative ({c})")
            out[i] = as_int_count(c, role)
            displs[i] = as_int_count(total, role)
            total += <size_t>c
        return total

    @staticmethod
    cdef _same_dtype(Message a, Message b, str what):
        if a.dtype != b.dtype:
            raise TypeError(f"{what}: send buffer is {DTYPE_NAMES[a.dtype]} but receive buffer is "
                            f"{DTYPE_NAMES[b.dtype]}; they must have the same dtype")

    def allreduce(self, sendbuf, recvbuf, op, int algorithm):
        """recvbuf = reduce(op, sendbuf of every rank); recvbuf None means in place on sendbuf."""
        cdef Message ms = as_message(sendbuf, recvbuf is None, "buffer" if recvbuf is None else "sendbuf")
        cdef Message mr = ms if recvbuf is None else as_message(recvbuf, True, "recvbuf")
        cdef Reduction red
        cdef int ierr = 0, n
        cdef size_t off
        cdef void *sptr
        cdef WaitCtx ctx
        self.start_ctx(&ctx)
        if mr is not ms:
            CoreComm._same_dtype(ms, mr, "allreduce")
            if mr.count != ms.count:
                raise ValueError(f"allreduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; they must match")
        red = resolve_op(op, ms.dtype)
        sptr = MPI_IN_PLACE if ms.ptr == mr.ptr else ms.ptr
        if algorithm == ALGO_NATIVE:
            with nogil:
                red.arm()
                off = 0
                while off < ms.count:
                    n = <int>min(self.chunk, ms.count - off)
                    ierr = MPI_Allreduce(MPI_IN_PLACE if sptr == MPI_IN_PLACE else <char*>sptr + off * ms.itemsize,
                                         <char*>mr.ptr + off * ms.itemsize, n, MPI_TYPES[ms.dtype], red.mpi_op,
                                         self.coll)
                    if ierr:
                        break
                    off += n
        elif algorithm == ALGO_RING:
            with nogil:
                ierr = self.ring.run(<char*>ms.ptr, <char*>mr.ptr, ms.count, ms.itemsize, red.fn, &ctx)
        elif algorithm == ALGO_RDOUBLE:
            as_int_count(ms.count * ms.itemsize, "allreduce (recursive doubling, in bytes)")
            with nogil:
                ierr = self.rdouble.run(<char*>ms.ptr, <char*>mr.ptr, ms.count, ms.itemsize, red.fn, &ctx)
        else:
            raise ValueError(f"unknown allreduce algorithm code {algorithm}")
        check(ierr, "allreduce")
        if red.avg:
            with nogil:
                eng_scale(mr.ptr, mr.count, mr.dtype, self.size, 1)

    def broadcast(self, buf, int root):
        self._root(root)
        cdef Message m = as_message(buf, True, "buffer")
        cdef int n, ierr = 0
        cdef size_t off = 0
        with nogil:
            while off < m.count:
                n = <int>min(self.chunk, m.count - off)
                ierr = MPI_Bcast(<char*>m.ptr + off * m.itemsize, n, MPI_TYPES[m.dtype], root, self.coll)
                if ierr:
                    break
                off += n
        check(ierr, "broadcast")

    def reduce(self, sendbuf, recvbuf, op, int root):
        """On root recvbuf = reduce(op, sendbuf of every rank) (recvbuf None: in place on sendbuf)."""
        self._root(root)
        cdef bint is_root = self.rank == root, inplace = recvbuf is None
        cdef Message ms = as_message(sendbuf, is_root and inplace, "sendbuf")
        cdef Message mr = ms
        cdef Reduction red = resolve_op(op, ms.dtype)
        cdef int n, ierr = 0
        cdef size_t off = 0
        cdef void *sptr = ms.ptr
        cdef void *rptr = NULL
        if is_root:
            if not inplace:
                mr = as_message(recvbuf, True, "recvbuf")
                CoreComm._same_dtype(ms, mr, "reduce")
                if mr.count != ms.count:
                    raise ValueError(f"reduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; they must match")
            rptr = mr.ptr
            if rptr == sptr:
                sptr = MPI_IN_PLACE
        with nogil:
            red.arm()
            while off < ms.count:
                n = <int>min(self.chunk, ms.count - off)
                ierr = MPI_Reduce(MPI_IN_PLACE if sptr == MPI_IN_PLACE else <char*>sptr + off * ms.itemsize,
                                  NULL if rptr == NULL else <char*>rptr + off * ms.itemsize, n,
                                  MPI_TYPES[ms.dtype], red.mpi_op, root, self.coll)
                if ierr:
                    break
                off += n
        check(ierr, "reduce")
        if red.avg and is_root:
            with nogil:
                eng_scale(mr.ptr, mr.count, mr.dtype, self.size, 1)

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of rank 0, 1, ...); counts: per-rank element counts when uneven."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef int *cnt = self.ibuf
        cdef int *dsp = self.ibuf + self.size
        cdef int n = as_int_count(ms.count, "allgather"), ierr
        cdef size_t total
        cdef void *sptr = ms.ptr
        CoreComm._same_dtype(ms, mr, "allgather")
        if counts is None:
            if mr.count != ms.count * self.size:
                raise ValueError(f"allgather: recvbuf has {mr.count} elements; it needs sendbuf's {ms.count} "
                                 f"x {self.size} ranks = {ms.count * self.size} (pass counts= for uneven sizes)")
            if sptr == <char*>mr.ptr + self.rank * ms.count * ms.itemsize:
                sptr = MPI_IN_PLACE
            with nogil:
                ierr = MPI_Allgather(sptr, n, MPI_TYPES[ms.dtype], mr.ptr, n, MPI_TYPES[mr.dtype], self.coll)
        else:
            total = self._counts(counts, cnt, dsp, "allgather counts")
            if cnt[self.rank] != ms.count:
                raise ValueError(f"allgather: counts[{self.rank}] is {cnt[self.rank]} but this rank's sendbuf has {ms.count} elements")
            if total != mr.count:
                raise ValueError(f"allgather: counts add up to {total} but recvbuf has {mr.count} elements")
            if sptr == <char*>mr.ptr + <size_t>dsp[self.rank] * ms.itemsize:
                sptr = MPI_IN_PLACE
            with nogil:
                ierr = MPI_Allgatherv(sptr, n, MPI_TYPES[ms.dtype], mr.ptr, cnt, dsp, MPI_TYPES[mr.dtype], self.coll)
        check(ierr, "allgather")

    def gather(self, sendbuf, recvbuf, int root, counts=None):
        """On root recvbuf = concat(sendbuf of every rank); recvbuf is ignored elsewhere."""
        self._root(root)
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = None
        cdef int *cnt = self.ibuf
        cdef int *dsp = self.ibuf + self.size
        cdef int n = as_int_count(ms.count, "gather"), ierr
        cdef size_t total
        cdef void *rptr = NULL
        cdef MPI_Datatype rtype = MPI_TYPES[ms.dtype]
        if self.rank == root:
            if recvbuf is None:
                raise ValueError("gather: the root needs a recvbuf")
            mr = as_message(recvbuf, True, "recvbuf")
            CoreComm._same_dtype(ms, mr, "gather")
            rptr = mr.ptr
        if counts is None:
            if mr is not None and mr.count != ms.count * self.size:
                raise ValueError(f"gather: recvbuf has {mr.count} elements; it needs {ms.count} x {self.size} ranks "
                                 "(pass counts= for uneven sizes)")
            with nogil:
                ierr = MPI_Gather(ms.ptr, n, MPI_TYPES[ms.dtype], rptr, n, rtype, root, self.coll)
        else:
            total = self._counts(counts, cnt, dsp, "gather counts")
            if cnt[self.rank] != ms.count:
                raise ValueError(f"gather: counts[{self.rank}] is {cnt[self.rank]} but this rank's sendbuf has {ms.count} elements")
            if mr is not None and total != mr.count:
                raise ValueError(f"gather: counts add up to {total} but recvbuf has {mr.count} elements")
            with nogil:
                ierr = MPI_Gatherv(ms.ptr, n, MPI_TYPES[ms.dtype], rptr, cnt, dsp, rtype, root, self.coll)
        check(ierr, "gather")

    def scatter(self, sendbuf, recvbuf, int root, counts=None):
        """recvbuf = this rank's slice of root's sendbuf; sendbuf is ignored off the root."""
        self._root(root)
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef Message ms = None
        cdef int *cnt = self.ibuf
        cdef int *dsp = self.ibuf + self.size
        cdef int n = as_int_count(mr.count, "scatter"), ierr
        cdef size_t total
        cdef void *sptr = NULL
        if self.rank == root:
            if sendbuf is None:
                raise ValueError("scatter: the root needs a sendbuf")
            ms = as_message(sendbuf, False, "sendbuf")
            CoreComm._same_dtype(ms, mr, "scatter")
            sptr = ms.ptr
        if counts is None:
            if ms is not None and ms.count != mr.count * self.size:
                raise ValueError(f"scatter: sendbuf has {ms.count} elements; it needs recvbuf's {mr.count} x "
                                 f"{self.size} ranks (pass counts= for uneven sizes)")
            with nogil:
                ierr = MPI_Scatter(sptr, n, MPI_TYPES[mr.dtype], mr.ptr, n, MPI_TYPES[mr.dtype], root, self.coll)
        else:
            total = self._counts(counts, cnt, dsp, "scatter counts")
            if cnt[self.rank] != mr.count:
                raise ValueError(f"scatter: counts[{self.rank}] is {cnt[self.rank]} but this rank's recvbuf has {mr.count} elements")
            if ms is not None and total != ms.count:
                raise ValueError(f"scatter: counts add up to {total} but sendbuf has {ms.count} elements")
            with nogil:
                ierr = MPI_Scatterv(sptr, cnt, dsp, MPI_TYPES[mr.dtype], mr.ptr, n, MPI_TYPES[mr.dtype], root, self.coll)
        check(ierr, "scatter")

    def reduce_scatter(self, sendbuf, recvbuf, op, counts=None):
        """recvbuf = this rank's block of reduce(op, sendbuf of every rank)."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef Reduction red
        cdef int *cnt = self.ibuf
        cdef int *dsp = self.ibuf + self.size
        cdef int n = as_int_count(mr.count, "reduce_scatter"), ierr
        cdef size_t total
        CoreComm._same_dtype(ms, mr, "reduce_scatter")
        red = resolve_op(op, ms.dtype)
        as_int_count(ms.count, "reduce_scatter")
        if counts is None:
            if ms.count != mr.count * self.size:
                raise ValueError(f"reduce_scatter: sendbuf has {ms.count} elements; it needs recvbuf's {mr.count} "
                                 f"x {self.size} ranks (pass counts= for uneven sizes)")
            with nogil:
                red.arm()
                ierr = MPI_Reduce_scatter_block(ms.ptr, mr.ptr, n, MPI_TYPES[ms.dtype], red.mpi_op, self.coll)
        else:
            total = self._counts(counts, cnt, dsp, "reduce_scatter counts")
            if cnt[self.rank] != mr.count:
                raise ValueError(f"reduce_scatter: counts[{self.rank}] is {cnt[self.rank]} but this rank's recvbuf has {mr.count} elements")
            if total != ms.count:
                raise ValueError(f"reduce_scatter: counts add up to {total} but sendbuf has {ms.count} elements")
            with nogil:
                red.arm()
                ierr = MPI_Reduce_scatter(ms.ptr, mr.ptr, cnt, MPI_TYPES[ms.dtype], red.mpi_op, self.coll)
        check(ierr, "reduce_scatter")
        if red.avg:
            with nogil:
                eng_scale(mr.ptr, mr.count, mr.dtype, self.size, 1)

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        """Block i of sendbuf goes to rank i; block j of recvbuf comes from rank j."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef int *sc = self.ibuf
        cdef int *sd = self.ibuf + self.size
        cdef int *rc = self.ibuf + 2 * self.size
        cdef int *rd = self.ibuf + 3 * self.size
        cdef int n, ierr
        cdef size_t stotal, rtotal
        CoreComm._same_dtype(ms, mr, "alltoall")
        if ms.ptr == mr.ptr and ms.count:
            raise ValueError("alltoall: sendbuf and recvbuf are the same memory; pass separate buffers")
        if send_counts is None and recv_counts is None:
            if ms.count % self.size or mr.count != ms.count:
                raise ValueError(f"alltoall: sendbuf ({ms.count}) and recvbuf ({mr.count}) must have the same number "
                                 f"of elements, divisible by the group size {self.size} (pass send_counts= and "
                                 "recv_counts= for uneven splits)")
            n = as_int_count(ms.count // self.size, "alltoall")
            with nogil:
                ierr = MPI_Alltoall(ms.ptr, n, MPI_TYPES[ms.dtype], mr.ptr, n, MPI_TYPES[mr.dtype], self.coll)
        else:
            if send_counts is None or recv_counts is None:
                raise ValueError("alltoall: uneven splits need both send_counts and recv_counts")
            stotal = self._counts(send_counts, sc, sd, "alltoall send_counts")
            rtotal = self._counts(recv_counts, rc, rd, "alltoall recv_counts")
            if stotal != ms.count:
                raise ValueError(f"alltoall: send_counts add up to {stotal} but sendbuf has {ms.count} elements")
            if rtotal != mr.count:
                raise ValueError(f"alltoall: recv_counts add up to {rtotal} but recvbuf has {mr.count} elements")
            with nogil:
                ierr = MPI_Alltoallv(ms.ptr, sc, sd, MPI_TYPES[ms.dtype], mr.ptr, rc, rd, MPI_TYPES[mr.dtype], self.coll)
        check(ierr, "alltoall")

    def allgather_watched(self, sendbuf, recvbuf):
        """MPI_Iallgather waited on through the watch: the debug-mode signature exchange, which must
        end in an exception (not a hang) when a rank never arrives."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef int n = as_int_count(ms.count, "allgather"), ierr
        cdef MPI_Request req
        cdef WaitCtx ctx
        if mr.count != ms.count * self.size or mr.dtype != ms.dtype:
            raise ValueError("allgather_watched: recvbuf must hold sendbuf's count x group size, same dtype")
        self.start_ctx(&ctx)
        with nogil:
            ierr = MPI_Iallgather(ms.ptr, n, MPI_TYPES[ms.dtype], mr.ptr, n, MPI_TYPES[mr.dtype], self.coll, &req)
            if not ierr:
                ierr = wait_req(&req, &ctx)
        check(ierr, "allgather")

    def barrier(self):
        cdef int ierr
        with nogil:
            ierr = MPI_Barrier(self.coll)
        check(ierr, "barrier")

    cdef int _peer(self, int peer, bint any_ok, str what) except? -9999:
        if any_ok and peer == -1:
            return MPI_ANY_SOURCE
        if peer < 0 or peer >= self.size:
            raise ValueError(f"{what} rank {peer} is out of range for a group of size {self.size}"
                             + (" (use None for any source)" if any_ok else ""))
        return peer

    cdef int _tag(self, int tag, bint any_ok) except? -9999:
        if any_ok and tag == -1:
            return MPI_ANY_TAG
        if tag < 0 or tag > 32767:   # MPI guarantees tags up to 32767
            raise ValueError(f"tag {tag} is out of range; use 0..32767")
        return tag

    def send(self, buf, int dest, int tag, hook=None):
        cdef int peer = self._peer(dest, False, "send: destination")
        cdef int t = self._tag(tag, False)
        cdef Message m = as_message(buf, False, "buffer")
        cdef int n = as_int_count(m.count, "send"), ierr
        cdef MPI_Request req
        cdef WaitCtx ctx
        self.start_ctx(&ctx, hook)
        with nogil:
            ierr = MPI_Isend(m.ptr, n, MPI_TYPES[m.dtype], peer, t, self.p2p, &req)
            if not ierr:
                ierr = wait_req(&req, &ctx)
        check(ierr, "send")

    def recv(self, buf, int source, int tag, hook=None):
        """Returns (source, tag, count) of the message received."""
        cdef int peer = self._peer(source, True, "recv: source")
        cdef int t = self._tag(tag, True)
        cdef Message m = as_message(buf, True, "buffer")
        cdef int n = as_int_count(m.count, "recv"), ierr, got = 0
        cdef MPI_Status st
        cdef MPI_Request req
        cdef WaitCtx ctx
        self.start_ctx(&ctx, hook)
        with nogil:
            ierr = MPI_Irecv(m.ptr, n, MPI_TYPES[m.dtype], peer, t, self.p2p, &req)
            if not ierr:
                ierr = wait_req_status(&req, &st, &ctx)
        check(ierr, "recv")
        MPI_Get_count(&st, MPI_TYPES[m.dtype], &got)
        return (st.MPI_SOURCE, st.MPI_TAG, got)

    def isend(self, buf, int dest, int tag, hook=None):
        cdef int peer = self._peer(dest, False, "isend: destination")
        cdef int t = self._tag(tag, False)
        cdef Request r = Request.__new__(Request)
        r.msg = as_message(buf, False, "buffer")
        r.what = "MPI_Isend"
        r.hook = hook if hook is not None else self.hook
        self.start_ctx(&r.ctx, r.hook)
        cdef int n = as_int_count(r.msg.count, "isend")
        check(MPI_Isend(r.msg.ptr, n, MPI_TYPES[r.msg.dtype], peer, t, self.p2p, &r.req), "isend")
        return r

    def irecv(self, buf, int source, int tag, hook=None):
        cdef int peer = self._peer(source, True, "irecv: source")
        cdef int t = self._tag(tag, True)
        cdef Request r = Request.__new__(Request)
        r.msg = as_message(buf, True, "buffer")
        r.what = "MPI_Irecv"
        r.hook = hook if hook is not None else self.hook
        self.start_ctx(&r.ctx, r.hook)
        cdef int n = as_int_count(r.msg.count, "irecv")
        check(MPI_Irecv(r.msg.ptr, n, MPI_TYPES[r.msg.dtype], peer, t, self.p2p, &r.req), "irecv")
        return r
