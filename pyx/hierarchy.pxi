# The hierarchy: a group's collectives in two levels, each a collective of another group (a stage).
# Across hosts with several ranks each: shared memory inside each host, the group's transport (TCP or
# MPI) between hosts. A shared-memory group whose ranks sit on several sockets (NUMA nodes) gets the
# same two levels with sockets for hosts, shared memory on both, so each stage's traffic stays on one
# socket's memory where it can. Below, "host" is the place of the first level: a host, or a socket.
# engine/hierarchy.py finds the places and makes the stages.
#
# Every rank carries a slice across hosts (measured better than one leader per host: docs/tuning.md),
# so all the ranks' links and cores work at once:
#
#     allreduce       local reduce_scatter -> cross allreduce of my slice (among the ranks of the same
#                     local index) -> local allgather
#     broadcast       cross broadcast among the root's local index -> local broadcast from it
#     allgather       cross allgather among my local index -> local allgather -> reorder to rank order
#     reduce_scatter  reorder -> local reduce_scatter -> cross reduce_scatter
#
# The leader allreduce (local reduce to one rank per host, an allreduce among those, local broadcast)
# exists for the comparison and for ENGINE_HIER=leader. Each stage call is an operation of its stage
# group (chosen by its own rules, recorded in its own recorder); the composite is one operation of
# this group, and CoreComm.invoke hands it SUM for AVG and divides once after.

cdef class Hierarchy:
    """The two levels of one group: local (this host's ranks) and cross (the ranks of this local index
    on every host) are the stage groups' cores; leaders (local index 0 of every host) is None on
    the other ranks. host_of / local_of: every global rank's host and local index."""

    def __init__(self, CoreComm local, CoreComm cross, host_of, local_of, CoreComm leaders=None,
                 leader_entries=frozenset()):
        cdef int g, n = len(host_of)
        self.local, self.cross, self.leaders = local, cross, leaders
        self.hosts, self.per_host = cross.size, local.size
        if n != self.hosts * self.per_host or len(local_of) != n:
            raise ValueError(f"hierarchy: {n} ranks are not {self.hosts} hosts x {self.per_host}")
        self.leader_entries = frozenset(leader_entries)
        self.host_of = <int*>malloc(3 * n * sizeof(int))
        if self.host_of == NULL:
            raise MemoryError()
        self.local_of, self.place = self.host_of + n, self.host_of + 2 * n
        for g in range(n):
            self.host_of[g], self.local_of[g] = host_of[g], local_of[g]
            self.place[host_of[g] * self.per_host + local_of[g]] = g

    def __dealloc__(self):
        free(self.host_of)
        free(self.work)

    cdef char *workspace(self, size_t nbytes) except NULL:
        """At least nbytes of this hierarchy's own memory (its content is not kept across calls)."""
        if nbytes > self.work_bytes or self.work == NULL:
            free(self.work)
            self.work_bytes = max(nbytes, <size_t>64)
            self.work = <char*>malloc(self.work_bytes)
            if self.work == NULL:
                self.work_bytes = 0
                raise MemoryError()
        return self.work

    cdef int stage(self, CoreComm g, int op, const char *src, char *dst, size_t count, int dtype, RedC *red,
                   int root, object keep, bint blocks=False) except -1:
        """One collective of stage g, chosen by g's rules and recorded as g's operation. count: this
        rank's piece of equal pieces; with blocks (allgather, reduce_scatter), count is the whole, cut
        in the near-equal blocks of block_range (the slice allreduce's two local steps)."""
        cdef Call s = new_call(op, src, dst, count, dtype)
        cdef size_t isz = eng_itemsize[dtype], largest = count
        cdef bint uneven = False
        cdef int i
        s.red, s.root = red, root
        if op == OP_ALLGATHER or op == OP_REDUCE_SCATTER:
            s.counts, s.displs = g.cnt, g.cnt + g.size
            if blocks:
                for i in range(g.size):
                    block_range(count, g.size, i, &g.cnt[g.size + i], &g.cnt[i])
                s.count = g.cnt[g.rank]
                uneven = not all_equal(g.cnt, g.size)
                largest = g.cnt[0]
            else:
                even_counts(g.cnt, g.cnt + g.size, g.size, count)
        g.invoke(&s, g.select(op, largest * isz, dtype,
                              OPBIT_NONE if red == NULL else opbit_of(red), uneven, None), s.count, keep)
        return 0

    cdef int run(self, Call *c, int entry, object keep) except -1:
        """Runs composite entry `entry` for call c (even counts). keep: the caller's buffers, kept
        alive by the stage that fails with requests still posted into them."""
        cdef size_t isz = eng_itemsize[c.dtype], n = c.count, blk
        cdef int H = self.hosts, L = self.per_host, i, h, g
        cdef char *buf = c.dst
        cdef char *across
        cdef char *both
        cdef size_t off, mine
        try:
            if c.op == OP_ALLREDUCE:
                if c.src != c.dst and n:
                    memcpy(c.dst, c.src, n * isz)
                if entry in self.leader_entries:
                    self.stage(self.local, OP_REDUCE, buf, buf if self.local.rank == 0 else NULL, n, c.dtype, c.red,
                               0, keep)
                    if self.leaders is not None:
                        self.stage(self.leaders, OP_ALLREDUCE, buf, buf, n, c.dtype, c.red, 0, keep)
                    self.stage(self.local, OP_BROADCAST, NULL, buf, n, c.dtype, NULL, 0, keep)
                    return 0
                # this rank's block of the whole (the local reduce_scatter's), carried across hosts
                block_range(n, L, self.local.rank, &off, &mine)
                across = self.workspace(mine * isz)
                self.stage(self.local, OP_REDUCE_SCATTER, buf, across, n, c.dtype, c.red, 0, keep, True)
                self.stage(self.cross, OP_ALLREDUCE, across, across, mine, c.dtype, c.red, 0, keep)
                self.stage(self.local, OP_ALLGATHER, across, buf, n, c.dtype, NULL, 0, keep, True)
            elif c.op == OP_BROADCAST:
                h, i = self.host_of[c.root], self.local_of[c.root]
                if self.local.rank == i:
                    self.stage(self.cross, OP_BROADCAST, NULL, buf, n, c.dtype, NULL, h, keep)
                self.stage(self.local, OP_BROADCAST, NULL, buf, n, c.dtype, NULL, i, keep)
            elif c.op == OP_ALLGATHER:
                blk = n * isz
                across = self.workspace((L + 1) * H * blk)
                both = across + H * blk
                self.stage(self.cross, OP_ALLGATHER, c.src, across, n, c.dtype, NULL, 0, keep)  # [h]: rank (h, mine)
                self.stage(self.local, OP_ALLGATHER, across, both, H * n, c.dtype, NULL, 0, keep)  # [i][h]: (h, i)
                with nogil:
                    for i in range(L):
                        for h in range(H):
                            g = self.place[h * L + i]
                            memcpy(c.dst + g * blk, both + (i * H + h) * blk, blk)
            elif c.op == OP_REDUCE_SCATTER:
                blk = n * isz
                both = self.workspace((L + 1) * H * blk)
                across = both + L * H * blk
                with nogil:
                    for i in range(L):
                        for h in range(H):
                            g = self.place[h * L + i]
                            memcpy(both + (i * H + h) * blk, c.src + g * blk, blk)
                self.stage(self.local, OP_REDUCE_SCATTER, both, across, H * n, c.dtype, c.red, 0, keep)  # my index's
                self.stage(self.cross, OP_REDUCE_SCATTER, across, c.dst, n, c.dtype, c.red, 0, keep)   # my block
            else:
                raise ValueError(f"the hierarchy has no {OP_KIND_NAMES[c.op]}")
        except BaseException:
            # A failed stage may have left requests posted into the workspace: never reuse or free it.
            self.work, self.work_bytes = NULL, 0
            raise
        return 0
