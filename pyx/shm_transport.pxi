# Point-to-point over the segment: one byte ring per (channel, sender, receiver). A message travels as
# frames (a 64-byte header, then up to a quarter of the ring of payload): FIRST opens a message and
# says its length and tag, CONT frames carry the rest, WRAP skips to the ring's start. The sender
# copies frames in while there is room; the receiver copies them out into the posted receive that
# matches (MPI's rules: in post order, source and tag or their wildcards, non-overtaking per sender),
# or, if none is posted yet, into a buffer of its own until one is (the unexpected queue).
#
# Large messages (ENGINE_SHM_CMA_MIN_BYTES and up, when the group may use process_vm_readv) send
# only an RTS frame with the buffer's address: the receiver copies the message straight out of the
# sender's memory once a receive matches, then answers with an ACK frame, which completes the send.
# The receive completes once its ACK is in the ring (it may wait there for room): a rank never leaves
# a call owing an ACK, which nothing might send while it runs other groups' calls, its sender waiting.
#
# Any wait on the channel moves every pending message, so an isend and an irecv to the same peer never
# block each other. A mutex keeps the channel's state whole when several threads wait on it.

from libc.stdint cimport int32_t, uint32_t

cdef enum:
    FRAME_FIRST = 0x46495253    # "FIRS"
    FRAME_CONT = 0x434f4e54     # "CONT"
    FRAME_WRAP = 0x57524150     # "WRAP"
    FRAME_RTS = 0x52545320      # "RTS ": read the message from my memory
    FRAME_ACK = 0x41434b20      # "ACK ": I have read it
    FRAME_HDR = 64
    PM_SEND = 1
    PM_RECV = 2
    PM_UNEXPECTED = 3
    PM_ACK = 4                  # an ACK waiting for room in the ring
    PS_QUEUED = 0               # nothing moved yet
    PS_ACTIVE = 1               # bytes moving (or, for an RTS send, waiting for the ACK)
    PS_DONE = 2


cdef uint64_t MAX_MESSAGE = 1ULL << 48   # a frame announcing more than this is corrupt


cdef struct Frame:
    uint32_t kind
    int32_t tag
    uint64_t total      # FIRST, RTS: the message's bytes
    uint64_t len        # payload bytes in this frame
    uint64_t addr       # RTS: where the message is in the sender's memory
    uint64_t id         # RTS, ACK: which message
    uint64_t pad[3]


cdef struct PMsg:
    int kind
    int peer
    int tag
    int state
    int err
    bint orphan         # its request was cancelled: the channel frees it when done with it
    bint owns_buf       # buf was allocated by the channel (unexpected data, a cancelled send's rest)
    bint rts            # moves by a single copy (RTS / ACK)
    char *buf
    size_t len          # send: message bytes; receive: capacity; unexpected: message bytes
    size_t done         # bytes moved so far
    uint64_t addr       # an unexpected RTS: the message's address in its sender
    uint64_t id         # RTS sends, unexpected RTS, pending ACKs
    Status st
    PMsg *next
    PMsg *bound         # a receive waiting for an unexpected message still arriving, and vice versa; or
                        # for its ACK to be written, and that ACK


cdef inline PMsg *_new_msg(int kind, char *buf, size_t nbytes, int peer, int tag) noexcept nogil:
    """A posted send or receive (zeroed: no state, nothing moved); NULL when out of memory."""
    cdef PMsg *m = <PMsg*>calloc(1, sizeof(PMsg))
    if m != NULL:
        m.kind, m.buf, m.len, m.peer, m.tag = kind, buf, nbytes, peer, tag
    return m


cdef inline void _free_msg(PMsg *m) noexcept nogil:
    if m.owns_buf:
        free(m.buf)
    free(m)


cdef inline bint _matches(PMsg *recv, int peer, int tag) noexcept nogil:
    return (recv.peer == ANY_PEER or recv.peer == peer) and (recv.tag == ANY_TAG_ or recv.tag == tag)


cdef struct MsgList:
    PMsg *head
    PMsg *tail


cdef inline void _push(MsgList *l, PMsg *m) noexcept nogil:
    m.next = NULL
    if l.tail == NULL:
        l.head = m
    else:
        l.tail.next = m
    l.tail = m


cdef inline bint _unlink(MsgList *l, PMsg *m) noexcept nogil:
    cdef PMsg *prev = NULL
    cdef PMsg *x = l.head
    while x != NULL and x != m:
        prev = x
        x = x.next
    if x == NULL:
        return False
    if prev == NULL:
        l.head = m.next
    else:
        prev.next = m.next
    if l.tail == m:
        l.tail = prev
    m.next = NULL
    return True


cdef struct PeerState:             # this channel's state of one peer
    MsgList sendq                   # sends in order; the head is the one moving
    MsgList awaiting                # RTS sends waiting for their ACK
    MsgList acks                    # ACKs waiting for room in the ring
    uint64_t next_id                # the next RTS id
    PMsg *incoming                  # where the current message's frames go (NULL: none)
    size_t incoming_left            # its bytes still to come
    bint discarding                 # the current message's receive was cancelled


cdef class ShmTransport(Transport):
    """One point-to-point channel of a group's segment."""
    cdef ShmSegment seg
    cdef int ch
    cdef size_t q                   # ring bytes
    cdef size_t maxfrag
    cdef pthread_mutex_t lock
    cdef MsgList posted             # receives not yet matched, in post order
    cdef MsgList unexpected         # messages nobody asked for yet, in arrival order
    cdef PeerState *pr              # per peer
    cdef int corrupt_peer
    cdef int other_peer             # the first peer seen in another collective (_unmatched), or -1
    cdef bint released              # the group was freed: its segment is unmapped (a request dropped
                                    # after that is cancelled without touching the rings)

    def __cinit__(self, ShmSegment seg, int channel):
        cdef int P = seg.size
        self.seg = seg
        self.ch = channel
        self.rank = seg.rank
        self.size = P
        self.err_peer = -1
        self.corrupt_peer = self.other_peer = -1
        self.wide_tags = True
        self.q = seg.queue_bytes
        self.door = &seg.door           # its waits sleep on this rank's doorbell
        self.maxfrag = (self.q // 4 // LINE) * LINE - FRAME_HDR
        self.pr = <PeerState*>calloc(P, sizeof(PeerState))
        if self.pr == NULL:
            raise MemoryError()
        pthread_mutex_init(&self.lock, NULL)

    def __dealloc__(self):
        # Requests hold this transport, so only what the channel owns is left: unexpected messages,
        # pending ACKs, and cancelled sends still under way.
        cdef int p
        _free_list(&self.unexpected, False)
        if self.pr != NULL:
            for p in range(self.size):
                _free_list(&self.pr[p].sendq, True)
                _free_list(&self.pr[p].awaiting, True)
                _free_list(&self.pr[p].acks, False)
        free(self.pr)
        pthread_mutex_destroy(&self.lock)

    # -- ring addresses --

    cdef inline char *ring(self, int src, int dst) noexcept nogil:
        return self.seg.queues + ((<size_t>self.ch * self.size + src) * self.size + dst) * self.q

    cdef inline uint64_t *head(self, int src, int dst) noexcept nogil:
        # Written by src only: in src's index lines.
        return <uint64_t*>(self.seg.index + ((<size_t>src * 2 * NCHANNELS + self.ch) * self.size + dst) * LINE)

    cdef inline uint64_t *tail(self, int src, int dst) noexcept nogil:
        # Written by dst only: in dst's index lines.
        return <uint64_t*>(self.seg.index + ((<size_t>dst * 2 * NCHANNELS + NCHANNELS + self.ch) * self.size + src) * LINE)

    # -- sending (called with the lock held) --

    cdef size_t room(self, int peer, uint64_t *head, size_t want) noexcept nogil:
        """Bytes of payload a frame to peer can carry now (at most want), after skipping to the ring's
        start if too little is left before its end; head is advanced past a WRAP. SIZE_MAX: no room."""
        cdef char *ring = self.ring(self.rank, peer)
        cdef uint64_t tail = eng_load_acquire(self.tail(self.rank, peer))
        cdef size_t free_ = self.q - <size_t>(head[0] - tail)
        cdef size_t pos = head[0] % self.q, end = self.q - pos
        if end < FRAME_HDR + want and end < self.q // 2:
            if free_ < end + LINE:
                return SIZE_MAX
            (<Frame*>(ring + pos)).kind = FRAME_WRAP
            head[0] += end
            eng_store_release(self.head(self.rank, peer), head[0])
            free_ -= end
            end = self.q
        if free_ < LINE:
            return SIZE_MAX
        return min(want, min(free_, end) - FRAME_HDR)

    cdef void put(self, int peer, uint64_t *head, uint32_t kind, int32_t tag, uint64_t total, const char *data,
                  size_t n, uint64_t addr, uint64_t id) noexcept nogil:
        cdef char *at = self.ring(self.rank, peer) + head[0] % self.q
        cdef Frame *f = <Frame*>at
        f.kind = kind
        f.tag = tag
        f.total = total
        f.len = n
        f.addr = addr
        f.id = id
        if n:
            memcpy(at + FRAME_HDR, data, n)
        head[0] += _align(FRAME_HDR + n, LINE)
        eng_store_release(self.head(self.rank, peer), head[0])
        self.seg.ring(peer)

    cdef void progress_send(self, int peer) noexcept nogil:
        cdef uint64_t head = eng_load_relaxed(self.head(self.rank, peer))
        if head % LINE or <size_t>(head - eng_load_acquire(self.tail(self.rank, peer))) > self.q:
            self._corrupt(peer)   # (an index off the grid would put a frame past the ring: progress() fails)
            return
        cdef PMsg *m
        cdef size_t n
        cdef PeerState *ps = &self.pr[peer]
        while ps.acks.head != NULL:
            if self.room(peer, &head, 0) == SIZE_MAX:
                return
            m = ps.acks.head
            self.put(peer, &head, FRAME_ACK, 0, 0, NULL, 0, 0, m.id)
            _unlink(&ps.acks, m)
            if m.bound != NULL:     # the receive it answers is complete now
                m.bound.bound = NULL
                m.bound.state = PS_DONE
            free(m)
        m = ps.sendq.head
        while m != NULL:
            if m.rts:
                if self.room(peer, &head, 0) == SIZE_MAX:
                    return
                self.put(peer, &head, FRAME_RTS, m.tag, m.len, NULL, 0, <uint64_t>m.buf, m.id)
                self.seg.single_copy_sends += 1
                _unlink(&ps.sendq, m)
                m.state = PS_ACTIVE
                _push(&ps.awaiting, m)
                m = ps.sendq.head
                continue
            n = self.room(peer, &head, min(m.len - m.done, self.maxfrag))
            if n == SIZE_MAX or (n == 0 and m.len != m.done):
                return
            self.put(peer, &head, FRAME_FIRST if m.state == PS_QUEUED else FRAME_CONT, m.tag, m.len,
                     m.buf + m.done, n, 0, 0)
            m.done += n
            m.state = PS_ACTIVE
            if m.done == m.len:
                _unlink(&ps.sendq, m)
                m.state = PS_DONE
                if m.orphan:
                    _free_msg(m)
                m = ps.sendq.head

    # -- receiving (called with the lock held) --

    cdef int progress_recv(self, int peer) noexcept nogil:
        cdef char *ring = self.ring(peer, self.rank)
        cdef uint64_t *tailp = self.tail(peer, self.rank)
        cdef uint64_t tail = eng_load_relaxed(tailp)
        cdef uint64_t head = eng_load_acquire(self.head(peer, self.rank))
        cdef size_t pos, avail, size
        cdef Frame f
        cdef PMsg *m
        cdef int ierr
        while tail != head:
            avail = <size_t>(head - tail)
            if avail > self.q or avail % LINE or tail % LINE:   # (on the grid: a whole frame before the end)
                return self._corrupt(peer)
            pos = tail % self.q
            memcpy(&f, ring + pos, sizeof(Frame))    # a private copy: the checks below can't be raced
            if f.kind == FRAME_WRAP:
                if self.q - pos > avail:
                    return self._corrupt(peer)
                tail += self.q - pos
                eng_store_release(tailp, tail)
                continue
            if f.len > self.q - pos - FRAME_HDR:
                return self._corrupt(peer)
            size = _align(FRAME_HDR + f.len, LINE)
            if size > avail:
                return self._corrupt(peer)
            if f.kind == FRAME_ACK:
                ierr = self._acked(peer, f.id)
            elif f.kind == FRAME_RTS:
                ierr = self._rts(peer, &f)
            elif f.kind == FRAME_FIRST or f.kind == FRAME_CONT:
                ierr = self._data(peer, &f, ring + pos + FRAME_HDR)
            else:
                ierr = self._corrupt(peer)
            if ierr:
                return ierr
            tail += size
            eng_store_release(tailp, tail)
            self.seg.ring(peer)     # a sender waiting for room
        return 0

    cdef int _data(self, int peer, Frame *f, const char *payload) noexcept nogil:
        cdef PMsg *m
        cdef char *buf
        cdef PeerState *ps = &self.pr[peer]
        if f.kind == FRAME_FIRST:
            if ps.incoming != NULL or ps.discarding or f.total < f.len or f.total > MAX_MESSAGE or f.tag < 0:
                return self._corrupt(peer)
            m = self._match_posted(peer, f.tag)
            if m == NULL:               # unexpected: into a buffer of its own until a receive takes it
                self._unmatched(peer, f.tag)
                buf = <char*>malloc(f.total if f.total else 1)
                m = _new_msg(PM_UNEXPECTED, buf, f.total, peer, f.tag) if buf != NULL else NULL
                if m == NULL:
                    free(buf)
                    return ENG_ERR_NOMEM
                m.owns_buf = True
                m.state = PS_ACTIVE
                _push(&self.unexpected, m)
            elif f.total > m.len:
                m.err = ENG_ERR_TRUNCATE
                m.st.source, m.st.tag, m.st.nbytes = peer, f.tag, f.total
                m.state = PS_DONE
                ps.discarding = True
                m = NULL
            else:
                m.state = PS_ACTIVE
                m.st.source, m.st.tag, m.st.nbytes = peer, f.tag, f.total
            ps.incoming = m
            ps.incoming_left = f.total
        elif ps.incoming == NULL and not ps.discarding:
            return self._corrupt(peer)
        if f.len > ps.incoming_left:
            return self._corrupt(peer)
        m = ps.incoming
        if m != NULL:
            memcpy(m.buf + m.done, payload, f.len)
            m.done += f.len
        ps.incoming_left -= f.len
        if ps.incoming_left == 0:
            ps.incoming = NULL
            ps.discarding = False
            if m != NULL:
                self._arrived(m)
        return 0

    cdef int _rts(self, int peer, Frame *f) noexcept nogil:
        cdef PMsg *m
        if self.pr[peer].incoming != NULL or self.pr[peer].discarding or f.total > MAX_MESSAGE or f.len or f.tag < 0:
            return self._corrupt(peer)
        m = self._match_posted(peer, f.tag)
        if m != NULL:
            return self._pull(m, peer, f.tag, f.total, f.addr, f.id)
        self._unmatched(peer, f.tag)
        m = _new_msg(PM_UNEXPECTED, NULL, f.total, peer, f.tag)
        if m == NULL:
            return ENG_ERR_NOMEM
        m.rts, m.addr, m.id, m.state = True, f.addr, f.id, PS_DONE
        _push(&self.unexpected, m)
        return 0

    cdef int _pull(self, PMsg *r, int peer, int tag, size_t nbytes, uint64_t addr, uint64_t id) noexcept nogil:
        """Receive r takes an RTS message: one copy out of the sender's memory, then the ACK, written
        once the ring has room (progress_send), which completes r."""
        cdef PMsg *ack = _new_msg(PM_ACK, NULL, 0, peer, 0)
        r.st.source, r.st.tag, r.st.nbytes = peer, tag, nbytes
        if ack == NULL:   # (r fails, its message taken: the frame is not read again into the next receive)
            r.err = ENG_ERR_NOMEM
        elif nbytes > r.len:
            r.err = ENG_ERR_TRUNCATE
        else:   # (fails where its sender withdrew the send: freed or aborted the group, or gave up the
            # collective the algorithms' channel carries it for)
            r.err = self.seg.cma_copy(peer, r.buf, addr, nbytes, False, self.ch == 0)
            r.done = nbytes
        if ack == NULL:
            r.state, r.bound = PS_DONE, NULL
            return 0
        r.state = PS_ACTIVE
        r.bound, ack.bound, ack.id = ack, r, id
        _push(&self.pr[peer].acks, ack)
        self.progress_send(peer)
        return 0

    cdef int _acked(self, int peer, uint64_t id) noexcept nogil:
        cdef PMsg *m = self.pr[peer].awaiting.head
        while m != NULL and m.id != id:
            m = m.next
        if m == NULL:
            return self._corrupt(peer)
        _unlink(&self.pr[peer].awaiting, m)
        m.state = PS_DONE
        if m.orphan:
            _free_msg(m)
        return 0

    cdef int _corrupt(self, int peer) noexcept nogil:
        self.corrupt_peer = peer
        return ENG_ERR_CORRUPT

    cdef void _arrived(self, PMsg *m) noexcept nogil:
        """A whole message is in: a receive completes; an unexpected one waits for its receive, or
        hands itself to the receive bound to it while it arrived."""
        cdef PMsg *r
        m.state = PS_DONE
        if m.kind == PM_RECV:
            self._release_if_orphan(m)
            return
        r = m.bound
        if r != NULL:
            _unlink(&self.unexpected, m)
            self._deliver(m, r)
            _free_msg(m)

    cdef int _deliver(self, PMsg *u, PMsg *r) noexcept nogil:
        """Receive r takes the complete unexpected message u (which the caller then frees)."""
        if u.rts:
            return self._pull(r, u.peer, u.tag, u.len, u.addr, u.id)
        r.st.source, r.st.tag, r.st.nbytes = u.peer, u.tag, u.len
        if u.len > r.len:
            r.err = ENG_ERR_TRUNCATE
        else:
            memcpy(r.buf, u.buf, u.len)
            r.done = u.len
        r.state = PS_DONE
        r.bound = NULL
        self._release_if_orphan(r)
        return 0

    cdef inline void _release_if_orphan(self, PMsg *m) noexcept nogil:
        if m.orphan and m.state == PS_DONE:
            _free_msg(m)

    cdef PMsg *_match_posted(self, int peer, int tag) noexcept nogil:
        cdef PMsg *m = self.posted.head
        while m != NULL and not _matches(m, peer, tag):
            m = m.next
        if m != NULL:
            _unlink(&self.posted, m)
        return m

    cdef void _unmatched(self, int peer, int tag) noexcept nogil:
        """Peer's message with this tag came, and no posted receive takes it. The algorithms' channel
        (0) is ordered: every rank runs the same collectives, whose receives name their peer and tag
        in the order that peer sends. So the message shows its sender in another collective when a
        receive waits on that sender (its message came first), or when its tag says so
        (pyx/call_tags.h): every request of the channel then fails naming it, at once."""
        cdef PMsg *m = self.posted.head
        if self.ch != 0 or peer == self.rank or self.other_peer >= 0:
            return
        while m != NULL and m.peer != peer:
            m = m.next
        if m != NULL or eng_other_call(self.tag_base, tag):
            self.other_peer = peer

    cdef bint _out_of_order(self, int peer) noexcept nogil:
        """A receive from peer is about to be posted, and no unexpected message matched it: whether
        one of them shows another collective (the same rule)."""
        cdef PMsg *u = self.unexpected.head
        if self.ch != 0:
            return False
        while u != NULL and self.other_peer < 0:
            if u.bound == NULL and u.peer != self.rank and (u.peer == peer or eng_other_call(self.tag_base, u.tag)):
                self.other_peer = u.peer
            u = u.next
        return self.other_peer >= 0

    cdef int progress(self) noexcept nogil:
        cdef int p, ierr
        for p in range(self.size):
            ierr = self.progress_recv(p)
            if ierr:
                self.err_peer = p
                return ierr
        for p in range(self.size):
            if self.pr[p].sendq.head != NULL or self.pr[p].acks.head != NULL:
                self.progress_send(p)
        if self.corrupt_peer >= 0:
            self.err_peer = self.corrupt_peer
            return ENG_ERR_CORRUPT
        return 0

    # -- the Transport interface --

    cdef int nudge(self) noexcept nogil:
        # Never needed again soon: a peer rings this rank's doorbell when it writes frames to it, or
        # takes frames from it (room for the rest), and that ends the sleep of any wait of the group.
        self.in_flight()
        return 0

    cdef int in_flight(self) noexcept nogil:
        # Sends with frames still to write, an ACK to send or one to read, receives posted or half-read:
        # each needs this rank to copy (a peer's failure ends that: its waits name it). 2: frames moved.
        cdef int p, busy
        cdef bint failed
        cdef uint64_t before
        if pthread_mutex_trylock(&self.lock) != 0:
            return 1
        before = self.positions()
        failed = self.progress() != 0
        busy = not failed and self.posted.head != NULL
        if not (busy or failed):
            for p in range(self.size):
                if (self.pr[p].sendq.head != NULL or self.pr[p].acks.head != NULL or self.pr[p].incoming != NULL
                    or self.pr[p].awaiting.head != NULL):   # (its ACK comes in a ring only a drive reads)
                    busy = 1
                    break
        if busy and self.positions() != before:
            busy = 2
        pthread_mutex_unlock(&self.lock)
        return busy

    cdef uint64_t positions(self) noexcept nogil:
        """The sum of this rank's ring positions (what it wrote to each peer, what it read from each):
        it moves when this rank moves frames."""
        cdef uint64_t sum = 0
        cdef int p
        for p in range(self.size):
            sum += eng_load_relaxed(self.head(self.rank, p)) + eng_load_relaxed(self.tail(p, self.rank))
        return sum

    cdef int isend(self, const void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        cdef PMsg *m = _new_msg(PM_SEND, <char*>buf, nbytes, peer, posted_tag(self, tag))
        if m == NULL:
            return ENG_ERR_NOMEM
        pthread_mutex_lock(&self.lock)
        if peer != self.rank and self.seg.use_cma(nbytes):
            m.rts = True
            m.id = self.pr[peer].next_id
            self.pr[peer].next_id += 1
        _push(&self.pr[peer].sendq, m)
        self.progress_send(peer)   # a small message is usually in the ring before isend returns
        pthread_mutex_unlock(&self.lock)
        req.w[0] = <size_t>m
        return 0

    cdef int irecv(self, void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        cdef PMsg *m = _new_msg(PM_RECV, <char*>buf, nbytes, peer, posted_tag(self, tag))
        cdef PMsg *u
        cdef int ierr = 0
        if m == NULL:
            return ENG_ERR_NOMEM
        pthread_mutex_lock(&self.lock)
        u = self.unexpected.head
        while u != NULL and (u.bound != NULL or not _matches(m, u.peer, u.tag)):
            u = u.next
        if self.other_peer >= 0 or (u == NULL and self._out_of_order(peer)):
            pthread_mutex_unlock(&self.lock)
            free(m)
            self.err_peer = self.other_peer
            return ENG_ERR_OTHER_CALL
        if u == NULL:
            _push(&self.posted, m)
        elif u.state == PS_DONE:
            _unlink(&self.unexpected, u)
            ierr = self._deliver(u, m)
            _free_msg(u)
        else:   # still arriving: it completes into m once in
            u.bound = m
            m.bound = u
            m.state = PS_ACTIVE
        pthread_mutex_unlock(&self.lock)
        req.w[0] = <size_t>m
        return ierr

    cdef int test(self, Req *req, bint *done, Status *st) except -1 nogil:
        cdef PMsg *m = <PMsg*>req.w[0]
        cdef int ierr = 0
        if m == NULL:
            done[0] = True
            return 0
        pthread_mutex_lock(&self.lock)
        ierr = self.progress()
        done[0] = m.state == PS_DONE
        if done[0]:
            if st != NULL:
                st[0] = m.st
            if m.err:
                ierr = m.err
                self.err_peer = m.st.source
            free(m)
            req.w[0] = 0
        elif self.other_peer >= 0 and not ierr:
            ierr = ENG_ERR_OTHER_CALL
            self.err_peer = self.other_peer
        pthread_mutex_unlock(&self.lock)
        return ierr

    cdef int cancel(self, Req *req) noexcept nogil:
        cdef PMsg *m = <PMsg*>req.w[0]
        cdef PMsg *u
        cdef PMsg *r
        cdef char *rest
        cdef int kept = 0
        if m == NULL:
            return 0
        req.w[0] = 0
        pthread_mutex_lock(&self.lock)
        if m.state == PS_DONE:
            free(m)
        elif m.kind == PM_RECV:
            if m.state == PS_QUEUED:            # still posted: take it back
                _unlink(&self.posted, m)
            elif m.bound != NULL:               # bound to an unexpected message still arriving, or to
                u = m.bound                     # the ACK it owes (sent all the same: now, if there's room)
                u.bound = NULL
                if u.kind == PM_UNEXPECTED:     # the next posted receive it matches takes it, in post order
                    r = self._match_posted(u.peer, u.tag)
                    if r != NULL:
                        u.bound, r.bound, r.state = r, u, PS_ACTIVE
                elif not self.released:
                    self.progress_send(u.peer)
            elif not self._unexpected_from(m):   # frames arriving into it: out of memory to keep the
                self.pr[m.st.source].incoming = NULL   # rest for the next receive: dropped
                self.pr[m.st.source].discarding = True
            free(m)
        elif m.state == PS_QUEUED:              # a send nothing of which moved: withdraw it
            _unlink(&self.pr[m.peer].sendq, m)
            free(m)
        elif m.rts:                             # the receiver may still read its buffer
            m.orphan = True
            kept = 1
        else:                                   # a send under way: finish it from a copy of its rest
            m.orphan = True                     # (the receiver expects the rest of its bytes)
            rest = <char*>malloc(m.len - m.done + 1)
            if rest != NULL:
                memcpy(rest, m.buf + m.done, m.len - m.done)
                m.buf = rest
                m.len -= m.done
                m.done = 0
                m.owns_buf = True
            else:
                kept = 1                        # out of memory: the caller keeps the buffer alive
        pthread_mutex_unlock(&self.lock)
        return kept

    cdef bint _unexpected_from(self, PMsg *m) noexcept nogil:
        """Receive m, cancelled while its message's frames arrive into it: the message goes on as one
        nobody asked for yet (what came so far copied into a buffer of the channel's), which the next
        receive matching it takes, posted already or later, before the sender's next message. False
        when out of memory for it."""
        cdef char *buf = <char*>malloc(m.st.nbytes if m.st.nbytes else 1)
        cdef PMsg *u = _new_msg(PM_UNEXPECTED, buf, m.st.nbytes, m.st.source, m.st.tag) if buf != NULL else NULL
        cdef PMsg *r
        if u == NULL:
            free(buf)
            return False
        memcpy(buf, m.buf, m.done)
        u.done, u.owns_buf, u.state = m.done, True, PS_ACTIVE
        _push(&self.unexpected, u)
        self.pr[u.peer].incoming = u
        r = self._match_posted(u.peer, u.tag)
        if r != NULL:
            u.bound, r.bound, r.state = r, u, PS_ACTIVE
        return True

    cdef void release(self) noexcept:
        self.released = True

    cdef str who(self, int peer):
        return f"rank {peer} (pid {self.seg.peers.pids[peer]})" if 0 <= peer < self.size else "a peer"

    cdef void group_broke(self, bint timed_out, int lost=-1, bint between=False) noexcept:
        if self.ch == 0 and not self.released:   # (the collectives': the segment says so at once)
            self.seg.give_up(timed_out, lost)

    cdef object error_text(self, int code):
        if code == ENG_ERR_CORRUPT:
            return _engine_error_text(code, self.corrupt_peer)
        if code == ENG_ERR_NOMEM and self.err_peer >= 0:   # (progress() names the peer whose frame failed)
            return (f"out of memory for a message from rank {self.err_peer} that no receive had asked for yet "
                    "(it is held whole, the size its first frame says)")
        return _engine_error_text(code, self.err_peer)


cdef void _free_list(MsgList *l, bint orphans_only) noexcept nogil:
    cdef PMsg *m = l.head
    cdef PMsg *nxt
    while m != NULL:
        nxt = m.next
        if not orphans_only or m.orphan:
            _free_msg(m)
        m = nxt
    l.head = l.tail = NULL


cdef Transport shm_channel(ShmSegment seg, int channel):
    """Point-to-point channel `channel` of the segment (0: the engine's algorithms, 1: the user's)."""
    return ShmTransport(seg, channel)
