# MPI's native collectives behind the communicator core (engine._core.CoreComm parses and checks;
# this only calls MPI). Broadcast, gather, scatter, alltoall and barrier are posted nonblocking (MPI_I*)
# and waited on through the engine's one wait, so the group's watch (stall warnings, the timeout naming
# who did not arrive), the peers' liveness check and abort() reach them as they reach every other wait.
# The reductions and allgather block inside MPI, where nothing can interrupt them, and the watchdog
# thread watches those (engine.watch; `blocks` says which): their nonblocking forms (Open MPI's libnbc)
# measured up to 2-4x slower than the blocking ones (docs/robustness.md), and a user (Numba) op finds
# its kernel in a thread-local, while MPI runs a nonblocking reduction in whichever thread progresses it.
# Element-wise collectives go in pieces of at most `chunk` elements, so counts past MPI's int limit
# work; the others take int counts (max_count says so before anything starts).


cdef class MpiComm(CoreComm):
    """A group over MPI: native collectives on `coll`, the engine's algorithms over `algo`, the user's
    send/recv over `p2p` (three communicators, so a user's ANY_TAG receive never sees ring traffic)."""
    cdef MPI_Comm coll
    cdef int *ibuf              # 4 x size ints: counts and displacements as MPI takes them
    cdef readonly size_t chunk
    cdef bint abandoned         # a collective was left posted (timeout, abort): MPI may still read ibuf

    def __cinit__(self, Comm coll, Comm algo, Comm p2p, size_t ring_segment_bytes):
        self.coll = coll.ob_mpi
        self.transport = "mpi"
        self.init_core(MpiTransport(algo), MpiTransport(p2p), ring_segment_bytes)
        self.impls |= 1u << IMPL_NATIVE
        self.ibuf = <int*>malloc(4 * self.size * sizeof(int))
        if self.ibuf == NULL:
            raise MemoryError()
        self.chunk = INT_MAX  # MPI counts are ints: larger messages are cut (engine.registry sets the piece)

    def __dealloc__(self):
        if not self.abandoned:
            free(self.ibuf)

    cdef bint blocks(self, Call *c) noexcept nogil:
        return c.red != NULL or c.op == OP_ALLGATHER

    cdef int finish(self, int ierr, MPI_Request *req, WaitCtx *ctx) except -1 nogil:
        """Waits for a posted collective (ierr: its posting's code). MPI moves it only inside MPI_Test,
        so the wait yields between polls and never sleeps. One that ends early (a timeout, an abort)
        stays posted: MPI forbids freeing a collective's request."""
        if ierr:
            return ierr
        ctx.busy_poll = True
        ierr = wait_until(_poll_mpi, NULL, req, ctx, NULL)
        if ierr:
            self.abandoned = True
        return ierr

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

    cdef int run_allreduce(self, const char *src, char *dst, size_t count, RedC *red, int impl,
                           WaitCtx *ctx) except -1 nogil:
        if impl != IMPL_NATIVE:
            return CoreComm.run_allreduce(self, src, dst, count, red, impl, ctx)
        return self.reduction(src, dst, count, red, -1)

    cdef int reduction(self, const char *src, char *dst, size_t count, RedC *red, int root) except -1 nogil:
        """MPI's own allreduce (root < 0) or reduce, in pieces whose counts fit MPI's int."""
        cdef size_t isz = eng_itemsize[red.dtype], off = 0
        cdef int n, ierr
        cdef MPI_Op op = mpi_op(red)
        cdef const void *s
        cdef void *d
        while off < count:
            n = <int>min(self.chunk, count - off)
            s, d = MPI_IN_PLACE if src == dst else src + off * isz, NULL if dst == NULL else dst + off * isz
            if root < 0:
                ierr = MPI_Allreduce(s, d, n, MPI_TYPES[red.dtype], op, self.coll)
            else:
                ierr = MPI_Reduce(s, d, n, MPI_TYPES[red.dtype], op, root, self.coll)
            if ierr:
                return ierr
            off += n
        return 0

    cdef int run_broadcast(self, char *buf, size_t count, int dtype, int root, int impl,
                           WaitCtx *ctx) except -1 nogil:
        cdef size_t isz = eng_itemsize[dtype], off = 0
        cdef int n, ierr
        cdef MPI_Request req
        while off < count:
            n = <int>min(self.chunk, count - off)
            ierr = self.finish(MPI_Ibcast(buf + off * isz, n, MPI_TYPES[dtype], root, self.coll, &req), &req, ctx)
            if ierr:
                return ierr
            off += n
        return 0

    cdef int run_reduce(self, const char *src, char *dst, size_t count, RedC *red, int root, int impl,
                        WaitCtx *ctx) except -1 nogil:
        return self.reduction(src, dst, count, red, root)

    cdef int run_allgather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                           const size_t *displs, WaitCtx *ctx) except -1 nogil:
        cdef size_t isz = eng_itemsize[dtype]
        cdef MPI_Datatype t = MPI_TYPES[dtype]
        if all_equal(counts, self.size):
            return MPI_Allgather(MPI_IN_PLACE if src == dst + self.rank * count * isz else src, <int>count, t,
                                 dst, <int>count, t, self.coll)
        return MPI_Allgatherv(MPI_IN_PLACE if src == dst + displs[self.rank] * isz else src, <int>count, t,
                              dst, self.ints(counts, 0), self.ints(displs, 1), t, self.coll)

    # gather and scatter: always the v-forms. Only the root knows every count (torch's gather of
    # tensors of different sizes gives none to the others), and MPI_Gatherv reads the counts on the
    # root alone, so every rank's call matches whatever the root's counts are.
    cdef int run_gather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                        const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        cdef MPI_Datatype t = MPI_TYPES[dtype]
        cdef MPI_Request req
        return self.finish(MPI_Igatherv(src, <int>count, t, dst, self.ints(counts, 0), self.ints(displs, 1), t, root,
                                        self.coll, &req), &req, ctx)

    cdef int run_scatter(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                         const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        cdef MPI_Datatype t = MPI_TYPES[dtype]
        cdef MPI_Request req
        return self.finish(MPI_Iscatterv(src, self.ints(counts, 0), self.ints(displs, 1), t, dst, <int>count, t, root,
                                         self.coll, &req), &req, ctx)

    cdef int run_reduce_scatter(self, const char *src, char *dst, size_t count, RedC *red,
                                const size_t *counts, const size_t *displs, WaitCtx *ctx) except -1 nogil:
        cdef int ierr
        cdef MPI_Op op = mpi_op(red)
        if all_equal(counts, self.size):
            ierr = MPI_Reduce_scatter_block(src, dst, <int>count, MPI_TYPES[red.dtype], op, self.coll)
        else:
            ierr = MPI_Reduce_scatter(src, dst, self.ints(counts, 0), MPI_TYPES[red.dtype], op, self.coll)
        return ierr

    cdef int run_alltoall(self, const char *src, char *dst, int dtype, const size_t *scounts,
                          const size_t *sdispls, const size_t *rcounts, const size_t *rdispls,
                          bint even, WaitCtx *ctx) except -1 nogil:
        cdef MPI_Datatype t = MPI_TYPES[dtype]
        cdef MPI_Request req
        if even:
            return self.finish(MPI_Ialltoall(src, <int>scounts[0], t, dst, <int>rcounts[0], t, self.coll, &req),
                               &req, ctx)
        return self.finish(MPI_Ialltoallv(src, self.ints(scounts, 0), self.ints(sdispls, 1), t, dst,
                                          self.ints(rcounts, 2), self.ints(rdispls, 3), t, self.coll, &req), &req, ctx)

    cdef int run_barrier(self, WaitCtx *ctx) except -1 nogil:
        cdef MPI_Request req
        return self.finish(MPI_Ibarrier(self.coll, &req), &req, ctx)


cdef int _poll_mpi(void *unused, void *req, bint *done) except -1 nogil:
    cdef int flag = 0, ierr = MPI_Test(<MPI_Request*>req, &flag, MPI_STATUS_IGNORE)
    done[0] = flag != 0
    return ierr
