# The shared segment of one group on one host, and the step protocol of its collectives.
#
# The group's first rank creates it (an owner-only memfd: it has no name in /dev/shm or anywhere, so
# nothing can outlive the job, even after SIGKILL); the others open it through /proc/<pid>/fd/<fd>
# (possible only for processes of the same user), check its owner, mode, size and a random 128-bit
# token, and map it. Layout, computed identically by every rank from (ranks, half_bytes, queue_bytes):
#
#   header (4 KiB)            magic, token, the layout (checked by every attaching rank)
#   control, per rank         line 0: the step flag; lines 1-2: the step's signature (two parities);
#                             line 3: the rank's doorbell (a futex word), whether it sleeps on it,
#                             whether it left the group, whether it gave its collectives up, its pid
#   queue index, per rank     one cache line per (channel, peer): the head of each queue it writes,
#                             the tail of each queue it reads
#   slots, per rank           two halves (step parity); each: a table of 2P + 1 words (piece lengths,
#                             the addresses single-copy readers read from), then data
#   queues                    one byte ring per (channel, sender, receiver) for point-to-point
#
# Steps (a flag per rank, two halves by step parity, a signature per step) and sleeping on the
# doorbell are described in docs/architecture.md, "The shared-memory transport".

from libc.stdint cimport uint32_t, int32_t


cdef uint64_t SEG_MAGIC = 0x31304d4853474e45ULL   # "ENGSHM01"

# A broadcast reader's table entry (its buffer's address) as the root's single-copy write of the
# tail marks it (user-space addresses never reach these bits).
cdef uint64_t TAIL_FAILED = 1ULL << 61
cdef uint64_t TAIL_CLAIMED = 1ULL << 62
cdef uint64_t TAIL_WRITTEN = 1ULL << 63


cdef inline uint32_t *_left_word(char *ctrl, int r) noexcept nogil:
    """Rank r's word that says it left the group (ShmComm.leave): set, never cleared."""
    return <uint32_t*>(ctrl + <size_t>r * CTRL_BYTES + 3 * LINE + 16)


cdef inline uint32_t *_gave_up_word(char *ctrl, int r) noexcept nogil:
    """Rank r's word that says it gave the group's collectives up (ShmSegment.give_up): set, never cleared."""
    return <uint32_t*>(ctrl + <size_t>r * CTRL_BYTES + 3 * LINE + 20)


cdef inline uint32_t *_pid_word(char *ctrl, int r) noexcept nogil:
    """Rank r's process id, as its process wrote it (ShmSegment.populate)."""
    return <uint32_t*>(ctrl + <size_t>r * CTRL_BYTES + 3 * LINE + 24)


cdef inline bint _has_left(Peers *p, int q) noexcept nogil:
    return p.ctrl != NULL and eng_load32(_left_word(p.ctrl, q)) != 0


cdef inline bint _out_of_collectives(Peers *p, int q) noexcept nogil:
    """Whether q takes no further part in the group's collectives: it left, or gave them up."""
    return _has_left(p, q) or (p.ctrl != NULL and eng_load32(_gave_up_word(p.ctrl, q)) != 0)


cdef int peers_alive(void *arg) noexcept nogil:
    """WaitCtx.alive of a shared-memory group: ENG_ERR_PEER_DEAD once a peer's process is gone,
    ENG_ERR_PEER_LEFT once a peer left the group (destroyed it) or gave its collectives up with this
    rank still waiting. A dead peer is named before one that left (the others often leave because of
    it), and one that left before it exited as one that left."""
    cdef Peers *p = <Peers*>arg
    cdef int q
    if _any_dead(p):
        return ENG_ERR_PEER_DEAD
    for q in range(p.n):
        if q != p.self_rank and _out_of_collectives(p, q):
            p.dead = q
            return ENG_ERR_PEER_LEFT
    return 0


cdef int peer_alive(void *arg) noexcept nogil:
    """WaitCtx.alive of a message to or from one rank (a PeerWatch): a dead process fails it, whichever
    rank (the group is lost, as over TCP), but a rank that left the group only where it is the peer:
    the members still in it may go on exchanging messages (a rank that destroyed a group it is done
    with, as Gloo allows). A receive from any rank fails once every other rank left."""
    cdef PeerWatch *w = <PeerWatch*>arg
    cdef Peers *p = w.peers
    cdef int q
    if _any_dead(p):
        return ENG_ERR_PEER_DEAD
    if w.peer == ANY_PEER:
        for q in range(p.n):
            if q != p.self_rank and not _has_left(p, q):
                return 0
        if p.n > 1:
            p.dead = 1 if p.self_rank == 0 else 0
            return ENG_ERR_PEER_LEFT
        return 0
    if w.peer != p.self_rank and _has_left(p, w.peer):
        p.dead = w.peer
        return ENG_ERR_PEER_LEFT
    return 0


cdef bint _any_dead(Peers *p) noexcept nogil:
    """Whether a peer's process is gone without leaving the group first (p.dead names it)."""
    cdef int q
    for q in range(p.n):
        if q != p.self_rank and p.pids[q] > 0 and not _has_left(p, q) and not eng_pid_alive(p.pidfds[q], p.pids[q]):
            p.dead = q
            return True
    return False


cdef int _layout(SegHeader *h, int nranks, size_t half_bytes, size_t queue_bytes) noexcept nogil:
    h.magic = SEG_MAGIC
    h.nranks = nranks
    h.half_bytes = half_bytes
    h.queue_bytes = queue_bytes
    h.nchannels = NCHANNELS
    h.ctrl_off = HEADER_BYTES
    h.index_off = h.ctrl_off + <size_t>nranks * CTRL_BYTES
    h.slots_off = _align(h.index_off + <size_t>nranks * 2 * NCHANNELS * nranks * LINE, PAGE)
    h.queues_off = h.slots_off + <size_t>nranks * _align(2 * half_bytes, PAGE)
    h.total = h.queues_off + <size_t>NCHANNELS * nranks * nranks * queue_bytes
    return 0


cdef class ShmSegment:
    """One group's segment: the slots and flags of its collectives and the queues of its
    point-to-point. create() on the group's first rank, attach() on the others (same host)."""
    def __cinit__(self):
        self.fd = -1
        self.err_peer = self.err_awaited = self.followed = -1
        self.peers.dead = -1

    def __dealloc__(self):
        self.release()
        free(self.peers.pidfds)
        free(self.peers.pids)

    cdef void release(self) noexcept:
        """Unmaps the segment and closes its descriptors now (the group is freed: nothing reads it again)."""
        cdef int q
        if self.private:
            free(self.base)
        else:
            eng_seg_unmap(self.base, self.total)
        self.base = self.ctrl = self.index = self.slots = self.queues = self.peers.ctrl = NULL
        self.door.bell = self.door.asleep = NULL
        eng_close(self.fd)
        self.fd = -1
        if self.peers.pidfds != NULL:
            for q in range(self.peers.n):
                eng_close(self.peers.pidfds[q])
                self.peers.pidfds[q] = -1

    cdef int _setup(self, const SegHeader *h, int rank, int size) except -1:
        # h: this rank's own copy of the header (the mapped one can change after it was checked)
        self.rank = rank
        self.size = size
        self.half_bytes = h.half_bytes
        self.queue_bytes = h.queue_bytes
        self.table_bytes = _align(8 * (2 * <size_t>size + 1), LINE)
        self.cap = self.half_bytes - self.table_bytes
        self.slot_stride = _align(2 * self.half_bytes, PAGE)
        self.ctrl = self.base + h.ctrl_off
        self.index = self.base + h.index_off
        self.slots = self.base + h.slots_off
        self.queues = self.base + h.queues_off
        self.peers.n = size
        self.peers.ctrl = self.ctrl
        self.door.bell = self.bell(rank)
        self.door.asleep = self.asleep(rank)
        self.peers.self_rank = rank
        self.peers.pids = <int*>calloc(size, sizeof(int))
        self.peers.pidfds = <int*>malloc(size * sizeof(int))
        if self.peers.pids == NULL or self.peers.pidfds == NULL:
            raise MemoryError()
        for q in range(size):
            self.peers.pidfds[q] = -1
        return 0

    def populate(self):
        """Faults in this rank's own slots (every rank at once, once rank 0 made the segment and the
        others attached, before any collective)."""
        if not self.private:
            eng_store32(_pid_word(self.ctrl, self.rank), <uint32_t>os.getpid())
            with nogil:
                eng_seg_populate(self.slots + <size_t>self.rank * self.slot_stride, self.slot_stride)

    @staticmethod
    def create(int size, size_t half_bytes, size_t queue_bytes):
        """The segment of a group of `size` ranks, made by its rank 0. A group of one gets private memory."""
        cdef ShmSegment seg = ShmSegment.__new__(ShmSegment)
        cdef SegHeader h
        cdef void *base = NULL
        cdef int err
        half_bytes, queue_bytes = _check_sizes(size, half_bytes, queue_bytes)
        _layout(&h, size, half_bytes, queue_bytes)
        err = eng_random(h.token, sizeof(h.token))
        if err:
            raise OSError(err, f"engine shm: no random bytes for the segment token: {os.strerror(err)}")
        if size == 1:
            base = calloc(1, h.total)
            if base == NULL:
                raise MemoryError()
            seg.private = True
        else:
            err = eng_seg_create(h.total, &seg.fd, &base)
            if err:
                raise OSError(err, f"engine shm: cannot create a {h.total}-byte shared segment: {os.strerror(err)}; "
                                   "use ENGINE_TRANSPORT=mpi, or give the processes more memory")
        seg.base = <char*>base
        seg.total = h.total
        memcpy(seg.base, &h, sizeof(h))
        seg.token = (<char*>h.token)[:16]
        seg._setup(&h, 0, size)
        return seg

    def descriptor(self):
        """What the other ranks need to attach (sent through the group's bootstrap)."""
        return {"pid": os.getpid(), "fd": self.fd, "total": self.total, "token": self.token.hex(),
                "half_bytes": self.half_bytes, "queue_bytes": self.queue_bytes}

    @staticmethod
    def attach(int rank, int size, desc):
        """Maps rank 0's segment after checking that it is what the descriptor says."""
        cdef ShmSegment seg = ShmSegment.__new__(ShmSegment)
        cdef SegHeader want
        cdef void *base = NULL
        cdef int err
        half_bytes, queue_bytes = _check_sizes(size, desc["half_bytes"], desc["queue_bytes"])
        _layout(&want, size, half_bytes, queue_bytes)
        if want.total != desc["total"]:
            raise RuntimeError(f"engine shm: the segment descriptor says {desc['total']} bytes but its layout needs "
                               f"{want.total}: the ranks disagree on the group (corrupt bootstrap?)")
        err = eng_seg_attach(desc["pid"], desc["fd"], want.total, &base)
        if err:
            raise RuntimeError(f"engine shm: rank {rank} cannot open rank 0's segment (pid {desc['pid']}): "
                               f"{_attach_error(err)}; ENGINE_TRANSPORT=tcp (or mpi, under an MPI launcher) avoids "
                               "shared memory")
        seg.base = <char*>base
        seg.total = want.total
        token = bytes.fromhex(desc["token"])
        if len(token) == 16:
            memcpy(want.token, <char*>token, 16)
        if len(token) != 16 or memcmp(base, &want, sizeof(want)):    # every field a uint64_t: no padding
            raise RuntimeError(f"engine shm: rank {rank}: the segment of pid {desc['pid']} is not the group's "
                               "(header or token differ); refusing to use it")
        seg.token = token
        seg._setup(&want, rank, size)
        return seg

    def close_fd(self):
        """Once every rank has attached: the segment now lives only in the mappings."""
        eng_close(self.fd)
        self.fd = -1

    def watch_peers(self, pids):
        """Starts watching the group's processes (pidfds): a wait on a dead peer fails at once. pids
        (from the group's store) must be those the ranks' processes wrote in the segment (populate(),
        by every rank before): single copy writes into the process a pid names."""
        cdef int q
        for q in range(self.size):
            if not self.private and q != self.rank and eng_load32(_pid_word(self.ctrl, q)) != <uint32_t>pids[q]:
                raise RuntimeError(f"engine shm: rank {q}'s process id in the group's store ({pids[q]}) is not the one "
                                   f"its process wrote in the group's segment ({eng_load32(_pid_word(self.ctrl, q))}): "
                                   "the store holds a value no rank of this group wrote; refusing the group")
        for q in range(self.size):
            self.peers.pids[q] = pids[q]
            if q != self.rank and self.peers.pidfds[q] < 0:
                self.peers.pidfds[q] = eng_pidfd_open(pids[q])

    def lost(self):
        """The peers whose process is gone (whether or not they left the group first)."""
        cdef int q
        if self.peers.pids == NULL:
            return []
        return [q for q in range(self.size) if q != self.rank and self.peers.pids[q] > 0
                and not eng_pid_alive(self.peers.pidfds[q], self.peers.pids[q])]

    def cma_probe(self, pids, addresses):
        """Whether this rank can read every peer's memory with process_vm_readv (same user, and the
        kernel's ptrace policy allows it): each peer's probe word is read and compared."""
        cdef uint64_t word = 0
        cdef int q
        for q in range(self.size):
            if q == self.rank:
                continue
            word = 0
            if eng_cma_copy(pids[q], &word, addresses[q], sizeof(word), 0) or word != eng_cma_probe_value():
                return False
        return True

    def set_cma(self, bint enabled, size_t min_bytes=1, size_t max_bytes=SIZE_MAX):
        """Whether single copy works between every pair of the group (every rank's probe succeeded:
        every rank must choose alike), and the sizes of point-to-point messages that move by it
        (the registry's sendrecv rules; collectives ask their own rules per piece)."""
        self.cma = enabled
        self.cma_min = min_bytes
        self.cma_max = max_bytes

    cdef inline bint use_cma(self, size_t nbytes) noexcept nogil:
        """Whether a point-to-point message of nbytes moves by single copy (a rendezvous)."""
        return self.cma and self.cma_min <= nbytes <= self.cma_max

    cdef int cma_copy(self, int q, void *local, uint64_t remote, size_t n, bint write, bint collective) noexcept nogil:
        """n bytes between `local` and `remote` in rank q's memory (write: to q); on failure
        ENG_ERR_PEER_DEAD where q's process is gone, else ENG_ERR_CMA. ENG_ERR_PEER_LEFT where q took
        its buffer back, before the copy or during it (looked at again after): it freed or aborted the
        group, or (collective: the buffer is a collective's) gave the collectives up; the buffer is its
        caller's again, holding whatever it wrote since."""
        cdef int err
        if n == 0:
            return 0
        if self.took_back(q, collective):
            return ENG_ERR_PEER_LEFT
        err = eng_cma_copy(self.peers.pids[q], local, remote, n, write)
        if err:
            self.err_peer = q
            return ENG_ERR_PEER_DEAD if err == ESRCH else ENG_ERR_CMA
        return ENG_ERR_PEER_LEFT if self.took_back(q, collective) else 0

    cdef bint took_back(self, int q, bint collective) noexcept nogil:
        eng_fence()   # (after a copy: its reads come before this look)
        if eng_load32(self.left(q)) == LEFT_WITHDRAWN or (collective and eng_load32(self.gave_up(q))):
            if collective:
                self.err_peer = q
            return True
        return False

    cdef int write_tail(self, int q, uint64_t step, char *src, size_t at, size_t nbytes) noexcept nogil:
        """The root's write of a broadcast's tail into reader q's buffer, at `at` bytes, as q published
        it in its table: claimed first, so that a reader that left the call (its wait failed: a timeout,
        abort()) and took its buffer back is never written to once its caller may reuse it; marked
        written after."""
        cdef uint64_t *entry = &self.table(q, step)[self.size]
        cdef uint64_t addr = eng_load_acquire(entry)
        cdef int ierr
        if addr == 0 or not eng_cas64(entry, addr, addr | TAIL_CLAIMED):
            return 0    # taken back: that reader never finishes this step, and the wait for it fails
        ierr = self.cma_copy(q, src, addr + at, nbytes, True, True)
        eng_store_release(entry, addr | TAIL_CLAIMED | TAIL_WRITTEN | (TAIL_FAILED if ierr else 0))
        return ierr

    cdef bint tail_written(self, uint64_t step) noexcept nogil:
        """Whether the root of this step's broadcast wrote this reader's tail whole."""
        cdef uint64_t entry = eng_load_acquire(&self.table(self.rank, step)[self.size])
        return (entry & TAIL_WRITTEN) != 0 and not (entry & TAIL_FAILED)

    cdef void withdraw_buffer(self, int root, uint64_t step, uint64_t buf) noexcept nogil:
        """A broadcast's reader leaving before it knows the root's write into buf is done (its wait
        failed): takes buf back from its table, or, where the root claimed it first, waits until that
        write is done or the root's process is gone: one copy of a part of the message, never a wait
        on anyone's call."""
        cdef uint64_t *entry = &self.table(self.rank, step)[self.size]
        if eng_cas64(entry, buf, 0):
            return
        while (not eng_load_acquire(entry) & TAIL_WRITTEN and
               eng_pid_alive(self.peers.pidfds[root], self.peers.pids[root])):
            eng_sleep(1e-4)

    cdef void give_up(self, bint timed_out, int lost) noexcept nogil:
        """This rank's collectives give the group up (a call failed here, timed out, or the group was
        aborted): a peer waiting for this rank in a collective fails at its next liveness check, not at
        its timeout, and no peer copies from or into a buffer of this rank's collectives any longer.
        Point-to-point goes on. The word says whether a call timed out or the group broke, and over
        the loss of which rank (lost: in the whole group's numbering, Transport.serve; or -1), or
        after which rank's word (followed), which a peer reading this one first then names."""
        cdef int q
        if self.ctrl == NULL or eng_load32(self.gave_up(self.rank)):
            return
        eng_store32(self.gave_up(self.rank), GAVE_UP_TIMED_OUT if timed_out else
                    GAVE_UP_BROKEN | (<uint32_t>(lost + 1) << 8) if 0 <= lost < 0xffffff else
                    GAVE_UP_FOLLOWED | (<uint32_t>(self.followed + 1) << 8) if 0 <= self.followed < 0xffffff else
                    GAVE_UP_BROKEN)
        for q in range(self.size):
            if q != self.rank:
                self.ring(q)

    # -- the step protocol --

    cdef inline uint64_t *sig(self, int r, uint64_t step) noexcept nogil:
        return <uint64_t*>(self.ctrl + <size_t>r * CTRL_BYTES + LINE + (step & 1) * LINE)

    cdef inline char *half(self, int r, uint64_t step) noexcept nogil:
        """Rank r's data half of a step (after its table)."""
        return self.slots + <size_t>r * self.slot_stride + (step & 1) * self.half_bytes + self.table_bytes

    cdef inline uint64_t *table(self, int r, uint64_t step) noexcept nogil:
        return <uint64_t*>(self.slots + <size_t>r * self.slot_stride + (step & 1) * self.half_bytes)

    cdef int begin(self, uint64_t w0, uint64_t count, uint64_t chash, uint64_t seq, uint64_t aux,
                   WaitCtx *ctx) except -1 nogil:
        """Starts the next step: waits until every peer finished step - 2 (the last user of this
        step's half), then writes this step's signature."""
        cdef int ierr
        cdef uint64_t *s
        self.step += 1
        if self.step > 2:
            ierr = self.wait_all(self.step - 2, PHASE_FINISHED, ctx, False)
            if ierr:
                return ierr
        self.my_sig[0] = w0
        self.my_sig[1] = count
        self.my_sig[2] = chash
        self.my_sig[3] = seq
        self.my_sig[4] = aux
        s = self.sig(self.rank, self.step)
        memcpy(s, self.my_sig, sizeof(self.my_sig))
        return 0

    cdef inline void post(self, int phase) noexcept nogil:
        """Sets this rank's step flag (line 0 of its control) to phase of this step; wakes the sleepers."""
        cdef int q
        eng_store_release(<uint64_t*>(self.ctrl + <size_t>self.rank * CTRL_BYTES), 4 * self.step + phase)
        eng_fence()
        for q in range(self.size):
            if q != self.rank and eng_load32(self.asleep(q)):
                eng_add32(self.bell(q))
                eng_futex_wake(self.bell(q))

    # -- doorbells --

    cdef inline uint32_t *bell(self, int r) noexcept nogil:
        return <uint32_t*>(self.ctrl + <size_t>r * CTRL_BYTES + 3 * LINE + 8)

    cdef inline uint32_t *asleep(self, int r) noexcept nogil:
        return <uint32_t*>(self.ctrl + <size_t>r * CTRL_BYTES + 3 * LINE + 12)

    cdef inline uint32_t *left(self, int r) noexcept nogil:
        return _left_word(self.ctrl, r)

    cdef inline uint32_t *gave_up(self, int r) noexcept nogil:
        return _gave_up_word(self.ctrl, r)

    cdef inline void ring(self, int q) noexcept nogil:
        """After publishing something q may wait for: wake q if it sleeps."""
        eng_fence()
        if eng_load32(self.asleep(q)):
            eng_add32(self.bell(q))
            eng_futex_wake(self.bell(q))

    cdef int wait_for(self, int only, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil:
        """Until rank `only` (-1: every peer) reached `phase` of `step`; check: their signatures must
        equal ours, each compared as soon as its rank arrives (two ranks in different collectives fail
        at once, though a third never comes)."""
        cdef FlagWait w
        cdef int ierr
        w.ctrl, w.size, w.me, w.only, w.next, w.target = self.ctrl, self.size, self.rank, only, 0, 4 * step + phase
        w.mine = self.my_sig if check else NULL
        w.sig_offset = LINE + (self.step & 1) * LINE
        w.alive, w.alive_arg = ctx.alive, ctx.alive_arg
        if ctx.alive == peers_alive:   # (a peer that left counts only where this wait still needs it)
            ctx.alive, ctx.alive_arg = _flags_alive, &w
        self.awaited_only = only     # (for a timeout's report, from the watch's thread: whom it waits on)
        self.awaited_target = w.target
        try:
            ierr = wait_until(_poll_flags, NULL, &w, ctx, &self.door)
        finally:
            ctx.alive, ctx.alive_arg = w.alive, w.alive_arg
            self.awaited_target = 0
        if ierr == ENG_ERR_PEER_DEAD or ierr == ENG_ERR_PEER_LEFT:
            self.err_peer = self.peers.dead
            # (a peer that died after it did its part here is not what this wait waited for: say so)
            self.err_peer_passed = self.err_peer >= 0 and self.reached(self.err_peer, w.target)
            self.err_awaited = self.short_of(w.target, only, self.err_peer)
        elif ierr == ENG_ERR_MISMATCH:
            memcpy(self.err_sig, self.sig(w.other, self.step), sizeof(self.err_sig))
            self.err_peer = w.other
        return ierr

    cdef inline int wait_peer(self, int q, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil:
        return self.wait_for(q, step, phase, ctx, check)

    cdef inline int wait_all(self, uint64_t step, int phase, WaitCtx *ctx, bint check) except -1 nogil:
        return self.wait_for(-1, step, phase, ctx, check)

    cdef uint64_t peer_aux(self, int q) noexcept nogil:
        return self.sig(q, self.step)[4]

    cdef inline bint reached(self, int q, uint64_t target) noexcept nogil:
        return eng_load_acquire(<uint64_t*>(self.ctrl + <size_t>q * CTRL_BYTES)) >= target

    cdef int short_of(self, uint64_t target, int only, int skip) noexcept nogil:
        """The first peer (`only`, or any where -1) other than `skip` that has not reached target, or -1."""
        cdef int q
        for q in range(self.size):
            if q != self.rank and q != skip and (only < 0 or q == only) and not self.reached(q, target):
                return q
        return -1

    def awaited(self):
        """(The peers the flag wait in progress still waits for, every peer past its flag), or None
        with no such wait."""
        cdef uint64_t target = self.awaited_target
        cdef int only = self.awaited_only, q
        if target == 0 or self.ctrl == NULL:
            return None
        peers = [q for q in range(self.size) if q != self.rank]
        return ([q for q in peers if (only < 0 or q == only) and not self.reached(q, target)],
                [q for q in peers if self.reached(q, target)])


cdef struct FlagWait:
    char *ctrl
    int size, me, only      # only: the one peer waited for, or -1: every peer
    int next                # the first peer not yet seen at the target
    uint64_t target
    const uint64_t *mine    # this rank's signature, which each peer's must equal; NULL: not checked
    size_t sig_offset       # where the step's signature lies in a rank's control lines
    int other               # the peer whose signature differs
    alive_fn alive          # the wait's own liveness check (the group's: peers_alive), which _flags_alive wraps
    void *alive_arg


cdef int _flags_alive(void *arg) noexcept nogil:
    """The group's liveness check, for a wait on step flags: a dead process fails it (the group is
    lost), and so does a peer whose group broke there or that aborted it (GAVE_UP_BROKEN: no
    collective of the group can end well, as over TCP); a peer that left the group, or whose call
    timed out, only where the wait still needs it. One that left after it reached the flag waited for
    (a one-shot reduce's peer that finished its part, then destroyed the group) is not missed, while
    the wait goes on for a slower rank."""
    cdef FlagWait *w = <FlagWait*>arg
    cdef Peers *p = <Peers*>w.alive_arg
    cdef int rc = w.alive(w.alive_arg), q
    if rc != ENG_ERR_PEER_LEFT:
        return rc
    for q in range(w.size):
        if q != w.me and (eng_load32(_gave_up_word(w.ctrl, q)) & GAVE_UP_KIND) in (GAVE_UP_BROKEN, GAVE_UP_FOLLOWED):
            p.dead = q
            return ENG_ERR_PEER_LEFT
    for q in range(w.size):
        if (q != w.me and (w.only < 0 or q == w.only) and _out_of_collectives(p, q)
                and eng_load_acquire(<uint64_t*>(w.ctrl + <size_t>q * CTRL_BYTES)) < w.target):
            p.dead = q
            return ENG_ERR_PEER_LEFT
    p.dead = -1
    return 0


cdef inline bint _signed_otherwise(FlagWait *w, int q) noexcept nogil:
    """Whether peer q, which reached the target, signed this step otherwise than this rank."""
    cdef const uint64_t *s = <const uint64_t*>(w.ctrl + <size_t>q * CTRL_BYTES + w.sig_offset)
    cdef int i
    for i in range(SIG_COMPARED):
        if s[i] != w.mine[i]:
            w.other = q
            return True
    return False


cdef int _poll_flags(void *unused, void *arg, bint *done) except -1 nogil:
    cdef FlagWait *w = <FlagWait*>arg
    cdef int q
    while w.next < w.size:
        if w.next != w.me and (w.only < 0 or w.next == w.only):
            if eng_load_acquire(<uint64_t*>(w.ctrl + <size_t>w.next * CTRL_BYTES)) < w.target:
                # Still waiting for w.next: the peers already here are compared meanwhile.
                for q in range(w.next + 1, w.size if w.mine != NULL and w.only < 0 else 0):
                    if (q != w.me and eng_load_acquire(<uint64_t*>(w.ctrl + <size_t>q * CTRL_BYTES)) >= w.target
                            and _signed_otherwise(w, q)):
                        return ENG_ERR_MISMATCH
                return 0
            if w.mine != NULL and _signed_otherwise(w, w.next):
                return ENG_ERR_MISMATCH
        w.next += 1
    done[0] = True
    return 0


SEGMENT_MAX = 1 << 44   # far beyond any host's memory, far below where the layout's arithmetic wraps


cdef _check_sizes(int size, size_t half_bytes, size_t queue_bytes):
    if size < 1:
        raise ValueError(f"a group needs at least one rank, got {size}")
    if half_bytes < 4096 or half_bytes < 64 * <size_t>size + _align(8 * (2 * <size_t>size + 1), LINE):
        raise ValueError(f"ENGINE_SHM_SLOT_BYTES={half_bytes} is too small for {size} ranks (at least "
                         f"{max(4096, 64 * size + _align(8 * (2 * size + 1), LINE))})")
    if queue_bytes < 4096:
        raise ValueError(f"ENGINE_SHM_QUEUE_BYTES={queue_bytes} is too small (at least 4096)")
    # (in Python's integers: the layout's size_t sums would wrap, and the segment be smaller than its offsets)
    total = (2 * <object>half_bytes + NCHANNELS * <object>size * <object>queue_bytes) * size
    if total > SEGMENT_MAX:
        raise ValueError(f"ENGINE_SHM_SLOT_BYTES={half_bytes} and ENGINE_SHM_QUEUE_BYTES={queue_bytes} make a segment "
                         f"of more than {SEGMENT_MAX >> 40} TiB for {size} ranks: use smaller values")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > memory:   # (its ranks fault every page in: the host would run out of memory, not fail)
        raise ValueError(f"ENGINE_SHM_SLOT_BYTES={half_bytes} and ENGINE_SHM_QUEUE_BYTES={queue_bytes} make a segment "
                         f"of {total / 2**30:.1f} GiB for {size} ranks, more than this host's memory "
                         f"({memory / 2**30:.1f} GiB): use smaller values")
    return _align(half_bytes, LINE), _align(queue_bytes, PAGE)


cdef str _attach_error(int err):
    if err == ENG_ATTACH_KIND:
        return "it is no shared memory file (a pipe or a device): not a segment this engine made"
    if err == ENG_ATTACH_OWNER:
        return "it belongs to another user"
    if err == ENG_ATTACH_MODE:
        return "it is readable by other users (mode is not 0600)"
    if err == ENG_ATTACH_SIZE:
        return "its size is not the agreed one"
    if err == errno.EACCES or err == errno.EPERM:
        return (f"{os.strerror(err)} (this process may not open another process's files under /proc: "
                "a different user, or a restricted /proc)")
    if err == errno.ENOENT:
        return "the process or its descriptor is gone (did rank 0 exit?)"
    return os.strerror(err)


def cma_probe_address():
    """(address, pid) of this process's probe word, for the peers' single-copy probe."""
    return eng_cma_probe_addr(), os.getpid()
