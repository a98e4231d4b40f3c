# The flight recorder of a group: a preallocated C ring of its last operations (sequence number, op,
# count, dtype, the registry entry that ran, start, end, state, the call's key), written without Python on every
# call, and the key of a call (call_key: what every rank must agree on; describe_call: its words).
# Python records are built only when dumped or traced. Once an operation failed in a way that
# leaves the group's state unknown (a timeout, a lost peer, a mismatch), the group is broken: every
# later operation is refused, naming why.

STATE_NAMES = ("running", "done", "failed", "timed out")
DEFAULT_RECORDS = 256

cdef class Recorder:

    def __cinit__(self):
        self.nrecs = DEFAULT_RECORDS
        self.entry_names = ()
        self.recs = <OpRec*>calloc(self.nrecs, sizeof(OpRec))
        if self.recs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.recs)

    def configure(self, size_t size, tracer=None, on_failure=None):
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

    cdef int check_usable(self, str what) except -1:
        """Raises, naming the earlier failure, once the group is broken."""
        if self.broken is not None:
            raise EngineError(f"{what}: this group is unusable after {self.broken_after or 'an earlier failure'} "
                              f"({self.broken}); destroy it and create a new one, or exit")
        return 0

    cdef OpRec *begin(self, int op, size_t count, int dtype, int entry, bint native, uint64_t key) except NULL:
        cdef OpRec *rec
        self.check_usable(OP_KIND_NAMES[op])
        self.seq += 1
        rec = &self.recs[self.seq % self.nrecs]
        rec[0] = OpRec(seq=self.seq, op=op, dtype=dtype, count=count, entry=entry, state=0, native=native,
                       start=eng_now(), end=0, key=key)
        self.cur = rec
        return rec

    cdef int end(self, OpRec *rec, object exc) except -1:
        """The operation is over: done (exc None), failed or timed out."""
        rec.end = eng_now()
        rec.state = 1 if exc is None else 3 if isinstance(exc, EngineTimeout) else 2
        self.cur = NULL
        if self.tracer is not None:
            self.tracer(self.record(rec))
        if exc is not None and self.on_failure is not None:
            self.on_failure(self.record(rec), exc)
        return 0

    def current(self):
        """The operation running now as a record tuple, or None."""
        return self.record(self.cur) if self.cur != NULL else None

    def records(self):
        """The recorded operations, oldest first: (seq, op, count, dtype, algorithm, start, end, state, native,
        key)."""
        cdef size_t i, n = min(self.seq, self.nrecs)
        return [self.record(&self.recs[(self.seq - n + 1 + i) % self.nrecs]) for i in range(n)]


    cdef tuple record(self, OpRec *r):
        return (r.seq, OP_KIND_NAMES[r.op], r.count, DTYPE_NAMES[r.dtype] if r.dtype >= 0 else None,
                self.entry_name(r.entry), r.start, r.end if r.end else None, STATE_NAMES[r.state], bool(r.native),
                r.key)

    cdef object entry_name(self, int entry):
        return self.entry_names[entry] if 0 <= entry < len(self.entry_names) else None


cdef uint64_t call_key(const Call *c) noexcept nogil:
    """What every rank's call must agree on: the collective, dtype, reduce op (AVG apart) and root.
    Hashed with the call's number into its point-to-point tags (pyx/call_tags.h), so a message of
    another call, or of this one with another op, dtype or root, is never taken for this call's."""
    cdef bint rooted = c.op == OP_BROADCAST or c.op == OP_REDUCE or c.op == OP_GATHER or c.op == OP_SCATTER
    return call_word(c.op, c.dtype, op_mark(c.red) if c.red != NULL else OPBIT_NONE, -1, c.root if rooted else -1)


def call_tag_base(int op, int dtype, int opmark, int root, uint64_t seq=0, bint wide=True):
    """The tags' base of call number seq whose call_key() is call_word(op, dtype, opmark, -1, root)
    (pyx/call_tags.h), for the tests that check which calls it tells apart."""
    return eng_call_tag_base(call_word(op, dtype, opmark, -1, root), seq, wide)


cdef tuple call_word_parts(uint64_t w):
    """(collective, dtype or None, reduce op or None, root or -1) of a call_word()."""
    cdef int op = w & 0xff, dtype = <int>((w >> 8) & 0xff) - 1, mark = <int>((w >> 16) & 0xff)
    return (OP_KIND_NAMES[op] if op < NOPKINDS else f"op {op}",
            DTYPE_NAMES[dtype] if 0 <= dtype < ENG_NDTYPES else None,
            OP_NAMES[mark].upper() if 0 <= mark < 8 else f"user #{mark - OPMARK_USER}" if mark >= OPMARK_USER else None,
            <long long>(w >> 32) - 1)


def describe_call(uint64_t key, size_t count):
    """A call's key (a flight record's last field) in words, for count elements: "allreduce of 8
    float32, op SUM", "broadcast of 8 float32, root 0"."""
    name, dtype, red, root = call_word_parts(key)
    text = f"{name} of {count} {dtype}" if dtype is not None else name
    if red is not None:
        text += f", op {red}"
    if root >= 0:
        text += f", root {root}"
    return text
