# The engine's schedules as pure functions (no I/O): which block, piece and peer each rank handles in
# each step. The algorithms run them in their nogil loops; schedule.pxi exposes them to Python, where
# tests play every rank's schedule against the others' (tests/test_schedules.py).


cdef inline void block_range(size_t count, size_t nblocks, size_t b, size_t *off, size_t *length) noexcept nogil:
    """Block b of count elements split in nblocks near-equal blocks; the first count % nblocks get one more."""
    cdef size_t base = count // nblocks, extra = count % nblocks
    length[0] = base + (1 if b < extra else 0)
    off[0] = b * base + (b if b < extra else extra)


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

cdef inline size_t piece(size_t total, size_t k, size_t cap) noexcept nogil:
    """Elements of step k's piece of a part of `total` elements cut in pieces of `cap`."""
    if total <= k * cap:
        return 0
    return min(cap, total - k * cap)


cdef inline size_t piece_steps(size_t count, size_t per, bint single_copy) noexcept nogil:
    """Steps a part of count elements needs: one when it moves by single copy, else ceil(count / per)."""
    if count == 0:
        return 0
    return 1 if single_copy else (count + per - 1) // per


cdef inline size_t piece_share(size_t count, size_t k, size_t per, bint single_copy) noexcept nogil:
    """Elements of a part that step k moves (a single-copy part moves whole in step 0)."""
    if single_copy:
        return count if k == 0 else 0
    return piece(count, k, per)


cdef inline size_t chunk_elements(bint oneshot, size_t cap, size_t chunk_bytes, size_t itemsize,
                                  int nranks) noexcept nogil:
    """Elements a reduction's step takes: a whole half (one-shot), else a chunk of at least one
    element per rank (two-shot)."""
    if oneshot:
        return cap // itemsize
    return max(<size_t>nranks, chunk_bytes // itemsize)
