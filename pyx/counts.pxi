# The count tables of the v-collectives: every size check of allgather, gather, scatter,
# reduce_scatter and alltoall, once, with a call's root and its transport's limits. CoreComm fills
# its call's tables here; the CUDA communicator
# (engine/cuda/communicator.py) reads the same tables through count_table and alltoall_table.

from cpython.number cimport PyNumber_Index
from schedule cimport even_counts

# The most elements counts may add up to: their bytes, at any element size up to 16, fit a size_t (a
# sum that wrapped around would pass the checks against a buffer's size, and place parts outside it).
cdef size_t MAX_ELEMENTS = (<size_t>-1) >> 4


cdef object _whole(object c, str role, Py_ssize_t i):
    try:
        return PyNumber_Index(c)    # (a float would be truncated: 2.5 elements moved as 2)
    except TypeError:
        raise TypeError(f"{role}[{i}] is {c!r}, not a whole number of elements; pass ints") from None


def whole_counts(counts, str role):
    """counts as ints, or the TypeError fill_counts raises (debug mode's signature reads them first)."""
    return [_whole(c, role, i) for i, c in enumerate(counts)]


cdef size_t fill_counts(int size, object counts, size_t *out, size_t *displs, str role) except? 0:
    """Fills out/displs from a list of per-rank element counts; returns their sum."""
    cdef size_t total = 0
    cdef int i
    if len(counts) != size:
        raise ValueError(f"{role} has {len(counts)} entries; it needs one per rank ({size})")
    for i in range(size):
        c = _whole(counts[i], role, i)
        if c < 0:
            raise ValueError(f"{role}[{i}] is negative ({c})")
        if c > MAX_ELEMENTS - total:
            raise ValueError(f"{role} add up to more than {MAX_ELEMENTS} elements at [{i}] ({c}): no buffer holds "
                             "so many")
        out[i] = <size_t>c
        displs[i] = total
        total += <size_t>c
    return total


cdef size_t v_sizes(int size, int rank, object counts, size_t mine, str mine_role, Py_ssize_t whole,
                    str whole_role, str what, size_t *out, size_t *displs) except? 0:
    """The one check of a v-collective's sizes: without counts, whole holds mine x the group size;
    with them, mine holds counts[rank] and whole their sum (whole -1: off the root, unchecked).
    Fills out / displs: the given counts, or mine for every rank. Returns the counts' sum."""
    cdef size_t total
    if counts is None:
        even_counts(out, displs, size, mine)
        if whole >= 0 and <size_t>whole != mine * size:
            raise ValueError(f"{what}: {whole_role} has {whole} elements; it needs {mine_role}'s {mine} "
                             f"x {size} ranks = {mine * size} (pass counts= for uneven sizes)")
        return mine * size
    total = fill_counts(size, counts, out, displs, f"{what} counts")
    if out[rank] != mine:
        raise ValueError(f"{what}: counts[{rank}] is {out[rank]} but this rank's {mine_role} has {mine} elements")
    if whole >= 0 and total != <size_t>whole:
        raise ValueError(f"{what}: counts add up to {total} but {whole_role} has {whole} elements")
    return total


cdef int _group_args(int size, int rank) except -1:
    """The group a caller outside the core names (the division and the table index trust it)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"a group of {size} ranks has no rank {rank}")
    return 0


def check_even_split(int size, size_t count, str side):
    """The one divisibility check of an alltoall without counts (side "send" or "recv")."""
    _group_args(size, 0)
    if count % size:
        raise NotDivisibleError(
            f"alltoall: {side}buf has {count} elements, not divisible by the group size {size}; pass "
            f"{side}_counts= (torch's all_to_all_single: {'input' if side == 'send' else 'output'}_split_sizes)")


cdef int _alltoall_side(int size, counts, size_t n, size_t *out, size_t *displs, str side) except -1:
    """One side of an alltoall: its counts, or its buffer of n elements split evenly."""
    if counts is None:
        check_even_split(size, n, side)
        even_counts(out, displs, size, n // size)
    elif fill_counts(size, counts, out, displs, f"alltoall {side}_counts") != n:
        raise ValueError(f"alltoall: {side}_counts add up to {displs[size - 1] + out[size - 1]} but {side}buf has "
                         f"{n} elements")
    return 0


cdef int alltoall_sizes(int size, int rank, send_counts, size_t scount, recv_counts, size_t rcount, size_t *sc,
                        size_t *sd, size_t *rc, size_t *rd) except -1:
    """The one check of an alltoall's sizes: each side's counts, or its buffer split evenly, and the
    piece this rank sends itself as long as the one it receives from itself (a peer's pieces are the
    transport's to check: a message longer than its receive fails as truncated)."""
    _alltoall_side(size, send_counts, scount, sc, sd, "send")
    _alltoall_side(size, recv_counts, rcount, rc, rd, "recv")
    if send_counts is None and recv_counts is None and rcount != scount:
        raise ValueError(f"alltoall: sendbuf has {scount} elements but recvbuf {rcount}; an even split needs "
                         f"the same number (pass send_counts= and recv_counts= for uneven splits)")
    if sc[rank] != rc[rank]:
        raise ValueError(f"alltoall: rank {rank} sends itself {sc[rank]} elements but receives {rc[rank]} from itself "
                         f"(its send count and its receive count for rank {rank} must be equal)")
    return 0


cdef tuple _tables(bytearray buf, int size):
    """The tables a count_table / alltoall_table filled into buf, size counts each, as lists."""
    cdef const size_t *t = <const size_t*><char*>buf
    return tuple([[t[k * size + i] for i in range(size)] for k in range(len(buf) // sizeof(size_t) // size)])


def count_table(int size, int rank, counts, size_t mine, str mine_role, whole, str whole_role, str what):
    """v_sizes for a communicator outside the core (the CUDA one): (counts, element displacements);
    whole None off the root."""
    _group_args(size, rank)
    cdef bytearray buf = bytearray(2 * size * sizeof(size_t))
    cdef size_t *t = <size_t*><char*>buf
    v_sizes(size, rank, counts, mine, mine_role, -1 if whole is None else whole, whole_role, what, t, t + size)
    return _tables(buf, size)


def alltoall_table(int size, int rank, send_counts, size_t scount, recv_counts, size_t rcount):
    """alltoall_sizes for a communicator outside the core: (send counts, send displacements, receive
    counts, receive displacements), in elements."""
    _group_args(size, rank)
    cdef bytearray buf = bytearray(4 * size * sizeof(size_t))
    cdef size_t *t = <size_t*><char*>buf
    alltoall_sizes(size, rank, send_counts, scount, recv_counts, rcount, t, t + size, t + 2 * size, t + 3 * size)
    return _tables(buf, size)


# ---- a CoreComm call's checks (comm.pxi) ----

REFUSALS = (ValueError, TypeError, OverflowError)   # what they raise (_refused)

cdef object _index(object value, str call, str what):
    """A rank or tag argument as a Python int, before any range check or C conversion (a float would
    be truncated: root=1.5 run as root 1; a huge int would fail as an OverflowError naming nothing).
    call: the entry point the error names before `what` (None: `what` alone); the name is made only
    for the error, off a message's path."""
    try:
        return PyNumber_Index(value)
    except TypeError:
        named = what if call is None else f"{call}'s {what}"
        raise TypeError(f"{named} is {value!r}, not an int") from None


cdef int _check_root(CoreComm self, object root) except -1:
    """The call's root, checked: an int of the group."""
    r = _index(root, None, "root")
    if not 0 <= r < self.size:
        raise ValueError(f"root {r} is out of range for a group of size {self.size} (valid: 0..{self.size - 1})")
    return r


cdef int _check_fits(CoreComm self, int op, size_t n, str what) except -1:
    if n > self.max_count(op):
        raise ValueError(f"{what}: {n} elements exceed the {self.transport} transport's limit of "
                         f"{self.max_count(op)} for this collective; allreduce, broadcast and reduce take any "
                         "size; split this buffer into smaller calls")
    return 0


cdef size_t _call_sizes(CoreComm self, Call *c, object counts, Message mine, str mine_role, Message whole,
                        str whole_role, str what) except? 0:
    """v_sizes for this group's call; fills c.counts / c.displs. Returns the largest part's bytes, which
    picks the call's rule: every rank knows it (its own part's size differs where the counts do)."""
    cdef size_t total, largest = 0
    _check_fits(self, c.op, mine.count, what)
    c.counts, c.displs = self.cnt, self.cnt + self.size
    total = v_sizes(self.size, self.rank, counts, mine.count, mine_role,
                    -1 if whole is None else <Py_ssize_t>whole.count, whole_role, what, self.cnt, self.cnt + self.size)
    _check_fits(self, c.op, total, what)   # (the displacements: MPI's v-forms take them as ints)
    for i in range(self.size):
        largest = max(largest, c.counts[i])
    return largest * mine.itemsize


# ---- the rules as C reads them (CoreComm.set_rules) ----

cdef Rule *_rule_array(CoreComm self, list rules) except? NULL:
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
            raise ValueError(f"entry {self.log.entry_name(entry)}: the {self.transport} transport has no "
                             f"implementation {impl}")
        out[i].entry, out[i].impl, out[i].lo, out[i].hi = entry, impl, lo, min(hi, SIZE_MAX)
        out[i].min_ranks, out[i].max_ranks = minr, min(maxr, 1 << 30)
        out[i].dtypes, out[i].ops, out[i].uneven = dtypes, ops, uneven
    return out


# ---- the pieces of CoreComm's entry points ----

cdef _rooted(CoreComm self, int op, sendbuf, recvbuf, object root_, counts):
    """gather and scatter, mirror images: every rank's side (gather's sendbuf, scatter's
    recvbuf) and the root's whole (gather's recvbuf, scatter's sendbuf), needed on the root only.
    A refusal counts as the call (_refused)."""
    cdef uint64_t seq = self.log.seq
    cdef bint gather = op == OP_GATHER
    cdef str what = OP_KIND_NAMES[op], mine_role = "sendbuf" if gather else "recvbuf"
    cdef str whole_role = "recvbuf" if gather else "sendbuf"
    cdef Message mine, whole = None, ms, mr
    cdef Call c
    cdef size_t at
    cdef int root
    try:
        root = _check_root(self, root_)
        mine = as_message(sendbuf if gather else recvbuf, not gather, mine_role)
        if self.rank == root:
            wbuf = recvbuf if gather else sendbuf
            if wbuf is None:
                raise ValueError(f"{what}: the root needs a {whole_role}")
            whole = as_message(wbuf, gather, whole_role)
        ms, mr = (mine, whole) if gather else (whole, mine)
        if whole is not None:
            same_dtype(ms, mr, what)
        c = new_call(op, ms.ptr if ms is not None else NULL, mr.ptr if mr is not None else NULL, mine.count,
                     mine.dtype)
        c.root = root
        largest = _call_sizes(self, &c, counts, mine, mine_role, whole, whole_role, what)
        if whole is not None:   # (in place: the root's own part of the whole)
            at = c.displs[root] * mine.itemsize
            ms = apart(ms, mr, <char*>mr.ptr + at if gather else <char*>mr.ptr - at)
            c.src = <char*>ms.ptr
        self.invoke(&c, self.select(op, largest, mine.dtype, OPBIT_NONE, counts is not None, None), mine.count,
                    (ms, mr))
    except REFUSALS as exc:
        raise _refused(self, op, seq, exc)


cdef object _refused(CoreComm self, int op, uint64_t seq, object exc):
    """Each collective entry's: exc (REFUSALS: a check of its arguments refused the call here), once the
    call is counted as the group's call seq + 1, as a rank whose checks passed counts it: a peer that
    went ahead sent its part, which this rank's next call would take as its own (the tags and the
    segment's steps carry the call's number). Recorded as failed: the watch notes it in the store, and
    a peer waiting in the call ends naming it. Nothing where the call had begun (its own failure), the
    group is unusable, or another thread's call runs."""
    cdef OpRec *rec
    if (self.log.seq == seq and self.log.broken is None and not eng_load32(&self.aborted)
            and self.orphaned is None and not self.collective_thread):
        rec = self.log.begin(op, 0, -1, -1, False, call_word(op, -1, OPBIT_NONE, -1, -1))
        self.log.end(rec, exc)
    return exc
