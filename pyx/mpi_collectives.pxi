# MPI's native collectives behind the communicator core (engine._core.CoreComm parses and checks;
# this only calls MPI). Broadcast, gather, scatter, alltoall and barrier are posted nonblocking (MPI_I*)
# and waited on through the engine's one wait, so the group's watch (stall warnings, the timeout naming
# who did not arrive), the peers' liveness check and abort() reach them as they reach every other wait.
# The reductions and allgather block inside MPI, where nothing can interrupt them, and the watchdog
# thread watches those (engine.watch; `blocks` says which; where receives from any rank probe they
# are posted too, `posts`): their nonblocking forms (Open MPI's libnbc)
# measured up to 2-4x slower than the blocking ones (docs/robustness.md), and a user (Numba) op finds
# its kernel in a thread-local, while MPI runs a nonblocking reduction in whichever thread progresses it.
# Element-wise collectives go in pieces of at most `chunk` elements, so counts past MPI's int limit
# work; the others take int counts (max_count says so before anything starts).


cdef class MpiComm(CoreComm):
    """A group over MPI: native collectives on `coll`, the engine's algorithms over `algo`, the user's
    send/recv over `p2p` (three communicators, so a user's ANY_TAG receive never sees ring traffic)."""
    cdef MPI_Comm coll
    cdef MpiTransport tp        # the algorithms' transport, which keeps MPI's code of a failed call
    cdef int *ibuf              # 4 x size ints: counts and displacements as MPI takes them
    cdef readonly size_t chunk
    cdef bint abandoned         # a collective was left posted (timeout, abort): MPI may still read ibuf
    cdef int native_op          # the op (OP_*) of the MPI collective run() runs
    cdef int in_native          # 1 + the op (OP_*) of MPI's own collective a wait is in, or 0
    cdef object comms           # the group's MPI communicators (mpi4py's) it frees with its transports, or None

    def __cinit__(self, Comm coll, Comm algo, Comm p2p, size_t ring_segment_bytes, int max_tag=0):
        self.coll = coll.ob_mpi
        self.transport = "mpi"
        self.tp = MpiTransport(algo, True, max_tag)
        self.init_core(self.tp, MpiTransport(p2p), ring_segment_bytes)
        self.impls |= 1u << IMPL_NATIVE
        self.reduce_scatters_in_place = False   # (an output inside the input is given a copy of the input)
        self.ibuf = <int*>malloc(4 * self.size * sizeof(int))
        if self.ibuf == NULL:
            raise MemoryError()
        self.chunk = INT_MAX  # MPI counts are ints: larger messages are cut (engine.registry sets the piece)

    def free_communicators(self, comms):
        """Frees comms (the group's MPI communicators) with the transports: at once if they are gone,
        else at release(), or when the last call inside leaves after it. MPI forbids freeing a
        communicator while a call uses it (abort() can't end a blocking MPI collective)."""
        self.comms = list(comms)
        if self.released:
            self._free_comms()

    cdef void release_transports(self) noexcept:
        CoreComm.release_transports(self)
        if self.comms is not None:   # (what peers sent on the group's channels that nobody took goes first)
            self.tp.drain()
            (<MpiTransport>self.user_tp).drain()
        self._free_comms()

    cdef void _free_comms(self) noexcept:
        comms, self.comms = self.comms, None
        for c in comms or ():
            try:
                if c != _MPI.COMM_NULL:
                    c.Free()
            except Exception as exc:   # (the group's end goes on: one communicator's failure is said)
                print(f"engine: freeing an MPI communicator of the group failed: {exc}", file=sys.stderr)

    def __dealloc__(self):
        if not self.abandoned:
            free(self.ibuf)

    cdef bint blocks(self, Call *c) noexcept nogil:
        return (c.red != NULL or c.op == OP_ALLGATHER) and not self.posts(c)

    cdef bint posts(self, Call *c) noexcept nogil:
        """Whether a collective that would block inside MPI is posted and waited on instead: where
        receives from any rank wait for a probe to find their message (ENGINE_MPI_ANY_SOURCE=probe), a
        blocking collective would never look (MPI moves only posted receives), and a sender that waits
        for its message before it joins the collective would wait for ever. Every rank of the group
        decides alike (MPI never matches a blocking collective with a nonblocking one): by the group's
        mode, which its ranks compare, and the op. A user (Numba) op blocks still: its kernel is found
        through the calling thread."""
        return self.tp.probed is not None and (c.red == NULL or c.red.code >= 0)

    cdef int finish(self, int ierr, MPI_Request *req, WaitCtx *ctx) except -1 nogil:
        """Waits for a posted collective (ierr: its posting's code). MPI moves it only inside MPI_Test,
        so the wait yields between polls and never sleeps: a rank that napped between the steps of a
        pipelined collective would stall its peers at every step. A barrier moves no data: it backs
        off as the engine's own waits do, so ranks waiting there for a late one leave their cores.
        One that ends early (a timeout, an abort) stays posted: MPI forbids freeing a collective's
        request."""
        cdef bint earlier = self.abandoned
        if ierr:
            return self.tp.failed(ierr)
        ctx.busy_poll = self.native_op != OP_BARRIER
        self.abandoned = True   # (until it completes: a timeout raises out of the wait)
        self.in_native = self.native_op + 1
        try:
            ierr = wait_until(_poll_mpi, <void*>self.tp, req, ctx, NULL)
        finally:   # (the watch's timeout raises out of the wait)
            self.in_native = 0
        if not ierr:
            self.abandoned = earlier
        return ierr

    def waiting_on(self):
        """Whom this rank's collective waits on, as the message its wait is on says (an algorithm of the
        engine's over MPI's point-to-point), for a timeout's report. MPI's own collectives say nothing:
        that such a wait can't tell a late rank from one already past it (the arrival notes can't: a
        rank notes its arrival once it has waited) is said instead."""
        cdef int q = self.tp.awaited_peer
        if self.in_native:
            return (f"this rank waits inside MPI's own {OP_KIND_NAMES[self.in_native - 1]}, which does not say "
                    "which ranks are past it: a rank named as not arriving may have passed it at once, as ranks "
                    "that name different roots or counts do (debug mode compares them first: ENGINE_DEBUG=1)")
        if not 0 <= q < self.size:
            return None
        return (f"this rank waits on rank {q}: its {'send to' if self.tp.awaited_send else 'receive from'} that "
                "rank, posted to MPI, has not completed")

    def set_any_source_by_probe(self, bint on):
        """Receives from any rank wait in MPI_Improbe instead of being posted (engine.mpi.any_source_by_probe);
        the algorithms' and MPI's collectives' waits move them too. (The algorithms name every peer.)"""
        (<MpiTransport>self.user_tp).probe_any_source(on, self.tp)

    @property
    def any_source_by_probe(self):
        return (<MpiTransport>self.user_tp).probe_any

    @property
    def max_tag(self):
        """The largest tag its algorithms may use: MPI's, or ENGINE_MPI_TAG_UB below it (0: unknown)."""
        return self.tp.max_tag

    def set_chunk(self, size_t elements):
        """Largest piece of an element-wise native collective (tests make it tiny to reach the loop)."""
        if elements == 0 or elements > <size_t>INT_MAX:
            raise ValueError(f"chunk must be in 1..{INT_MAX} elements")
        self.chunk = elements

    cdef size_t max_count(self, int op) noexcept:
        if op == OP_ALLGATHER or op == OP_GATHER or op == OP_SCATTER or op == OP_REDUCE_SCATTER or op == OP_ALLTOALL:
            return INT_MAX
        return SIZE_MAX

    cdef int *ints(self, const size_t *counts, int k) noexcept nogil:
        """counts as MPI's ints (in slot k of ibuf); the core checked that they fit."""
        cdef int i
        cdef int *out = self.ibuf + k * self.size
        for i in range(self.size):
            out[i] = <int>counts[i]
        return out

    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """MPI's own collectives (IMPL_NATIVE); the engine's algorithms over MPI are CoreComm's."""
        cdef MPI_Datatype t
        cdef MPI_Request req
        cdef size_t isz
        if c.impl != IMPL_NATIVE:
            return CoreComm.run(self, c, ctx)
        self.native_op = c.op
        if c.op == OP_ALLREDUCE or c.op == OP_REDUCE or c.op == OP_BROADCAST:
            return self.chunked(c, ctx)
        if c.op == OP_BARRIER:
            return self.finish(MPI_Ibarrier(self.coll, &req), &req, ctx)
        t, isz = MPI_TYPES[c.dtype], eng_itemsize[c.dtype]
        cdef bint posts = self.posts(c)
        cdef const void *src
        cdef void *dst
        if c.op == OP_ALLGATHER and all_equal(c.counts, self.size):
            src = MPI_IN_PLACE if c.src == c.dst + self.rank * c.count * isz else c.src
            if posts:
                return self.finish(MPI_Iallgather(src, <int>c.count, t, c.dst, <int>c.count, t, self.coll, &req), &req,
                                   ctx)
            return self.tp.failed(MPI_Allgather(src, <int>c.count, t, c.dst, <int>c.count, t, self.coll))
        if c.op == OP_ALLGATHER:
            src = MPI_IN_PLACE if c.src == c.dst + c.displs[self.rank] * isz else c.src
            if posts:
                return self.finish(MPI_Iallgatherv(src, <int>c.count, t, c.dst, self.ints(c.counts, 0),
                                                   self.ints(c.displs, 1), t, self.coll, &req), &req, ctx)
            return self.tp.failed(MPI_Allgatherv(src, <int>c.count, t, c.dst, self.ints(c.counts, 0),
                                                 self.ints(c.displs, 1), t, self.coll))
        # gather and scatter: always the v-forms. Only the root knows every count (torch's gather of
        # tensors of different sizes gives none to the others), and MPI_Gatherv reads the counts on the
        # root alone, so every rank's call matches whatever the root's counts are.
        # (in place on the root, as MPI says it: the root's part already in its place, MPI_IN_PLACE for it;
        # MPI's buffers must not alias, and MPICH refuses it)
        if c.op == OP_GATHER:
            src = MPI_IN_PLACE if self.rank == c.root and c.src == c.dst + c.displs[c.root] * isz else c.src
            return self.finish(MPI_Igatherv(src, <int>c.count, t, c.dst, self.ints(c.counts, 0), self.ints(c.displs, 1),
                                            t, c.root, self.coll, &req), &req, ctx)
        if c.op == OP_SCATTER:
            dst = MPI_IN_PLACE if self.rank == c.root and c.dst == c.src + c.displs[c.root] * isz else c.dst
            return self.finish(MPI_Iscatterv(c.src, self.ints(c.counts, 0), self.ints(c.displs, 1), t, dst, <int>c.count,
                                             t, c.root, self.coll, &req), &req, ctx)
        if c.op == OP_REDUCE_SCATTER and all_equal(c.counts, self.size):
            if posts:
                return self.finish(MPI_Ireduce_scatter_block(c.src, c.dst, <int>c.count, t, mpi_op(c.red), self.coll,
                                                             &req), &req, ctx)
            return self.tp.failed(MPI_Reduce_scatter_block(c.src, c.dst, <int>c.count, t, mpi_op(c.red), self.coll))
        if c.op == OP_REDUCE_SCATTER:
            if posts:
                return self.finish(MPI_Ireduce_scatter(c.src, c.dst, self.ints(c.counts, 0), t, mpi_op(c.red),
                                                       self.coll, &req), &req, ctx)
            return self.tp.failed(MPI_Reduce_scatter(c.src, c.dst, self.ints(c.counts, 0), t, mpi_op(c.red), self.coll))
        if c.even:
            return self.finish(MPI_Ialltoall(c.src, <int>c.counts[0], t, c.dst, <int>c.rcounts[0], t, self.coll, &req),
                               &req, ctx)
        return self.finish(MPI_Ialltoallv(c.src, self.ints(c.counts, 0), self.ints(c.displs, 1), t, c.dst,
                                          self.ints(c.rcounts, 2), self.ints(c.rdispls, 3), t, self.coll, &req), &req, ctx)

    cdef int chunked(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """MPI's own allreduce, reduce (blocking) or broadcast (posted, then waited on), in pieces whose
        counts fit MPI's int."""
        cdef size_t isz = eng_itemsize[c.dtype], off = 0
        cdef int n, ierr
        cdef MPI_Datatype t = MPI_TYPES[c.dtype]
        cdef MPI_Op op = mpi_op(c.red) if c.red != NULL else MPI_OP_NULL
        cdef MPI_Request req
        cdef void *d
        cdef const void *s
        cdef bint posts = self.posts(c)
        while off < c.count:
            n = <int>min(self.chunk, c.count - off)
            d = NULL if c.dst == NULL else c.dst + off * isz
            if c.op == OP_BROADCAST:
                ierr = self.finish(MPI_Ibcast(d, n, t, c.root, self.coll, &req), &req, ctx)
            else:
                s = MPI_IN_PLACE if c.src == c.dst else c.src + off * isz
                if c.op == OP_ALLREDUCE and posts:
                    ierr = self.finish(MPI_Iallreduce(s, d, n, t, op, self.coll, &req), &req, ctx)
                elif c.op == OP_ALLREDUCE:
                    ierr = self.tp.failed(MPI_Allreduce(s, d, n, t, op, self.coll))
                elif posts:
                    ierr = self.finish(MPI_Ireduce(s, d, n, t, op, c.root, self.coll, &req), &req, ctx)
                else:
                    ierr = self.tp.failed(MPI_Reduce(s, d, n, t, op, c.root, self.coll))
            if ierr:
                return ierr
            off += n
        return 0


cdef int _poll_mpi(void *tp, void *req, bint *done) except -1 nogil:
    cdef int flag = 0, ierr = (<MpiTransport>tp).move_probed()
    if ierr:
        return ierr
    ierr = MPI_Test(<MPI_Request*>req, &flag, MPI_STATUS_IGNORE)
    done[0] = flag != 0
    return (<MpiTransport>tp).failed(ierr)
