# The engine's point-to-point allreduce algorithms, each a small class over a Transport whose
# constructor allocates and whose run() only moves data (Gloo's pattern). run() is a nogil C function:
# no Python per step or segment. On an error or a timeout, run() cancels what it still has posted.


cdef enum:
    RING_SLOTS = 4   # receive segments in flight per rank (temporary buffers of the ring)


cdef class RingAllreduce:
    """Segmented, pipelined ring: reduce-scatter then allgather over 2(P-1) steps.

    Step j receives block (r-j-1) from the left neighbour and sends block (r-j) to the right one; a
    block is cut in segments of seg_bytes. The first P-1 steps reduce a received segment into the
    output (dst = tmp op src); the last P-1 receive final segments in place. Each segment is sent on
    to the right as soon as it is ready, so the reduction of one segment overlaps the transfer of the
    next ones (up to RING_SLOTS receives in flight).
    """
    # tmp: RING_SLOTS segments, written only by the left neighbour; sreqs: one per segment sent in a
    # run (grows, never shrinks); rbase[j] / sbase[j]: index of step j's first received / sent segment.

    def __cinit__(self, Transport tp, size_t seg_bytes):
        self.tp = tp
        self.rank = tp.rank
        self.size = tp.size
        if seg_bytes < 16:
            raise ValueError(f"ring segment size must be at least 16 bytes, got {seg_bytes}")
        self.seg_bytes = seg_bytes
        self.tmp = <char*>malloc(RING_SLOTS * seg_bytes)
        self.rreqs = <Req*>calloc(RING_SLOTS, sizeof(Req))
        self.rbase = <size_t*>malloc((2 * self.size) * sizeof(size_t))
        self.sbase = <size_t*>malloc((2 * self.size) * sizeof(size_t))
        if self.tmp == NULL or self.rreqs == NULL or self.rbase == NULL or self.sbase == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.tmp)
        free(self.rreqs)
        free(self.sreqs)
        free(self.rbase)
        free(self.sbase)

    cdef int run(self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                 WaitCtx *ctx) except -1 nogil:
        """Returns 0 or a transport error code; raises (returns -1) when out of memory or the watch
        raises. Whatever is still posted when it fails is cancelled first."""
        cdef int ierr = _ring_run(self, src, dst, count, isz, fn, ctx)
        if ierr:
            self.tp.cancel_all(self.rreqs, RING_SLOTS)
            self.tp.cancel_all(self.sreqs, self.sreq_cap)
        return ierr


cdef int _ring_run(RingAllreduce self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                   WaitCtx *ctx) except -1 nogil:
    cdef int P = self.size, r = self.rank, ierr = 0
    cdef int left = mod(r - 1, P), right = mod(r + 1, P)
    cdef int steps = 2 * (P - 1), j, t, pj = 0, cj = 0
    cdef size_t segc = self.seg_bytes // isz, total_r = 0, total_s = 0
    cdef size_t off, blen, soff, slen, pk = 0, ck = 0, posted = 0, processed = 0, k
    cdef char *buf
    if count == 0:
        return 0
    for j in range(steps):
        self.rbase[j] = total_r
        block_range(count, P, ring_recv_block(r, j, P), &off, &blen)
        total_r += segments(blen, segc)
        self.sbase[j] = total_s
        block_range(count, P, ring_send_block(r, j, P), &off, &blen)
        total_s += segments(blen, segc)
    self.rbase[steps] = total_r
    grow(<void**>&self.sreqs, &self.sreq_cap, total_s, sizeof(Req), "ring allreduce")
    memset(self.sreqs, 0, self.sreq_cap * sizeof(Req))
    memset(self.rreqs, 0, RING_SLOTS * sizeof(Req))

    # Step 0 sends this rank's own block, straight from the input.
    block_range(count, P, r, &off, &blen)
    for k in range(segments(blen, segc)):
        slen = min(segc, blen - k * segc)
        ierr = self.tp.isend(src + (off + k * segc) * isz, slen * isz, right, 0, &self.sreqs[k])
        if ierr:
            return ierr

    while processed < total_r:
        # Post receives ahead, in the order the left neighbour sends.
        while posted < total_r and posted < processed + RING_SLOTS:
            while self.rbase[pj + 1] <= posted:
                pj += 1
            pk = posted - self.rbase[pj]
            block_range(count, P, ring_recv_block(r, pj, P), &off, &blen)
            slen = min(segc, blen - pk * segc)
            if pj < P - 1:
                buf = self.tmp + (posted % RING_SLOTS) * self.seg_bytes
            else:
                # Allgather receives in place: the segment's reduce-scatter send (step t) must
                # have been posted (it is, once step t-1's segment pk was processed) and be done.
                t = pj - (P - 1)
                if t > 0 and self.rbase[t - 1] + pk >= processed:
                    break
                ierr = self.tp.wait(&self.sreqs[self.sbase[t] + pk], NULL, ctx)
                if ierr:
                    return ierr
                buf = dst + (off + pk * segc) * isz
            ierr = self.tp.irecv(buf, slen * isz, left, 0, &self.rreqs[posted % RING_SLOTS])
            if ierr:
                return ierr
            posted += 1

        while self.rbase[cj + 1] <= processed:
            cj += 1
        ck = processed - self.rbase[cj]
        block_range(count, P, ring_recv_block(r, cj, P), &off, &blen)
        soff = off + ck * segc
        slen = min(segc, blen - ck * segc)
        ierr = self.tp.wait(&self.rreqs[processed % RING_SLOTS], NULL, ctx)
        if ierr:
            return ierr
        if cj < P - 1:
            fn(dst + soff * isz, self.tmp + (processed % RING_SLOTS) * self.seg_bytes,
               src + soff * isz, slen)
        if cj + 1 < steps:
            ierr = self.tp.isend(dst + soff * isz, slen * isz, right, 0, &self.sreqs[self.sbase[cj + 1] + ck])
            if ierr:
                return ierr
        processed += 1
    for k in range(total_s):
        ierr = self.tp.wait(&self.sreqs[k], NULL, ctx)
        if ierr:
            return ierr
    return 0


cdef class RecursiveDoubling:
    """Latency-optimal allreduce: log2(P) exchanges of the whole vector with partners at distance
    1, 2, 4, ...; for P not a power of two the first 2*(P - p2) ranks pair up first (Rabenseifner's
    fold). Each pair reduces lower-rank data first, so every rank ends with the same bits."""

    def __cinit__(self, Transport tp):
        self.tp = tp
        self.rank = tp.rank
        self.size = tp.size

    def __dealloc__(self):
        free(self.tmp)

    cdef int run(self, const char *src, char *dst, size_t count, size_t isz, eng_reduce_fn fn,
                 WaitCtx *ctx) except -1 nogil:
        cdef int P = self.size, r = self.rank, ierr = 0
        cdef int p2 = pow2_below(P), rem = P - p2, newrank = rdouble_rank(r, P), mask, peer
        cdef size_t nbytes = count * isz
        if src != dst and nbytes:
            memcpy(dst, src, nbytes)
        if count == 0:
            return 0
        grow(<void**>&self.tmp, &self.tmp_cap, nbytes, 1, "recursive doubling")
        if r < 2 * rem:                 # fold: the even rank of each leading pair hands its data on
            if newrank < 0:
                ierr = peer_exchange(self.tp, dst, nbytes, r + 1, NULL, 0, -1, 1, ctx)
            else:
                ierr = peer_exchange(self.tp, NULL, 0, -1, self.tmp, nbytes, r - 1, 1, ctx)
                if not ierr:
                    fn(dst, self.tmp, dst, count)
            if ierr:
                return ierr
        if newrank >= 0:
            mask = 1
            while mask < p2:
                peer = rdouble_peer(newrank, mask, P)
                ierr = peer_exchange(self.tp, dst, nbytes, peer, self.tmp, nbytes, peer, 2, ctx)
                if ierr:
                    return ierr
                if peer < r:            # the lower rank's data first: every rank gets the same bits
                    fn(dst, self.tmp, dst, count)
                else:
                    fn(dst, dst, self.tmp, count)
                mask <<= 1
        if r < 2 * rem:                 # unfold: the folded rank gets the result back
            if newrank >= 0:
                ierr = peer_exchange(self.tp, dst, nbytes, r - 1, NULL, 0, -1, 3, ctx)
            else:
                ierr = peer_exchange(self.tp, NULL, 0, -1, dst, nbytes, r + 1, 3, ctx)
        return ierr
