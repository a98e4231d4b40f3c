# Every collective on the segment (see shm_segment.pxi for the step protocol). Each is a loop of
# steps over chunks of at most one half-slot, so messages of any size go through a fixed segment:
#
#   allreduce  oneshot: every rank copies its chunk in, every rank reduces all P copies (one sync);
#              twoshot: every rank copies in, reduces its 1/P block of the chunk (reduce-scatter),
#              then copies the others' reduced blocks out (allgather); a rank runs ahead into the
#              next chunk while its peers finish this one (double-buffered halves).
#   reduce     oneshot to the root, or twoshot's reduce-scatter with the root gathering the blocks.
#   broadcast, scatter: the root copies in, the others copy out.  gather: the reverse.
#   allgather, alltoall, reduce_scatter: everyone copies in, everyone copies out what is theirs.
#
# Reductions run in rank order 0..P-1 on whichever rank computes a block, so every rank gets the
# same bits. Counts a peer states in the segment (gather, scatter, alltoall) are checked against
# what this rank expects before anything is copied.

cdef inline uint64_t _sig_word(int op, int dtype, int redop, int algo, int root) noexcept nogil:
    return (<uint64_t>(op & 0xff) | (<uint64_t>((dtype + 1) & 0xff) << 8) | (<uint64_t>((redop + 2) & 0xff) << 16)
            | (<uint64_t>((algo + 1) & 0xff) << 24) | (<uint64_t>(root + 1) << 32))


cdef inline int _redop(RedC *red) noexcept nogil:
    return 7 if red.avg else red.code


cdef uint64_t _counts_hash(const size_t *counts, int n) noexcept nogil:
    """FNV-1a over the per-rank counts of an uneven collective (every rank must pass the same)."""
    cdef uint64_t h = 1469598103934665603ULL
    cdef int i
    if counts == NULL:
        return 0
    for i in range(n):
        h = (h ^ counts[i]) * 1099511628211ULL
    return h


cdef inline size_t _piece(size_t total, size_t k, size_t cap) noexcept nogil:
    """Elements of step k's piece of a part of `total` elements cut in pieces of `cap`."""
    if total <= k * cap:
        return 0
    return min(cap, total - k * cap)


cdef class ShmComm(CoreComm):
    """A group whose ranks share one host: every collective through one segment."""
    cdef readonly ShmSegment seg
    cdef size_t chunk_bytes         # twoshot step size
    cdef const void **srcs          # P source pointers of a reduction
    cdef char *scratch              # the fused oneshot's reduced chunk; peers' pieces a pull reduces
    cdef public size_t pull_piece   # bytes per peer and piece when a reduction pulls inputs by single copy

    def __cinit__(self, ShmSegment seg, size_t ring_segment_bytes, size_t chunk_bytes):
        self.seg = seg
        self.transport = "shm"
        self.init_core(ShmTransport(seg, 0), ShmTransport(seg, 1), ring_segment_bytes)
        self.impls = ((1u << IMPL_ONESHOT) | (1u << IMPL_TWOSHOT) | (1u << IMPL_RING) | (1u << IMPL_RDOUBLE)
                      | (1u << IMPL_SEGMENT) | (1u << IMPL_SINGLE_COPY))
        self.chunk_bytes = max(LINE * <size_t>self.seg.size, min(chunk_bytes, self.seg.cap))
        self.pull_piece = self.seg.cap    # engine.registry's parameter replaces it (Communicator)
        self.srcs = <const void**>malloc(self.seg.size * sizeof(void*))
        self.scratch = <char*>malloc(self.seg.cap)
        if self.srcs == NULL or self.scratch == NULL:
            raise MemoryError()
        self.alive = peers_alive
        self.alive_arg = &self.seg.peers

    def __dealloc__(self):
        free(self.srcs)
        free(self.scratch)

    @property
    def chunk_bytes(self):
        return self.chunk_bytes

    cdef object error(self, int ierr, str what):
        if ierr == ENG_ERR_MISMATCH and self.seg.err_peer >= 0:
            q = self.seg.err_peer
            text = (f"collective mismatch in this group: rank {self.rank}: {_describe_sig(self.seg.my_sig)}; "
                    f"rank {q}: {_describe_sig(self.seg.err_sig)}")
            self.broken = text
            return EngineMismatch(f"{what} failed: {text}")
        if ierr == ENG_ERR_PEER_DEAD and self.seg.err_peer >= 0:
            q = self.seg.err_peer
            text = (f"rank {q} (pid {self.seg.peers.pids[q]}) exited while rank {self.rank} waited for it in "
                    f"{what} #{self.seq}")
            self.broken = text
            return EnginePeerLost(f"{what} failed: {text}")
        return CoreComm.error(self, ierr, what)

    cdef inline int begin_step(self, int op, int dtype, int redop, int algo, int root, uint64_t count,
                               uint64_t chash, uint64_t aux, WaitCtx *ctx) except -1 nogil:
        return self.seg.begin(_sig_word(op, dtype, redop, algo, root), count, chash, self.seq, aux, ctx)

    # -- allreduce --

    cdef int run_allreduce(self, const char *src, char *dst, size_t count, RedC *red, int impl,
                           WaitCtx *ctx) except -1 nogil:
        cdef size_t isz = eng_itemsize[red.dtype]
        cdef double divisor = self.size if red.avg else 0.0
        if impl == IMPL_RING or impl == IMPL_RDOUBLE:
            return CoreComm.run_allreduce(self, src, dst, count, red, impl, ctx)
        if self.size == 1:
            if src != dst:
                memcpy(dst, src, count * isz)
            return 0
        if impl == IMPL_ONESHOT:
            return self.oneshot(src, dst, count, red, divisor, ctx)
        return self.twoshot(src, dst, count, red, divisor, ctx)

    cdef int oneshot(self, const char *src, char *dst, size_t count, RedC *red, double divisor,
                     WaitCtx *ctx) except -1 nogil:
        cdef size_t isz = eng_itemsize[red.dtype], per = self.seg.cap // isz, off = 0, n
        cdef int q, ierr
        while off < count:
            n = min(per, count - off)
            ierr = self.begin_step(OP_ALLREDUCE, red.dtype, _redop(red), IMPL_ONESHOT, -1, count, 0, 0, ctx)
            if ierr:
                return ierr
            memcpy(self.seg.half(self.rank, self.seg.step), src + off * isz, n * isz)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            for q in range(self.size):
                self.srcs[q] = self.seg.half(q, self.seg.step)
            eng_reduce_many(red.fn, dst + off * isz, NULL, self.srcs, self.size, n, isz, red.dtype, divisor)
            self.seg.post(PHASE_FINISHED)
            off += n
        return 0

    cdef int twoshot(self, const char *src, char *dst, size_t count, RedC *red, double divisor,
                     WaitCtx *ctx) except -1 nogil:
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], per = max(<size_t>P, self.chunk_bytes // isz)
        cdef size_t off = 0, n, bo, bl
        cdef char *mine
        while off < count:
            n = min(per, count - off)
            ierr = self.begin_step(OP_ALLREDUCE, red.dtype, _redop(red), IMPL_TWOSHOT, -1, count, 0, 0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            for q in range(P):          # every block but this rank's own: the peers reduce those
                if q != r:
                    block_range(n, P, q, &bo, &bl)
                    memcpy(mine + bo * isz, src + (off + bo) * isz, bl * isz)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            block_range(n, P, r, &bo, &bl)
            for q in range(P):
                self.srcs[q] = (src + (off + bo) * isz) if q == r else (self.seg.half(q, self.seg.step) + bo * isz)
            eng_reduce_many(red.fn, dst + (off + bo) * isz, mine + bo * isz, self.srcs, P, bl, isz, red.dtype,
                            divisor)
            self.seg.post(PHASE_REDUCED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_REDUCED, ctx, False)
            if ierr:
                return ierr
            for q in range(P):
                if q != r:
                    block_range(n, P, q, &bo, &bl)
                    memcpy(dst + (off + bo) * isz, self.seg.half(q, self.seg.step) + bo * isz, bl * isz)
            self.seg.post(PHASE_FINISHED)
            off += n
        return 0

    # -- fused allreduce: buckets packed straight into the segment, unpacked straight out of it --

    def allreduce_parts(self, parts, op=0, wire=None, double before=1.0, double after=1.0):
        """parts[i] = reduce(op) over ranks of parts[i] (in place, all of one dtype): each chunk is
        packed (cast to `wire`, times `before`) into this rank's half, reduced there, and unpacked
        (cast back, times `after`) from every rank's half into the parts."""
        cdef _PartList pl = _parse_parts(parts, True, "parts")
        cdef int wdt, ierr = 0
        cdef Reduction red
        cdef const Rule *rule
        cdef WaitCtx ctx
        cdef OpRec *rec
        if pl.n == 0 or pl.total == 0:
            return parts
        wdt = pl.dtype if wire is None else DTYPE_CODES[wire]
        if not eng_convertible(wdt, pl.dtype, before) or not eng_convertible(pl.dtype, wdt, after):
            raise TypeError(f"cannot carry {DTYPE_NAMES[pl.dtype]} parts as {DTYPE_NAMES[wdt]}"
                            + (" with scaling" if before != 1.0 or after != 1.0 else ""))
        red = resolve_op(op, wdt)
        if red.c.avg:
            raise ValueError("allreduce_parts takes SUM with after=1/size for AVG (engine.fusion does this)")
        # Packed straight into the slots: one-shot or two-shot (a rule naming another runs two-shot).
        rule = self.select(OP_ALLREDUCE, pl.total * eng_itemsize[wdt], wdt, opbit_of(&red.c), False, None)
        if rule.impl != IMPL_ONESHOT:
            rule = self.named_impl(OP_ALLREDUCE, IMPL_TWOSHOT)
        rec = self.begin(OP_ALLREDUCE, pl.total, wdt, rule.entry, False)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.fused(pl, &red.c, wdt, before, after, rule.impl, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "allreduce")
        return parts

    cdef const Rule *named_impl(self, int op, int impl) except NULL:
        """The entry of op this group runs with impl (the fused path's two-shot)."""
        cdef int i
        for i in range(len([k for k in self.named_index if k[0] == op])):
            if self.named[op][i].impl == impl:
                return &self.named[op][i]
        raise ValueError(f"this group has no {OP_KIND_NAMES[op]} entry with implementation {impl}")

    cdef int fused(self, _PartList pl, RedC *red, int wdt, double before, double after, int algo,
                   WaitCtx *ctx) except -1 nogil:
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t wsz = eng_itemsize[wdt], psz = eng_itemsize[pl.dtype]
        cdef size_t per = (self.seg.cap // wsz) if algo == IMPL_ONESHOT else max(<size_t>P, self.chunk_bytes // wsz)
        cdef size_t off = 0, n, bo, bl
        cdef char *mine
        while off < pl.total:
            n = min(per, pl.total - off)
            ierr = self.begin_step(OP_ALLREDUCE, wdt, _redop(red), algo, -1, pl.total, 0, 0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            eng_pack_range(mine, wdt, wsz, pl.ptrs, pl.counts, pl.n, pl.dtype, psz, before, off, n)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            if algo == IMPL_ONESHOT or P == 1:
                for q in range(P):
                    self.srcs[q] = self.seg.half(q, self.seg.step)
                eng_reduce_many(red.fn, self.scratch, NULL, self.srcs, P, n, wsz, wdt, 0.0)
                eng_unpack_range(self.scratch, wdt, wsz, pl.ptrs, pl.counts, pl.n, pl.dtype, psz, after, off, n)
            else:
                block_range(n, P, r, &bo, &bl)
                for q in range(P):
                    self.srcs[q] = self.seg.half(q, self.seg.step) + bo * wsz
                eng_reduce_many(red.fn, mine + bo * wsz, NULL, self.srcs, P, bl, wsz, wdt, 0.0)
                self.seg.post(PHASE_REDUCED)
                ierr = self.seg.wait_all(self.seg.step, PHASE_REDUCED, ctx, False)
                if ierr:
                    return ierr
                for q in range(P):
                    block_range(n, P, q, &bo, &bl)
                    eng_unpack_range(self.seg.half(q, self.seg.step) + bo * wsz, wdt, wsz, pl.ptrs, pl.counts, pl.n,
                                     pl.dtype, psz, after, off + bo, bl)
            self.seg.post(PHASE_FINISHED)
            off += n
        return 0

    # -- the other collectives --

    cdef int run_broadcast(self, char *buf, size_t count, int dtype, int root, int impl,
                           WaitCtx *ctx) except -1 nogil:
        cdef size_t isz = eng_itemsize[dtype], per = self.seg.cap // isz, off = 0, n
        cdef int ierr, err
        if self.size == 1:
            return 0
        if impl == IMPL_SINGLE_COPY:
            return self.cma_broadcast(buf, count, isz, dtype, root, ctx)
        while off < count:
            n = min(per, count - off)
            ierr = self.begin_step(OP_BROADCAST, dtype, -1, -1, root, count, 0, 0, ctx)
            if ierr:
                return ierr
            if self.rank == root:
                memcpy(self.seg.half(root, self.seg.step), buf + off * isz, n * isz)
            else:
                ierr = self.seg.wait_peer(root, self.seg.step, PHASE_POSTED, ctx, True)
                if ierr:
                    return ierr
                memcpy(buf + off * isz, self.seg.half(root, self.seg.step), n * isz)
            self.seg.post(PHASE_FINISHED)
            off += n
        return 0

    cdef int cma_broadcast(self, char *buf, size_t count, size_t isz, int dtype, int root,
                           WaitCtx *ctx) except -1 nogil:
        """One step by single copy, the root helping: each other rank reads the head of the message
        straight from the root's buffer while the root writes the tail, 1/P of it, into each of theirs
        (process_vm_writev), so the root's core copies too instead of waiting (2 ranks: both halves at
        once). The root keeps its buffer untouched until every reader finished."""
        cdef int P = self.size, r = self.rank, q, ierr, err
        cdef size_t tail = count // P, head = count - tail
        cdef uint64_t step
        ierr = self.begin_step(OP_BROADCAST, dtype, -1, IMPL_SINGLE_COPY, root, count, 0, 0, ctx)
        if ierr:
            return ierr
        step = self.seg.step
        self.seg.table(r, step)[P] = <uint64_t>buf
        self.seg.post(PHASE_POSTED)
        if r == root:
            ierr = self.seg.wait_all(step, PHASE_POSTED, ctx, True)
            q = 0
            while not ierr and q < P:
                if q != root:
                    ierr = self.seg.cma_write(q, buf + head * isz, self.seg.table(q, step)[P] + head * isz, tail * isz)
                q += 1
            self.seg.table(r, step)[P + 1] = ierr != 0    # the readers must not return a tail never written
            self.seg.post(PHASE_FINISHED)
            err = self.seg.wait_all(step, PHASE_FINISHED, ctx, False)    # the readers are done with buf
            return ierr if ierr else err
        ierr = self.seg.wait_peer(root, step, PHASE_POSTED, ctx, True)
        if not ierr:
            ierr = self.seg.cma_read(root, buf, self.seg.table(root, step)[P], head * isz)
        self.seg.post(PHASE_FINISHED)
        err = self.seg.wait_peer(root, step, PHASE_FINISHED, ctx, False)  # the root's writes into buf are done
        if not ierr and not err and self.seg.table(root, step)[P + 1]:
            self.seg.err_peer = root
            self.seg.err_errno = 0
            return ENG_ERR_CMA
        return ierr if ierr else err

    cdef int run_reduce(self, const char *src, char *dst, size_t count, RedC *red, int root, int impl,
                        WaitCtx *ctx) except -1 nogil:
        """Through the slots at every size. One-shot: the peers copy in, the root reduces (its own input
        where it lies), and the peers' copies of the next call overlap the root's reduction. Two-shot:
        every rank reduces a block, the root gathers them."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], off = 0, n, bo, bl, per
        cdef double divisor = P if red.avg else 0.0
        cdef bint oneshot = impl == IMPL_ONESHOT
        cdef int algo = IMPL_ONESHOT if oneshot else IMPL_TWOSHOT
        cdef char *mine
        if P == 1:
            if src != dst:
                memcpy(dst, src, count * isz)
            if red.avg:
                eng_scale(dst, count, red.dtype, 1, 1)
            return 0
        per = (self.seg.cap // isz) if oneshot else max(<size_t>P, self.chunk_bytes // isz)
        while off < count:
            n = min(per, count - off)
            ierr = self.begin_step(OP_REDUCE, red.dtype, _redop(red), algo, root, count, 0, 0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            if oneshot:                 # the peers copy in; the root reduces its own input where it lies
                if r != root:
                    memcpy(mine, src + off * isz, n * isz)
                    self.seg.post(PHASE_FINISHED)
                    off += n
                    continue
                self.seg.post(PHASE_POSTED)
                ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
                if ierr:
                    return ierr
                for q in range(P):
                    self.srcs[q] = (src + off * isz) if q == r else self.seg.half(q, self.seg.step)
                eng_reduce_many(red.fn, dst + off * isz, NULL, self.srcs, P, n, isz, red.dtype, divisor)
                self.seg.post(PHASE_FINISHED)
                off += n
                continue
            for q in range(P):
                if q != r:
                    block_range(n, P, q, &bo, &bl)
                    memcpy(mine + bo * isz, src + (off + bo) * isz, bl * isz)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            block_range(n, P, r, &bo, &bl)
            for q in range(P):
                self.srcs[q] = (src + (off + bo) * isz) if q == r else (self.seg.half(q, self.seg.step) + bo * isz)
            if r != root:               # the root gathers the reduced block from this rank's half
                eng_reduce_many(red.fn, mine + bo * isz, NULL, self.srcs, P, bl, isz, red.dtype, divisor)
                self.seg.post(PHASE_FINISHED)
                off += n
                continue
            eng_reduce_many(red.fn, dst + (off + bo) * isz, NULL, self.srcs, P, bl, isz, red.dtype, divisor)
            ierr = self.seg.wait_all(self.seg.step, PHASE_FINISHED, ctx, False)
            if ierr:
                return ierr
            for q in range(P):
                if q != r:
                    block_range(n, P, q, &bo, &bl)
                    memcpy(dst + (off + bo) * isz, self.seg.half(q, self.seg.step) + bo * isz, bl * isz)
            self.seg.post(PHASE_FINISHED)
            off += n
        if r != root and not oneshot:
            # Two-shot keeps in step with the root, as allreduce does: peers running ahead into the
            # next call's chunks while the root still gathers measured 3.5-4.7x slower in some runs.
            # One-shot peers may run a call ahead: the copy of the next call overlaps the root's
            # reduction of this one (docs/tuning.md).
            return self.seg.wait_peer(root, self.seg.step, PHASE_FINISHED, ctx, False)
        return 0

    cdef int run_allgather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                           const size_t *displs, WaitCtx *ctx) except -1 nogil:
        return self.gather_to(src, dst, count, dtype, counts, displs, -1, ctx)

    cdef int run_gather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                        const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        return self.gather_to(src, dst, count, dtype, counts, displs, root, ctx)

    cdef inline size_t _steps(self, int op, int dtype, size_t c, size_t isz, size_t per) noexcept nogil:
        """Steps a piece of c elements needs: one when it moves by single copy, else ceil(c / per)."""
        return 1 if self.single_copy(op, c * isz, dtype) else (c + per - 1) // per

    cdef inline size_t _share(self, int op, int dtype, size_t c, size_t k, size_t isz, size_t per) noexcept nogil:
        """Elements of a c-element piece that step k moves (a single-copy piece moves whole in step 0)."""
        if self.single_copy(op, c * isz, dtype):
            return c if k == 0 else 0
        return _piece(c, k, per)

    cdef int gather_to(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                       const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        """allgather (root -1) or gather. Each rank's part goes through its own half in pieces, or,
        in the single-copy range, is read straight from its buffer in the first step (its owner then
        waits for the readers before returning). Readers check each writer's stated count (aux)."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef int op = OP_ALLGATHER if root < 0 else OP_GATHER
        cdef size_t isz = eng_itemsize[dtype], per = self.seg.cap // isz, k = 0, steps = 0, m, c, off
        cdef bint reader = root < 0 or r == root, mine_cma = self.single_copy(op, count * isz, dtype)
        cdef uint64_t total = 0, first = self.seg.step + 1
        for q in range(P):
            if counts != NULL or reader or q == r:
                c = count if counts == NULL else counts[q]
                total += c
                steps = max(steps, self._steps(op, dtype, c, isz, per) if c else 0)
        if reader and src != dst + (r * count if counts == NULL else displs[r]) * isz:
            memcpy(dst + (r * count if counts == NULL else displs[r]) * isz, src, count * isz)
        if P == 1:
            return 0
        # allgather: every rank knows every count (the signature makes them agree), so every rank
        # knows the number of steps. gather: only the root knows the counts; it states the number of
        # steps in its first step's aux, which the others read there.
        while k < steps or (root >= 0 and k == 0):
            ierr = self.begin_step(op, dtype, -1, -1, root, total if root < 0 else 0,
                                   _counts_hash(counts, P) if root < 0 else 0,
                                   steps if (root >= 0 and r == root) else count, ctx)
            if ierr:
                return ierr
            if mine_cma:
                if k == 0:
                    self.seg.table(r, self.seg.step)[P + r] = <uint64_t>src
            else:
                m = _piece(count, k, per)
                if m:
                    memcpy(self.seg.half(r, self.seg.step), src + k * per * isz, m * isz)
            if not reader:
                if k == 0:
                    self.seg.post(PHASE_POSTED)
                    ierr = self.seg.wait_peer(root, self.seg.step, PHASE_POSTED, ctx, True)
                    if ierr:
                        return ierr
                    steps = self.seg.peer_aux(root)
                    if steps > (<size_t>1 << 40):
                        self.seg.err_peer = root
                        return ENG_ERR_CORRUPT
                self.seg.post(PHASE_FINISHED)
                k += 1
                continue
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            for q in range(P):
                if q == r:
                    continue
                c = count if counts == NULL else counts[q]
                if self.seg.peer_aux(q) != c:
                    self.seg.err_peer = q
                    memcpy(self.seg.err_sig, self.seg.sig(q, self.seg.step), sizeof(self.seg.err_sig))
                    return ENG_ERR_MISMATCH
                off = (q * count if counts == NULL else displs[q]) * isz
                if self.single_copy(op, c * isz, dtype):
                    if k == 0:
                        ierr = self.seg.cma_read(q, dst + off, self.seg.table(q, self.seg.step)[P + q], c * isz)
                        if ierr:
                            self.seg.post(PHASE_FINISHED)
                            return ierr
                else:
                    m = _piece(c, k, per)
                    if m:
                        memcpy(dst + off + k * per * isz, self.seg.half(q, self.seg.step), m * isz)
            self.seg.post(PHASE_FINISHED)
            k += 1
        if mine_cma and count and k:     # readers copy from this rank's buffer: wait until they are done
            if root < 0:
                return self.seg.wait_all(first, PHASE_FINISHED, ctx, False)
            if r != root:
                return self.seg.wait_peer(root, first, PHASE_FINISHED, ctx, False)
        return 0

    cdef int run_scatter(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                         const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        """The root writes every rank's piece (and its length, in its table) or, in the single-copy
        range, the piece's address; each rank checks the length against its own count, then copies."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[dtype], per = (self.seg.cap // P) // isz, k = 0, steps, m, c, got
        cdef uint64_t *tab
        cdef uint64_t first = self.seg.step + 1
        cdef bint any_cma = False
        if r == root and src + (r * count if counts == NULL else displs[r]) * isz != dst:
            memcpy(dst, src + (r * count if counts == NULL else displs[r]) * isz, count * isz)
        if P == 1:
            return 0
        # Every rank's step count must agree: the root knows them all, the others only their own,
        # so the root states the number of steps (aux of the first step).
        steps = self._steps(OP_SCATTER, dtype, count, isz, per)
        if r == root:
            for q in range(P):
                if q != r:
                    c = count if counts == NULL else counts[q]
                    steps = max(steps, self._steps(OP_SCATTER, dtype, c, isz, per))
                    any_cma = any_cma or (c and self.single_copy(OP_SCATTER, c * isz, dtype))
        while True:
            ierr = self.begin_step(OP_SCATTER, dtype, -1, -1, root, 0, 0, steps if r == root else 0, ctx)
            if ierr:
                return ierr
            if r == root:
                tab = self.seg.table(r, self.seg.step)
                for q in range(P):
                    c = count if counts == NULL else counts[q]
                    m = self._share(OP_SCATTER, dtype, c, k, isz, per) if q != r else 0
                    tab[q] = m
                    tab[P + q] = 0
                    if m and self.single_copy(OP_SCATTER, c * isz, dtype):
                        tab[P + q] = <uint64_t>(src + (q * count if counts == NULL else displs[q]) * isz)
                    elif m:
                        memcpy(self.seg.half(r, self.seg.step) + q * per * isz,
                               src + ((q * count if counts == NULL else displs[q]) + k * per) * isz, m * isz)
                self.seg.post(PHASE_POSTED)
            else:
                ierr = self.seg.wait_peer(root, self.seg.step, PHASE_POSTED, ctx, True)
                if ierr:
                    return ierr
                if k == 0:
                    steps = self.seg.peer_aux(root)
                    if steps > (<size_t>1 << 40):
                        self.seg.err_peer = root
                        return ENG_ERR_CORRUPT
                m = self._share(OP_SCATTER, dtype, count, k, isz, per)
                got = self.seg.table(root, self.seg.step)[r]
                if got != m:
                    self.seg.err_peer = root
                    memcpy(self.seg.err_sig, self.seg.sig(root, self.seg.step), sizeof(self.seg.err_sig))
                    self.seg.err_sig[4] = got
                    return ENG_ERR_MISMATCH
                if m and self.single_copy(OP_SCATTER, count * isz, dtype):
                    ierr = self.seg.cma_read(root, dst, self.seg.table(root, self.seg.step)[P + r], m * isz)
                    if ierr:
                        self.seg.post(PHASE_FINISHED)
                        return ierr
                elif m:
                    memcpy(dst + k * per * isz, self.seg.half(root, self.seg.step) + r * per * isz, m * isz)
            self.seg.post(PHASE_FINISHED)
            k += 1
            if k >= steps:
                break
        if any_cma:                         # the others copy from the root's buffer: wait for them
            return self.seg.wait_all(first, PHASE_FINISHED, ctx, False)
        return 0

    cdef int run_reduce_scatter(self, const char *src, char *dst, size_t count, RedC *red,
                                const size_t *counts, const size_t *displs, WaitCtx *ctx) except -1 nogil:
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], per = (self.seg.cap // P) // isz, k = 0, steps = 0, m, c, d
        cdef double divisor = P if red.avg else 0.0
        cdef uint64_t total = 0
        cdef char *mine
        for q in range(P):
            c = count if counts == NULL else counts[q]
            total += c
            steps = max(steps, (c + per - 1) // per)
        if P == 1:
            if src != dst:
                memcpy(dst, src, count * isz)
            if red.avg:
                eng_scale(dst, count, red.dtype, 1, 1)
            return 0
        if self.single_copy(OP_REDUCE_SCATTER, self._largest(count, counts) * isz, red.dtype):
            return self.pull_reduce_scatter(src, dst, count, red, counts, displs, total, divisor, ctx)
        while k < steps:
            ierr = self.begin_step(OP_REDUCE_SCATTER, red.dtype, _redop(red), -1, -1, total,
                                   _counts_hash(counts, P), 0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            for q in range(P):
                if q != r:
                    c = count if counts == NULL else counts[q]
                    d = q * count if counts == NULL else displs[q]
                    m = _piece(c, k, per)
                    if m:
                        memcpy(mine + q * per * isz, src + (d + k * per) * isz, m * isz)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            m = _piece(count, k, per)
            d = r * count if counts == NULL else displs[r]
            for q in range(P):
                self.srcs[q] = (src + (d + k * per) * isz) if q == r else (self.seg.half(q, self.seg.step) + r * per * isz)
            if m:
                eng_reduce_many(red.fn, dst + k * per * isz, NULL, self.srcs, P, m, isz, red.dtype, divisor)
            self.seg.post(PHASE_FINISHED)
            k += 1
        return 0

    cdef size_t _largest(self, size_t count, const size_t *counts) noexcept nogil:
        cdef size_t m = count
        cdef int q
        if counts != NULL:
            for q in range(self.size):
                m = max(m, counts[q])
        return m

    cdef int pull_reduce_scatter(self, const char *src, char *dst, size_t count, RedC *red, const size_t *counts,
                                 const size_t *displs, uint64_t total, double divisor,
                                 WaitCtx *ctx) except -1 nogil:
        """reduce_scatter in the single-copy range: each rank copies its block straight out of every
        peer's input, piece by piece, and reduces it; then waits until its own input was read."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], per = max(1, min(self.seg.cap // (P - 1), self.pull_piece) // isz)
        cdef size_t off = 0, n
        cdef size_t d = r * count if counts == NULL else displs[r]
        cdef uint64_t step
        ierr = self.begin_step(OP_REDUCE_SCATTER, red.dtype, _redop(red), IMPL_SINGLE_COPY, -1, total, _counts_hash(counts, P),
                               0, ctx)
        if ierr:
            return ierr
        step = self.seg.step
        self.seg.table(r, step)[P + r] = <uint64_t>src
        self.seg.post(PHASE_POSTED)
        ierr = self.seg.wait_all(step, PHASE_POSTED, ctx, True)
        while not ierr and off < count:
            n = min(per, count - off)
            for q in range(P):
                if q == r:
                    self.srcs[q] = src + (d + off) * isz
                    continue
                self.srcs[q] = self.scratch + (q - (q > r)) * per * isz
                ierr = self.seg.cma_read(q, <void*>self.srcs[q], self.seg.table(q, step)[P + q] + (d + off) * isz,
                                         n * isz)
                if ierr:
                    break
            if not ierr:
                eng_reduce_many(red.fn, dst + off * isz, NULL, self.srcs, P, n, isz, red.dtype, divisor)
            off += n
        self.seg.post(PHASE_FINISHED)
        if ierr:
            return ierr
        return self.seg.wait_all(step, PHASE_FINISHED, ctx, False)   # the others read this rank's input

    cdef int run_alltoall(self, const char *src, char *dst, int dtype, const size_t *scounts,
                          const size_t *sdispls, const size_t *rcounts, const size_t *rdispls,
                          bint even, WaitCtx *ctx) except -1 nogil:
        """Block q of this rank goes through its half in pieces (at q's place), or, in the single-copy
        range, is read by q straight from this rank's buffer in the first step. Each writer states
        every piece's length in its table; each reader checks it against its own count first."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[dtype], per = (self.seg.cap // P) // isz, k = 0, steps = 0, m, got
        cdef uint64_t *tab
        cdef uint64_t first = self.seg.step + 1
        cdef bint any_cma = False
        memcpy(dst + rdispls[r] * isz, src + sdispls[r] * isz, min(scounts[r], rcounts[r]) * isz)
        if P == 1:
            return 0
        for q in range(P):
            if q != r:
                steps = max(steps, self._steps(OP_ALLTOALL, dtype, scounts[q], isz, per),
                            self._steps(OP_ALLTOALL, dtype, rcounts[q], isz, per))
                any_cma = any_cma or (scounts[q] and self.single_copy(OP_ALLTOALL, scounts[q] * isz, dtype))
        # Each rank knows only its own sizes: the first step's aux carries each rank's step count
        # and everyone runs the largest.
        while True:
            ierr = self.begin_step(OP_ALLTOALL, dtype, -1, -1, -1, 0, 0, steps, ctx)
            if ierr:
                return ierr
            tab = self.seg.table(r, self.seg.step)
            for q in range(P):
                m = self._share(OP_ALLTOALL, dtype, scounts[q], k, isz, per) if q != r else 0
                tab[q] = m
                tab[P + q] = 0
                if m and self.single_copy(OP_ALLTOALL, scounts[q] * isz, dtype):
                    tab[P + q] = <uint64_t>(src + sdispls[q] * isz)
                elif m:
                    memcpy(self.seg.half(r, self.seg.step) + q * per * isz, src + (sdispls[q] + k * per) * isz,
                           m * isz)
            self.seg.post(PHASE_POSTED)
            ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
            if ierr:
                return ierr
            if k == 0:
                for q in range(P):
                    if q != r:
                        if self.seg.peer_aux(q) > (<size_t>1 << 40):
                            self.seg.err_peer = q
                            return ENG_ERR_CORRUPT
                        steps = max(steps, self.seg.peer_aux(q))
            for q in range(P):
                if q == r:
                    continue
                m = self._share(OP_ALLTOALL, dtype, rcounts[q], k, isz, per)
                got = self.seg.table(q, self.seg.step)[r]
                if got != m:
                    self.seg.err_peer = q
                    memcpy(self.seg.err_sig, self.seg.sig(q, self.seg.step), sizeof(self.seg.err_sig))
                    self.seg.err_sig[4] = got
                    self.seg.post(PHASE_FINISHED)
                    return ENG_ERR_MISMATCH
                if m and self.single_copy(OP_ALLTOALL, rcounts[q] * isz, dtype):
                    ierr = self.seg.cma_read(q, dst + rdispls[q] * isz, self.seg.table(q, self.seg.step)[P + r],
                                             m * isz)
                    if ierr:
                        self.seg.post(PHASE_FINISHED)
                        return ierr
                elif m:
                    memcpy(dst + (rdispls[q] + k * per) * isz, self.seg.half(q, self.seg.step) + r * per * isz,
                           m * isz)
            self.seg.post(PHASE_FINISHED)
            k += 1
            if k >= steps:
                break
        if any_cma:                         # the others copy from this rank's buffer: wait for them
            return self.seg.wait_all(first, PHASE_FINISHED, ctx, False)
        return 0

    cdef int run_barrier(self, WaitCtx *ctx) except -1 nogil:
        cdef int ierr
        if self.size == 1:
            return 0
        ierr = self.begin_step(OP_BARRIER, -1, -1, -1, -1, 0, 0, 0, ctx)
        if ierr:
            return ierr
        self.seg.post(PHASE_POSTED)
        ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
        if ierr:
            return ierr
        self.seg.post(PHASE_FINISHED)
        return 0


cdef str _describe_sig(const uint64_t *s):
    cdef int op = s[0] & 0xff, dtype = <int>((s[0] >> 8) & 0xff) - 1, redop = <int>((s[0] >> 16) & 0xff) - 2
    cdef long long root = <long long>(s[0] >> 32) - 1
    name = OP_KIND_NAMES[op] if op < NOPKINDS else f"op {op}"
    text = f"{name} #{s[3]}"
    if s[1]:
        text += f" with {s[1]} {DTYPE_NAMES[dtype] if 0 <= dtype < ENG_NDTYPES else ''} elements"
    elif 0 <= dtype < ENG_NDTYPES:
        text += f" of {DTYPE_NAMES[dtype]} ({s[4]} elements from this rank)" if op in (OP_GATHER, OP_SCATTER, OP_ALLTOALL) \
            else f" of {DTYPE_NAMES[dtype]}"
    if root >= 0:
        text += f" root {root}"
    if 0 <= redop < 8:
        text += f" op {OP_NAMES[redop].upper()}"
    elif redop == 13:
        text += " op user"
    return text
