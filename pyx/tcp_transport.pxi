# The TCP transport behind the seam (the protocol, matching and progress are pyx/tcp.h's), and the
# group whose collectives are the engine's own point-to-point algorithms over it (TcpComm).
#
# Waiting: the engine's one wait (wait_until, pyx/wait.pxi) over this channel: it spins (polling the
# channel's sockets) for the group's spin budget, then sleeps in poll() on them (the channel's doze)
# until something arrives, the watch is due, or another thread completes a request (the channel's
# completion count is its doorbell). No GIL is held while it waits.

from libc.string cimport strerror

cdef extern from "tcp.h" nogil:
    ctypedef struct eng_tcp:
        int dead_peer
        int listen_fd
        int rejected
        int said_bye
        int ordered                 # the collectives' channel (the user's messages: not)
        int nstreams
        size_t split_min, eager_max
        int sys_errno
        uint32_t gen
    ctypedef struct tcp_req:
        pass
    enum:
        ENG_TCP_MAX_STREAMS
        ENG_TCP_MAX_RANKS
        TCP_LEFT_BROKEN
        TCP_LEFT_TIMED_OUT
    eng_tcp *eng_tcp_new(int rank, int size, int channel, int nstreams, int fail_any, int ordered, size_t split_min,
                         size_t eager_max, const unsigned char *token, int listen_fd, int *err)
    void eng_tcp_free(eng_tcp *t)
    int eng_tcp_peers_connected(eng_tcp *t)
    void eng_tcp_set_call(eng_tcp *t, int base)
    void eng_tcp_goodbye(eng_tcp *t, int broken, int lost, int between)
    int eng_tcp_set_peer(eng_tcp *t, int peer, const char *host, int port)
    int eng_tcp_listen(const char *host, int *fd_out, int *port_out)
    void tcp_siphash128(const unsigned char *key, const void *data, size_t len, unsigned char *out)
    int eng_tcp_interfaces(char *out, size_t cap)
    int eng_tcp_isend(eng_tcp *t, const void *buf, size_t n, int peer, int tag, tcp_req **out, int *err_peer)
    int eng_tcp_irecv(eng_tcp *t, void *buf, size_t n, int peer, int tag, tcp_req **out, int *err_peer)
    int eng_tcp_test(eng_tcp *t, tcp_req *r, int *done, int *src, int *tag, size_t *nbytes, int *err_peer)
    void eng_tcp_sleep(eng_tcp *t, uint32_t gen, double seconds)
    int eng_tcp_cancel(eng_tcp *t, tcp_req *r)
    int eng_tcp_nudge(eng_tcp *t)
    int eng_tcp_connect_all(eng_tcp *t)
    int eng_tcp_mesh_missing(eng_tcp *t, int *code)
    int eng_tcp_waiting_on(eng_tcp *t, int *peers, double *silent, int cap)
    int eng_tcp_peer_errno(eng_tcp *t, int peer)
    int eng_tcp_departed(eng_tcp *t, int peer)
    int eng_tcp_bye_lost(eng_tcp *t, int peer)
    int eng_tcp_bye_first(eng_tcp *t, int peer)
    int eng_tcp_whole(eng_tcp *t, int q)
    void eng_tcp_set_whole(eng_tcp *t, int whole_size, int *ranks)
    int eng_tcp_lost(eng_tcp *t, int waited_on, int *lost)

cdef extern from "<netdb.h>" nogil:
    const char *gai_strerror(int code)


def tcp_proof(bytes token, bytes data):
    """The wire's proof of data by the group's 16-byte token (SipHash-2-4, 128 bits): a hello carries
    that of its other fields, a goodbye written back that of itself and its connection (pyx/tcp_wire.h)."""
    cdef unsigned char out[16]
    if len(token) != 16:
        raise ValueError("the group's token must be 16 bytes")
    tcp_siphash128(token, <const char*>data, len(data), out)
    return out[:16]


def tcp_listen(str host):
    """A listening socket on host (a numeric IPv4 or IPv6 address) and an ephemeral port: (fd, port).
    The fd goes to a TcpTransport, which closes it."""
    cdef int fd = -1, port = 0
    cdef bytes h = host.encode()
    cdef int rc = eng_tcp_listen(h, &fd, &port)
    if rc > 0:
        raise OSError(rc, f"engine: can't listen on {host}: {strerror(rc).decode()}")
    if rc < 0:
        raise OSError(f"engine: can't listen on {host}: {gai_strerror(-rc).decode()}")
    return fd, port


def tcp_interfaces():
    """[(interface, 4 or 6, address)] of every interface that is up."""
    cdef char buf[65536]
    cdef int rc = eng_tcp_interfaces(buf, sizeof(buf))
    if rc:
        raise OSError(rc, f"engine: can't list the network interfaces: {strerror(rc).decode()}")
    out = []
    for line in buf.decode().splitlines():
        name, fam, addr = line.split(" ")
        out.append((name, int(fam), addr))
    return out


def close_fd(int fd):
    """Closes a descriptor tcp_listen() returned that no transport took."""
    eng_close(fd)


cdef void _tcp_doze(void *t, uint32_t gen, double seconds) noexcept nogil:
    eng_tcp_sleep(<eng_tcp*>t, gen, seconds)


cdef class TcpTransport(Transport):
    """One channel of a group over TCP: listen_fd (from tcp_listen, taken over once this returns: if it
    raises, the fd is still the caller's to close), the group's token, and every rank's (host, port,
    name) to connect to. fail_any: a peer's end without its goodbye (a crash) fails every request (the
    engine's collectives need every rank). ordered: each peer's messages are received in the order it
    sends them (the collectives'), so one that no receive takes while a receive waits on that peer is
    another collective's (ENG_ERR_OTHER_CALL, pyx/tcp_match.h)."""
    cdef eng_tcp *t
    cdef Doorbell bell              # its waits doze in poll() until a request completes (t.gen moves)
    cdef readonly list peers        # (address, port, host name) of every rank
    cdef int leaving                # goodbye()s running without the GIL: release() leaves t to __dealloc__
    cdef uint32_t connect_aborted   # abort_connect(): connect_mesh() ends (a reconfigure's abort())
    cdef int broken                 # its group failed or was aborted here (TCP_LEFT_BROKEN - 1), or a call timed
                                    # out here (TCP_LEFT_TIMED_OUT - 1): the goodbye says which
    cdef int broke_over             # the rank whose loss broke the group (group_broke()), or -1
    cdef bint broke_between         # it broke while no call of it ran here (group_broke()'s between)
    cdef object abort_reason        # what abort_connect() was told

    def __cinit__(self, int rank, int size, int channel, int listen_fd, bytes token, list peers, int nstreams=1,
                  size_t split_min=1 << 20, size_t eager_max=64 << 10, bint fail_any=True,
                  bint ordered=False):
        if len(token) != 16:
            raise ValueError("the group's token must be 16 bytes")
        if len(peers) != size:
            raise ValueError(f"{len(peers)} peer addresses for a group of {size}")
        if not 1 <= size <= ENG_TCP_MAX_RANKS:   # (the poll table keeps a rank in 20 bits)
            raise ValueError(f"a TCP group has 1..{ENG_TCP_MAX_RANKS} ranks, got {size}")
        if not 1 <= nstreams <= ENG_TCP_MAX_STREAMS:
            raise ValueError(f"streams per peer must be in 1..{ENG_TCP_MAX_STREAMS}, got {nstreams}")
        self.rank, self.size = rank, size
        self.err_peer = -1
        self.broke_over = -1
        self.wide_tags = True
        self.peers = list(peers)
        cdef int err = 0
        self.t = eng_tcp_new(rank, size, channel, nstreams, fail_any, ordered, split_min, eager_max, token, listen_fd,
                             &err)
        if err == errno.ENOMEM:
            raise MemoryError(f"engine: no memory for TCP channel {channel}'s transport")
        if err:
            raise OSError(err, f"engine: TCP channel {channel} can't make its wake-up eventfd: {strerror(err).decode()}")
        self.bell.bell = &self.t.gen
        self.bell.doze = _tcp_doze
        self.bell.doze_obj = self.t
        self.door = &self.bell
        for q, (addr, port, _) in enumerate(peers):
            if not 1 <= port <= 65535:   # (getaddrinfo would take it modulo 65536: another port)
                self.t.listen_fd = -1
                raise ValueError(f"engine: rank {q}'s port {port} (from the group's store) is outside 1-65535")
            rc = eng_tcp_set_peer(self.t, q, addr.encode(), port)
            if rc:
                self.t.listen_fd = -1       # raising: the fd stays the caller's (engine/tcp.py closes it)
                raise ValueError(f"engine: rank {q}'s address {addr!r} port {port}: {gai_strerror(rc).decode()}")

    def __dealloc__(self):
        eng_tcp_free(self.t)

    cdef void release(self) noexcept:
        if self.leaving:        # (another thread's goodbye reads it: freed with the object instead)
            return
        eng_tcp_free(self.t)    # (goodbye first: the peers are told)
        self.t = NULL

    def goodbye(self):
        """Leaves the group in order: every peer is told (so only what still involves this rank fails
        there, or, where the group broke here, every collective: group_broke()), every connection
        closed; what was under way here fails. The group's end, and the process's normal exit
        (through the group's core, TcpComm.leave: engine/transports.py), call it; freeing the transport does too."""
        self.say_goodbye()

    cdef void say_goodbye(self) noexcept:
        cdef eng_tcp *t = self.t
        cdef int broken = self.broken, lost = self.broke_over, between = self.broke_between
        if t == NULL:
            return
        self.leaving += 1
        with nogil:
            eng_tcp_goodbye(t, broken, lost, between)
        self.leaving -= 1

    cdef void group_broke(self, bint timed_out, int lost=-1, bint between=False) noexcept:
        """Its group's collectives gave the group up here: this channel (the algorithms': CoreComm tells
        only that one) says its goodbye at once, saying why, so a peer's collective fails then, naming
        this rank, not at its timeout: every collective where the group broke, what involves this rank
        where a call only timed out (a peer waiting on another rank reaches its own verdict). The
        goodbye names the rank lost, where one broke the group: the user's channel may have seen it
        end before this one did. The user's channel goes on (point-to-point outlives a broken group's
        collectives). Where it broke between calls, a peer still in one this rank ended finishes it
        (eng_tcp_goodbye)."""
        if not self.broken:
            self.broken = (TCP_LEFT_TIMED_OUT if timed_out else TCP_LEFT_BROKEN) - 1
            self.broke_over = lost if lost >= 0 else -1   # (eng_tcp_goodbye checks it)
            self.broke_between = between
        self.say_goodbye()

    cdef int serve(self, tuple whole, int whole_size, str name) except -1:
        Transport.serve(self, whole, whole_size, name)
        cdef int *ranks = <int*>malloc(self.size * sizeof(int))   # (the channel's from here)
        cdef int q
        if ranks == NULL:
            raise MemoryError()
        for q in range(self.size):
            ranks[q] = whole[q]
        if self.t == NULL:
            free(ranks)
        else:
            eng_tcp_set_whole(self.t, whole_size, ranks)
        return 0

    cdef int lost_rank(self, int code) noexcept:
        cdef int p = self.err_peer
        if self.t == NULL or not 0 <= p < self.size:
            return -1
        if code == ENG_ERR_PEER_DEAD:
            return eng_tcp_whole(self.t, p)
        if code == ENG_ERR_PEER_LEFT and eng_tcp_departed(self.t, p) == TCP_LEFT_BROKEN:
            return eng_tcp_bye_lost(self.t, p)
        return -1

    cdef void begin_call(self, int base) noexcept nogil:
        self.tag_base = base
        eng_tcp_set_call(self.t, base)

    cdef int isend(self, const void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        cdef tcp_req *r = NULL
        cdef int ep = -1
        cdef int ierr = eng_tcp_isend(self.t, buf, nbytes, peer, posted_tag(self, tag), &r, &ep)
        return self.posted(ierr, r, ep, req)     # (r and ep read after the call sets them)

    cdef int irecv(self, void *buf, size_t nbytes, int peer, int tag, Req *req) except -1 nogil:
        cdef tcp_req *r = NULL
        cdef int ep = -1
        cdef int ierr = eng_tcp_irecv(self.t, buf, nbytes, peer, posted_tag(self, tag), &r, &ep)
        return self.posted(ierr, r, ep, req)

    cdef inline int posted(self, int ierr, tcp_req *r, int err_peer, Req *req) noexcept nogil:
        """The request in req, or the error and the peer it names."""
        if ierr:
            self.err_peer = err_peer
            return ierr
        req.w[0] = <size_t>r
        return 0

    cdef int test(self, Req *req, bint *done, Status *st) except -1 nogil:
        cdef int d = 0, src = -1, tag = -1, ep = -1, ierr
        cdef size_t nbytes = 0
        if not req_active(req):
            done[0] = True
            return 0
        ierr = eng_tcp_test(self.t, <tcp_req*>req.w[0], &d, &src, &tag, &nbytes, &ep)
        done[0] = d != 0
        if d:
            req.w[0] = 0
            if st != NULL:
                st.source, st.tag, st.nbytes = src, tag, nbytes
        if ierr:
            self.err_peer = ep
        return ierr

    cdef int nudge(self) noexcept nogil:
        return eng_tcp_nudge(self.t) if self.t != NULL else 0

    cdef int in_flight(self) noexcept nogil:
        return self.nudge()   # (the nudge's answer: no doorbell wakes a wait on another channel)

    cdef int cancel(self, Req *req) noexcept nogil:
        cdef tcp_req *r = <tcp_req*>req.w[0]
        if r == NULL:
            return 0
        req.w[0] = 0
        if self.t == NULL:   # released: nothing refers to the request any more
            free(r)
            return 0
        return eng_tcp_cancel(self.t, r)

    def connect_mesh(self, double timeout):
        """Connects to every peer (and waits for every peer's connections) now, not at first use; ends
        with EngineAborted, giving abort_connect()'s reason, once that is called."""
        cdef MeshWait w
        cdef WaitCtx ctx
        cdef int ierr
        w.deadline = eng_now() + timeout
        w.missing = -1
        start_wait(&ctx, _signal_handlers_run, 0.25)   # (an abort() from a signal handler on this thread)
        ctx.abort = &self.connect_aborted
        with nogil:
            ierr = eng_tcp_connect_all(self.t)
            if not ierr:
                ierr = wait_until(_poll_mesh, <void*>self.t, &w, &ctx, self.door)
        if ierr == ENG_ERR_ABORTED:
            raise EngineAborted(f"{self.abort_reason} (while the group's ranks connected over TCP)")
        if ierr:
            self.err_peer = w.missing if w.missing >= 0 else self.t.dead_peer
            refused = ierr == ENG_ERR_CONNECT and 0 <= self.err_peer < self.size and \
                eng_tcp_peer_errno(self.t, self.err_peer) == ECONNREFUSED   # (not: no route to it from here)
            raise EnginePeerLost(f"engine: connecting the group's ranks over TCP failed: {self.error_text(ierr)}"
                                 + (" (or it failed to make its end of the group, and closed its sockets: its own "
                                    "error says why)" if ierr == ENG_ERR_PEER_DEAD or refused else ""))
        if w.missing >= 0:
            addr, port, host = self.peers[w.missing]
            raise EngineTimeout(f"engine: rank {self.rank} could not connect to rank {w.missing} ({host}, {addr} port "
                                f"{port}) within {timeout:g} s, or it never connected back: a firewall, a wrong "
                                f"interface (ENGINE_SOCKET_IFNAME), or that rank never made this group")

    def abort_connect(self, why):
        """Ends a connect_mesh() running in another thread (within its back-off's 50 ms), for reason why."""
        self.abort_reason = why
        eng_store32(&self.connect_aborted, 1)

    def waiting_on(self):
        """[(peer, seconds since bytes last came from it, or None: never)] of the peers this channel's
        unfinished requests wait on."""
        cdef int peers[64]
        cdef double silent[64]
        cdef int n = eng_tcp_waiting_on(self.t, peers, silent, 64) if self.t != NULL else 0
        return [(peers[i], silent[i] if silent[i] >= 0 else None) for i in range(n)]

    @property
    def departed(self):
        """The peers that left the group in order (their goodbye came)."""
        return [q for q in range(self.size) if q != self.rank and self.t != NULL and eng_tcp_departed(self.t, q)]

    def lost(self):
        """The peers lost to this rank (their connection ended without a goodbye), after a round of
        progress: a peer that died while the channel idled is seen at once. (With the GIL held: the
        group's release, which frees the channel, holds it too.)"""
        cdef int *lost
        cdef int n
        if self.t == NULL:
            return []
        lost = <int*>malloc(self.size * sizeof(int))
        if lost == NULL:
            raise MemoryError()
        n = eng_tcp_lost(self.t, eng_load32(&self.waiting), lost)
        try:
            return [lost[i] for i in range(n)]
        finally:
            free(lost)

    @property
    def streams(self):
        """(streams per peer, the least message split over them, the most a receiver reads ahead unasked)
        as this channel runs, and how many peers it has connected to (ENGINE_TCP_CONNECT=lazy: those it
        sent to)."""
        if self.t == NULL:
            return None
        return self.t.nstreams, self.t.split_min, self.t.eager_max, eng_tcp_peers_connected(self.t)

    @property
    def rejected(self):
        """Connections closed before or at their hello (a wrong token, a stranger, a duplicate)."""
        return self.t.rejected if self.t != NULL else 0

    cdef str who(self, int peer):
        if peer < 0 or peer >= len(self.peers):
            return "a peer"
        addr, port, host = self.peers[peer]
        return f"rank {peer} ({host}, {addr} port {port})"

    cdef int classify(self, int code) noexcept:
        """A peer whose goodbye said its call timed out (TCP_LEFT_TIMED_OUT): the call here that still
        needed it timed out too, in effect (ENG_ERR_PEER_TIMED_OUT: EngineTimeout)."""
        cdef int p = self.err_peer
        if code == ENG_ERR_PEER_LEFT and self.t != NULL and 0 <= p < self.size and not self.t.said_bye \
                and eng_tcp_departed(self.t, p) == TCP_LEFT_TIMED_OUT:
            return ENG_ERR_PEER_TIMED_OUT
        return code

    cdef object error_text(self, int code):
        cdef int p = self.err_peer, e
        if self.t == NULL:    # released: the group was destroyed
            return _engine_error_text(code, p)
        if code == ENG_ERR_PEER_LEFT and self.t.said_bye and self.broken:
            return (f"rank {self.rank} gave this group up after a failure here (an earlier error says why) while this "
                    "ran, and told its peers so")
        if code == ENG_ERR_PEER_LEFT and self.t.said_bye:
            return f"rank {self.rank} left this group (it was destroyed, or the process is exiting) while this ran"
        if code == ENG_ERR_PEER_TIMED_OUT:
            return (f"{self.who(p)} gave the group up while rank {self.rank} ran this: its call timed out there "
                    "(its own error names the ranks it waited for)")
        lost = self.lost_rank(code)   # (where a peer's goodbye said its group broke over a lost rank: that rank)
        if code == ENG_ERR_PEER_LEFT and 0 <= lost != self.whole_rank(self.rank):
            return (f"{self.whole_who(lost)} was lost: {self.who(p)} saw it end (its process or its link) and gave "
                    f"the group up, while rank {self.rank} ran this; none of the group's collectives can end")
        if code == ENG_ERR_PEER_LEFT and 0 <= p < self.size and eng_tcp_departed(self.t, p) == TCP_LEFT_BROKEN:
            first = eng_tcp_bye_first(self.t, p)   # (the rank whose giving up it followed, where it names one)
            if first == self.whole_rank(self.rank) or self.member(first) == p:
                first = -1
            who = self.whole_who(first) if first >= 0 else self.who(p)
            after = f"; {self.who(p)} gave it up after it" if first >= 0 else ""
            return (f"{who} gave the group up while rank {self.rank} ran this: a call of it failed there (its own "
                    f"error says why: a lost peer, a mismatch) or it was aborted{after}; none of the group's "
                    "collectives can end")
        if code == ENG_ERR_PEER_LEFT:
            return (f"{self.who(p)} left the group (it destroyed it, or its process ended) while rank {self.rank} "
                    "still waited for it: " + ("the ranks did not run the same collectives, or one destroyed the "
                                               "group early" if self.t.ordered else "its sends and receives did not "
                                               "pair with this rank's, or it ended first (its own error, if any, says "
                                               "why)"))
        if code == ENG_ERR_PEER_DEAD:
            e = eng_tcp_peer_errno(self.t, p) if 0 <= p < self.size else 0
            why = f" ({strerror(e).decode()})" if e else ""
            if e in (ETIMEDOUT, EHOSTUNREACH):   # (this kernel gave the connection up: nothing came back on it)
                return (f"the connection to {self.who(p)} timed out here{why} while rank {self.rank} waited: what "
                        "this rank sent it went unacknowledged, so the link to it is cut or its host is down")
            return (f"{self.who(p)} closed its connection{why} without leaving the group while rank {self.rank} "
                    "waited: its process died (killed, crashed), the link to it broke, or it gave the group up "
                    "in the middle of a message (after a failure of its own, which its error names)")
        if code == ENG_ERR_CONNECT:
            e = eng_tcp_peer_errno(self.t, p) if 0 <= p < self.size else 0
            if e == ECONNREFUSED:   # (the host answered: nothing listens there, where the peer listened at the start)
                return (f"could not connect to {self.who(p)}: {strerror(e).decode()}: nothing listens there now, so "
                        "it left the group (destroyed or aborted it) or its process ended (where it never was "
                        "reachable, the address is another host's: ENGINE_SOCKET_IFNAME chooses the interface)")
            return (f"could not connect to {self.who(p)}: {strerror(e).decode() if e else 'failed'} (is that "
                    "address reachable from this host? ENGINE_SOCKET_IFNAME chooses the interface)")
        if code == ENG_ERR_CORRUPT:
            return (f"{self.who(p)} sent a malformed frame: refusing to read it (a bug, or not an engine peer); "
                    "its connection is closed")
        if code == ENG_ERR_NOMEM and p < 0 and self.t.sys_errno in (EMFILE, ENFILE):
            return (f"rank {self.rank} could not accept a peer's connection: {strerror(self.t.sys_errno).decode()}: "
                    "raise the process's limit (ulimit -n) or make fewer groups")
        if code == ENG_ERR_NOMEM and 0 <= p < self.size:
            return (f"out of memory for a message from {self.who(p)} that no receive had asked for yet (it is "
                    "held whole, the size its header says); its connection is closed")
        return _engine_error_text(code, p, self.who(p))


cdef struct MeshWait:
    double deadline
    int missing         # the first peer not yet connected both ways, or -1


cdef int _poll_mesh(void *t, void *arg, bint *done) except -1 nogil:
    """Done once every connection is made both ways, or at the deadline (w.missing names who is not)."""
    cdef MeshWait *w = <MeshWait*>arg
    cdef int code = 0
    w.missing = eng_tcp_mesh_missing(<eng_tcp*>t, &code)
    done[0] = w.missing < 0 or eng_now() >= w.deadline
    return code


cdef class TcpComm(CoreComm):
    """A group over TCP: only the engine's algorithms over point-to-point on `algo` (the core's: the
    ring and recursive doubling of pyx/ring.pxi, the rest of pyx/p2p_collectives.pxi); the user's
    send/recv over `user` (two channels, so a user's any-tag receive never sees the algorithms' messages)."""

    def __cinit__(self, TcpTransport algo, TcpTransport user, size_t ring_segment_bytes):
        self.transport = "tcp"
        self.init_core(algo, user, ring_segment_bytes)
        self.impls |= 1u << IMPL_NATIVE   # the sendrecv entry

    @property
    def algo_transport(self):
        return self.algo_tp

    def leave(self):
        """Tells every peer, on both channels, that this rank leaves the group in order."""
        (<TcpTransport>self.algo_tp).goodbye()
        (<TcpTransport>self.user_tp).goodbye()

    @property
    def user_transport(self):
        return self.user_tp

    def passed(self):
        """The peers that left the group in order (their goodbye came)."""
        return (<TcpTransport>self.algo_tp).departed

    def waiting_on(self):
        """Whom this rank's collective waits on, as the TCP transport sees it (for a timeout's report:
        the store that would name the missing ranks may be out of reach behind a cut link), or None."""
        cdef TcpTransport tp = <TcpTransport>self.algo_tp
        waits = tp.waiting_on()
        if not waits:
            return None
        return "; ".join(f"this rank waits on {tp.who(q)}, " + (f"from which nothing has arrived for {s:.1f} s"
                                                                  if s is not None else "from which nothing ever arrived")
                         for q, s in waits)
