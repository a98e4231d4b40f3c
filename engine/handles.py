"""How the members of a reconfigured group meet: through their reconfigure handles alone, no store.

torch 2.14's contract (ProcessGroup.reconfigure): every process of a group made with
enable_reconfigure=True hands out an opaque handle; a reconfigure names the new members by a list of
handles (a member's rank is its handle's position) and a uuid fresh for every new communicator.

A handle here is a capability: `engine1/<address>/<port>/<secret>`, the address and port this
process listens on for reconfigures, and 16 random bytes only holders of the handle know. The first
member of the list is the hub: every other member connects to it and sends a fixed-size hello whose
first field after the magic is the hub's secret, compared in constant time before anything else the
connection sends is read; then the uuid, its index, the member count and a digest of the whole list
(so every member agrees on the membership and the order). The hub then serves a small key-value store
(set / get / check, every length bounds-checked) over those connections for as long as the members
build their communicator through it (engine.bootstrap.StoreBootstrap), exactly as a group made
through torch's store is built: shared memory on one host, the engine's TCP transport across hosts.

A member that dies is named at once, not at the reconfigure's timeout: the hub probes the handles of
members that have not connected (a handle that refuses connections is a process that ended, on a host
that lives), and a member's connection that closes before it said it is done (OP_DONE) fails the
meeting. The hub then tells every member why, and ends its own making.

A connection that does not prove the secret is closed unread. One for a uuid this hub has not
reached yet is kept for that reconfigure; one for a uuid it already used is told so and closed.
"""

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

from . import forks, tcp

MAGIC = b"ENGRCF1\0"
_HELLO = struct.Struct("!8s16sqII32s")   # magic, hub secret, uuid, member index, member count, list digest
_REPLY = struct.Struct("!BI")            # status (OK, REFUSED, FAILED), length of the text that follows
_REQ = struct.Struct("!BII")             # op, key length, value length
MAX_KEY = 4096
MAX_VALUE = 16 << 20
MAX_MEMBERS = 1 << 16
HELLO_SECONDS = 10.0                     # an accepted connection must say hello within this
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
    """(address, port, secret) of a handle; HandleError naming what is wrong."""
    if not isinstance(handle, str):
        raise HandleError(f"a reconfigure handle is a str, got {type(handle).__name__}")
    parts = handle.split("/")
    if len(parts) != 4 or parts[0] != "engine1":
        raise HandleError(f"{handle[:80]!r} is not a reconfigure handle of backend 'engine' (expected "
                          "'engine1/<address>/<port>/<secret>', as get_reconfigure_handle() returns)")
    try:
        port, secret = int(parts[2]), bytes.fromhex(parts[3])
    except ValueError:
        raise HandleError(f"reconfigure handle {handle!r}: its port or secret is malformed") from None
    if not 0 < port < 65536 or len(secret) != 16:
        raise HandleError(f"reconfigure handle {handle!r}: port out of range or secret not 16 bytes")
    return parts[1], port, secret


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

    def __init__(self):
        addr, self.how = tcp.listen_address()
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
        self.handle = f"engine1/{addr}/{self.sock.getsockname()[1]}/{self.secret.hex()}"
        self.parked = {}       # uuid -> {index: (socket, member count, digest)}: hellos for later reconfigures
        self.used = set()      # uuids this hub served (a late hello for one is refused)
        self.meeting = None    # the Meeting of the reconfigure in flight, if one is
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
            for sock in list(meeting.socks):
                sock.close()
        self.close()

    def close(self):
        self.sock.close()
        for members in self.parked.values():
            for conn, _, _ in members.values():
                conn.close()
        self.parked.clear()

    def accept_members(self, uuid, n, digest, deadline, handles, meeting):
        """The n - 1 authenticated connections of reconfigure uuid: {index: socket}. Where it fails, the
        members that connected are told why."""
        mine = {}
        try:
            return self._accept(mine, uuid, n, digest, deadline, handles, meeting)
        except BaseException as exc:
            for conn in mine.values():
                _reply(conn, FAILED, f"the first member ({_where(handles[0])}) ended this reconfigure: {exc}")
                conn.close()
            raise

    def _accept(self, mine, uuid, n, digest, deadline, handles, meeting):
        for index, (conn, count, dig) in self.parked.pop(uuid, {}).items():
            self._admit(mine, conn, index, count, dig, n, digest)
        probe_gap, probe_from = PROBE_SECONDS[0], 0
        probe_at = time.monotonic() + probe_gap
        while len(mine) < n - 1:
            meeting.check()
            now = time.monotonic()
            left = deadline - now
            missing = [i for i in range(1, n) if i not in mine]
            if left <= 0:
                raise TimeoutError(f"members {missing} ({', '.join(_where(handles[i]) for i in missing[:4])}) "
                                   "never connected to this rank, the first member")
            if now >= probe_at:
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
            self.sock.settimeout(min(left, ACCEPT_TICK_SECONDS))
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            try:
                self._hello(conn, uuid, n, digest, mine)
            except (OSError, ConnectionError, ValueError):
                conn.close()
        for conn in mine.values():
            meeting.socks.append(conn)
            _reply(conn, OK, "")
        return mine

    def _hello(self, conn, uuid, n, digest, mine):
        conn.settimeout(HELLO_SECONDS)
        magic, secret, their_uuid, index, count, dig = _HELLO.unpack(_recv_exact(conn, _HELLO.size, "hello"))
        if magic != MAGIC or not hmac.compare_digest(secret, self.secret):
            raise ValueError("not a member: wrong magic or secret")
        if their_uuid == uuid:
            self._admit(mine, conn, index, count, dig, n, digest)
        elif their_uuid in self.used:
            _reply(conn, REFUSED, f"uuid {their_uuid} was already used by this group's first member: pass a fresh uuid to "
                            "every reconfigure")
            conn.close()
        elif sum(len(v) for v in self.parked.values()) < MAX_PARKED:
            self.parked.setdefault(their_uuid, {})[index] = (conn, count, dig)
        else:
            conn.close()

    @staticmethod
    def _admit(mine, conn, index, count, dig, n, digest):
        if count != n or dig != digest:
            _reply(conn, REFUSED, f"this reconfigure's first member was given {n} handles, and another list than "
                            f"member {index}'s ({count} handles): every member must pass the same handles in the same "
                            "order")
            conn.close()
        elif not 1 <= index < n or index in mine:
            _reply(conn, REFUSED, f"member index {index} is out of range or taken twice")
            conn.close()
        else:
            conn.settimeout(None)
            mine[index] = conn


def _where(handle):
    try:
        addr, port, _ = parse_handle(handle)
        return f"{addr}:{port}"
    except HandleError:
        return "?"


def _refuses(handle):
    """True if the address of handle refuses connections: no process listens there any more (a process
    that lives keeps its handle's socket listening; a connection it does not accept waits in its
    backlog and closes unread). A timeout or an unreachable host proves nothing."""
    addr, port, _ = parse_handle(handle)
    try:
        probe = socket.create_connection((addr, port), timeout=PROBE_CONNECT_SECONDS)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    probe.close()
    return False


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

    def __init__(self, listener):
        self.listener = listener
        self.cancelled = None
        self.socks = []
        self.hub = None
        self.cancels = []
        listener.meeting = self

    def on_cancel(self, fn):
        """fn(why) runs when the meeting is cancelled (at once if it was)."""
        self.cancels.append(fn)
        if self.cancelled is not None:   # (cancel() sets it before it reads the list)
            fn(self.cancelled)

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

    A member whose connection closes before that failed or died: the meeting fails (_lost). Then, or
    where the hub could not make its end, close() tells every member still connected why: a FAILED
    reply is queued on its connection, which the member reads as the answer to its next request, and
    the hub stops answering (it still reads what comes, so its close never resets a connection, which
    would throw the reply away before the member read it)."""

    def __init__(self, conns, deadline, meeting, handles):
        self.meeting = meeting
        meeting.hub = self
        self.data = {}
        self.cv = threading.Condition()
        self.deadline = deadline
        self.error = None
        self.threads = [threading.Thread(target=self._serve, args=(c, f"member {i} ({_where(handles[i])})"),
                                         name="engine-reconfigure-hub", daemon=True) for i, c in conns.items()]
        self.conns = list(conns.values())
        self.serving = len(self.conns)   # members not yet done
        self.answering = 0                # requests being answered
        self.closing = False              # close() began: the threads answer nothing more, and it closes
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

    def _lost(self, member):
        """A member's connection closed before it said it was done: it failed or died, and the group
        can't be made. The hub's own waits end (its store's and its transport's making)."""
        why = f"reconfigure: {member} closed its connection before the group was made: it failed or died"
        with self.cv:
            if self.closing or self.error is not None:
                return
            self.error = why
            self.cv.notify_all()
        for fn in list(self.meeting.cancels):
            fn(why)

    def _serve(self, conn, member):
        try:
            while True:
                try:
                    head = conn.recv(_REQ.size, socket.MSG_WAITALL)
                except OSError:
                    head = b""
                if len(head) < _REQ.size:
                    self._lost(member)
                    return
                op, klen, vlen = _REQ.unpack(head)
                if op == OP_DONE:
                    return
                if op not in (OP_SET, OP_GET, OP_CHECK):
                    raise ValueError(f"unknown request {op}")
                _check_sizes(klen, vlen)
                key = _recv_exact(conn, klen, "key").decode()
                value = _recv_exact(conn, vlen, "value") if op == OP_SET else None
                with self.cv:
                    if self.closing:
                        continue   # (close() told this member why)
                    self.answering += 1
                try:
                    self._answer(conn, op, key, value)
                finally:
                    with self.cv:
                        self.answering -= 1
                        self.cv.notify_all()
        except (OSError, ValueError, ConnectionError, UnicodeDecodeError) as exc:
            self.fail(f"reconfigure: {member}'s connection failed: {exc}")
        finally:
            with self.cv:
                self.serving -= 1
                self.cv.notify_all()
                mine = not self.closing   # (else close() closes it)
            if mine:
                conn.close()

    def _answer(self, conn, op, key, value):
        if op == OP_SET:
            self.set(key, value)
            conn.sendall(_REPLY.pack(OK, 0))
        elif op == OP_GET:
            try:
                data = self.get(key)
            except (TimeoutError, ConnectionError) as exc:
                _reply(conn, REFUSED if isinstance(exc, TimeoutError) else FAILED, str(exc))
                return
            conn.sendall(_REPLY.pack(OK, len(data)) + data)
        else:
            conn.sendall(_REPLY.pack(OK, 1) + b"\1" if self.check(key.split("\0")) else _REPLY.pack(OK, 0))

    def close(self, deadline, made=True):
        """Waits (until deadline) for every member to say it is done: they may still read keys. Where
        the meeting failed, or this hub did not make its end (made=False), it waits for none: each
        member still connected is told why, and given a second to read it."""
        if not made:
            self.fail(f"reconfigure: the first member ({_where(self.meeting.listener.handle)}) could not make its "
                      "end of the group")
        with self.cv:
            while self.serving and self.error is None and time.monotonic() < deadline:
                self.cv.wait(max(0.0, deadline - time.monotonic()))
            told = min(deadline, time.monotonic() + 1.0)
            while self.answering and time.monotonic() < told:   # (answers in flight go first)
                self.cv.wait(max(0.0, told - time.monotonic()))
            self.closing = True
            why = self.error
        if why is not None:
            for c in self.conns:
                _reply(c, FAILED, why)
                try:
                    c.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            for t in self.threads:   # (each ends when its member, told, closes)
                t.join(max(0.0, told - time.monotonic()))
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


class MemberStore:
    """A member's side of the hub's store (torch's Store API as StoreBootstrap uses it)."""

    def __init__(self, hub_handle, uuid, index, n, digest, deadline, meeting):
        addr, port, secret = parse_handle(hub_handle)
        self.where = f"{addr}:{port}"
        self.deadline = deadline
        self.meeting = meeting
        left = max(0.1, deadline - time.monotonic())
        try:
            self.sock = socket.create_connection((addr, port), timeout=left)
        except OSError as exc:
            raise ConnectionError(f"can't reach the first member's handle at {self.where} ({exc.strerror or exc}): "
                                  "is that process gone?") from None
        meeting.socks.append(self.sock)
        meeting.check()   # (cancelled while connecting: its shutdown missed this socket)
        self.sock.sendall(_HELLO.pack(MAGIC, secret, uuid, index, n, digest))
        self.sock.settimeout(max(0.1, deadline - time.monotonic()))
        status, text = self._reply("the first member's answer to this rank's hello")
        if status != OK:
            self.sock.close()
            raise (ConnectionError if status == FAILED else RuntimeError)(text.decode(errors="replace"))

    def _reply(self, what):
        try:
            status, length = _REPLY.unpack(_recv_exact(self.sock, _REPLY.size, what))
            _check_sizes(0, length)
            return status, _recv_exact(self.sock, length, what)
        except socket.timeout:
            raise TimeoutError(f"{what}: the first member ({self.where}) did not answer in time") from None
        except ConnectionError:
            self.meeting.check()
            raise ConnectionError(f"{what}: the first member ({self.where}) closed the connection: it failed or "
                                  "was aborted") from None

    def _call(self, op, key, value=b""):
        k = key.encode()
        _check_sizes(len(k), len(value))
        self.meeting.check()
        self.sock.settimeout(max(0.1, self.deadline - time.monotonic()))
        try:
            self.sock.sendall(_REQ.pack(op, len(k), len(value)) + k + value)
        except OSError:
            self.meeting.check()
            raise
        status, data = self._reply(f"reconfigure store {key!r}")
        if status != OK:
            raise (ConnectionError if status == FAILED else TimeoutError)(data.decode(errors="replace"))
        return data

    def set(self, key, value):
        self._call(OP_SET, key, _bytes(value))

    def get(self, key):
        return self._call(OP_GET, key)

    def check(self, keys):
        return self._call(OP_CHECK, "\0".join(keys)) != b""  # length 1 (yes) or 0 (no)

    def close(self, deadline=None, made=True):
        """made: this rank made its end of the group, so the hub may stop waiting for it (OP_DONE); a
        member that closes without it has failed, and the hub ends the meeting for everyone."""
        if made:
            try:
                self.sock.settimeout(1.0)
                self.sock.sendall(_REQ.pack(OP_DONE, 0, 0))
            except OSError:
                pass
        self.sock.close()
        self.meeting.end()


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


def meet(listener, uuid, handles, timeout):
    """(store, index, n): the rendezvous store of reconfigure `uuid` among `handles`, this process's
    index among them, their count. The caller builds its communicator through the store, then calls
    store.close(deadline)."""
    members = order(handles)
    if listener.handle not in members:
        raise HandleError("this rank's own handle (get_reconfigure_handle()) is not among the handles passed to "
                          "reconfigure: every member passes the same list, itself included")
    index, n = members.index(listener.handle), len(members)
    digest = hashlib.sha256("\n".join(members).encode()).digest()
    deadline = time.monotonic() + timeout
    if uuid in listener.used:
        raise RuntimeError(f"reconfigure uuid {uuid} was already used by this group: pass a fresh uuid to every "
                           "reconfigure")
    meeting = Meeting(listener)
    try:
        if index == 0:
            conns = listener.accept_members(uuid, n, digest, deadline, members, meeting) if n > 1 else {}
            listener.used.add(uuid)
            store = HubStore(conns, deadline, meeting, members)
            meeting.check()   # (cancelled before the hub could hear of it)
            return store, index, n
        listener.used.add(uuid)
        return MemberStore(members[0], uuid, index, n, digest, deadline, meeting), index, n
    except BaseException:
        meeting.end()
        raise
