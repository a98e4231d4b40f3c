# The communicator core: every collective and point-to-point call, written once for every transport.
# Each entry point parses its buffers (once), checks what can be checked locally, chooses the entry
# its rules name (engine/registry.py), then invoke() records the operation in the flight recorder and
# makes one GIL-free call to the transport's implementation (run, overridden by ShmComm and
# engine._mpi.MpiComm), or runs a composite entry through its Hierarchy (hierarchy.pxi).

from cpython.ref cimport Py_INCREF

OP_KIND_NAMES = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
                 "alltoall", "barrier", "sendrecv")


class Impl:
    """The core's implementations, as engine.registry's entries refer to them (pyx/engine/_core.pxd)."""
    NATIVE, RING, RDOUBLE, ONESHOT, TWOSHOT = IMPL_NATIVE, IMPL_RING, IMPL_RDOUBLE, IMPL_ONESHOT, IMPL_TWOSHOT
    SEGMENT, SINGLE_COPY, COMPOSITE, TREE = IMPL_SEGMENT, IMPL_SINGLE_COPY, IMPL_COMPOSITE, IMPL_TREE
    PIPELINE, RSAG, LINEAR, PAIRWISE = IMPL_PIPELINE, IMPL_RSAG, IMPL_LINEAR, IMPL_PAIRWISE
    DISSEMINATION, THREADED = IMPL_DISSEMINATION, IMPL_THREADED


OPBITS = {"user": OPBIT_USER, "none": OPBIT_NONE}   # Rule.ops bits beyond the reduce op codes


cdef inline object _any(x):
    return -1 if x is None else x


cdef inline size_t _nbytes(Message m) noexcept nogil:
    return m.count * m.itemsize


cdef class CoreComm:
    """Collectives over one group; subclasses supply the transport (ShmComm, engine._mpi.MpiComm).

    Buffers: numpy arrays, torch CPU tensors, bytearrays or DLPack objects, read without copies."""

    def __cinit__(self, *args, **kwargs):
        self.spin, self.interval = -1, 1.0
        self.limbo, self.detached = [], []
        self.named_index = {}
        self.reduce_scatters_in_place = True
        self.transport, self.broke_over = "?", -1
        self.log = Recorder()

    def __dealloc__(self):
        cdef int op
        for op in range(NOPKINDS):
            free(self.rules[op])
            free(self.named[op])
        free(self.cnt)
        free(self.avg_input)

    cdef int init_core(self, Transport algo_tp, Transport user_tp, size_t ring_segment_bytes) except -1:
        self.rank, self.size = algo_tp.rank, algo_tp.size
        self.algo_tp = algo_tp
        self.user_tp = self.side_tp = user_tp
        self.ring = RingAllreduce(algo_tp, ring_segment_bytes)
        self.rdouble = RecursiveDoubling(algo_tp)
        self.p2p = P2PCollectives(algo_tp, ring_segment_bytes)
        # every transport's: over algo_tp, and the hierarchy over two stage groups
        self.impls = P2P_IMPLS | (1u << IMPL_RING) | (1u << IMPL_RDOUBLE) | (1u << IMPL_COMPOSITE)
        self.cnt = <size_t*>malloc(4 * self.size * sizeof(size_t))
        if self.cnt == NULL:
            raise MemoryError()
        return 0

    # -- configuration (from engine.Communicator) --

    @property
    def ring_segment_bytes(self):
        return self.ring.seg_bytes

    @property
    def algorithms(self):
        """Names of the allreduce entries this group can run (its algorithm= argument)."""
        return tuple(name for (op, name) in self.named_index if op == OP_ALLREDUCE)

    @property
    def impls(self):
        """The IMPL_* codes this transport implements (engine.registry checks its entries against them)."""
        return frozenset(i for i in range(NIMPLS) if self.impls & (1u << i))

    def set_watch(self, hook, double interval=1.0, p2p=None):
        """hook(elapsed_seconds) runs every `interval` s while a collective's wait polls; it may raise
        (a timeout) to abandon the operation. p2p.peer_timeout(what, peer, tag, elapsed) does the same
        for point-to-point waits, and p2p.message_failed(exc) hears of a message whose failure broke the
        group (a lost peer). None: waits are never interrupted."""
        if interval <= 0:
            raise ValueError("watch interval must be positive")
        self.hook, self.interval, self.p2p_watch = hook, interval, p2p

    def set_spin(self, double microseconds):
        """This group's waits, and its helper threads between jobs, spin this long before yielding (< 0:
        the process's policy, 250 us)."""
        self.spin = microseconds * 1e-6 if microseconds >= 0 else -1

    @property
    def spin_budget(self):
        """Seconds a wait of this group spins on the calling thread before it yields."""
        return spin_budget(self.spin)

    @property
    def driver(self):
        """(drive_transport, the user's channel: addresses; the channel): for engine._progress's drive()."""
        return <size_t>drive_transport, <size_t><void*>self.user_tp, self.user_tp

    cdef void start(self, WaitCtx *ctx) noexcept:
        start_wait(ctx, self.hook, self.interval)
        ctx.alive, ctx.alive_arg, ctx.spin = self.alive, self.alive_arg, self.spin
        ctx.abort = &self.aborted
        ctx.side = nudge_transport    # (the user's messages go on during every wait of the group)
        ctx.side_arg = <void*>self.side_tp

    # -- abort: ends every wait of this group, from any thread --

    def abort(self):
        """Marks the group aborted: every wait of its calls, running now in any thread or started later,
        ends within one round of its back-off (at most 50 ms asleep) with EngineAborted, and the peers
        are told (not by a fork's copy: orphan()). Nothing is freed here: release it once `busy` is 0."""
        eng_store32(&self.aborted, 1)
        if self.orphaned is None:
            self.algo_tp.group_broke(False, -1, self.busy == 0 and not self.collective_thread)

    @property
    def aborted(self):
        return eng_load32(&self.aborted) != 0

    def release(self):
        """Frees the group's transports (memory, descriptors, threads) now, as destroy_process_group
        promises, not whenever the collector finds this object: the watch and the adapter's fast path
        hold it in reference cycles. The group is aborted first, so every later call is refused, and
        one still inside (another thread's) ends, and this rank leaves it (leave()); then, if no call
        is inside (busy 0), the transports go, else it returns False and the last call to leave frees
        them (call_left)."""
        if self.orphaned is not None:
            return True
        if not eng_load32(&self.aborted):
            self.destroyed = True
            eng_store32(&self.aborted, 1)
        self.leave()
        self.release_due = True
        self.release_if_idle()
        return self.busy == 0

    def orphan(self, str why):
        """This process is a fork of the one that made the group (engine/forks.py): every call is
        refused (as aborted), saying why, and the group is never freed here. Freeing it would tell the
        parent's peers this rank left (the segment's flags) and stop threads that are not in this
        process; its memory goes when this process ends."""
        if self.orphaned is None:
            eng_store32(&self.aborted, 1)
            Py_INCREF(self)
        self.orphaned = why     # (a fork of a fork: the newest)

    cdef void release_if_idle(self) noexcept:
        """Frees the transports once a release() is due and no call is inside (once)."""
        if self.busy == 0 and self.release_due and not self.released:
            self.released = True
            self.release_transports()

    cdef void release_transports(self) noexcept:
        """What release() frees: the transports' (a transport with more of its own adds it)."""
        self.detached = []   # (cancelled: the group is gone)
        self.algo_tp.release()
        if self.user_tp is not self.algo_tp:
            self.user_tp.release()

    cdef void call_left(self) noexcept:
        """A call leaves the core (every `busy += 1` is paired with this, once its error is made: the
        error may read the transport); the last one out frees what a release() left to it."""
        self.busy -= 1
        self.release_if_idle()

    @property
    def busy(self):
        """How many calls of this group are inside the core now (a thread in a wait among them)."""
        return self.busy

    # -- the flight recorder (recorder.pxi), as engine.watch reads it --

    def set_recorder(self, size_t size, tracer=None, on_failure=None):
        self.log.configure(size, tracer, on_failure)

    def current(self):
        return self.log.current()

    def records(self):
        return self.log.records()

    @property
    def seq(self):
        return self.log.seq

    @property
    def broken(self):
        return self.log.broken

    @property
    def broken_after(self):
        """What broke the group, in BROKEN_AFTER's words (None: not broken, or unknown)."""
        return self.log.broken_after

    def check_usable(self, str what):
        """Raises what every later operation of a broken group raises (an asynchronous call is refused
        when it is made, not when it runs)."""
        if self.orphaned is not None:
            raise self.error(ENG_ERR_ABORTED, what)
        self.log.check_usable(what)

    def set_broken(self, why, after=None, int lost=-1, bint between=False):
        """Marks the group unusable: every later operation raises, naming why, and after what (a few words:
        "an earlier call timed out"); lost: the rank whose loss broke it (see broke()), or -1; between:
        it broke between calls (debug mode's signatures differ: Transport.group_broke), unless a call runs."""
        self.log.broken, self.log.broken_after, self.broke_over = why, after, lost
        self.algo_tp.group_broke(after == BROKEN_AFTER[EngineTimeout], lost, between and not self.collective_thread)

    # -- choosing the entry that runs (the rules come from engine.registry.Plan) --

    def set_hierarchy(self, Hierarchy hier):
        """The two levels that run this group's composite entries (None: none). Their waits move this
        group's user messages (its collectives wait there)."""
        cdef CoreComm stage
        self.hier = hier
        if hier is not None:
            for stage in (hier.local, hier.cross, hier.leaders):
                if stage is not None:
                    stage.side_tp = self.user_tp

    def set_rules(self, str collective, rules, named, entry_names):
        """How this group chooses for one collective: rules, walked in order for each call, the first
        that applies runs; named, every entry this group can run (for algorithm=). Each item: (entry,
        impl, lo_bytes, hi_bytes, min_ranks, max_ranks, dtype_mask, op_mask, takes_uneven_counts);
        named items are (name, item); entry_names: every entry's name, as entry indexes them (for the
        recorder and messages)."""
        cdef int op = OP_KIND_NAMES.index(collective)
        self.log.entry_names = tuple(entry_names)
        rules, named = list(rules), list(named)
        cdef Rule *r = _rule_array(self, rules)
        cdef Rule *n = _rule_array(self, [rule for _, rule in named])
        free(self.rules[op])
        free(self.named[op])
        self.rules[op], self.nrules[op] = r, len(rules)
        self.named[op] = n
        for key in [k for k in self.named_index if k[0] == op]:
            del self.named_index[key]
        for i, (name, _) in enumerate(named):
            self.named_index[op, name] = i

    cdef const Rule *choose(self, int op, size_t nbytes, int dtype, int opbit, bint uneven) noexcept nogil:
        """The first of op's rules that applies to a message of nbytes (one rank's piece), or NULL."""
        cdef int i
        cdef const Rule *r
        for i in range(self.nrules[op]):
            r = &self.rules[op][i]
            if (r.lo <= nbytes <= r.hi and r.min_ranks <= self.size <= r.max_ranks
                    and (dtype < 0 or (r.dtypes >> dtype) & 1) and (r.ops >> opbit) & 1
                    and (r.uneven or not uneven)):
                return r
        return NULL

    cdef const Rule *select(self, int op, size_t nbytes, int dtype, int opbit, bint uneven, object name) except NULL:
        """The rule this call runs: the named entry (algorithm=), else the first rule that applies."""
        cdef const Rule *r
        if name is not None and name != "auto":
            i = self.named_index.get((op, name))
            if i is None:
                raise ValueError(f"unknown {OP_KIND_NAMES[op]} algorithm {name!r} for this group ({self.transport}); "
                                 f"it runs {', '.join(n for (o, n) in self.named_index if o == op)}")
            return &self.named[op][<int>i]
        r = self.choose(op, nbytes, dtype, opbit, uneven)
        if r == NULL:
            what = f"{DTYPE_NAMES[dtype]} " if dtype >= 0 else ""
            raise ValueError(f"{OP_KIND_NAMES[op]}: no algorithm of this group takes this call ({what}"
                             f"{nbytes} bytes{', uneven counts' if uneven else ''}"
                             f"{', user op' if opbit == OPBIT_USER else ''}): "
                             f"ENGINE_{OP_KIND_NAMES[op].upper()}_ALGO forces one that does not (see engine.registry)")
        return r

    cdef bint single_copy(self, int op, size_t nbytes, int dtype) noexcept nogil:
        """Whether a piece of nbytes of op moves by single copy (every rank decides alike from its size)."""
        cdef const Rule *r
        if nbytes == 0:
            return False
        r = self.choose(op, nbytes, dtype, OPBIT_NONE, False)
        return r != NULL and r.impl == IMPL_SINGLE_COPY

    def algorithm_for(self, size_t nbytes, str collective="allreduce", str dtype="float32"):
        """The entry the rules pick for a call of nbytes (a SUM for reductions)."""
        cdef int op = OP_KIND_NAMES.index(collective)
        cdef const Rule *r = self.choose(op, nbytes, DTYPE_CODES[dtype],
                                         ENG_SUM if op in (OP_ALLREDUCE, OP_REDUCE, OP_REDUCE_SCATTER) else OPBIT_NONE,
                                         False)
        return self.log.entry_name(r.entry) if r != NULL else None

    # -- one call: record, run without the GIL, finish --

    cdef int invoke(self, Call *c, const Rule *rule, size_t recorded, object keep, Reduction red=None) except -1:
        """Runs call c with rule's implementation as one recorded operation of this group (a composite entry: through
        its hierarchy). keep: the call's buffers, kept alive for good if it fails. red: c's op (a user op's raise: every
        rank learns it). A group runs one collective at a time (MPI's rule too): two threads at once would share its
        steps and scratch and corrupt both results, so the second is refused."""
        if self.collective_thread:
            raise RuntimeError(f"{OP_KIND_NAMES[c.op]}: a collective of this group is running in another thread "
                               f"(ident {self.collective_thread}): a group runs one collective at a time; call its "
                               "collectives from one thread, or behind a lock, or give each thread a group of its own")
        cdef RaiseWatch raises   # (a user op's raises, counted for this call alone: user_ops.pxi)
        raise_watch_begin(&raises, red is not None and red.c.code < 0)
        self.collective_thread = PyThread_get_thread_ident()
        try:
            self._invoke(c, rule, recorded, keep)
        finally:
            self.collective_thread = 0
            raise_watch_end(&raises)
        if raises.on:
            user_op_agree(self, red, raises.raised, OP_KIND_NAMES[c.op])
        return 0

    cdef int _invoke(self, Call *c, const Rule *rule, size_t recorded, object keep) except -1:
        cdef OpRec *rec
        cdef WaitCtx ctx
        cdef int ierr = 0
        cdef bint avg
        cdef double spread = 0.0
        cdef Reduction total
        cdef Hierarchy hier = self.hier    # (a reference of its own: free() may drop the group's meanwhile)
        cdef uint64_t key = call_key(c)
        if self.aborted:
            raise self.error(ENG_ERR_ABORTED, OP_KIND_NAMES[c.op])
        # (seq + 1: the number log.begin gives this call, composite or not)
        self.algo_tp.begin_call(eng_call_tag_base(key, self.log.seq + 1, self.algo_tp.wide_tags))
        if rule.impl == IMPL_COMPOSITE:
            # AVG: the stages sum, and this core divides, before and after, as dispatch().
            avg = c.red != NULL and c.red.avg
            if avg:
                spread = avg_before(c, self.rank, self.size, &self.avg_input, &self.avg_input_bytes)
                total = resolve_op(ENG_SUM, c.dtype)
                c.red = &total.c
            rec = self.log.begin(c.op, recorded, c.dtype, rule.entry, False, key)
            self.busy += 1
            try:
                if hier is None or self.aborted:
                    raise self.error(ENG_ERR_ABORTED, OP_KIND_NAMES[c.op])
                hier.run(c, rule.entry, keep)
                if avg:
                    avg_after(c, self.size, spread)
                exc_ = None
            except BaseException as exc:
                exc_ = exc
        else:
            c.impl = rule.impl
            rec = self.log.begin(c.op, recorded, c.dtype, rule.entry, rule.impl == IMPL_NATIVE and self.blocks(c), key)
            self.start(&ctx)
            self.busy += 1
            try:
                if self.aborted:   # again: a tracer's Python may have let another thread abort or release it
                    ierr = ENG_ERR_ABORTED
                else:
                    with nogil:
                        ierr = self.dispatch(c, &ctx)
                exc_ = self.error(ierr, OP_KIND_NAMES[c.op]) if ierr else None
            except BaseException as exc:
                exc_ = exc
        self.call_left()
        if exc_ is not None and keep is not None:
            # (a cancel can't take back all that MPI, the point-to-point algorithms or a peer's single
            # copy still move: a failed call's buffers are never freed, so it lands in no reused memory;
            # nor is AVG's divided input)
            self.limbo.append(keep)
        if exc_ is not None and <void*>c.src == self.avg_input:
            self.avg_input, self.avg_input_bytes = NULL, 0
        self.log.end(rec, exc_)
        if exc_ is not None:
            raise exc_
        return 0

    cdef bint blocks(self, Call *c) noexcept nogil:
        return False

    cdef int dispatch(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """Runs the call between AVG's divisions (dtypes.pxi), for every transport and algorithm that
        doesn't divide inside its reduction (avg_fused). A group of one divides nothing."""
        cdef bint divides_here = not (self.avg_fused & (1u << c.impl))
        cdef double spread = 0.0
        cdef int ierr
        if self.size == 1 and c.aux == NULL:
            return self.run_alone(c)
        if divides_here:
            spread = avg_before(c, self.rank, self.size, &self.avg_input, &self.avg_input_bytes)
        ierr = self.run(c, ctx)
        if (not ierr and divides_here and c.red != NULL and c.red.avg and c.dst != NULL
                and (c.op != OP_REDUCE or self.rank == c.root)):
            avg_after(c, self.size, spread)
        return ierr

    cdef int run_alone(self, Call *c) except -1 nogil:
        """A group of one, whatever the transport and algorithm: this rank's data to its output."""
        cdef size_t isz, n = c.count
        cdef const char *src = c.src
        cdef char *dst = c.dst
        if c.op == OP_BROADCAST or c.op == OP_BARRIER or src == NULL or dst == NULL:
            return 0
        isz = eng_itemsize[c.dtype]
        if c.op == OP_REDUCE_SCATTER or c.op == OP_SCATTER or c.op == OP_ALLTOALL:
            src += c.displs[0] * isz
            n = c.counts[0]
        if c.op == OP_ALLTOALL:
            dst += c.rdispls[0] * isz
        elif c.op == OP_ALLGATHER or c.op == OP_GATHER:
            dst += c.displs[0] * isz
        if src != dst and n:
            memmove(dst, src, n * isz)
        return 0

    cdef int run(self, Call *c, WaitCtx *ctx) except -1 nogil:
        """The algorithms over point-to-point, on every transport; a transport's own implementations
        are its override's, which hands every other call here."""
        if (P2P_IMPLS & (1u << c.impl)) or (c.impl == IMPL_RING and c.op != OP_ALLREDUCE):
            return self.p2p.run(c, ctx)
        if c.op == OP_ALLREDUCE and c.impl == IMPL_RDOUBLE:
            return self.rdouble.run(c.src, c.dst, c.count, eng_itemsize[c.red.dtype], c.red.fn, ctx)
        if c.op == OP_ALLREDUCE:
            return self.ring.run(c.src, c.dst, c.count, eng_itemsize[c.red.dtype], c.red.fn, ctx)
        with gil:
            raise NotImplementedError(f"the {self.transport} transport has no {OP_KIND_NAMES[c.op]}")

    def waiting_on(self):
        """Whom this rank's running collective waits on, as its transport sees it, for a timeout's report
        (a sentence), or None where the transport can't say (the store's arrival notes name them)."""
        return None

    def passed(self):
        """The peers this rank's transport knows to be past its running collective (gone from the group
        in order, or, where it can see it, past the step this rank waits at): not late, whatever the
        store's arrival notes lack."""
        return []

    def leave(self):
        """This rank leaves the group (it is being freed): a transport whose peers must tell a departure
        from a crash says so now, not whenever the object is collected (MPI has nothing to say)."""

    cdef object error(self, int ierr, str what, Transport tp=None):
        """The exception for an error code of transport tp (the algorithms' by default)."""
        if ierr == -1:
            return MemoryError(f"{what}: out of memory")
        tp = self.algo_tp if tp is None else tp
        ierr = tp.classify(ierr)
        if ierr == ENG_ERR_TRUNCATE and tp is self.algo_tp:   # (a collective's: the ranks' counts differ, as
            ierr = ENG_ERR_MISMATCH                           # where a message is shorter than expected)
        if ierr == ENG_ERR_PEER_LEFT and eng_load32(&self.aborted):   # (TCP: free()'s or abort()'s own goodbye
            ierr = ENG_ERR_ABORTED                                     # failed the call before it saw the abort)
        if ierr == ENG_ERR_ABORTED and self.orphaned is not None:
            return EngineError(f"{what}: {self.orphaned}")
        if ierr == ENG_ERR_ABORTED and self.destroyed:
            return EngineAborted(f"{what} failed: the group was destroyed (destroy_process_group or "
                                 "Communicator.free()): create a new group")
        text = tp.error_text(ierr)
        if ierr == ENG_ERR_PEER_DEAD or ierr == ENG_ERR_PEER_LEFT or ierr == ENG_ERR_PEER_TIMED_OUT:
            kind = EngineTimeout if ierr == ENG_ERR_PEER_TIMED_OUT else EnginePeerLost
            return self.broke(kind, text, what, tp.lost_rank(ierr))
        if ierr == ENG_ERR_MISMATCH or ierr == ENG_ERR_OTHER_CALL or ierr == ENG_ERR_CORRUPT:
            return self.broke(EngineError if ierr == ENG_ERR_CORRUPT else EngineMismatch, text, what)
        if ierr == ENG_ERR_ABORTED:
            return EngineAborted(f"{what} failed: {text}")
        return EngineError(f"{what} failed: {text}")

    cdef object broke(self, kind, str text, str what, int lost=-1):
        """Marks the group unusable, naming why (telling the peers of lost: the rank lost, if any, in the
        numbering of the whole group a stage serves, Transport.serve); its exception, whose `lost` says
        which rank (the group the stage serves tells its other stages: Communicator._break_parts)."""
        self.set_broken(text + (self.stage_note or ""), BROKEN_AFTER[kind], lost)
        exc = kind(f"{what} failed: {self.log.broken}")
        exc.lost = lost
        return exc

    def serve(self, whole, int whole_size, str name):
        """A stage of a hierarchy: whole[q] is its rank q's rank in group `name` (of whole_size ranks), the
        group it serves. Its errors say so, and name a lost rank in that numbering (Transport.serve)."""
        self.stage_note = (f" [a stage of group '{name}': its ranks {', '.join(map(str, range(len(whole))))} are "
                           f"ranks {', '.join(map(str, whole))} there]")
        whole = tuple(whole)
        self.algo_tp.serve(whole, whole_size, name)
        self.user_tp.serve(whole, whole_size, name)

    cdef size_t max_count(self, int op) noexcept:
        """The largest element count a transport takes in one call of op (MPI: int counts)."""
        return SIZE_MAX

    def refuse(self, str collective, exc):
        """A check above the core (torch's adapter) refused a call of `collective` here (exc): it counts as
        the group's next call, as a refusal of the core's own checks does (_refused)."""
        return _refused(self, OP_KIND_NAMES.index(collective), self.log.seq, exc)

    # -- collectives --

    def allreduce(self, sendbuf, recvbuf=None, op=0, algorithm=None):
        """recvbuf = reduce(op, sendbuf of every rank); recvbuf None: in place on sendbuf.
        algorithm: None (the rules), or the name of one of this group's allreduce entries."""
        cdef uint64_t seq = self.log.seq
        cdef Message ms, mr
        cdef Reduction red
        cdef Call c
        try:
            ms = as_message(sendbuf, recvbuf is None, "buffer" if recvbuf is None else "sendbuf")
            mr = ms if recvbuf is None else as_message(recvbuf, True, "recvbuf")
            red = resolve_op(op, ms.dtype)
            if mr is not ms:
                same_dtype(ms, mr, "allreduce")
                if mr.count != ms.count:
                    raise ValueError(f"allreduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; "
                                     "they must match")
                ms = apart(ms, mr, <char*>mr.ptr)
            c = new_call(OP_ALLREDUCE, ms.ptr, mr.ptr, ms.count, ms.dtype)
            c.red = &red.c
            self.invoke(&c, self.select(OP_ALLREDUCE, _nbytes(ms), ms.dtype, opbit_of(&red.c), False, algorithm),
                        ms.count, (ms, mr), red)
        except REFUSALS as exc:
            raise _refused(self, OP_ALLREDUCE, seq, exc)
        return recvbuf if recvbuf is not None else sendbuf

    def broadcast(self, buf, root=0):
        cdef uint64_t seq = self.log.seq
        cdef int r
        cdef Message m
        cdef Call c
        try:
            r = _check_root(self, root)
            m = as_message(buf, True, "buffer")
            c = new_call(OP_BROADCAST, NULL, m.ptr, m.count, m.dtype)
            c.root = r
            self.invoke(&c, self.select(OP_BROADCAST, _nbytes(m), m.dtype, OPBIT_NONE, False, None), m.count, m)
        except REFUSALS as exc:
            raise _refused(self, OP_BROADCAST, seq, exc)
        return buf

    def reduce(self, sendbuf, recvbuf=None, op=0, root=0):
        """On root recvbuf = reduce(op, sendbuf of every rank) (recvbuf None: in place on sendbuf)."""
        cdef uint64_t seq = self.log.seq
        cdef int r
        cdef bint is_root, inplace = recvbuf is None
        cdef Message ms, mr
        cdef Reduction red
        cdef Call c
        try:
            r = _check_root(self, root)
            is_root = self.rank == r
            ms = mr = as_message(sendbuf, is_root and inplace, "sendbuf")
            red = resolve_op(op, ms.dtype)
            if is_root and not inplace:
                mr = as_message(recvbuf, True, "recvbuf")
                same_dtype(ms, mr, "reduce")
                if mr.count != ms.count:
                    raise ValueError(f"reduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; they must match")
                ms = apart(ms, mr, <char*>mr.ptr)
            c = new_call(OP_REDUCE, ms.ptr, mr.ptr if is_root else NULL, ms.count, ms.dtype)
            c.red, c.root = &red.c, r
            self.invoke(&c, self.select(OP_REDUCE, _nbytes(ms), ms.dtype, opbit_of(&red.c), False, None), ms.count,
                        (ms, mr), red)
        except REFUSALS as exc:
            raise _refused(self, OP_REDUCE, seq, exc)
        return recvbuf if recvbuf is not None else sendbuf

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of rank 0, 1, ...); counts: per-rank element counts when uneven."""
        cdef uint64_t seq = self.log.seq
        cdef Message ms, mr
        cdef Call c
        try:
            ms = as_message(sendbuf, False, "sendbuf")
            mr = as_message(recvbuf, True, "recvbuf")
            same_dtype(ms, mr, "allgather")
            c = new_call(OP_ALLGATHER, ms.ptr, mr.ptr, ms.count, ms.dtype)
            largest = _call_sizes(self, &c, counts, ms, "sendbuf", mr, "recvbuf", "allgather")
            ms = apart(ms, mr, <char*>mr.ptr + c.displs[self.rank] * ms.itemsize)   # (in place: its part of recvbuf)
            c.src = <char*>ms.ptr
            self.invoke(&c, self.select(OP_ALLGATHER, largest, ms.dtype, OPBIT_NONE, counts is not None, None),
                        mr.count, (ms, mr))
        except REFUSALS as exc:
            raise _refused(self, OP_ALLGATHER, seq, exc)
        return recvbuf

    def gather(self, sendbuf, recvbuf=None, root=0, counts=None):
        """On root recvbuf = concat(sendbuf of every rank); recvbuf is ignored elsewhere."""
        _rooted(self, OP_GATHER, sendbuf, recvbuf, root, counts)
        return recvbuf

    def scatter(self, sendbuf, recvbuf, root=0, counts=None):
        """recvbuf = this rank's slice of root's sendbuf; sendbuf is ignored off the root."""
        _rooted(self, OP_SCATTER, sendbuf, recvbuf, root, counts)
        return recvbuf

    def reduce_scatter(self, sendbuf, recvbuf, op=0, counts=None):
        """recvbuf = this rank's block of reduce(op, sendbuf of every rank); counts: block sizes when uneven."""
        cdef uint64_t seq = self.log.seq
        cdef Message ms, mr
        cdef Reduction red
        cdef Call c
        try:
            ms = as_message(sendbuf, False, "sendbuf")
            mr = as_message(recvbuf, True, "recvbuf")
            same_dtype(ms, mr, "reduce_scatter")
            red = resolve_op(op, ms.dtype)
            c = new_call(OP_REDUCE_SCATTER, ms.ptr, mr.ptr, mr.count, ms.dtype)
            c.red = &red.c
            largest = _call_sizes(self, &c, counts, mr, "recvbuf", ms, "sendbuf", "reduce_scatter")
            ms = apart(ms, mr, <char*>mr.ptr - c.displs[self.rank] * ms.itemsize if self.reduce_scatters_in_place
                       else NULL)   # (in place: recvbuf is its block)
            c.src = <char*>ms.ptr
            self.invoke(&c, self.select(OP_REDUCE_SCATTER, largest, ms.dtype, opbit_of(&red.c), counts is not None,
                                        None), ms.count, (ms, mr), red)
        except REFUSALS as exc:
            raise _refused(self, OP_REDUCE_SCATTER, seq, exc)
        return recvbuf

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        """Block i of sendbuf goes to rank i; block j of recvbuf comes from rank j."""
        cdef uint64_t seq = self.log.seq
        cdef Message ms, mr
        cdef size_t *sc = self.cnt
        cdef size_t *sd = self.cnt + self.size
        cdef size_t *rc = self.cnt + 2 * self.size
        cdef size_t *rd = self.cnt + 3 * self.size
        cdef size_t largest = 0
        cdef int i
        cdef Call c
        cdef bint even = send_counts is None and recv_counts is None
        try:
            ms = as_message(sendbuf, False, "sendbuf")
            mr = as_message(recvbuf, True, "recvbuf")
            same_dtype(ms, mr, "alltoall")
            ms = apart(ms, mr, NULL)
            alltoall_sizes(self.size, self.rank, send_counts, ms.count, recv_counts, mr.count, sc, sd, rc, rd)
            for i in range(self.size):
                largest = max(largest, sc[i], rc[i])
            _check_fits(self, OP_ALLTOALL, largest if even else max(ms.count, mr.count), "alltoall")
            c = new_call(OP_ALLTOALL, ms.ptr, mr.ptr, ms.count, ms.dtype)
            c.counts, c.displs, c.rcounts, c.rdispls, c.even = sc, sd, rc, rd, even
            # (uneven: no size is known to every rank: each runs the rule for the largest calls, registry.EVERY)
            self.invoke(&c, self.select(OP_ALLTOALL, sc[0] * ms.itemsize if even else <size_t>1 << 62, ms.dtype,
                                        OPBIT_NONE, not even, None), ms.count, (ms, mr))
        except REFUSALS as exc:
            raise _refused(self, OP_ALLTOALL, seq, exc)
        return recvbuf

    def check_even_split(self, size_t count, str side):
        """check_even_split for this group; torch's adapter calls it before it queues an alltoall."""
        check_even_split(self.size, count, side)

    def barrier(self):
        cdef Call c = new_call(OP_BARRIER, NULL, NULL, 0, -1)
        self.invoke(&c, self.select(OP_BARRIER, 0, -1, OPBIT_NONE, False, None), 0, None)

    # -- point to point (not numbered: they need not match across all ranks) --

    def isend(self, buf, dest, tag=0):
        """Returns a Request: .wait(), .test()."""
        return _post_user(self, buf, dest, tag, False, "isend", "isend")

    def irecv(self, buf, source=-1, tag=-1, bint whole=False):
        """Returns a Request whose .wait() gives (source, tag, count); source / tag None or -1: any; whole: a
        message shorter than buf fails it (torch's recv, which has no count to say what it left unwritten)."""
        return whole_message(_post_user(self, buf, _any(source), _any(tag), True, "irecv", "irecv"), whole)

    def send(self, buf, dest, tag=0):
        _post_user(self, buf, dest, tag, False, "send", "send").wait()

    def recv(self, buf, source=-1, tag=-1):
        """Returns (source, tag, count) of the message received; source / tag None or -1: any."""
        return _post_user(self, buf, _any(source), _any(tag), True, "recv", "recv").wait()

    def sendrecv(self, sendbuf, dest, recvbuf, source=-1, sendtag=0, recvtag=-1):
        """MPI_Sendrecv, returning (source, tag, count); sendbuf sharing recvbuf's bytes sends what it held."""
        into = as_message(recvbuf, True, "buffer")
        sent = apart(as_message(sendbuf, False, "buffer"), into, NULL)
        r = _post_user(self, into, _any(source), _any(recvtag), True, "sendrecv", "recv")
        _post_user(self, sent, dest, sendtag, False, "sendrecv", "send").wait()
        return r.wait()


# ---- the checks and the pieces of CoreComm's entry points (this file's only) ----

cdef Request _post_user(CoreComm self, object buf, object peer_, object tag_, bint recv, str call, str what):
    """The user's isend / irecv on the group's user channel, peer and tag checked (`call` names the entry
    point in the errors; a receive takes -1 for any source or tag; the tag is checked once the peer passed)."""
    peer = _index(peer_, call, "source" if recv else "destination")
    if not (recv and peer == ANY_PEER) and not 0 <= peer < self.size:
        raise ValueError(f"{call}: {'source' if recv else 'destination'} rank {peer} is out of range for a group "
                         f"of size {self.size}" + (" (use None for any source)" if recv else ""))
    tag = _index(tag_, call, "tag")
    cdef int top = 0x7FFFFFFF if self.user_tp.wide_tags else 32767   # (all MPI promises; Gloo's are ints)
    if not (recv and tag == ANY_TAG_) and not 0 <= tag <= top:
        raise ValueError(f"tag {tag} is out of range; use 0..{top}")
    return post_request(self, self.user_tp, buf, peer, tag, recv, what)
