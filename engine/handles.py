"""How the members of a reconfigured group meet: through their reconfigure handles alone, no store.

torch 2.14's contract (ProcessGroup.reconfigure): every process of a group made with
enable_reconfigure=True hands out an opaque handle; a reconfigure names the new members by a list of
handles (a member's rank is its handle's position) and a uuid fresh for every new communicator.

A handle here is a capability: `engine2/<address>/<port>/<secret>/<host>`, the address and port this
process listens on for reconfigures, 16 random bytes only holders of the handle know, and a digest of
its host (engine.bootstrap.host_identity). The hub is the first member of the list whose handle's
address is not a loopback one (the first member where all are): a host whose MASTER_ADDR is
localhost or 127.0.0.1 (torchrun's default on the rendezvous host) hands out loopback handles, which
other hosts can't reach. Every other member connects to the hub and sends a fixed-size hello whose
first field after the magic proves the hub's secret (an HMAC of the hello's other fields; the secret
itself never travels), compared in constant time before anything else the connection sends is read;
then the uuid, its index, the member count and a digest of the whole list (so every member agrees on
the membership and the order). The hub answers with its own proof of the secret over that hello,
which the member checks before it reads anything else: whatever listens at the hub's address (a
process that took its port) learns nothing, and is not believed. The hub then serves a small key-value store
(set / get / check, every length bounds-checked) over those connections for as long as the members
build their communicator through it (engine.bootstrap.StoreBootstrap), exactly as a group made
through torch's store is built: shared memory on one host, the engine's TCP transport across hosts.

A member that dies is named within a second, not at the reconfigure's timeout: the hub probes the
handles of members that have not connected (a handle that refuses connections is a process that
ended, on a host that lives; a loopback handle of another host can't be probed), and a member's connection that closes before it said it is done
(OP_DONE) fails the meeting. The hub then ends its own making and tells every member still connected
why; the members that are done wait for its verdict, so a reconfigure succeeds on all or on none.

A connection that does not prove the secret is closed unread. One for a uuid this hub has not
reached yet is kept for that reconfigure; one for a uuid it already used is told so and closed.
"""

import errno
import hashlib
import hmac
import os
import selectors
import socket
import struct
import threading
import time

from . import forks, tcp

MAGIC = b"ENGRCF3\0"                     # (2: members say when they are done, OP_DONE; 3: proofs, not the secret)
_HELLO = struct.Struct("!8s16sqII32s")   # magic, proof of the secret, uuid, member index, member count, list digest
_PROOF = 16
_REPLY = struct.Struct("!BI")            # status (OK, REFUSED, FAILED), length of the text that follows
_REQ = struct.Struct("!BII")             # op, key length, value length
MAX_KEY = 4096
MAX_VALUE = 16 << 20
MAX_MEMBERS = 1 << 16
HELLO_SECONDS = 10.0                     # an accepted connection must say hello within this
HELLO_ANSWER_GRACE_SECONDS = 2.0         # a member waits for the hub's answer this long past its deadline
MAX_WAIT_SECONDS = 7 * 24 * 3600.0        # the most a member takes from the hub's answer as the hub's time left
ACCEPT_TICK_SECONDS = 0.05               # the hub's accept wait reads abort() this often
PROBE_SECONDS = (1.0, 30.0)              # the hub probes a member not yet connected after 1 s, then ever less often
PROBE_CONNECT_SECONDS = 0.05             # (a refusal comes in one round trip; silence proves nothing)
OP_SET, OP_GET, OP_CHECK, OP_DONE = 1, 2, 3, 4
OK, REFUSED, FAILED = 0, 1, 2            # reply statuses: REFUSED (a hello, or a key not set in time) is the
                                         # member's own mistake or the deadline; FAILED: the reconfigure failed
MAX_PARKED = 256


class HandleError(ValueError):
    """A reconfigure handle that is not one of the engine's, or a list of them that can't form a group."""


def parse_handle(handle):
    """(address, port, secret, host) of a handle; HandleError naming what is wrong."""
    if not isinstance(handle, str):
        raise HandleError(f"a reconfigure handle is a str, got {type(handle).__name__}")
    parts = handle.split("/")
    if len(parts) != 5 or parts[0] != "engine2":
        raise HandleError(f"{handle[:80]!r} is not a reconfigure handle of backend 'engine' (expected "
                          "'engine2/<address>/<port>/<secret>/<host>', as get_reconfigure_handle() returns)")
    try:
        port, secret = int(parts[2]), bytes.fromhex(parts[3])
    except ValueError:
        raise HandleError(f"reconfigure handle {handle!r}: its port or secret is malformed") from None
    if not 0 < port < 65536 or len(secret) != 16 or not parts[4]:
        raise HandleError(f"reconfigure handle {handle!r}: port out of range, secret not 16 bytes or no host")
    return parts[1], port, secret, parts[4]


def this_host():
    """This host, as handles name it: a digest of engine.bootstrap.host_identity()'s host."""
    from .bootstrap import host_identity
    return hashlib.sha256(host_identity()[0].encode()).hexdigest()[:16]


def hub_of(members):
    """The index of the reconfigure's hub among the member handles: the first whose address is not a
    loopback one, else the first (every member derives the same from the same list)."""
    for i, h in enumerate(members):
        if not tcp.is_loopback(parse_handle(h)[0]):
            return i
    return 0


def _proof(secret, side, data):
    """What proves the hub's secret over data, from one side (b"member": a hello; b"hub": its answer)."""
    return hmac.new(secret, side + data, hashlib.sha256).digest()[:_PROOF]


def member_hello(secret, uuid, index, n, digest):
    """A member's hello to the hub: where the secret would go, the proof of the other fields by it (the
    secret never travels: whatever listens at the hub's address, a process that took its port, learns
    nothing it can use)."""
    bare = _HELLO.pack(MAGIC, bytes(_PROOF), uuid, index, n, digest)
    return bare[:8] + _proof(secret, b"member", bare[8 + _PROOF:]) + bare[8 + _PROOF:]


def _recv_exact(sock, n, what):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"{what}: the connection closed")
        got += k
    return bytes(buf)


class Listener:
    """This process's end of reconfigure: a listening socket and the handle that names it."""

    def __init__(self, rendezvous=None):
        addr, self.how = tcp.listen_address(rendezvous=rendezvous)   # (rendezvous: tcp.store_host's)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)   # not inherited by children (PEP 446)
        try:
            self.sock.bind((addr.split("%")[0], 0))
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise RuntimeError(f"engine: can't listen for reconfigures on {addr} (chosen by {self.how}): {exc}; "
                               "set ENGINE_SOCKET_IFNAME to the interface the ranks reach each other on") from None
        self.secret = os.urandom(16)
        self.handle = f"engine2/{addr}/{self.sock.getsockname()[1]}/{self.secret.hex()}/{this_host()}"
        self.parked = {}       # uuid -> {index: (socket, member count, digest)}: hellos for later reconfigures
        self.used = set()      # uuids this hub served (a late hello for one is refused)
        self.failed = {}       # uuid -> why, of the reconfigures that failed here (a late hello hears why)
        self.meeting = None    # the Meeting of the reconfigure in flight, if one is
        self.unsaid = {}       # connections accepted whose hello is still to come (_Hellos)
        forks.track(self)

    def interrupt(self, why):
        """Ends the reconfigure in flight, if one is, with ConnectionError(why) where it waits (abort()
        from another thread); the handle stays valid for the next."""
        meeting = self.meeting
        if meeting is not None:
            meeting.cancel(why)

    def orphan(self, why):
        """In a child forked from this process: its copies of the sockets close (a copy of the listening
        socket would keep the port taken after this process ends, and hellos would wait there unanswered);
        closing them is this process's only, where a shutdown would end the parent's connections. So do
        the connections of a reconfigure in flight at the fork (the parent's meet goes on)."""
        meeting, self.meeting = self.meeting, None
        if meeting is not None:
            for sock in list(meeting.socks) + list(meeting.admitted):
                sock.close()
        self.close()

    def close(self):
        self.sock.close()
        for members in self.parked.values():
            for conn, _, _ in members.values():
                conn.close()
        self.parked.clear()
        for conn in self.unsaid:
            conn.close()
        self.unsaid.clear()

    def accept_members(self, uuid, n, digest, deadline, handles, meeting):
        """The n - 1 authenticated connections of reconfigure uuid: {index: socket}. Where it fails, the
        members that connected are told why."""
        mine = {}
        try:
            return self._accept(mine, uuid, n, digest, deadline, handles, meeting)
        except BaseException as exc:
            why = f"the hub ({_where(self.handle)}) ended this reconfigure: {exc}"
            if len(self.failed) >= MAX_PARKED:
                del self.failed[next(iter(self.failed))]
            self.failed[uuid] = why
            for conn in list(mine.values()) + [c for c, _, _ in self.parked.pop(uuid, {}).values()]:
                _reply(conn, FAILED, why)
                conn.close()
            raise

    def _accept(self, mine, uuid, n, digest, deadline, handles, meeting):
        with _Hellos(self.sock, self.unsaid) as hellos:
            return self._accept_from(hellos, mine, uuid, n, digest, deadline, handles, meeting)

    def _accept_from(self, hellos, mine, uuid, n, digest, deadline, handles, meeting):
        hub = handles.index(self.handle)
        for index, (conn, count, dig) in self.parked.pop(uuid, {}).items():
            self._admit(mine, conn, index, count, dig, n, digest, meeting, hub)
        probe_gap, probe_from = PROBE_SECONDS[0], 0
        probe_at = time.monotonic() + probe_gap
        while len(mine) < n - 1:
            meeting.check()
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                missing = [i for i in range(n) if i != hub and i not in mine]
                raise TimeoutError(f"members {missing} ({', '.join(_where(handles[i]) for i in missing[:4])}) "
                                   "never connected to this rank, the hub")
            if now >= probe_at:
                missing = [i for i in range(n) if i != hub and i not in mine]
                # (a round of probes takes at most 0.2 s, whatever the members' hosts answer, and reads
                # abort() between probes: the rest wait for the next round, which starts where this one stopped)
                probed = 0
                for i in missing[probe_from % len(missing):] + missing[:probe_from % len(missing)]:
                    if time.monotonic() - now > 4 * PROBE_CONNECT_SECONDS:
                        break
                    meeting.check()
                    probed += 1
                    if _refuses(handles[i]):
                        raise ConnectionError(f"member {i} ({_where(handles[i])}) is gone: its handle refuses "
                                              "connections (the process that handed it out ended)")
                probe_from += probed
                probe_gap = min(2 * probe_gap, PROBE_SECONDS[1])
                probe_at = time.monotonic() + probe_gap
            for conn, hello in hellos.poll(min(left, ACCEPT_TICK_SECONDS)):
                try:
                    self._hello(conn, hello, uuid, n, digest, mine, meeting, hub)
                except (OSError, ValueError):
                    conn.close()
        meeting.check()   # (an abort since the last look: the members hear of it from the hub's error)
        meeting.socks.extend(mine.values())
        meeting.admitted = []
        for conn in mine.values():   # (with the seconds this hub gives the meeting: its members wait its verdict so long)
            _reply(conn, OK, f"{max(0.0, deadline - time.monotonic()):.3f}")
        return mine

    def _hello(self, conn, hello, uuid, n, digest, mine, meeting, hub):
        magic, proof, their_uuid, index, count, dig = _HELLO.unpack(hello)
        if magic != MAGIC or not hmac.compare_digest(proof, _proof(self.secret, b"member", hello[8 + _PROOF:])):
            raise ValueError("not a member: wrong magic or secret")
        conn.sendall(_proof(self.secret, b"hub", hello))   # (this hub's, before anything it answers)
        if their_uuid == uuid:
            self._admit(mine, conn, index, count, dig, n, digest, meeting, hub)
        elif their_uuid in self.failed:
            _reply(conn, FAILED, self.failed[their_uuid])
            conn.close()
        elif their_uuid in self.used:
            _reply(conn, REFUSED, f"uuid {their_uuid} was already used by this group's hub: pass a fresh uuid to "
                            "every reconfigure")
            conn.close()
        elif sum(len(v) for v in self.parked.values()) < MAX_PARKED or self._prune_parked():
            before = self.parked.setdefault(their_uuid, {}).get(index)
            if before is not None:   # (the member's hello again, on a new connection: the last one is it)
                before[0].close()
            self.parked[their_uuid][index] = (conn, count, dig)
        else:
            conn.close()

    def _prune_parked(self):
        """With the parked table full: closes the parked members that gave up (their end closed: a member
        of a reconfigure this hub never reached leaves at its deadline), which would otherwise stay until
        the listener closes; returns whether that made room."""
        for uuid, members in list(self.parked.items()):
            for index, (conn, _, _) in list(members.items()):
                if _closed(conn):
                    conn.close()
                    del members[index]
            if not members:
                del self.parked[uuid]
        return sum(len(v) for v in self.parked.values()) < MAX_PARKED

    @staticmethod
    def _admit(mine, conn, index, count, dig, n, digest, meeting, hub):
        if count != n or dig != digest:
            _reply(conn, REFUSED, f"this reconfigure's hub was given {n} handles, and another list than "
                            f"member {index}'s ({count} handles): every member must pass the same handles in the same "
                            "order")
            conn.close()
        elif not 0 <= index < n or index == hub or index in mine:
            _reply(conn, REFUSED, f"member index {index} is out of range or taken twice")
            conn.close()
        else:
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # (a multi_get's replies go back to back)
            mine[index] = conn
            meeting.admitted.append(conn)   # (a fork's child closes its copy)


class _Hellos:
    """The hub's accepted connections that have not said their hello yet, read as their bytes come:
    one that stays silent (anything may connect to the handle's port) holds up neither the members
    behind it nor abort(). One silent for HELLO_SECONDS is closed, as is the one waiting longest when
    MAX_PARKED wait and another comes."""

    def __init__(self, sock, waiting):
        # waiting: socket -> (when it must have said hello, what it said so far), the listener's: a
        # connection accepted in one meeting that has not said its hello when it ends (a member of the
        # next reconfigure, come early) says it to the next
        self.sock, self.waiting = sock, waiting
        sock.setblocking(False)   # (a connection reset between the select and the accept: none to take)
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)
        for conn in waiting:
            self.selector.register(conn, selectors.EVENT_READ)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.selector.close()

    def poll(self, seconds):
        """[(socket, its hello)] of the connections whose hello is complete within seconds; the
        socket is blocking again, and no longer watched."""
        now, done = time.monotonic(), []
        for key, _ in self.selector.select(seconds):
            if key.fileobj is self.sock:
                self._accept(now)
                continue
            conn = key.fileobj
            if conn not in self.waiting:   # (dropped by an accept earlier in this batch to make room)
                continue
            said = self.waiting[conn][1]
            try:
                data = conn.recv(_HELLO.size - len(said))
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._drop(conn)
                continue
            said += data
            if len(said) == _HELLO.size:
                self.selector.unregister(conn)
                del self.waiting[conn]
                conn.setblocking(True)
                done.append((conn, bytes(said)))
        for conn in [c for c, (until, _) in self.waiting.items() if until <= now]:
            self._drop(conn)
        return done

    def _accept(self, now):
        try:
            conn, _ = self.sock.accept()
        except OSError:   # (none to take after all, or out of descriptors: it waits in the backlog for the next try)
            return
        if len(self.waiting) >= MAX_PARKED:
            # (the one waiting longest makes room: a member says its hello as it connects, and a stray
            # client holding silent connections open would otherwise keep every member out)
            self._drop(next(iter(self.waiting)))
        conn.setblocking(False)
        self.waiting[conn] = (now + HELLO_SECONDS, bytearray())
        self.selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn):
        self.selector.unregister(conn)
        del self.waiting[conn]
        conn.close()


def _where(handle):
    try:
        addr, port, _, _ = parse_handle(handle)
        return f"{addr}:{port}"
    except HandleError:
        return "?"


def _refuses(handle):
    """True if the address of handle refuses connections: no process listens there any more (a process
    that lives keeps its handle's socket listening; a connection it does not accept waits in its
    backlog and closes unread). A timeout or an unreachable host proves nothing, nor does a loopback
    address of another host (this host's own answers)."""
    addr, port, _, host = parse_handle(handle)
    if tcp.is_loopback(addr) and host != this_host():
        return False
    try:
        probe = socket.create_connection((addr, port), timeout=PROBE_CONNECT_SECONDS)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    probe.close()
    return False


def _closed(conn):
    """Whether a parked member's connection was closed by its end (after its hello it sends nothing
    until the hub answers: readable means its end, or a reset)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _reply(conn, status, text):
    data = text.encode()
    try:
        conn.sendall(_REPLY.pack(status, len(data)) + data)
    except OSError:
        pass


def _bytes(value):
    return bytes(value if isinstance(value, (bytes, bytearray)) else str(value).encode())


def _check_sizes(klen, vlen):
    if klen > MAX_KEY or vlen > MAX_VALUE:
        raise ValueError(f"a reconfigure store frame of {klen} + {vlen} bytes exceeds the bounds")


class Meeting:
    """One reconfigure's meet as abort() sees it (listener.interrupt): its sockets, shut down on
    cancel, its hub's store, failed on cancel, what the communicator's making registered (on_cancel:
    the TCP transport's connecting), and the reason. It is the listener's from meet() until the meet
    fails or its store is closed (end())."""

    def __init__(self, listener, digest=None):
        self.listener = listener
        self.digest = digest   # the member list's SHA-256, which every member compares (meet)
        self.cancelled = None
        self.lost = None       # why the meeting failed, where a member was lost (HubStore._lost)
        self.socks = []        # the meeting's connections, shut down on cancel
        self.admitted = []     # the hub's members admitted but not yet answered (its accept loop tells them why)
        self.hub = None
        self.cancels = []
        listener.meeting = self

    def on_cancel(self, fn):
        """fn(why) runs when the meeting is cancelled or fails (at once if it did)."""
        self.cancels.append(fn)
        why = self.cancelled or self.lost   # (cancel() and lose() set it before they read the list)
        if why is not None:
            fn(why)

    def lose(self, why):
        """The meeting failed (a member was lost): the making's waits end, as on cancel, but the
        connections stay open, so the members still connected hear why."""
        self.lost = why
        for fn in list(self.cancels):
            fn(why)

    def end(self):
        if self.listener.meeting is self:
            self.listener.meeting = None

    def cancel(self, why):
        self.cancelled = why
        if self.hub is not None:   # (first: the connections' ends, next, are this abort's, not members lost)
            self.hub.fail(why)
        for sock in list(self.socks):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for fn in list(self.cancels):
            fn(why)

    def check(self):
        if self.cancelled is not None:
            raise ConnectionError(self.cancelled)


class HubStore:
    """The hub's key-value store: the hub's own calls in process, the members' over their connections,
    each served by a thread of its own until the member says it is done (OP_DONE).

    A member whose connection closes (or fails) before that failed or died: the meeting fails
    (_lost), the hub's own making ends, and every request that would wait is answered with why
    (FAILED); keys already set are still given, so a member reading one learns what the failed rank
    itself said. The threads go on answering until their members close, for a second at most after
    close(); close() alone closes the connections, once the threads are done with them.

    A member that said it is done waits for the verdict, which close() gives once every member is
    done (OK) or the meeting failed (FAILED, why): a reconfigure succeeds on every member or on none
    (a member left out would find its group broken at its first call)."""

    def __init__(self, conns, deadline, meeting, handles):
        self.meeting = meeting
        self.data = {}
        self.cv = threading.Condition()
        self.deadline = deadline
        self.error = None
        self.threads = [threading.Thread(target=self._serve, args=(c, f"member {i} ({_where(handles[i])})"),
                                         name="engine-reconfigure-hub", daemon=True) for i, c in conns.items()]
        self.conns = list(conns.values())
        self.serving = len(self.conns)   # members not yet done (nor gone)
        self.finished = []                # the connections of members that are done: they wait for the verdict
        self.closing = False              # close() shuts the connections: a member's end is no news then
        meeting.hub = self   # (once fail() can run: an abort() from another thread calls it from here on)
        for t in self.threads:
            t.start()

    def set(self, key, value):
        with self.cv:
            self.data[key] = _bytes(value)
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            while key not in self.data:
                left = self.deadline - time.monotonic()
                if self.error is not None:
                    raise ConnectionError(f"{self.error} (while waiting for {key!r})")
                if left <= 0:
                    raise TimeoutError(f"reconfigure: no member set {key!r} in time")
                self.cv.wait(min(left, 0.5))
            return self.data[key]

    def check(self, keys):
        with self.cv:
            return all(k in self.data for k in keys)

    def fail(self, why):
        with self.cv:
            self.error = self.error or why
            self.cv.notify_all()

    def _lost(self, why):
        """A member failed or died before the group was made: so does the meeting."""
        with self.cv:
            if self.closing or self.error is not None:
                return
            self.error = why
            self.cv.notify_all()
        self.meeting.lose(why)

    def _serve(self, conn, member):
        try:
            while True:
                try:
                    head = conn.recv(_REQ.size, socket.MSG_WAITALL)
                except OSError:
                    head = b""
                if len(head) < _REQ.size:
                    self._lost(f"reconfigure: {member} closed its connection before the group was made: it gave "
                               "the making up (a failure, or its own deadline passed: its error says which) or died")
                    return
                op, klen, vlen = _REQ.unpack(head)
                if (op == OP_DONE and klen) or (op != OP_SET and vlen):   # (bytes that would be read as a request)
                    raise ValueError(f"request {op} announces {klen} + {vlen} bytes it does not carry")
                if op == OP_DONE:
                    with self.cv:
                        self.finished.append(conn)   # (close() alone writes to it from now on)
                    return
                if op not in (OP_SET, OP_GET, OP_CHECK):
                    raise ValueError(f"unknown request {op}")
                _check_sizes(klen, vlen)
                key = _recv_exact(conn, klen, "key").decode()
                if op == OP_SET:
                    self.set(key, _recv_exact(conn, vlen, "value"))
                    conn.sendall(_REPLY.pack(OK, 0))
                elif op == OP_CHECK:
                    conn.sendall(_REPLY.pack(OK, 1) + b"\1" if self.check(key.split("\0")) else _REPLY.pack(OK, 0))
                else:
                    try:
                        data = self.get(key)
                    except (TimeoutError, ConnectionError) as exc:
                        _reply(conn, REFUSED if isinstance(exc, TimeoutError) else FAILED, str(exc))
                        return
                    conn.sendall(_REPLY.pack(OK, len(data)) + data)
        except (OSError, ValueError, ConnectionError, UnicodeDecodeError) as exc:
            self._lost(f"reconfigure: {member}'s connection failed before the group was made: {exc}")
        finally:
            with self.cv:
                self.serving -= 1
                self.cv.notify_all()

    def close(self, deadline, made=True):
        """Waits (until deadline) for every member to say it is done: they may still read keys. Where
        the meeting failed, or this hub did not make its end (made=False), the members still connected
        are given a second to hear why (their requests are answered so), no more. Raises
        ConnectionError where the meeting failed after this hub made its end: the group can't work."""
        if not made:
            self.fail(f"reconfigure: the hub ({_where(self.meeting.listener.handle)}) could not make its "
                      "end of the group")
        with self.cv:
            while self.serving and self.error is None and time.monotonic() < deadline:
                self.cv.wait(max(0.0, deadline - time.monotonic()))
            if self.serving and self.error is None:
                self.error = f"reconfigure: {self.serving} member(s) did not make their end of the group in time"
            told = time.monotonic() + 1.0
            while self.serving and self.error is not None and time.monotonic() < told:
                self.cv.wait(max(0.0, told - time.monotonic()))
            self.closing = True
            why = self.error
        for c in self.finished:
            c.settimeout(1.0)   # (a member that stopped reading must not hold the hub)
            _reply(c, OK if why is None else FAILED, why or "")
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(1.0)
        for c in self.conns:
            c.close()
        self.meeting.end()
        if made and why is not None:
            raise ConnectionError(why)


def _connect(addr, port, seconds, meeting):
    """A connection to addr:port within seconds, made in ticks that read abort() (meeting.check): a
    blocking connect can't be interrupted, and a host that is gone (its SYNs unanswered) would hold
    it for the reconfigure's whole timeout."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        err = sock.connect_ex(where)
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_WRITE)
            while err in (errno.EINPROGRESS, errno.EAGAIN):
                meeting.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("timed out")
                if sel.select(min(left, ACCEPT_TICK_SECONDS)):
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        sock.setblocking(True)
        return sock
    except BaseException:
        sock.close()
        raise


class MemberStore:
    """A member's side of the hub's store (torch's Store API as StoreBootstrap uses it)."""

    def __init__(self, hub_handle, uuid, index, n, digest, deadline, meeting):
        addr, port, secret, _ = parse_handle(hub_handle)
        self.where = f"{addr}:{port}"
        self.deadline = deadline
        self.meeting = meeting
        try:
            self.sock = _connect(addr, port, max(0.1, deadline - time.monotonic()), meeting)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # (a multi_get's replies come back to back)
        except OSError as exc:
            if isinstance(exc, ConnectionError) and meeting.cancelled is not None:
                raise
            raise ConnectionError(f"can't reach the hub's handle at {self.where} ({exc.strerror or exc}): "
                                  "is that process gone?") from None
        meeting.socks.append(self.sock)
        try:
            meeting.check()   # (cancelled while connecting: its shutdown missed this socket)
            hello = member_hello(secret, uuid, index, n, digest)
            self.sock.sendall(hello)
        except BaseException:
            self.sock.close()
            raise
        # (past the deadline by a grace: the hub, which started about when this rank did, answers at its own
        # deadline why it gave up, naming the members that never came)
        self.sock.settimeout(max(0.1, deadline - time.monotonic()) + HELLO_ANSWER_GRACE_SECONDS)
        try:
            what = "the hub's answer to this rank's hello"
            if not hmac.compare_digest(self._read(_PROOF, what), _proof(secret, b"hub", hello)):
                raise ConnectionError(f"the process at the hub's handle ({self.where}) did not prove the handle's "
                                      "secret: it is not the hub (another process took its port after it ended?)")
            left = self._answer(what, refused=RuntimeError)
            self.verdict_by = max(deadline, time.monotonic() + _seconds(left))   # (the hub's deadline, if later)
        except TimeoutError as exc:
            self.sock.close()
            raise TimeoutError(f"{exc}: it still waits for other members to connect, or it is stuck") from None
        except BaseException:
            self.sock.close()
            raise

    def _answer(self, what, refused):
        """The hub's reply's text; raises what a status other than OK says: ConnectionError where the
        reconfigure failed (FAILED), `refused` where the hub turned this request down (REFUSED)."""
        status, text = self._reply(what)
        if status != OK:
            raise (ConnectionError if status == FAILED else refused)(text.decode(errors="replace"))
        return text

    def _reply(self, what):
        status, length = _REPLY.unpack(self._read(_REPLY.size, what))
        _check_sizes(0, length)
        return status, self._read(length, what)

    def _read(self, n, what):
        try:
            return _recv_exact(self.sock, n, what)
        except socket.timeout:
            raise TimeoutError(f"{what}: the hub ({self.where}) did not answer in time") from None
        except ConnectionError:
            self.meeting.check()
            raise ConnectionError(f"{what}: the hub ({self.where}) closed the connection: it failed or "
                                  "was aborted") from None

    @staticmethod
    def _frame(op, key, value=b""):
        k = key.encode()
        _check_sizes(len(k), len(value))
        return _REQ.pack(op, len(k), len(value)) + k + value

    def _send(self, data):
        self.meeting.check()
        self.sock.settimeout(max(0.1, self.deadline - time.monotonic()))
        try:
            self.sock.sendall(data)
        except OSError:
            self.meeting.check()
            raise

    def _call(self, op, key, value=b""):
        self._send(self._frame(op, key, value))
        return self._answer(f"reconfigure store {key!r}", refused=TimeoutError)

    def set(self, key, value):
        self._call(OP_SET, key, _bytes(value))

    def get(self, key):
        return self._call(OP_GET, key)

    def multi_get(self, keys):
        """The values of keys, each once it is set (until the deadline), in one round trip: every request
        goes out before the first reply is read (the hub answers a connection's requests in order)."""
        self._send(b"".join(self._frame(OP_GET, k) for k in keys))
        return [self._answer(f"reconfigure store {k!r}", refused=TimeoutError) for k in keys]

    def check(self, keys):
        return self._call(OP_CHECK, "\0".join(keys)) != b""  # length 1 (yes) or 0 (no)

    def close(self, deadline=None, made=True):
        """made: this rank made its end of the group: it says so (OP_DONE) and waits for the hub's
        verdict, ConnectionError or TimeoutError where the meeting failed. A member that closes without
        it has failed, and the hub ends the meeting for every member."""
        try:
            if made:
                # (the verdict comes at the hub's deadline at the latest, which may fall after this rank's:
                # a member that gave up on it sooner would fail alone, the others succeeding)
                self.sock.settimeout(max(0.1, max(deadline or self.deadline, self.verdict_by) - time.monotonic())
                                     + HELLO_ANSWER_GRACE_SECONDS)
                try:
                    self.sock.sendall(_REQ.pack(OP_DONE, 0, 0))
                except OSError:
                    self.meeting.check()
                    raise ConnectionError(f"the hub ({self.where}) closed the connection: it failed or was "
                                          "aborted") from None
                self._answer("the hub's word that every member made its end", refused=ConnectionError)
        finally:
            self.sock.close()
            self.meeting.end()


def _seconds(text):
    """The hub's seconds left, from its answer to a hello: bounded (a hub of an older release says none)."""
    try:
        return min(max(float(text), 0.0), MAX_WAIT_SECONDS)
    except ValueError:
        return 0.0


def order(handles):
    """The member list of a reconfigure: a list keeps its order (rank = position); a set is sorted, so
    every member derives the same ranks. HandleError on a duplicate or a foreign handle."""
    members = sorted(handles) if isinstance(handles, (set, frozenset)) else list(handles)
    if not members:
        raise HandleError("reconfigure needs at least one handle (this rank's own)")
    if len(members) > MAX_MEMBERS:
        raise HandleError(f"{len(members)} handles exceed the limit of {MAX_MEMBERS}")
    seen = set()
    for h in members:
        parse_handle(h)
        if h in seen:
            raise HandleError(f"handle {h!r} is listed twice: each member's handle once")
        seen.add(h)
    return members


def meet(listener, uuid, handles, timeout, aborted=None):
    """(store, index, n): the rendezvous store of reconfigure `uuid` among `handles`, this process's
    index among them, their count. The caller builds its communicator through the store, then calls
    store.close(deadline). aborted: why the caller was aborted since it began, else None, asked once
    the meeting can hear of an abort (listener.interrupt): one that came before found none to end."""
    if not -(1 << 63) <= uuid < 1 << 63:   # (every member's hello carries it as an int64)
        raise ValueError(f"reconfigure uuid {uuid} is outside int64's range: pass one from -2**63 to 2**63 - 1")
    members = order(handles)
    if listener.handle not in members:
        raise HandleError("this rank's own handle (get_reconfigure_handle()) is not among the handles passed to "
                          "reconfigure: every member passes the same list, itself included")
    index, n, hub = members.index(listener.handle), len(members), hub_of(members)
    digest = hashlib.sha256("\n".join(members).encode()).digest()
    deadline = time.monotonic() + timeout
    if uuid in listener.used:
        raise RuntimeError(f"reconfigure uuid {uuid} was already used by this group: pass a fresh uuid to every "
                           "reconfigure")
    meeting = Meeting(listener, digest)
    why = aborted() if aborted is not None else None
    if why is not None:
        meeting.cancel(why)
    try:
        if index == hub:
            conns = listener.accept_members(uuid, n, digest, deadline, members, meeting) if n > 1 else {}
            listener.used.add(uuid)
            store = HubStore(conns, deadline, meeting, members)
            if meeting.cancelled is not None:   # (cancelled before the hub could hear of it)
                store.fail(meeting.cancelled)
                store.close(deadline, made=False)
                meeting.check()
            return store, index, n
        listener.used.add(uuid)
        return MemberStore(members[hub], uuid, index, n, digest, deadline, meeting), index, n
    except BaseException:
        meeting.end()
        raise
