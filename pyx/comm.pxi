# The communicator core: every collective and point-to-point call, written once for every transport.
# Each entry point parses its buffers (once), checks what can be checked locally, records the
# operation in the flight recorder (a preallocated C ring), then makes one GIL-free call to the
# transport's implementation (run_* below, overridden by ShmComm and engine._mpi.MpiComm).

from libc.stdint cimport SIZE_MAX

OP_KIND_NAMES = ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
                 "alltoall", "barrier", "sendrecv")


class Impl:
    """The core's implementations, as engine.registry's entries refer to them (pyx/engine/_core.pxd)."""
    NATIVE = IMPL_NATIVE
    RING = IMPL_RING
    RDOUBLE = IMPL_RDOUBLE
    ONESHOT = IMPL_ONESHOT
    TWOSHOT = IMPL_TWOSHOT
    SEGMENT = IMPL_SEGMENT
    SINGLE_COPY = IMPL_SINGLE_COPY
    COMPOSITE = IMPL_COMPOSITE


OPBITS = {"user": OPBIT_USER, "none": OPBIT_NONE}   # Rule.ops bits beyond the reduce op codes

cdef tuple _ENTRY_NAMES = ()    # what the flight recorder calls each registry entry (set by engine.registry)


def set_entry_names(names):
    """The registry's entry names, indexed as the rules' entries are (called once, by engine.registry)."""
    global _ENTRY_NAMES
    _ENTRY_NAMES = tuple(names)


cdef inline int opbit_of(RedC *red) noexcept nogil:
    """The Rule.ops bit of a resolved reduction."""
    if red.code < 0:
        return OPBIT_USER
    return 7 if red.avg else red.code
STATE_NAMES = ("running", "done", "failed", "timed out")
DEFAULT_RECORDS = 256

cdef list _LIMBO = []   # buffers a cancelled request may still be touched through (MPI sends): kept alive


cdef class Request:
    """A pending isend / irecv; keeps its buffer alive until it completes. While it is waited on, the
    request itself is the wait's watch: past the group's timeout it raises, naming its peer."""
    cdef Req req
    cdef Message msg
    cdef Transport tp
    cdef CoreComm comm
    cdef Status st
    cdef bint done, is_recv
    cdef int peer, tag
    cdef str what
    cdef WaitCtx ctx

    def __call__(self, double elapsed):
        watch = self.comm.p2p_watch
        if watch is not None:
            watch.peer_timeout(self.what, None if self.peer == ANY_PEER else self.peer, self.tag, elapsed)

    def __dealloc__(self):
        if req_active(&self.req) and self.tp is not None:
            if self.tp.cancel(&self.req):
                _LIMBO.append(self.msg)

    def wait(self):
        """Blocks (without the GIL) until complete; returns (source, tag, count) for receives."""
        cdef int ierr = 0
        if not self.done:
            with nogil:
                ierr = self.tp.wait(&self.req, &self.st, &self.ctx)
            if ierr:
                raise self.comm.error(ierr, "irecv" if self.is_recv else "isend")
            self.done = True
        return self._result()

    def test(self):
        """True once complete (then wait() returns at once)."""
        cdef int ierr = 0
        cdef bint flag = False
        if not self.done:
            ierr = self.tp.test(&self.req, &flag, &self.st)
            if ierr:
                raise self.comm.error(ierr, "irecv" if self.is_recv else "isend")
            self.done = flag
        return self.done

    def _result(self):
        if not self.is_recv:
            return None
        return (self.st.source, self.st.tag, self.st.nbytes // self.msg.itemsize)


cdef inline object _any(x):
    return -1 if x is None else x


cdef inline size_t _nbytes(Message m) noexcept nogil:
    return m.count * m.itemsize


cdef class CoreComm:
    """Collectives over one group; subclasses supply the transport (ShmComm, engine._mpi.MpiComm).

    Buffers: numpy arrays, torch CPU tensors, bytearrays or DLPack objects, read without copies."""

    def __cinit__(self, *args, **kwargs):
        self.cur = NULL
        self.spin = -1
        self.broken = None
        self.interval = 1.0
        self.limbo = []
        self.named_index = {}
        self.transport = "?"

    def __dealloc__(self):
        cdef int op
        for op in range(NOPKINDS):
            free(self.rules[op])
            free(self.named[op])
        free(self.cnt)
        free(self.recs)

    cdef int init_core(self, Transport algo_tp, Transport user_tp, size_t ring_segment_bytes) except -1:
        self.rank = algo_tp.rank
        self.size = algo_tp.size
        self.algo_tp = algo_tp
        self.user_tp = user_tp
        self.ring = RingAllreduce(algo_tp, ring_segment_bytes)
        self.rdouble = RecursiveDoubling(algo_tp)
        self.cnt = <size_t*>malloc(4 * self.size * sizeof(size_t))
        self.nrecs = DEFAULT_RECORDS
        self.recs = <OpRec*>calloc(self.nrecs, sizeof(OpRec))
        if self.cnt == NULL or self.recs == NULL:
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
        for point-to-point waits. None: waits are never interrupted."""
        if interval <= 0:
            raise ValueError("watch interval must be positive")
        self.hook = hook
        self.interval = interval
        self.p2p_watch = p2p

    def set_recorder(self, size_t size, tracer=None, on_failure=None):
        """Keeps the last `size` operations; tracer(record) after each, on_failure(record, exc) on failures."""
        cdef OpRec *recs
        if size == 0:
            raise ValueError("the flight recorder needs at least one entry")
        if size != self.nrecs:
            recs = <OpRec*>calloc(size, sizeof(OpRec))
            if recs == NULL:
                raise MemoryError()
            free(self.recs)
            self.recs = recs
            self.nrecs = size
            self.cur = NULL
        self.tracer = tracer
        self.on_failure = on_failure

    def set_rules(self, str collective, rules, named, composite=None):
        """How this group chooses for one collective (engine.registry.Plan builds both lists):
        rules, walked in order for each call, the first that applies runs; named, every entry this
        group can run (for algorithm=). Each item: (entry, impl, lo_bytes, hi_bytes, min_ranks,
        max_ranks, dtype_mask, op_mask, takes_uneven_counts); named items are (name, item).
        composite(entry, *args) runs IMPL_COMPOSITE entries."""
        cdef int op = OP_KIND_NAMES.index(collective)
        rules, named = list(rules), list(named)
        cdef Rule *r = self._rule_array(rules)
        cdef Rule *n = self._rule_array([rule for _, rule in named])
        free(self.rules[op])
        free(self.named[op])
        self.rules[op], self.nrules[op] = r, len(rules)
        self.named[op] = n
        for key in [k for k in self.named_index if k[0] == op]:
            del self.named_index[key]
        for i, (name, _) in enumerate(named):
            self.named_index[op, name] = i
        if composite is not None:
            self.composite = composite

    cdef Rule *_rule_array(self, list rules) except? NULL:
        cdef Rule *out
        cdef int i
        if not rules:
            return NULL
        out = <Rule*>calloc(len(rules), sizeof(Rule))
        if out == NULL:
            raise MemoryError()
        for i, (entry, impl, lo, hi, minr, maxr, dtypes, ops, uneven) in enumerate(rules):
            if not (self.impls & (1u << impl)):
                free(out)
                raise ValueError(f"entry {_entry_name(entry)}: the {self.transport} transport has no implementation "
                                 f"{impl}")
            out[i].entry = entry
            out[i].impl = impl
            out[i].lo = lo
            out[i].hi = min(hi, SIZE_MAX)
            out[i].min_ranks = minr
            out[i].max_ranks = min(maxr, 1 << 30)
            out[i].dtypes = dtypes
            out[i].ops = ops
            out[i].uneven = uneven
        return out

    @property
    def blocking(self):
        return self.blocking

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
        return _entry_name(r.entry) if r != NULL else None

    cdef size_t max_count(self, int op) noexcept:
        """The largest element count a transport takes in one call of op (MPI: int counts)."""
        return SIZE_MAX

    # -- the flight recorder --

    cdef OpRec *begin(self, int op, size_t count, int dtype, int entry, bint native) except NULL:
        cdef OpRec *rec
        if self.broken is not None:
            raise EngineError(f"{OP_KIND_NAMES[op]}: this group is unusable after an earlier failure "
                              f"({self.broken}); destroy it and create a new one, or exit")
        self.seq += 1
        rec = &self.recs[self.seq % self.nrecs]
        rec.seq = self.seq
        rec.op = op
        rec.dtype = dtype
        rec.count = count
        rec.entry = entry
        rec.state = 0
        rec.native = native and self.blocking
        rec.start = eng_now()
        rec.end = 0
        self.cur = rec
        return rec

    cdef int finish(self, OpRec *rec, int ierr, str what) except -1:
        if ierr:
            exc = self.error(ierr, what)
            self.fail(rec, exc)
            raise exc
        rec.end = eng_now()
        rec.state = 1
        self.cur = NULL
        if self.tracer is not None:
            self.tracer(_record(rec))
        return 0

    cdef int fail(self, OpRec *rec, object exc) except -1:
        rec.end = eng_now()
        rec.state = 3 if isinstance(exc, EngineTimeout) else 2
        self.cur = NULL
        if self.tracer is not None:
            self.tracer(_record(rec))
        if self.on_failure is not None:
            self.on_failure(_record(rec), exc)
        return 0

    cdef object run_composite(self, int op, const Rule *rule, size_t count, int dtype, tuple args):
        """A collective composed in Python of other groups' (engine.hierarchy), recorded (numbered,
        timed, traced) as one operation of this group."""
        cdef OpRec *rec = self.begin(op, count, dtype, rule.entry, False)
        try:
            result = self.composite(rule.entry, *args)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, 0, OP_KIND_NAMES[op])
        return result

    def current(self):
        """The operation running now as a record tuple, or None."""
        return _record(self.cur) if self.cur != NULL else None

    def records(self):
        """The recorded operations, oldest first: (seq, op, count, dtype, algorithm, start, end, state, native)."""
        cdef size_t i, n = min(self.seq, self.nrecs)
        return [_record(&self.recs[(self.seq - n + 1 + i) % self.nrecs]) for i in range(n)]

    @property
    def seq(self):
        return self.seq

    @property
    def broken(self):
        return self.broken

    def set_broken(self, why):
        """Marks the group unusable (after a timeout): every later operation raises, naming why."""
        self.broken = why

    cdef object error(self, int ierr, str what):
        """The exception for a transport error code."""
        if ierr == -1:
            return MemoryError(f"{what}: out of memory")
        text = (self.algo_tp.error_text(ierr) if ierr < ENG_ERR_BASE
                else _engine_error_text(ierr, self.algo_tp.err_peer))
        if ierr == ENG_ERR_PEER_DEAD:
            self.broken = text
            return EnginePeerLost(f"{what} failed: {text}")
        if ierr == ENG_ERR_MISMATCH:
            self.broken = text
            return EngineMismatch(f"{what} failed: {text}")
        if ierr == ENG_ERR_CORRUPT:
            self.broken = text
        return EngineError(f"{what} failed: {text}")

    # -- argument checks shared by every transport --

    cdef int _root(self, int root) except -1:
        if root < 0 or root >= self.size:
            raise ValueError(f"root {root} is out of range for a group of size {self.size} (valid: 0..{self.size - 1})")
        return 0

    cdef int _fits(self, int op, size_t n, str what) except -1:
        if n > self.max_count(op):
            raise ValueError(f"{what}: {n} elements exceed the {self.transport} transport's limit of "
                             f"{self.max_count(op)} for this collective; allreduce, broadcast and reduce take any "
                             "size; split this buffer into smaller calls")
        return 0

    cdef size_t fill_counts(self, object counts, size_t *out, size_t *displs, str role) except? 0:
        """Fills out/displs from a list of per-rank element counts; returns their sum."""
        cdef size_t total = 0
        cdef int i
        if len(counts) != self.size:
            raise ValueError(f"{role} has {len(counts)} entries; it needs one per rank ({self.size})")
        for i in range(self.size):
            c = counts[i]
            if c < 0:
                raise ValueError(f"{role}[{i}] is negative ({c})")
            out[i] = <size_t>c
            displs[i] = total
            total += <size_t>c
        return total

    @staticmethod
    cdef int _same_dtype(Message a, Message b, str what) except -1:
        if a.dtype != b.dtype:
            raise TypeError(f"{what}: send buffer is {DTYPE_NAMES[a.dtype]} but receive buffer is "
                            f"{DTYPE_NAMES[b.dtype]}; they must have the same dtype")
        return 0

    cdef void start(self, WaitCtx *ctx) noexcept:
        start_wait(ctx, self.hook, self.interval)
        ctx.alive = self.alive
        ctx.alive_arg = self.alive_arg
        ctx.spin = self.spin

    def set_spin(self, double microseconds):
        """This group's waits spin at most this long before yielding (< 0: the process's policy)."""
        self.spin = microseconds * 1e-6 if microseconds >= 0 else -1

    # -- collectives --

    def allreduce(self, sendbuf, recvbuf=None, op=0, algorithm=None):
        """recvbuf = reduce(op, sendbuf of every rank); recvbuf None: in place on sendbuf.
        algorithm: None (the rules), or one of this transport's algorithm names."""
        cdef Message ms = as_message(sendbuf, recvbuf is None, "buffer" if recvbuf is None else "sendbuf")
        cdef Message mr = ms if recvbuf is None else as_message(recvbuf, True, "recvbuf")
        cdef Reduction red = resolve_op(op, ms.dtype)
        cdef int ierr = 0
        cdef const Rule *rule
        cdef WaitCtx ctx
        cdef OpRec *rec
        if mr is not ms:
            CoreComm._same_dtype(ms, mr, "allreduce")
            if mr.count != ms.count:
                raise ValueError(f"allreduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; they must match")
        rule = self.select(OP_ALLREDUCE, _nbytes(ms), ms.dtype, opbit_of(&red.c), False, algorithm)
        if rule.impl == IMPL_COMPOSITE:
            return self.run_composite(OP_ALLREDUCE, rule, ms.count, ms.dtype, (sendbuf, recvbuf, op))
        rec = self.begin(OP_ALLREDUCE, ms.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_allreduce(<char*>ms.ptr, <char*>mr.ptr, ms.count, &red.c, rule.impl, &ctx)
        except BaseException as exc:
            self._keep_if_posted(rule.impl, ms, mr)
            self.fail(rec, exc)
            raise
        if ierr:
            self._keep_if_posted(rule.impl, ms, mr)
        self.finish(rec, ierr, "allreduce")
        return recvbuf if recvbuf is not None else sendbuf

    cdef _keep_if_posted(self, int impl, Message ms, Message mr):
        # The point-to-point algorithms post into the user's buffers; whatever a cancel can't take
        # back must not land in freed memory.
        if impl == IMPL_RING or impl == IMPL_RDOUBLE:
            self.limbo.append((ms, mr))

    def broadcast(self, buf, int root=0):
        self._root(root)
        cdef Message m = as_message(buf, True, "buffer")
        cdef int ierr = 0
        cdef WaitCtx ctx
        cdef const Rule *rule = self.select(OP_BROADCAST, _nbytes(m), m.dtype, OPBIT_NONE, False, None)
        cdef OpRec *rec
        if rule.impl == IMPL_COMPOSITE:
            return self.run_composite(OP_BROADCAST, rule, m.count, m.dtype, (buf, root))
        rec = self.begin(OP_BROADCAST, m.count, m.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_broadcast(<char*>m.ptr, m.count, m.dtype, root, rule.impl, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "broadcast")
        return buf

    def reduce(self, sendbuf, recvbuf=None, op=0, int root=0):
        """On root recvbuf = reduce(op, sendbuf of every rank) (recvbuf None: in place on sendbuf)."""
        self._root(root)
        cdef bint is_root = self.rank == root, inplace = recvbuf is None
        cdef Message ms = as_message(sendbuf, is_root and inplace, "sendbuf")
        cdef Message mr = ms
        cdef Reduction red = resolve_op(op, ms.dtype)
        cdef int ierr = 0
        cdef char *rptr = NULL
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule = self.select(OP_REDUCE, _nbytes(ms), ms.dtype, opbit_of(&red.c), False, None)
        if is_root:
            if not inplace:
                mr = as_message(recvbuf, True, "recvbuf")
                CoreComm._same_dtype(ms, mr, "reduce")
                if mr.count != ms.count:
                    raise ValueError(f"reduce: sendbuf has {ms.count} elements but recvbuf {mr.count}; they must match")
            rptr = <char*>mr.ptr
        rec = self.begin(OP_REDUCE, ms.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_reduce(<char*>ms.ptr, rptr, ms.count, &red.c, root, rule.impl, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "reduce")
        return recvbuf if recvbuf is not None else sendbuf

    def allgather(self, sendbuf, recvbuf, counts=None):
        """recvbuf = concat(sendbuf of rank 0, 1, ...); counts: per-rank element counts when uneven."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef size_t *cnt = NULL
        cdef size_t *dsp = NULL
        cdef size_t total
        cdef int ierr = 0
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule
        CoreComm._same_dtype(ms, mr, "allgather")
        self._fits(OP_ALLGATHER, ms.count, "allgather")
        if counts is None:
            if mr.count != ms.count * self.size:
                raise ValueError(f"allgather: recvbuf has {mr.count} elements; it needs sendbuf's {ms.count} "
                                 f"x {self.size} ranks = {ms.count * self.size} (pass counts= for uneven sizes)")
        else:
            cnt, dsp = self.cnt, self.cnt + self.size
            total = self.fill_counts(counts, cnt, dsp, "allgather counts")
            if cnt[self.rank] != ms.count:
                raise ValueError(f"allgather: counts[{self.rank}] is {cnt[self.rank]} but this rank's sendbuf has {ms.count} elements")
            if total != mr.count:
                raise ValueError(f"allgather: counts add up to {total} but recvbuf has {mr.count} elements")
            self._fits(OP_ALLGATHER, total, "allgather")
        rule = self.select(OP_ALLGATHER, _nbytes(ms), ms.dtype, OPBIT_NONE, counts is not None, None)
        if rule.impl == IMPL_COMPOSITE:
            return self.run_composite(OP_ALLGATHER, rule, mr.count, ms.dtype, (sendbuf, recvbuf))
        rec = self.begin(OP_ALLGATHER, mr.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_allgather(<char*>ms.ptr, <char*>mr.ptr, ms.count, ms.dtype, cnt, dsp, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "allgather")
        return recvbuf

    def gather(self, sendbuf, recvbuf=None, int root=0, counts=None):
        """On root recvbuf = concat(sendbuf of every rank); recvbuf is ignored elsewhere."""
        self._root(root)
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = None
        cdef size_t *cnt = NULL
        cdef size_t *dsp = NULL
        cdef size_t total
        cdef char *rptr = NULL
        cdef int ierr = 0
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule
        self._fits(OP_GATHER, ms.count, "gather")
        if self.rank == root:
            if recvbuf is None:
                raise ValueError("gather: the root needs a recvbuf")
            mr = as_message(recvbuf, True, "recvbuf")
            CoreComm._same_dtype(ms, mr, "gather")
            rptr = <char*>mr.ptr
        if counts is None:
            if mr is not None and mr.count != ms.count * self.size:
                raise ValueError(f"gather: recvbuf has {mr.count} elements; it needs {ms.count} x {self.size} ranks "
                                 "(pass counts= for uneven sizes)")
        else:
            cnt, dsp = self.cnt, self.cnt + self.size
            total = self.fill_counts(counts, cnt, dsp, "gather counts")
            if cnt[self.rank] != ms.count:
                raise ValueError(f"gather: counts[{self.rank}] is {cnt[self.rank]} but this rank's sendbuf has {ms.count} elements")
            if mr is not None and total != mr.count:
                raise ValueError(f"gather: counts add up to {total} but recvbuf has {mr.count} elements")
            self._fits(OP_GATHER, total, "gather")
        rule = self.select(OP_GATHER, _nbytes(ms), ms.dtype, OPBIT_NONE, counts is not None, None)
        rec = self.begin(OP_GATHER, ms.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_gather(<char*>ms.ptr, rptr, ms.count, ms.dtype, cnt, dsp, root, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "gather")
        return recvbuf

    def scatter(self, sendbuf, recvbuf, int root=0, counts=None):
        """recvbuf = this rank's slice of root's sendbuf; sendbuf is ignored off the root."""
        self._root(root)
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef Message ms = None
        cdef size_t *cnt = NULL
        cdef size_t *dsp = NULL
        cdef size_t total
        cdef char *sptr = NULL
        cdef int ierr = 0
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule
        self._fits(OP_SCATTER, mr.count, "scatter")
        if self.rank == root:
            if sendbuf is None:
                raise ValueError("scatter: the root needs a sendbuf")
            ms = as_message(sendbuf, False, "sendbuf")
            CoreComm._same_dtype(ms, mr, "scatter")
            sptr = <char*>ms.ptr
        if counts is None:
            if ms is not None and ms.count != mr.count * self.size:
                raise ValueError(f"scatter: sendbuf has {ms.count} elements; it needs recvbuf's {mr.count} x "
                                 f"{self.size} ranks (pass counts= for uneven sizes)")
        else:
            cnt, dsp = self.cnt, self.cnt + self.size
            total = self.fill_counts(counts, cnt, dsp, "scatter counts")
            if cnt[self.rank] != mr.count:
                raise ValueError(f"scatter: counts[{self.rank}] is {cnt[self.rank]} but this rank's recvbuf has {mr.count} elements")
            if ms is not None and total != ms.count:
                raise ValueError(f"scatter: counts add up to {total} but sendbuf has {ms.count} elements")
            self._fits(OP_SCATTER, total, "scatter")
        rule = self.select(OP_SCATTER, _nbytes(mr), mr.dtype, OPBIT_NONE, counts is not None, None)
        rec = self.begin(OP_SCATTER, mr.count, mr.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_scatter(sptr, <char*>mr.ptr, mr.count, mr.dtype, cnt, dsp, root, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "scatter")
        return recvbuf

    def reduce_scatter(self, sendbuf, recvbuf, op=0, counts=None):
        """recvbuf = this rank's block of reduce(op, sendbuf of every rank); counts: block sizes when uneven."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef Reduction red
        cdef size_t *cnt = NULL
        cdef size_t *dsp = NULL
        cdef size_t total, largest = mr.count
        cdef int ierr = 0, i
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule
        CoreComm._same_dtype(ms, mr, "reduce_scatter")
        red = resolve_op(op, ms.dtype)
        self._fits(OP_REDUCE_SCATTER, ms.count, "reduce_scatter")
        if counts is None:
            if ms.count != mr.count * self.size:
                raise ValueError(f"reduce_scatter: sendbuf has {ms.count} elements; it needs recvbuf's {mr.count} "
                                 f"x {self.size} ranks (pass counts= for uneven sizes)")
        else:
            cnt, dsp = self.cnt, self.cnt + self.size
            total = self.fill_counts(counts, cnt, dsp, "reduce_scatter counts")
            if cnt[self.rank] != mr.count:
                raise ValueError(f"reduce_scatter: counts[{self.rank}] is {cnt[self.rank]} but this rank's recvbuf has {mr.count} elements")
            if total != ms.count:
                raise ValueError(f"reduce_scatter: counts add up to {total} but sendbuf has {ms.count} elements")
            for i in range(self.size):
                largest = max(largest, cnt[i])
        rule = self.select(OP_REDUCE_SCATTER, largest * ms.itemsize, ms.dtype, opbit_of(&red.c), counts is not None,
                           None)
        if rule.impl == IMPL_COMPOSITE:
            return self.run_composite(OP_REDUCE_SCATTER, rule, ms.count, ms.dtype, (sendbuf, recvbuf, op))
        rec = self.begin(OP_REDUCE_SCATTER, ms.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_reduce_scatter(<char*>ms.ptr, <char*>mr.ptr, mr.count, &red.c, cnt, dsp, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "reduce_scatter")
        return recvbuf

    def alltoall(self, sendbuf, recvbuf, send_counts=None, recv_counts=None):
        """Block i of sendbuf goes to rank i; block j of recvbuf comes from rank j."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef size_t *sc = self.cnt
        cdef size_t *sd = self.cnt + self.size
        cdef size_t *rc = self.cnt + 2 * self.size
        cdef size_t *rd = self.cnt + 3 * self.size
        cdef size_t stotal, rtotal, block, largest = 0
        cdef bint even = send_counts is None and recv_counts is None
        cdef int i, ierr = 0
        cdef WaitCtx ctx
        cdef OpRec *rec
        cdef const Rule *rule
        CoreComm._same_dtype(ms, mr, "alltoall")
        if ms.ptr == mr.ptr and ms.count:
            raise ValueError("alltoall: sendbuf and recvbuf are the same memory; pass separate buffers")
        if even:
            if ms.count % self.size or mr.count != ms.count:
                raise ValueError(f"alltoall: sendbuf ({ms.count}) and recvbuf ({mr.count}) must have the same number "
                                 f"of elements, divisible by the group size {self.size} (pass send_counts= and "
                                 "recv_counts= for uneven splits)")
            block = ms.count // self.size
            self._fits(OP_ALLTOALL, block, "alltoall")
            for i in range(self.size):
                sc[i] = rc[i] = block
                sd[i] = rd[i] = i * block
        else:
            if send_counts is None or recv_counts is None:
                raise ValueError("alltoall: uneven splits need both send_counts and recv_counts")
            stotal = self.fill_counts(send_counts, sc, sd, "alltoall send_counts")
            rtotal = self.fill_counts(recv_counts, rc, rd, "alltoall recv_counts")
            if stotal != ms.count:
                raise ValueError(f"alltoall: send_counts add up to {stotal} but sendbuf has {ms.count} elements")
            if rtotal != mr.count:
                raise ValueError(f"alltoall: recv_counts add up to {rtotal} but recvbuf has {mr.count} elements")
            self._fits(OP_ALLTOALL, max(stotal, rtotal), "alltoall")
        for i in range(self.size):
            largest = max(largest, sc[i])
        rule = self.select(OP_ALLTOALL, largest * ms.itemsize, ms.dtype, OPBIT_NONE, not even, None)
        rec = self.begin(OP_ALLTOALL, ms.count, ms.dtype, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_alltoall(<char*>ms.ptr, <char*>mr.ptr, ms.dtype, sc, sd, rc, rd, even, &ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "alltoall")
        return recvbuf

    def barrier(self):
        cdef int ierr = 0
        cdef WaitCtx ctx
        cdef const Rule *rule = self.select(OP_BARRIER, 0, -1, OPBIT_NONE, False, None)
        cdef OpRec *rec = self.begin(OP_BARRIER, 0, -1, rule.entry, rule.impl == IMPL_NATIVE)
        self.start(&ctx)
        try:
            with nogil:
                ierr = self.run_barrier(&ctx)
        except BaseException as exc:
            self.fail(rec, exc)
            raise
        self.finish(rec, ierr, "barrier")

    def allgather_watched(self, sendbuf, recvbuf):
        """An allgather that is not numbered or recorded (the debug-mode signature exchange); its waits
        go through the watch, so a rank that never arrives ends in an exception, not a hang."""
        cdef Message ms = as_message(sendbuf, False, "sendbuf")
        cdef Message mr = as_message(recvbuf, True, "recvbuf")
        cdef int ierr = 0
        cdef WaitCtx ctx
        if mr.count != ms.count * self.size or mr.dtype != ms.dtype:
            raise ValueError("allgather_watched: recvbuf must hold sendbuf's count x group size, same dtype")
        self.start(&ctx)
        with nogil:
            ierr = self.run_allgather(<char*>ms.ptr, <char*>mr.ptr, ms.count, ms.dtype, NULL, NULL, &ctx)
        if ierr:
            raise self.error(ierr, "allgather")

    # -- point to point (not numbered: they need not match across all ranks) --

    cdef int _peer(self, int peer, bint any_ok, str what) except? -9999:
        if any_ok and peer == -1:
            return ANY_PEER
        if peer < 0 or peer >= self.size:
            raise ValueError(f"{what} rank {peer} is out of range for a group of size {self.size}"
                             + (" (use None for any source)" if any_ok else ""))
        return peer

    cdef int _tag(self, int tag, bint any_ok) except? -9999:
        if any_ok and tag == -1:
            return ANY_TAG_
        if tag < 0 or tag > 32767:   # MPI guarantees tags up to 32767
            raise ValueError(f"tag {tag} is out of range; use 0..32767")
        return tag

    cdef object _post(self, buf, int peer, int tag, bint recv, str what):
        cdef Request r = Request.__new__(Request)
        cdef int ierr
        r.msg = as_message(buf, recv, "buffer")
        r.tp = self.user_tp
        r.comm = self
        r.is_recv = recv
        r.peer = peer
        r.tag = tag
        r.what = what
        start_wait(&r.ctx, r, self.interval)
        r.ctx.alive = self.alive
        r.ctx.alive_arg = self.alive_arg
        r.ctx.spin = self.spin
        if recv:
            ierr = self.user_tp.irecv(r.msg.ptr, _nbytes(r.msg), peer, tag, &r.req)
        else:
            ierr = self.user_tp.isend(r.msg.ptr, _nbytes(r.msg), peer, tag, &r.req)
        if ierr:
            raise self.error(ierr, what)
        return r

    def isend(self, buf, int dest, int tag=0):
        """Returns a Request: .wait(), .test()."""
        return self._post(buf, self._peer(dest, False, "isend: destination"), self._tag(tag, False), False, "isend")

    def irecv(self, buf, source=-1, tag=-1):
        """Returns a Request whose .wait() gives (source, tag, count); source / tag None or -1: any."""
        return self._post(buf, self._peer(_any(source), True, "irecv: source"), self._tag(_any(tag), True), True,
                          "irecv")

    def send(self, buf, int dest, int tag=0):
        self._post(buf, self._peer(dest, False, "send: destination"), self._tag(tag, False), False, "send").wait()

    def recv(self, buf, source=-1, tag=-1):
        """Returns (source, tag, count) of the message received; source / tag None or -1: any."""
        return self._post(buf, self._peer(_any(source), True, "recv: source"), self._tag(_any(tag), True), True,
                          "recv").wait()

    def sendrecv(self, sendbuf, int dest, recvbuf, source=-1, int sendtag=0, recvtag=-1):
        """Sends sendbuf to dest and receives recvbuf at once (MPI_Sendrecv); returns the receive's
        (source, tag, count)."""
        r = self._post(recvbuf, self._peer(_any(source), True, "sendrecv: source"), self._tag(_any(recvtag), True),
                       True, "recv")
        self._post(sendbuf, self._peer(dest, False, "sendrecv: destination"), self._tag(sendtag, False), False,
                   "send").wait()
        return r.wait()

    # -- what each transport implements (the defaults: the engine's point-to-point algorithms) --

    cdef int run_allreduce(self, const char *src, char *dst, size_t count, RedC *red, int impl,
                           WaitCtx *ctx) except -1 nogil:
        cdef int ierr
        cdef size_t isz = eng_itemsize[red.dtype]
        if impl == IMPL_RDOUBLE:
            ierr = self.rdouble.run(src, dst, count, isz, red.fn, ctx)
        else:
            ierr = self.ring.run(src, dst, count, isz, red.fn, ctx)
        if not ierr and red.avg:
            eng_scale(dst, count, red.dtype, self.size, 1)
        return ierr

    cdef int run_broadcast(self, char *buf, size_t count, int dtype, int root, int impl,
                           WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_reduce(self, const char *src, char *dst, size_t count, RedC *red, int root, int impl,
                        WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_allgather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                           const size_t *displs, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_gather(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                        const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_scatter(self, const char *src, char *dst, size_t count, int dtype, const size_t *counts,
                         const size_t *displs, int root, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_reduce_scatter(self, const char *src, char *dst, size_t count, RedC *red,
                                const size_t *counts, const size_t *displs, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_alltoall(self, const char *src, char *dst, int dtype, const size_t *scounts,
                          const size_t *sdispls, const size_t *rcounts, const size_t *rdispls,
                          bint even, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError

    cdef int run_barrier(self, WaitCtx *ctx) except -1 nogil:
        with gil:
            raise NotImplementedError


cdef tuple _record(OpRec *r):
    return (r.seq, OP_KIND_NAMES[r.op], r.count, DTYPE_NAMES[r.dtype] if r.dtype >= 0 else None,
            _entry_name(r.entry), r.start, r.end if r.end else None,
            STATE_NAMES[r.state], bool(r.native))


cdef object _entry_name(int entry):
    return _ENTRY_NAMES[entry] if 0 <= entry < len(_ENTRY_NAMES) else None
