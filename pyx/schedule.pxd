# The engine's schedules as pure functions (no I/O): which block, piece and peer each rank handles in
# each step. The algorithms run them in their nogil loops; schedule.pxi exposes them to Python, where
# tests play every rank's schedule against the others' (tests/test_schedules.py).


cdef inline void block_range(size_t count, size_t nblocks, size_t b, size_t *off, size_t *length) noexcept nogil:
    """Block b of count elements split in nblocks near-equal blocks; the first count % nblocks get one more."""
    cdef size_t base = count // nblocks, extra = count % nblocks
    length[0] = base + (1 if b < extra else 0)
    off[0] = b * base + (b if b < extra else extra)


cdef inline void even_counts(size_t *counts, size_t *displs, int nranks, size_t count) noexcept nogil:
    """The table of an even v-collective: count elements for every rank, back to back. The communicator
    fills it for every call without counts, so no algorithm or transport has an even case of its own."""
    cdef int i
    for i in range(nranks):
        counts[i] = count
        displs[i] = <size_t>i * count


cdef inline bint all_equal(const size_t *counts, int nranks) noexcept nogil:
    """Every rank's count the same (a transport may then use its block form)."""
    cdef int i
    for i in range(1, nranks):
        if counts[i] != counts[0]:
            return False
    return True


cdef inline int mod(int a, int n) noexcept nogil:
    return ((a % n) + n) % n


# -- the ring (ring.pxi): 2(P-1) steps to the right neighbour; the first P-1 reduce, the rest copy --

cdef inline int ring_send_block(int rank, int step, int nranks) noexcept nogil:
    return mod(rank - step, nranks)


cdef inline int ring_recv_block(int rank, int step, int nranks) noexcept nogil:
    return mod(rank - step - 1, nranks)


cdef inline size_t segments(size_t length, size_t seg) noexcept nogil:
    """Pipeline segments of a block of length elements, seg elements each (the last shorter)."""
    return (length + seg - 1) // seg


# -- recursive doubling (ring.pxi): Rabenseifner's fold for sizes that are not a power of two --

cdef inline int pow2_below(int nranks) noexcept nogil:
    """The largest power of two <= nranks."""
    cdef int p2 = 1
    while p2 * 2 <= nranks:
        p2 *= 2
    return p2


cdef inline int rdouble_rank(int rank, int nranks) noexcept nogil:
    """This rank's index among the power-of-two ranks that exchange, or -1 (folded into rank + 1)."""
    cdef int rem = nranks - pow2_below(nranks)
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


cdef inline int rdouble_peer(int newrank, int mask, int nranks) noexcept nogil:
    """The rank a power-of-two index exchanges with at distance mask."""
    cdef int rem = nranks - pow2_below(nranks), np_ = newrank ^ mask
    return np_ * 2 + 1 if np_ < rem else np_ + rem


# -- the shared segment's steps (shm_collectives.pxi) --

cdef inline size_t piece_steps(size_t count, size_t per, bint single_copy) noexcept nogil:
    """Steps a part of count elements needs: one when it moves by single copy, else ceil(count / per)."""
    if count == 0:
        return 0
    return 1 if single_copy else (count + per - 1) // per


cdef inline size_t piece_share(size_t count, size_t k, size_t per, bint single_copy) noexcept nogil:
    """Elements of a part that step k moves: its k-th piece of `per` (a single-copy part moves whole in step 0)."""
    if single_copy:
        return count if k == 0 else 0
    if count <= k * per:
        return 0
    return min(per, count - k * per)


cdef inline size_t chunk_elements(bint oneshot, size_t cap, size_t chunk_bytes, size_t itemsize,
                                  int nranks) noexcept nogil:
    """Elements a reduction's step takes: a whole half (one-shot), else a chunk of at least one
    element per rank (two-shot)."""
    if oneshot:
        return cap // itemsize
    return max(<size_t>nranks, chunk_bytes // itemsize)


# -- the point-to-point collectives (p2p_collectives.pxi: every collective but allreduce over TCP) --
#
# Their rings are the allreduce ring's halves: reduce_scatter runs its first P-1 steps one step on
# (ring_send_block(rank, step + 1, P)), so that rank r ends with block r reduced; allgather runs them
# as they are, starting from each rank's own block. Trees are over relative ranks vr = (rank - root)
# mod P: the parent of vr > 0 is vr with its lowest set bit cleared; its children are vr + m for the
# powers of two m below that bit (below P for the root) with vr + m < P, sent to the farthest first.

cdef inline int tree_parent(int vr) noexcept nogil:
    """The parent of relative rank vr in the binomial tree (-1: the root)."""
    return -1 if vr == 0 else vr & (vr - 1)


cdef inline int tree_span(int vr, int nranks) noexcept nogil:
    """The lowest set bit of vr (for the root: the least power of two >= nranks): vr's children are
    vr + m for the powers of two m < tree_span with vr + m < nranks."""
    cdef int m = 1
    if vr != 0:
        return vr & -vr
    while m < nranks:
        m <<= 1
    return m


cdef inline void shift_peers(int rank, int dist, int nranks, int *to, int *frm) noexcept nogil:
    """The peers at distance dist: to rank + dist, from rank - dist. Alltoall's pairwise exchange takes
    every dist in 1..P-1 (no rank is everybody's first destination); the dissemination barrier takes
    1, 2, 4, ... < P (after its last round every rank has heard from every other, through others)."""
    to[0] = mod(rank + dist, nranks)
    frm[0] = mod(rank - dist, nranks)
