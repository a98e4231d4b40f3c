# The collectives over point-to-point, the same code on every transport (TCP's own; forced or tuned
# over shm and MPI): one function per algorithm over a P2PCollectives' Transport; which rank talks to which in each step
# is schedule.pxd's (pure functions, played rank by rank in tests/test_schedules.py). The allreduce's
# ring and recursive doubling are pyx/ring.pxi's.
#
# Each algorithm posts into this object's requests, waits through the watch, checks that every message
# brought exactly the bytes this rank expects (a rank whose counts differ is named, not read past), and
# on an error, or an exception from the watch, cancels what it still has posted before it returns.
# Nothing here allocates per call once the requests and the workspace have grown to a size.


# Tags on the algorithms' channel (the ring and recursive doubling use 0..3): a rank a collective ahead
# of its peer never has its messages taken for this one's.
cdef enum:
    PIPELINE_SLOTS = 4      # receive segments in flight per rank of the pipelined broadcast
    TAG_P2P_BCAST = 8
    TAG_P2P_REDUCE = 9
    TAG_P2P_ALLGATHER = 10
    TAG_P2P_GATHER = 11
    TAG_P2P_SCATTER = 12
    TAG_P2P_REDUCE_SCATTER = 13
    TAG_P2P_ALLTOALL = 14
    TAG_P2P_BARRIER = 15


# ---- the algorithms ----

cdef class P2PCollectives:
    """Every collective but allreduce over one transport's point-to-point (the algorithms' channel).
    Its state (requests, expected lengths, workspace) is declared in pyx/engine/_core.pxd."""

    def __cinit__(self, Transport tp, size_t seg_bytes):
        self.tp = tp
        self.rank, self.size = tp.rank, tp.size
        self.seg_bytes = max(seg_bytes, <size_t>4096)
        self.blocks = <size_t*>malloc(2 * self.size * sizeof(size_t))
        if self.blocks == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.reqs)
        free(self.expect)
        free(self.blocks)
        free(self.work)

    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """The call's entry (CoreComm.run sends every point-to-point entry here, on every transport)."""
        cdef size_t isz = eng_itemsize[c.dtype] if c.dtype >= 0 else 0     # (a barrier has no dtype: -1)
        cdef const size_t *counts = c.counts
        cdef const size_t *displs = c.displs
        if c.op == OP_BROADCAST:
            if c.impl == IMPL_PIPELINE:
                return _broadcast_pipeline(self, c.dst, c.count * isz, c.root, ctx)
            return _broadcast_tree(self, c.dst, c.count * isz, c.root, ctx)
        if c.op == OP_REDUCE:
            if c.impl == IMPL_RSAG:
                return _reduce_rsag(self, c.src, c.dst, c.count, isz, c.red.fn, c.root, ctx)
            return _reduce_tree(self, c.src, c.dst, c.count, isz, c.red.fn, c.root, ctx)
        if c.op == OP_ALLGATHER:
            return _allgather_ring(self, c.src, c.dst, isz, counts, displs, ctx)
        if c.op == OP_GATHER:
            return _p2p_linear(self, True, c.src, c.dst, c.count, isz, counts, displs, c.root, ctx)
        if c.op == OP_SCATTER:
            return _p2p_linear(self, False, c.src, c.dst, c.count, isz, counts, displs, c.root, ctx)
        if c.op == OP_REDUCE_SCATTER:
            return _reduce_scatter_ring(self, c.src, c.dst, isz, c.red.fn, counts, displs, ctx)
        if c.op == OP_ALLTOALL:
            return _alltoall_pairwise(self, c.src, c.dst, isz, c.counts, c.displs, c.rcounts, c.rdispls, ctx)
        return _barrier_dissemination(self, ctx)


cdef int _p2p_reserve(P2PCollectives self, size_t nreqs, size_t work_bytes) except -1 nogil:
    """Room for nreqs requests (cleared, all sends) and work_bytes of workspace."""
    cdef size_t reqs_cap = self.cap     # both arrays hold self.cap; expect's growth sets it
    grow(<void**>&self.reqs, &reqs_cap, nreqs, sizeof(Req), "point-to-point collective")
    grow(<void**>&self.expect, &self.cap, nreqs, sizeof(size_t), "point-to-point collective")
    if nreqs:
        memset(self.reqs, 0, nreqs * sizeof(Req))
        memset(self.expect, 0xff, nreqs * sizeof(size_t))
    grow(<void**>&self.work, &self.work_cap, work_bytes, 1, "point-to-point collective")
    return 0


cdef int _p2p_finish(P2PCollectives self, size_t n, int ierr, WaitCtx *ctx) except -1 nogil:
    """Waits for requests 0..n-1 (receives checked against self.expect), unless ierr; on an error or
    an exception cancels what is still posted. Returns the error."""
    cdef size_t i
    cdef Status st
    cdef bint clean = False
    try:
        for i in range(n):
            if ierr:
                break
            st.nbytes = 0
            ierr = self.tp.wait(&self.reqs[i], &st, ctx)
            if not ierr and self.expect[i] != SIZE_MAX and st.nbytes != self.expect[i]:
                ierr = self.tp.mismatch(st.source)
        clean = not ierr
    finally:
        if not clean:
            self.tp.cancel_all(self.reqs, n)
    return ierr


cdef int _broadcast_tree(P2PCollectives self, char *buf, size_t n, int root, WaitCtx *ctx) except -1 nogil:
    """Binomial tree: log2(P) rounds; each rank receives the message once, then passes it on."""
    cdef int P = self.size, vr = (self.rank - root + P) % P, m, ierr = 0
    cdef size_t k = 0
    if vr:
        ierr = peer_exchange(self.tp, NULL, 0, -1, buf, n, (tree_parent(vr) + root) % P, TAG_P2P_BCAST, ctx)
        if ierr:
            return ierr
    _p2p_reserve(self, 32, 0)
    m = tree_span(vr, P) >> 1
    while m > 0 and not ierr:
        if vr + m < P:
            ierr = self.tp.isend(buf, n, (vr + m + root) % P, TAG_P2P_BCAST, &self.reqs[k])
            if not ierr:
                k += 1
        m >>= 1
    return _p2p_finish(self, k, ierr, ctx)


cdef int _broadcast_pipeline(P2PCollectives self, char *buf, size_t n, int root, WaitCtx *ctx) except -1 nogil:
    """A chain from the root (rank order from it), in segments: each rank passes a segment on as soon
    as it has it, so every link carries the message once, all at the same time."""
    cdef int P = self.size, vr = (self.rank - root + P) % P, ierr = 0
    cdef int prev = (self.rank - 1 + P) % P, nxt = (self.rank + 1) % P
    cdef size_t seg = self.seg_bytes, nseg = (n + seg - 1) // seg, k, posted = 0, sent = 0, w
    cdef Req *rq
    cdef Status st
    cdef bint clean = False
    if n == 0:
        return 0
    _p2p_reserve(self, nseg + PIPELINE_SLOTS, 0)
    rq = self.reqs + nseg                       # receives: a window of PIPELINE_SLOTS segments
    if vr == 0:
        for k in range(nseg):
            ierr = self.tp.isend(buf + k * seg, min(seg, n - k * seg), nxt, TAG_P2P_BCAST, &self.reqs[k])
            if ierr:
                break
            sent += 1
        return _p2p_finish(self, sent, ierr, ctx)
    try:
        for k in range(nseg):
            while not ierr and posted < nseg and posted < k + PIPELINE_SLOTS:
                ierr = self.tp.irecv(buf + posted * seg, min(seg, n - posted * seg), prev, TAG_P2P_BCAST,
                                     &rq[posted % PIPELINE_SLOTS])
                posted += 1
            if ierr:
                break
            w = min(seg, n - k * seg)
            st.nbytes = 0
            ierr = self.tp.wait(&rq[k % PIPELINE_SLOTS], &st, ctx)
            if not ierr and st.nbytes != w:
                ierr = self.tp.mismatch(prev)
            if ierr:
                break
            if vr < P - 1:
                ierr = self.tp.isend(buf + k * seg, w, nxt, TAG_P2P_BCAST, &self.reqs[k])
                if ierr:
                    break
                sent += 1
        clean = not ierr
    finally:
        if not clean:
            self.tp.cancel_all(rq, PIPELINE_SLOTS)
            self.tp.cancel_all(self.reqs, sent)
    if ierr:
        return ierr
    return _p2p_finish(self, sent, 0, ctx)


cdef int _reduce_tree(P2PCollectives self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                      int root, WaitCtx *ctx) except -1 nogil:
    """Binomial tree towards the root; a rank reduces its children's partial results in relative
    rank order (its own first), so the root's bits do not depend on timing."""
    cdef int P = self.size, vr = (self.rank - root + P) % P, m, span, ierr
    cdef size_t n = count * isz
    cdef bint is_root = vr == 0
    cdef char *acc
    cdef char *tmp
    _p2p_reserve(self, 2, n if is_root else 2 * n)
    acc = dst if is_root else self.work
    tmp = self.work if is_root else self.work + n
    if acc != src and n:
        memcpy(acc, src, n)
    span = tree_span(vr, P)
    m = 1
    while m < span:
        if vr + m < P:
            ierr = peer_exchange(self.tp, NULL, 0, -1, tmp, n, (vr + m + root) % P, TAG_P2P_REDUCE, ctx)
            if ierr:
                return ierr
            fn(acc, acc, tmp, count)
        m <<= 1
    if is_root:
        return 0
    return peer_exchange(self.tp, acc, n, (tree_parent(vr) + root) % P, NULL, 0, -1, TAG_P2P_REDUCE, ctx)


cdef int _reduce_rsag(P2PCollectives self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                      int root, WaitCtx *ctx) except -1 nogil:
    """Large reduce: the ring's reduce-scatter leaves each rank one reduced block, the root gathers
    them (each link carries about twice the message, not log2(P) times)."""
    cdef int P = self.size, i, ierr
    cdef size_t off, length, largest = 0
    cdef size_t *counts = self.blocks
    cdef size_t *displs = self.blocks + P
    cdef char *mine
    for i in range(P):
        block_range(count, P, i, &off, &length)
        counts[i], displs[i] = length, off
        largest = max(largest, length)
    if self.rank == root:
        mine = dst + displs[self.rank] * isz
    else:
        _p2p_reserve(self, 0, 4 * largest * isz)
        mine = self.work + 3 * largest * isz    # past what the reduce-scatter uses
    ierr = _reduce_scatter_ring(self, src, mine, isz, fn, counts, displs, ctx)
    if ierr:
        return ierr
    return _p2p_linear(self, True, mine, dst, counts[self.rank], isz, counts, displs, root, ctx)


cdef int _allgather_ring(P2PCollectives self, const char *src, char *dst, size_t isz, const size_t *counts,
                         const size_t *displs, WaitCtx *ctx) except -1 nogil:
    """P - 1 steps: each rank passes to the right the block it received from the left a step before."""
    cdef int P = self.size, r = self.rank, j, sb, rb, ierr
    cdef char *own = dst + displs[r] * isz
    if src != own and counts[r]:
        memcpy(own, src, counts[r] * isz)
    for j in range(P - 1):
        sb, rb = ring_send_block(r, j, P), ring_recv_block(r, j, P)
        ierr = peer_exchange(self.tp, dst + displs[sb] * isz, counts[sb] * isz, (r + 1) % P,
                             dst + displs[rb] * isz, counts[rb] * isz, (r - 1 + P) % P, TAG_P2P_ALLGATHER, ctx)
        if ierr:
            return ierr
    return 0


cdef int _p2p_linear(P2PCollectives self, bint gather, const char *src, char *dst, size_t count, size_t isz,
                     const size_t *counts, const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
    """Gather: every rank sends its part to the root, which receives them all at once. Only the root
    needs the counts (torch's gather of parts of different sizes gives the others none). Scatter:
    the root sends every rank its part at once."""
    cdef int P = self.size, q, ierr = 0, tag = TAG_P2P_GATHER if gather else TAG_P2P_SCATTER
    cdef size_t k = 0, n
    cdef char *part
    if self.rank != root:
        if gather:
            return peer_exchange(self.tp, src, count * isz, root, NULL, 0, -1, tag, ctx)
        return peer_exchange(self.tp, NULL, 0, -1, dst, count * isz, root, tag, ctx)
    _p2p_reserve(self, P, 0)
    for q in range(P):
        n, part = counts[q] * isz, (dst if gather else <char*>src) + displs[q] * isz
        if q == root:
            if n and gather and part != src:
                memcpy(part, src, n)
            elif n and not gather and part != dst:
                memcpy(dst, part, n)
            continue
        if gather:
            ierr = self.tp.irecv(part, n, q, tag, &self.reqs[k])
            self.expect[k] = n
        else:
            ierr = self.tp.isend(part, n, q, tag, &self.reqs[k])
        if ierr:
            break
        k += 1
    return _p2p_finish(self, k, ierr, ctx)


cdef int _reduce_scatter_ring(P2PCollectives self, const char *src, char *dst, size_t isz, eng_reduce_fn fn,
                              const size_t *counts, const size_t *displs, WaitCtx *ctx) except -1 nogil:
    """P - 1 steps around the ring (schedule.pxd): a rank adds its own part of a block to
    the partial sum that came from the left and passes it on. Each block is reduced along one chain,
    in the same order on every run, so its bits do not depend on timing."""
    cdef int P = self.size, r = self.rank, j, sb, rb, ierr, i
    cdef size_t largest = 0
    cdef char *acc[2]
    cdef char *tmp
    cdef char *out
    cdef const char *sendp
    for i in range(P):
        largest = max(largest, counts[i] * isz)
    _p2p_reserve(self, 2, 3 * largest)
    acc[0], acc[1], tmp = self.work, self.work + largest, self.work + 2 * largest
    for j in range(P - 1):
        sb, rb = ring_send_block(r, j + 1, P), ring_recv_block(r, j + 1, P)
        sendp = src + displs[sb] * isz if j == 0 else acc[(j - 1) % 2]
        out = dst if j == P - 2 else acc[j % 2]
        ierr = peer_exchange(self.tp, sendp, counts[sb] * isz, (r + 1) % P, tmp, counts[rb] * isz, (r - 1 + P) % P,
                             TAG_P2P_REDUCE_SCATTER, ctx)
        if ierr:
            return ierr
        fn(out, tmp, src + displs[rb] * isz, counts[rb])
    return 0


cdef int _alltoall_pairwise(P2PCollectives self, const char *src, char *dst, size_t isz, const size_t *scounts,
                            const size_t *sdispls, const size_t *rcounts, const size_t *rdispls,
                            WaitCtx *ctx) except -1 nogil:
    """Every pair exchanges its blocks directly, all at once; the i-th send goes to rank r+i and the
    i-th receive comes from rank r-i, so no rank is everybody's first destination."""
    cdef int P = self.size, r = self.rank, i, to, frm, ierr = 0
    cdef size_t k = 0
    if scounts[r] and dst + rdispls[r] * isz != src + sdispls[r] * isz:
        memcpy(dst + rdispls[r] * isz, src + sdispls[r] * isz, scounts[r] * isz)
    _p2p_reserve(self, 2 * P, 0)
    for i in range(1, P):
        shift_peers(r, i, P, &to, &frm)
        ierr = self.tp.irecv(dst + rdispls[frm] * isz, rcounts[frm] * isz, frm, TAG_P2P_ALLTOALL, &self.reqs[k])
        if ierr:
            break
        self.expect[k] = rcounts[frm] * isz
        k += 1
        ierr = self.tp.isend(src + sdispls[to] * isz, scounts[to] * isz, to, TAG_P2P_ALLTOALL, &self.reqs[k])
        if ierr:
            break
        k += 1
    return _p2p_finish(self, k, ierr, ctx)


cdef int _barrier_dissemination(P2PCollectives self, WaitCtx *ctx) except -1 nogil:
    """ceil(log2(P)) rounds: in round k every rank signals rank r + 2^k and hears from rank r - 2^k."""
    cdef int P = self.size, r = self.rank, dist = 1, to, frm, ierr = 0
    while dist < P and not ierr:
        shift_peers(r, dist, P, &to, &frm)
        ierr = peer_exchange(self.tp, NULL, 0, to, NULL, 0, frm, TAG_P2P_BARRIER, ctx)
        dist <<= 1
    return ierr
