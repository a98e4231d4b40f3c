# The schedules of schedule.pxd as Python sees them: what each rank does in each step, for tests that
# play all ranks against each other and for the GPU ring, which runs the CPU ring's schedule.


def ring_block(size_t count, size_t nblocks, size_t b):
    """(offset, length) of block b of count elements cut in nblocks near-equal blocks."""
    cdef size_t off, length
    if nblocks == 0 or b >= nblocks:
        raise ValueError(f"block {b} out of range for {nblocks} blocks")
    block_range(count, nblocks, b, &off, &length)
    return off, length


def ring_schedule(size_t count, int nranks, int rank):
    """The ring allreduce's steps for one rank: (phase, send (offset, length), receive (offset,
    length)) in elements, to the right neighbour and from the left one; phase "reduce" (the received
    block is reduced into this rank's) for the first P-1 steps, then "copy" (received in place)."""
    cdef size_t so, sl, ro, rl
    cdef int j
    out = []
    for j in range(2 * (nranks - 1)):
        block_range(count, nranks, ring_send_block(rank, j, nranks), &so, &sl)
        block_range(count, nranks, ring_recv_block(rank, j, nranks), &ro, &rl)
        out.append(("reduce" if j < nranks - 1 else "copy", (so, sl), (ro, rl)))
    return out


def rdouble_schedule(int nranks, int rank):
    """Recursive doubling's steps for one rank: ("send" | "recv" | "exchange", peer), in order. A
    "recv" reduces what arrives into this rank's data; an "exchange" sends this rank's data and
    reduces what arrives (the lower rank's first); "copy": the result arrives (a folded rank)."""
    cdef int p2 = pow2_below(nranks), rem = nranks - p2, newrank = rdouble_rank(rank, nranks), mask = 1
    out = []
    if rank < 2 * rem:
        out.append(("send", rank + 1) if newrank < 0 else ("recv", rank - 1))
    while newrank >= 0 and mask < p2:
        out.append(("exchange", rdouble_peer(newrank, mask, nranks)))
        mask <<= 1
    if rank < 2 * rem:
        out.append(("send", rank - 1) if newrank >= 0 else ("copy", rank + 1))
    return out


def piece_schedule(size_t count, size_t per, bint single_copy):
    """The segment's steps of one part of count elements, pieces of per: [(step, offset, length)]."""
    cdef size_t k, n = piece_steps(count, per, single_copy)
    return [(k, k * per, piece_share(count, k, per, single_copy)) for k in range(n)]


def chunk_schedule(size_t total, bint oneshot, size_t cap, size_t chunk_bytes, size_t itemsize, int nranks):
    """A reduction's chunks through the segment: [(offset, length)] in elements."""
    cdef size_t per = chunk_elements(oneshot, cap, chunk_bytes, itemsize, nranks)
    return [(off, min(per, total - off)) for off in range(0, total, per)]


def binomial_tree(int nranks, int vr):
    """(parent, [children in sending order]) of relative rank vr in the binomial tree of nranks ranks
    (the point-to-point broadcast and reduce: ranks relative to the root)."""
    if not 0 <= vr < nranks:
        raise ValueError(f"relative rank {vr} out of range for {nranks} ranks")
    cdef int m = tree_span(vr, nranks) >> 1
    children = []
    while m > 0:
        if vr + m < nranks:
            children.append(vr + m)
        m >>= 1
    return tree_parent(vr), children


def ring_pass_schedule(str kind, int nranks, int rank):
    """[(send_block, recv_block)] of each of the P-1 steps of the point-to-point reduce_scatter ring
    (kind "reduce_scatter": the received partial sum is reduced with this rank's part and passed on)
    or allgather ring ("allgather": the received block is passed on), to the right, from the left."""
    if kind not in ("reduce_scatter", "allgather"):
        raise ValueError(f"ring schedule {kind!r}: expected reduce_scatter or allgather")
    cdef int shift = 1 if kind == "reduce_scatter" else 0
    return [(ring_send_block(rank, j + shift, nranks), ring_recv_block(rank, j + shift, nranks))
            for j in range(nranks - 1)]


def shift_schedule(str kind, int nranks, int rank):
    """[(to, from)] of each step of the pairwise alltoall (kind "pairwise": distances 1..P-1) or of each
    round of the dissemination barrier ("dissemination": distances 1, 2, 4, ... < P)."""
    cdef int to, frm, dist = 1
    if kind not in ("pairwise", "dissemination"):
        raise ValueError(f"shift schedule {kind!r}: expected pairwise or dissemination")
    out = []
    while dist < nranks:
        shift_peers(rank, dist, nranks, &to, &frm)
        out.append((to, frm))
        dist = dist + 1 if kind == "pairwise" else dist * 2
    return out
