# Every collective on the segment, each a short loop over the step primitives of shm_segment.pxi, as
# NCCL writes its algorithms over a few primitives: reduce_steps (allreduce, reduce, the fused
# allreduce; one-shot and two-shot; a Mover says how data enters and leaves the slots), exchange
# (broadcast, allgather, gather, scatter, alltoall) and reduce_scatter (docs/architecture.md, "Step
# primitives"). Reductions run in rank order 0..P-1 on whichever rank computes a block, so every rank
# gets the same bits. Every schedule (chunks, blocks, pieces, steps) is a pure function of schedule.pxd.

cdef uint64_t _counts_hash(const size_t *counts, int n) noexcept nogil:
    """FNV-1a over the per-rank counts of an uneven collective (every rank must pass the same)."""
    cdef uint64_t h = 1469598103934665603ULL
    cdef int i
    for i in range(n):
        h = (h ^ counts[i]) * 1099511628211ULL
    return h


cdef struct Mover:      # how a reduction's data enters and leaves the slots: plain (src, dst) or parts
    const char *src         # plain: the input; NULL: parts
    char *dst               # plain: the output (a reduce's peers: NULL)
    void **ptrs             # parts: the tensors, their counts and dtype
    const size_t *counts
    size_t nparts
    int pdtype
    int wdt                 # the dtype in the slots
    size_t wsz
    double before, after    # parts: scale on the way in and out


cdef inline void mv_load(Mover *mv, char *to, size_t off, size_t n, eng_team *tm) noexcept nogil:
    if mv.src != NULL:
        eng_team_copy(tm, to, mv.src + off * mv.wsz, n * mv.wsz)
    else:
        eng_move_range(1, to, mv.wdt, mv.wsz, mv.ptrs, mv.counts, mv.nparts, mv.pdtype, eng_itemsize[mv.pdtype],
                       mv.before, off, n)


cdef inline void mv_store(Mover *mv, const char *frm, size_t off, size_t n, eng_team *tm) noexcept nogil:
    if mv.src != NULL:
        eng_team_copy(tm, mv.dst + off * mv.wsz, frm, n * mv.wsz)
    else:
        eng_move_range(0, <char*>frm, mv.wdt, mv.wsz, mv.ptrs, mv.counts, mv.nparts, mv.pdtype,
                       eng_itemsize[mv.pdtype], mv.after, off, n)


cdef enum:   # what ShmComm runs itself (the rest: CoreComm.run, over the segment's queues)
    SHM_IMPLS = ((1u << IMPL_ONESHOT) | (1u << IMPL_TWOSHOT) | (1u << IMPL_THREADED) | (1u << IMPL_SEGMENT)
                 | (1u << IMPL_SINGLE_COPY))


cdef class ShmComm(CoreComm):
    """A group whose ranks share one host: every collective through one segment."""
    cdef readonly ShmSegment seg
    cdef readonly size_t chunk_bytes  # two-shot step size
    cdef const void **srcs          # P source pointers of a reduction
    cdef char *scratch              # a fused one-shot's reduced chunk; the pieces a pull reduces
    cdef public size_t pull_piece   # bytes per peer and piece when a reduction pulls inputs by single copy
    cdef uint64_t sig[3]            # this collective's signature words (op..root, count, counts hash)
    cdef size_t *ex                 # an exchange's pieces, 6 x P: send count, send displacement, receive
                                    # count, receive displacement (elements), sent and received by
                                    # single copy (0/1), per peer
    cdef eng_team team              # the helper threads of IMPL_THREADED (started at its first call)
    cdef bint team_started
    cdef public int threads         # threads IMPL_THREADED splits a blocking call's kernels over (1: none)
    cdef public size_t thread_slice # bytes: the least slice a thread takes (engine.registry's parameter)

    def __cinit__(self, ShmSegment seg, size_t ring_segment_bytes, size_t chunk_bytes):
        self.seg = seg
        self.transport = "shm"
        self.init_core(shm_channel(seg, 0), shm_channel(seg, 1), ring_segment_bytes)
        self.impls |= SHM_IMPLS
        self.avg_fused = SHM_IMPLS    # each of its own divides AVG inside its reduction
        self.chunk_bytes = max(LINE * <size_t>self.seg.size, min(chunk_bytes, self.seg.cap))
        self.pull_piece = self.seg.cap    # engine.registry's parameter replaces it (Communicator)
        self.srcs = <const void**>malloc(self.seg.size * sizeof(void*))
        self.scratch = <char*>malloc(self.seg.cap)
        self.ex = <size_t*>malloc(6 * self.seg.size * sizeof(size_t))
        if self.srcs == NULL or self.scratch == NULL or self.ex == NULL:
            raise MemoryError()
        self.alive = peers_alive
        self.alive_arg = &self.seg.peers
        self.threads = 1
        self.thread_slice = 16384

    def __dealloc__(self):
        self.stop_team()
        free(self.srcs)
        free(self.scratch)
        free(self.ex)

    cdef object error(self, int ierr, str what, Transport tp=None):
        cdef int lost = -1   # (the rank whose loss broke the group, Transport.serve's)
        # (the segment's word names the rank a collective failed on; a message's channel names its own)
        cdef int q = self.seg.err_peer if tp is None or tp is self.algo_tp else -1
        if q < 0 and (ierr == ENG_ERR_PEER_DEAD or ierr == ENG_ERR_PEER_LEFT):
            q = self.seg.peers.dead      # (a wait on the point-to-point queues)
        if ierr == ENG_ERR_PEER_LEFT and eng_load32(&self.aborted):   # (a peer that gave up since: aborted here)
            return CoreComm.error(self, ierr, what, tp)
        cdef uint32_t gave_up = (eng_load32(self.seg.gave_up(q)) if q >= 0 and not self.released and
                                 (tp is None or tp is self.algo_tp) else 0)   # (how q gave the collectives up)
        ierr = ENG_ERR_PEER_LEFT if ierr == ENG_ERR_CMA and gave_up else ierr   # (a copy failed as q gave up)
        if ierr == ENG_ERR_CMA and q >= 0:   # (the segment knows whose memory the single copy read; the
            return self.broke(EnginePeerLost, _engine_error_text(ierr, q), what)   # step was abandoned midway)
        if q < 0 or (ierr != ENG_ERR_MISMATCH and ierr != ENG_ERR_PEER_DEAD and ierr != ENG_ERR_PEER_LEFT):
            return CoreComm.error(self, ierr, what, tp)
        if ierr == ENG_ERR_MISMATCH:   # the segment holds both signatures: name what each rank called
            pieces = self.seg.err_pieces   # (and, where a piece's size differs, both sizes)
            mine = _describe_sig(self.seg.my_sig, f"expects {self.seg.my_sig[4]} elements from rank {q}" if pieces else None)
            theirs = _describe_sig(self.seg.err_sig, f"sends {self.seg.err_sig[4]} elements to rank {self.rank}" if pieces else None)
            if mine == theirs and self.seg.my_sig[2] != self.seg.err_sig[2]:   # (alike in words: the counts' hash
                user = " op user #" in mine   # or a user op's whole fingerprint)
                theirs += (", but its user op (another function, or other values in it) differs" if user and
                           (self.seg.my_sig[0] & 0xff) != OP_REDUCE_SCATTER else
                           ", but its per-rank counts (the sizes of an uneven call's pieces)"
                           + (" or its user op differ" if user else " differ"))
            kind, text = EngineMismatch, f"collective mismatch in this group: rank {self.rank}: {mine}; rank {q}: {theirs}"
        elif ierr == ENG_ERR_PEER_DEAD and self.seg.err_peer_passed and (tp is None or tp is self.algo_tp):
            # (its part of the collective done: it is not what was late)
            lost, awaited = self.algo_tp.whole_rank(q), self.seg.err_awaited
            kind, text = EnginePeerLost, (
                f"{self.algo_tp.who(q)} exited without leaving the group (killed, crashed, "
                f"os._exit) while rank {self.rank} was in {what} #{self.seq}, after it had done its part there"
                + (f"; rank {self.rank} was waiting for rank {awaited}" if awaited >= 0 else ""))
        elif ierr == ENG_ERR_PEER_DEAD:
            lost = self.algo_tp.whole_rank(q)
            kind, text = EnginePeerLost, (f"{self.algo_tp.who(q)} exited while rank {self.rank} "
                                          f"waited for it in {what} #{self.seq}")
        elif gave_up:   # (where the group broke over a rank lost in any stage of the whole group, or after
            # another rank's word: which, in the whole group's numbering, read from a peer's word: checked)
            timed_out, named = gave_up == GAVE_UP_TIMED_OUT, <int>(gave_up >> 8) - 1
            named = named if self.algo_tp.in_whole(named) else -1
            lost = named if (gave_up & GAVE_UP_KIND) == GAVE_UP_BROKEN else -1
            first = named if ((gave_up & GAVE_UP_KIND) == GAVE_UP_FOLLOWED and
                              self.algo_tp.member(named) not in (q, self.rank)) else -1
            if not timed_out and lost < 0:   # (this rank's word follows q's: it names whom q's followed, or q)
                self.seg.followed = first if first >= 0 else self.algo_tp.whole_rank(q)
            who = self.algo_tp.whole_who(first) if first >= 0 else self.algo_tp.who(q)
            after = f"; {self.algo_tp.who(q)} gave it up after it" if first >= 0 else ""
            kind = EngineTimeout if timed_out else EnginePeerLost
            text = (f"{who} gave the group up while rank {self.rank} waited for it in {what} #{self.seq}: " + (
                        "its call timed out there (its own error names the ranks it waited for)" if timed_out else
                        "a call of it failed there (its own error says why: a lost peer, a mismatch) or it was "
                        f"aborted{after}; none of the group's collectives can end" if lost < 0 else
                        "a call of it failed there over that loss; none of the group's collectives can end"))
            text = text if lost < 0 else f"{self.algo_tp.whole_who(lost)} was lost: {text}"
        else:
            kind, text = EnginePeerLost, (f"{self.algo_tp.who(q)} left the group (it destroyed it, "
                                          "or its process ended) "
                                          f"while rank {self.rank} waited for it in {what} #{self.seq}: the ranks did "
                                          "not run the same collectives, or one destroyed the group early")
        return self.broke(kind, text, what, lost)

    cdef void release_transports(self) noexcept:
        """The channels', then the helper threads and the segment's mapping and descriptors."""
        CoreComm.release_transports(self)
        self.stop_team()
        self.seg.release()

    def waiting_on(self):
        """Whom this rank's collective waits on in the segment (the step flags it waits for), or None."""
        awaited = self.seg.awaited() if not self.released else None
        if not awaited or not awaited[0]:
            return None
        return "; ".join(f"this rank waits on {self.algo_tp.who(q)} to reach its step"
                         for q in awaited[0])

    def passed(self):
        """The peers past the step this rank's collective waits at, and those that left the group."""
        awaited = self.seg.awaited() if not self.released else None
        gone = [q for q in range(self.size) if q != self.rank and not self.released and eng_load32(self.seg.left(q))]
        return sorted(set(gone) | set(awaited[1] if awaited else ()))

    def leave(self):
        """Marks this rank gone from the group in the segment: a peer still waiting for it fails at
        its next liveness check (ENG_ERR_PEER_LEFT), as over TCP, not at the timeout. The group's end,
        and the process's normal exit (engine/transports.py), call it; a group aborted (freed) withdrew
        its messages in flight, one left at exit did not."""
        cdef int q
        if self.released:
            return
        if eng_load32(self.seg.left(self.rank)) != LEFT_WITHDRAWN:
            eng_store32(self.seg.left(self.rank), LEFT_WITHDRAWN if eng_load32(&self.aborted) else LEFT_AT_EXIT)
        for q in range(self.size):
            if q != self.rank:
                self.seg.ring(q)

    cdef void stop_team(self) noexcept nogil:
        if self.team_started:
            eng_team_stop(&self.team)
            self.team_started = False

    def set_threads(self, int threads):
        """Threads (the caller's included) that IMPL_THREADED splits a blocking call's copies and
        reductions over; its helpers start at its first call. Asynchronous calls (the progress thread)
        keep one thread: their caller's cores run the computation they overlap."""
        check_threads(threads)
        if threads != self.threads:
            self.stop_team()
        self.threads = threads

    @property
    def team_spin(self):
        """Seconds the started team's helpers spin between jobs (None: none started yet)."""
        return self.team.spin if self.team_started else None

    @property
    def threads_running(self):
        """Threads of the started team, the caller's included (0: none started yet)."""
        return self.team.n if self.team_started else 0

    @property
    def threads_shared(self):
        """Jobs the started team split over its threads (slices of at least thread_slice bytes)."""
        return self.team.shared if self.team_started else 0

    cdef eng_team *team_for(self, int impl, Mover *mv) noexcept nogil:
        """The team a reduction's kernels run on, or NULL (one thread)."""
        if impl != IMPL_THREADED or eng_polite_waits or mv.src == NULL or self.threads < 2:
            return NULL
        if not self.team_started:
            if eng_team_start(&self.team, self.threads, self.size, spin_budget(self.spin)):
                self.threads = 1          # no threads to be had: one, from now on
                return NULL
            self.team_started = True
        self.team.slice_min = self.thread_slice
        self.team.spin = spin_budget(self.spin)   # the helpers wait for a step as the caller does (set_spin)
        return &self.team

    # -- the step primitives of this group's collectives --

    cdef inline void sign(self, int op, int dtype, int opmark, int impl, int root, uint64_t count,
                          uint64_t chash) noexcept nogil:
        """The signature every step of this collective carries (peers in another one are refused); chash:
        the per-rank counts' hash, a user op's whole fingerprint mixed in."""
        self.sig[0] = call_word(op, dtype, opmark, impl, root)
        self.sig[1] = count
        self.sig[2] = chash

    cdef inline int open_step(self, uint64_t aux, WaitCtx *ctx) except -1 nogil:
        """Claims this rank's next half (once every peer finished the step that last used it)."""
        return self.seg.begin(self.sig[0], self.sig[1], self.sig[2], self.log.seq, aux, ctx)

    cdef inline int publish_await(self, int phase, WaitCtx *ctx) except -1 nogil:
        """Publishes phase, then waits until every peer reached it (their signatures checked at POSTED)."""
        self.seg.post(phase)
        return self.seg.wait_all(self.seg.step, phase, ctx, phase == PHASE_POSTED)

    cdef inline int mismatch(self, int q, uint64_t stated, uint64_t expected) noexcept nogil:
        """Rank q's table states a piece of another size than this rank expects: the call differs. (The
        signatures' last word, aux, carries the two sizes for the error's text.)"""
        self.seg.err_peer = q
        memcpy(self.seg.err_sig, self.seg.sig(q, self.seg.step), sizeof(self.seg.err_sig))
        self.seg.err_sig[4] = stated
        self.seg.my_sig[4] = expected
        self.seg.err_pieces = True
        return ENG_ERR_MISMATCH

    # -- reductions: allreduce, reduce, the fused allreduce --

    cdef int reduce_steps(self, Mover *mv, size_t total, RedC *red, int impl, int root, WaitCtx *ctx) except -1 nogil:
        """op over every rank's data, to every rank (root < 0) or to root, chunk by chunk."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t wsz = mv.wsz, off = 0, n, bo, bl, qo, ql
        cdef size_t per = chunk_elements(impl == IMPL_ONESHOT, self.seg.cap, self.chunk_bytes, wsz, P)
        cdef double divisor = P if red.avg else 0.0
        cdef bint reader = root < 0 or r == root, own_direct = mv.src != NULL
        cdef char *mine
        cdef char *out
        cdef eng_team *tm = self.team_for(impl, mv)
        self.sign(OP_ALLREDUCE if root < 0 else OP_REDUCE, mv.wdt, op_mark(red), impl, root, total, red.ident)
        while off < total:
            n = min(per, total - off)
            ierr = self.open_step(0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            if impl == IMPL_ONESHOT:
                # Every rank's chunk in its half, but a reduce's root reduces its own where it lies.
                if not (root == r and own_direct):
                    mv_load(mv, mine, off, n, NULL)
                if not reader:          # a reduce's peer: done once its chunk is in
                    self.seg.post(PHASE_FINISHED)
                    off += n
                    continue
                ierr = self.publish_await(PHASE_POSTED, ctx)
                if ierr:
                    return ierr
                for q in range(P):
                    self.srcs[q] = self.seg.half(q, self.seg.step)
                if root == r and own_direct:
                    self.srcs[r] = mv.src + off * wsz
                out = mv.dst + off * wsz if own_direct else self.scratch
                eng_reduce_many(red.fn, out, NULL, self.srcs, P, n, wsz, mv.wdt, divisor)
                if not own_direct:
                    mv_store(mv, out, off, n, NULL)
            else:
                # Two-shot: the blocks the peers reduce go into this rank's half (its own too where it
                # can't be read where it lies); this rank reduces its block from every half.
                for q in range(P):
                    if q != r or not own_direct:
                        block_range(n, P, q, &qo, &ql)
                        mv_load(mv, mine + qo * wsz, off + qo, ql, tm)
                ierr = self.publish_await(PHASE_POSTED, ctx)
                if ierr:
                    return ierr
                block_range(n, P, r, &bo, &bl)
                for q in range(P):
                    self.srcs[q] = self.seg.half(q, self.seg.step) + bo * wsz
                if own_direct:
                    self.srcs[r] = mv.src + (off + bo) * wsz
                if root < 0:
                    # The reduced block goes to the output at once and into the half for the peers.
                    eng_team_reduce(tm, red.fn, mv.dst + (off + bo) * wsz if own_direct else mine + bo * wsz,
                                    mine + bo * wsz if own_direct else NULL, self.srcs, P, bl, wsz, mv.wdt, divisor)
                    ierr = self.publish_await(PHASE_REDUCED, ctx)
                    if ierr:
                        return ierr
                    for q in range(P):
                        if q != r or not own_direct:
                            block_range(n, P, q, &qo, &ql)
                            mv_store(mv, self.seg.half(q, self.seg.step) + qo * wsz, off + qo, ql, tm)
                elif r != root:         # the root gathers this rank's reduced block from its half
                    eng_team_reduce(tm, red.fn, mine + bo * wsz, NULL, self.srcs, P, bl, wsz, mv.wdt, divisor)
                else:
                    eng_team_reduce(tm, red.fn, mv.dst + (off + bo) * wsz, NULL, self.srcs, P, bl, wsz, mv.wdt, divisor)
                    ierr = self.seg.wait_all(self.seg.step, PHASE_FINISHED, ctx, False)
                    if ierr:
                        return ierr
                    for q in range(P):
                        if q != r:
                            block_range(n, P, q, &qo, &ql)
                            mv_store(mv, self.seg.half(q, self.seg.step) + qo * wsz, off + qo, ql, tm)
            self.seg.post(PHASE_FINISHED)
            off += n
        if root >= 0 and r != root and impl != IMPL_ONESHOT and total:
            # Two-shot peers stay in step with the root (running ahead into the next call's chunks
            # while it still gathers makes them contend for the cores it needs).
            return self.seg.wait_peer(root, self.seg.step, PHASE_FINISHED, ctx, False)
        return 0

    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """The segment's own implementations (SHM_IMPLS); the engine's algorithms over the segment's
        queues are CoreComm's."""
        cdef Mover mv
        cdef int r = self.rank, q, ierr
        cdef size_t total
        if not (SHM_IMPLS & (1u << c.impl)):
            return CoreComm.run(self, c, ctx)
        if c.op == OP_ALLREDUCE or c.op == OP_REDUCE:
            mv.src, mv.dst, mv.wdt, mv.wsz = c.src, c.dst, c.red.dtype, eng_itemsize[c.red.dtype]
            return self.reduce_steps(&mv, c.count, c.red, c.impl, -1 if c.op == OP_ALLREDUCE else c.root, ctx)
        if c.op == OP_BROADCAST and c.impl == IMPL_SINGLE_COPY:
            return self.cma_broadcast(c.dst, c.count, eng_itemsize[c.dtype], c.dtype, c.root, ctx)
        if c.op == OP_BROADCAST:
            self.sign(OP_BROADCAST, c.dtype, OPBIT_NONE, IMPL_SEGMENT, c.root, c.count, 0)
            for q in range(self.size):
                self.set_piece(q, c.count if r == c.root else 0, 0, c.count if q == c.root and r != c.root else 0, 0)
            return self.exchange(OP_BROADCAST, c.dst, c.dst, c.dtype, True, c.root, True, ctx)
        if c.op == OP_ALLGATHER:
            total = c.displs[self.size - 1] + c.counts[self.size - 1]
            self.sign(OP_ALLGATHER, c.dtype, OPBIT_NONE, IMPL_SEGMENT, -1, total, _counts_hash(c.counts, self.size))
            for q in range(self.size):
                self.set_piece(q, c.count, 0, c.counts[q], c.displs[q])
            return self.exchange(OP_ALLGATHER, c.src, c.dst, c.dtype, True, -1, True, ctx)
        if c.op == OP_GATHER or c.op == OP_SCATTER:
            return self.rooted(c.op, c.src, c.dst, c.count, c.dtype, c.counts, c.displs, c.root, ctx)
        if c.op == OP_ALLTOALL:
            self.sign(OP_ALLTOALL, c.dtype, OPBIT_NONE, IMPL_SEGMENT, -1, 0, 0)
            for q in range(self.size):
                self.set_piece(q, c.counts[q], c.displs[q], c.rcounts[q], c.rdispls[q])
            return self.exchange(OP_ALLTOALL, c.src, c.dst, c.dtype, False, -1, False, ctx)
        if c.op == OP_REDUCE_SCATTER:
            return self.reduce_scatter_steps(c.src, c.dst, c.count, c.red, c.counts, c.displs, ctx)
        # the barrier: every rank's step flag
        self.sign(OP_BARRIER, -1, OPBIT_NONE, IMPL_SEGMENT, -1, 0, 0)
        ierr = self.open_step(0, ctx)
        if not ierr:
            ierr = self.publish_await(PHASE_POSTED, ctx)
        if not ierr:
            self.seg.post(PHASE_FINISHED)
        return ierr

    def allreduce_parts(self, parts, op=0, wire=None, double before=1.0, double after=1.0):
        """parts[i] = reduce(op) over ranks of parts[i] (in place, all of one dtype): each chunk is
        packed (cast to `wire`, times `before`) into this rank's half, reduced there, and unpacked
        (cast back, times `after`) from every rank's half into the parts."""
        cdef _PartList pl = _parse_parts(parts, True, "parts")
        cdef Reduction red
        cdef const Rule *rule
        cdef Mover mv
        cdef Call c
        cdef int i
        if pl.n == 0 or pl.total == 0:
            return parts
        if wire is not None and wire not in DTYPE_CODES:
            raise ValueError(f"allreduce_parts: wire {wire!r} is not a dtype name: one of {', '.join(DTYPE_NAMES)}")
        mv.wdt = pl.dtype if wire is None else DTYPE_CODES[wire]
        if not eng_convertible(mv.wdt, pl.dtype, before) or not eng_convertible(pl.dtype, mv.wdt, after):
            raise TypeError(f"cannot carry {DTYPE_NAMES[pl.dtype]} parts as {DTYPE_NAMES[mv.wdt]}"
                            + (" with scaling" if before != 1.0 or after != 1.0 else ""))
        red = resolve_op(op, mv.wdt)
        if red.c.avg:
            raise ValueError("allreduce_parts takes SUM with after=1/size for AVG (engine.fusion does this)")
        mv.src, mv.dst, mv.wsz = NULL, NULL, eng_itemsize[mv.wdt]
        mv.ptrs, mv.counts, mv.nparts, mv.pdtype = pl.ptrs, pl.counts, pl.n, pl.dtype
        mv.before, mv.after = before, after
        # Packed straight into the slots: one-shot or two-shot (a rule naming another runs two-shot).
        rule = self.select(OP_ALLREDUCE, pl.total * mv.wsz, mv.wdt, opbit_of(&red.c), False, None)
        if rule.impl != IMPL_ONESHOT:   # the entry this group runs with two-shot
            for i in range(len([k for k in self.named_index if k[0] == OP_ALLREDUCE])):
                if self.named[OP_ALLREDUCE][i].impl == IMPL_TWOSHOT:
                    rule = &self.named[OP_ALLREDUCE][i]
                    break
            else:
                raise ValueError(f"this group has no allreduce entry with implementation {IMPL_TWOSHOT}")
        c = new_call(OP_ALLREDUCE, NULL, NULL, pl.total, mv.wdt)
        c.red, c.aux = &red.c, &mv
        self.invoke(&c, rule, pl.total, None, red)
        return parts

    cdef int dispatch(self, Call *c, WaitCtx *ctx) except -1 nogil:
        if c.aux != NULL:               # the fused path: parts packed through the slots
            return self.reduce_steps(<Mover*>c.aux, c.count, c.red, c.impl, -1, ctx)
        return CoreComm.dispatch(self, c, ctx)

    # -- data movement: pieces from senders to receivers --

    cdef int exchange(self, int op, const char *src, char *dst, int dtype, bint shared, int source, bint agreed,
                      WaitCtx *ctx) except -1 nogil:
        """Moves the pieces set in self.ex (set_piece): a piece goes through the sender's half in steps
        (shared: one copy for every receiver, at the half's start; else each receiver's at its
        1/P of the half), or in the first step by single copy from the sender's buffer. source: the
        one rank this rank receives from (itself: a broadcast's root, which waits in the first step
        until its readers posted, to check their signatures: a rank naming another root fails there
        rather than keep its own data), or -1 for every peer. Every rank runs the most steps any
        rank needs: agreed, every rank computes the same (the signature holds every count), and a
        sender runs ahead as far as the two halves let it; else each states its own in the first
        step. A sender whose pieces were read from its buffer waits until its readers are done."""
        cdef int P = self.size, r = self.rank, q, ierr = 0
        cdef size_t *sc = self.ex
        cdef size_t *sd = self.ex + P
        cdef size_t *rc = self.ex + 2 * P
        cdef size_t *rd = self.ex + 3 * P
        cdef size_t *scopy = self.ex + 4 * P
        cdef size_t *rcopy = self.ex + 5 * P
        cdef size_t isz = eng_itemsize[dtype], per = self.seg.cap // isz // (1 if shared else P)
        cdef size_t k = 0, steps = 0, m
        cdef uint64_t first = self.seg.step + 1, got
        cdef uint64_t *tab
        cdef bint by_copy = False, wrote
        if rc[r] and src + sd[r] * isz != dst + rd[r] * isz:
            memcpy(dst + rd[r] * isz, src + sd[r] * isz, rc[r] * isz)
        for q in range(P):
            scopy[q] = q != r and self.single_copy(op, sc[q] * isz, dtype)
            rcopy[q] = q != r and self.single_copy(op, rc[q] * isz, dtype)
            if q != r:
                steps = max(steps, piece_steps(sc[q], per, scopy[q]), piece_steps(rc[q], per, rcopy[q]))
                by_copy = by_copy or scopy[q]
        while True:
            ierr = self.open_step(steps if k == 0 else 0, ctx)
            if ierr:
                return ierr
            tab = self.seg.table(r, self.seg.step)
            wrote = False
            for q in range(P):
                m = piece_share(sc[q], k, per, scopy[q]) if q != r else 0
                if not agreed:
                    tab[q] = m
                if m and scopy[q]:
                    tab[P + q] = <uint64_t>(src + sd[q] * isz)
                elif m and not (shared and wrote):
                    memcpy(self.seg.half(r, self.seg.step) + (0 if shared else q * per * isz),
                           src + (sd[q] + k * per) * isz, m * isz)
                    wrote = True
            if k == 0 and not agreed:   # learn the number of steps every rank runs
                ierr = self.publish_await(PHASE_POSTED, ctx)
                if ierr:
                    return ierr
                for q in range(P):
                    if q != r:
                        if self.seg.peer_aux(q) > (<size_t>1 << 40):
                            self.seg.err_peer = q
                            return ENG_ERR_CORRUPT
                        steps = max(steps, self.seg.peer_aux(q))
            else:
                self.seg.post(PHASE_POSTED)
                if k == 0 and source == r:  # a root that reads from nobody checks its readers' signatures
                    ierr = self.seg.wait_all(self.seg.step, PHASE_POSTED, ctx, True)
                    if ierr:
                        return ierr
            for q in range(P):
                if q == r or (source >= 0 and q != source):
                    continue
                if k or agreed:
                    ierr = self.seg.wait_peer(q, self.seg.step, PHASE_POSTED, ctx, True)
                    if ierr:
                        return ierr
                m = piece_share(rc[q], k, per, rcopy[q])
                if not agreed:          # agreed: the signatures, checked at POSTED, hold every count
                    got = self.seg.table(q, self.seg.step)[r]
                    if got != m:
                        self.seg.post(PHASE_FINISHED)
                        return self.mismatch(q, got, m)
                if m and rcopy[q]:
                    ierr = self.seg.cma_copy(q, dst + rd[q] * isz, self.seg.table(q, self.seg.step)[P + r], m * isz,
                                             False, True)
                elif m:
                    memcpy(dst + (rd[q] + k * per) * isz,
                           self.seg.half(q, self.seg.step) + (0 if shared else r * per * isz), m * isz)
                if ierr:
                    self.seg.post(PHASE_FINISHED)
                    return ierr
            self.seg.post(PHASE_FINISHED)
            k += 1
            if k >= steps:
                break
        if by_copy:                     # the readers copy from this rank's buffer: wait for them
            return self.seg.wait_all(first, PHASE_FINISHED, ctx, False)
        return 0

    cdef inline void set_piece(self, int q, size_t send, size_t send_at, size_t recv, size_t recv_at) noexcept nogil:
        """What this rank sends to peer q (count, displacement in its input) and receives from it
        (count, displacement in its output), in elements."""
        cdef int P = self.size
        self.ex[q], self.ex[P + q], self.ex[2 * P + q], self.ex[3 * P + q] = send, send_at, recv, recv_at

    cdef int cma_broadcast(self, char *buf, size_t count, size_t isz, int dtype, int root,
                           WaitCtx *ctx) except -1 nogil:
        """One step by single copy, the root helping: each other rank reads the head of the message
        straight from the root's buffer while the root writes the tail, 1/P of it, into each of theirs
        (process_vm_writev), so the root's core copies too instead of waiting (2 ranks: both halves at
        once). The root keeps its buffer untouched until every reader finished."""
        cdef int P = self.size, r = self.rank, q, ierr, err
        cdef size_t tail = count // P, head = count - tail
        cdef uint64_t step, failed
        cdef bint written
        self.sign(OP_BROADCAST, dtype, OPBIT_NONE, IMPL_SINGLE_COPY, root, count, 0)
        ierr = self.open_step(0, ctx)
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
                    ierr = self.seg.write_tail(q, step, buf + head * isz, head * isz, tail * isz)
                q += 1
            # (the readers whose tail is not written fail, naming the rank this root failed on and how)
            self.seg.table(r, step)[P + 1] = 0 if not ierr else (
                (<uint64_t>(self.seg.err_peer + 1) << 32) | <uint32_t>ierr)
            self.seg.post(PHASE_FINISHED)
            if ierr == ENG_ERR_MISMATCH:   # (a rank in another call never finishes this step; what a reader
                return ierr                # still copies from buf stays alive: a failed call's buffers are kept)
            err = self.seg.wait_all(step, PHASE_FINISHED, ctx, False)    # the readers are done with buf
            return ierr if ierr else err
        ierr = err = -1   # (until a wait returns: one that raises leaves through the finally)
        try:
            ierr = self.seg.wait_peer(root, step, PHASE_POSTED, ctx, True)
            if ierr == ENG_ERR_MISMATCH:       # (the root saw it too, and wrote nothing here)
                return ierr
            if not ierr:
                ierr = self.seg.cma_copy(root, buf, self.seg.table(root, step)[P], head * isz, False, True)
            err = self.seg.wait_peer(root, step, PHASE_FINISHED, ctx, False)  # the root's writes into buf are done
        finally:
            if ierr or err:   # leaving before they are known done
                self.seg.withdraw_buffer(root, step, <uint64_t>buf)
        # The root's word on its writes is read before this rank finishes: once every reader finished,
        # the root may run on to the step that reuses this half, table and all.
        failed = self.seg.table(root, step)[P + 1] if not ierr and not err else 0
        written = self.seg.tail_written(step)
        self.seg.post(PHASE_FINISHED)
        if failed and not written:   # (no tail here: the root's word says why)
            q, ierr = <int>(failed >> 32) - 1, <int>(failed & 0xffffffffu)
            if 0 <= q < P and q != r and q != root and (ierr == ENG_ERR_PEER_DEAD or ierr == ENG_ERR_PEER_LEFT):
                self.seg.err_peer, self.seg.err_peer_passed, self.seg.err_awaited = q, False, -1   # (a reader it lost)
                return ierr
            self.seg.err_peer = root   # (else its copy into this rank's memory)
            return ENG_ERR_CMA
        return ierr if ierr else err

    cdef int rooted(self, int op, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                    const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        """gather (every rank's count elements to the root, at displs) and scatter (the root's
        pieces at displs, count elements to each rank), mirror images: only the root's counts are
        read (torch gives the others none). A gather's piece is the same for every receiver (one
        copy in the half); a scatter's differs per receiver."""
        cdef int r = self.rank, q
        cdef bint gather = op == OP_GATHER
        cdef size_t theirs, at, mine
        self.sign(op, dtype, OPBIT_NONE, IMPL_SEGMENT, root, 0, 0)
        for q in range(self.size):
            theirs = counts[q] if r == root else 0
            at = displs[q]
            mine = count if q == root else 0
            if gather:
                self.set_piece(q, mine, 0, theirs, at)
            else:
                self.set_piece(q, theirs, at, mine, 0)
        return self.exchange(op, src, dst, dtype, gather, -1 if gather else root, False, ctx)

    # -- reduce_scatter --

    cdef int reduce_scatter_steps(self, const char *src, char *dst, size_t count, RedC *red,
                                  const size_t *counts, const size_t *displs, WaitCtx *ctx) except -1 nogil:
        """Through the slots: each rank writes every peer's block into its half (at the peer's 1/P),
        then reduces its own block from every half. By single copy: each rank reads its block straight
        out of every peer's input, piece by piece, and reduces it."""
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], per = (self.seg.cap // P) // isz, k = 0, steps = 0, m, c, d
        cdef size_t largest = count
        cdef double divisor = P if red.avg else 0.0
        cdef uint64_t total = 0
        cdef char *mine
        for q in range(P):
            c = counts[q]
            total += c
            steps = max(steps, piece_steps(c, per, False))
            largest = max(largest, c)
        self.sign(OP_REDUCE_SCATTER, red.dtype, op_mark(red), IMPL_SEGMENT, -1, total,
                  _counts_hash(counts, P) ^ red.ident)
        if self.single_copy(OP_REDUCE_SCATTER, largest * isz, red.dtype):
            self.sig[0] = call_word(OP_REDUCE_SCATTER, red.dtype, op_mark(red), IMPL_SINGLE_COPY, -1)
            return self.pull_reduce_scatter(src, dst, count, red, counts, displs, divisor, ctx)
        while k < steps:
            ierr = self.open_step(0, ctx)
            if ierr:
                return ierr
            mine = self.seg.half(r, self.seg.step)
            for q in range(P):
                if q != r:
                    c, d = counts[q], displs[q]
                    m = piece_share(c, k, per, False)
                    if m:
                        memcpy(mine + q * per * isz, src + (d + k * per) * isz, m * isz)
            ierr = self.publish_await(PHASE_POSTED, ctx)
            if ierr:
                return ierr
            m = piece_share(count, k, per, False)
            d = displs[r]
            for q in range(P):
                self.srcs[q] = (src + (d + k * per) * isz) if q == r else (self.seg.half(q, self.seg.step) + r * per * isz)
            if m:
                eng_reduce_many(red.fn, dst + k * per * isz, NULL, self.srcs, P, m, isz, red.dtype, divisor)
            self.seg.post(PHASE_FINISHED)
            k += 1
        return 0

    cdef int pull_reduce_scatter(self, const char *src, char *dst, size_t count, RedC *red, const size_t *counts,
                                 const size_t *displs, double divisor, WaitCtx *ctx) except -1 nogil:
        cdef int P = self.size, r = self.rank, q, ierr
        cdef size_t isz = eng_itemsize[red.dtype], per = max(1, min(self.seg.cap // (P - 1), self.pull_piece) // isz)
        cdef size_t off = 0, n
        cdef size_t d = displs[r]
        cdef uint64_t step
        ierr = self.open_step(0, ctx)
        if ierr:
            return ierr
        step = self.seg.step
        self.seg.table(r, step)[P + r] = <uint64_t>src
        ierr = self.publish_await(PHASE_POSTED, ctx)
        while not ierr and off < count:
            n = min(per, count - off)
            for q in range(P):
                if q == r:
                    self.srcs[q] = src + (d + off) * isz
                    continue
                self.srcs[q] = self.scratch + (q - (q > r)) * per * isz
                ierr = self.seg.cma_copy(q, <void*>self.srcs[q], self.seg.table(q, step)[P + q] + (d + off) * isz,
                                         n * isz, False, True)
                if ierr:
                    break
            if not ierr:
                eng_reduce_many(red.fn, dst + off * isz, NULL, self.srcs, P, n, isz, red.dtype, divisor)
            off += n
        self.seg.post(PHASE_FINISHED)
        if ierr:
            return ierr
        return self.seg.wait_all(step, PHASE_FINISHED, ctx, False)   # the others read this rank's input


cdef str _describe_sig(const uint64_t *s, str pieces=None):
    """A step's signature in words; pieces: what the rank's table said of a piece's size, where it differed."""
    name, dtype, red, root = call_word_parts(s[0])
    text = f"{name} #{s[3]}"
    if s[1]:
        text += f" with {s[1]} {dtype or ''} elements"
    elif dtype is not None:
        text += f" of {dtype}" + (f" ({pieces})" if pieces else "")
    if root >= 0:
        text += f" root {root}"
    if red is not None:
        text += f" op {red}"
    return text
