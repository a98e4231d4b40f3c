"""The TCP transport's wire, checked from one process against a peer written here byte by byte
(pyx/tcp.h's format): connections that don't prove the group's token are closed before anything they
send is read; every length on the wire is checked; messages split over streams, arriving out of order
or from a peer that dies mid-message end as the protocol says. The transport's behaviour between
real ranks is tests/mpi/tcp_suite.py's (tests/test_hosts.py)."""

import gc
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import _core
from engine.watch import EngineError, EnginePeerLost
from p2p_watch import Deadline, receive_until_it_ends

MAGIC, VERSION, HDR = 0x54474E45, 3, 32
MSG, PART, BYE = 0x2147534D, 0x54524150, 0x21455942
HELLO = 48
TOKEN = bytes(range(16))


def hello(token=TOKEN, frm=1, to=0, channel=1, stream=0, nstreams=1, size=2):
    """A hello proving `token`: where its token field is, the proof of its other fields."""
    fields = (frm, to, channel, stream, nstreams, size)
    bare = struct.pack("<IHH16sIIIIII", MAGIC, VERSION, HDR, bytes(16), *fields)
    return struct.pack("<IHH16sIIIIII", MAGIC, VERSION, HDR, _core.tcp_proof(token, bare), *fields)


def back_bye(frm, stream, to=0, channel=1, token=TOKEN):
    """A goodbye written back on stream `stream` of a connection rank `to` made to rank `frm`, proved."""
    bye = header(BYE, 0, 0, 0, 0)
    return bye + _core.tcp_proof(token, bye + struct.pack("<IIII", frm, to, channel, stream))


def header(kind, tag, seq, a, b):
    return struct.pack("<IiQQQ", kind, tag, seq, a, b)


def group_of(size, collective_user_channel=False, nstreams=2, split_min=1 << 20):
    """Rank 0 of a group of `size` whose other ranks are this test: (core, their listeners (None for
    rank 0), rank 0's ports). collective_user_channel: the user's channel fails every request when a peer
    crashes (fail_any), as the collectives' channel does, so that tests can drive that rule by send/recv."""
    fakes = [None] + [socket.socket() for _ in range(size - 1)]
    for f in fakes[1:]:
        f.bind(("127.0.0.1", 0))
        f.listen(16)
    ports, transports = [], []
    for ch in range(2):
        fd, port = _core.tcp_listen("127.0.0.1")
        ports.append(port)
        peers = [("127.0.0.1", port, "rank0")] + [("127.0.0.1", f.getsockname()[1], f"rank{q}")
                                                   for q, f in enumerate(fakes) if f is not None]
        transports.append(_core.TcpTransport(0, size, ch, fd, TOKEN, peers, nstreams=nstreams, split_min=split_min,
                                             eager_max=64 << 10, fail_any=ch == 0 or collective_user_channel))
    core = _core.TcpComm(transports[0], transports[1], 1 << 16)
    core.set_watch(Deadline(), 0.05, p2p=Deadline())
    return core, fakes, ports


@pytest.mark.parametrize("port", [0, 65536 + 80, -1, 1 << 31])
def test_a_peer_port_outside_the_port_range_is_refused_naming_the_rank(port):
    """A port read from the store that no socket has: refused, where getaddrinfo took 65616 as 80."""
    fd, own = _core.tcp_listen("127.0.0.1")
    try:
        with pytest.raises(ValueError, match=rf"rank 1's port {port} \(from the group's store\) is outside 1-65535"):
            _core.TcpTransport(0, 2, 0, fd, TOKEN, [("127.0.0.1", own, "rank0"), ("127.0.0.1", port, "rank1")])
    finally:
        _core.close_fd(fd)


def test_a_group_larger_than_the_poll_table_can_name_is_refused():
    """The poll table's events name a rank in 20 bits: a group of 2**20 ranks would have its last
    rank's events read as rank 0's."""
    fd, own = _core.tcp_listen("127.0.0.1")
    try:
        with pytest.raises(ValueError, match=r"a TCP group has 1\.\.1048575 ranks, got 1048576"):
            _core.TcpTransport(0, 1 << 20, 0, fd, TOKEN, [("127.0.0.1", own, "rank0")] * (1 << 20))
    finally:
        _core.close_fd(fd)


@pytest.fixture
def rank0():
    """Rank 0 of a group of 2 whose rank 1 is this test: (core, rank 1's listener, rank 0's ports)."""
    core, fakes, ports = group_of(2)
    yield core, fakes[1], ports
    fakes[1].close()


@pytest.fixture
def trio():
    """Rank 0 of a group of 3 whose ranks 1 and 2 are this test, every channel failing at a crash."""
    core, fakes, ports = group_of(3, collective_user_channel=True)
    yield core, fakes, ports
    for f in fakes[1:]:
        f.close()


def recv_exact(sock, n):
    sock.settimeout(5)
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        assert more, f"the connection ended after {len(got)} of {n} bytes"
        got += more
    return got


def connect(port, data=b""):
    s = socket.create_connection(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def drive(request, until, seconds=5.0):
    """Polls request (progress happens inside test()) until until() or the deadline."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        request.test()
        if until():
            return True
        time.sleep(0.01)
    return False


def closed_by_peer(sock):
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


# Each field of a hello, right (rank 1 to rank 0 of a group of 2, on the user's channel) or wrong (the
# token: the one its proof is made with; "proof": one made before a field changed, the one given here).
HELLO_FIELDS = {"magic": [MAGIC, MAGIC ^ 1], "version": [VERSION, 2, 4], "hdr": [HDR, 16],
                "token": [TOKEN, bytes(16)], "frm": [1, 0, 2, 1 << 31], "to": [0, 1, 7], "channel": [1, 0, 2],
                "stream": [0, 1, 2, 16], "nstreams": [1, 0, 17], "size": [2, 1, 3],
                "proof": [None, ("size", 3), ("frm", 0), ("channel", 0)]}


def hello_of(fields):
    """The hello of HELLO_FIELDS-like fields: its token field the proof of the others by fields["token"]
    (made before fields["proof"]'s change, where one is named)."""
    values = {k: v for k, v in fields.items() if k not in ("token", "proof")}
    bare = dict(values)
    if fields["proof"] is not None:
        name, value = fields["proof"]
        bare[name] = values[name] ^ 1 if value == values[name] else value

    def pack(f, token):
        return struct.pack("<IHH16sIIIIII", f["magic"], f["version"], f["hdr"], token, f["frm"], f["to"], f["channel"],
                           f["stream"], f["nstreams"], f["size"])
    return pack(values, _core.tcp_proof(fields["token"], pack(bare, bytes(16))))


@settings(max_examples=100, deadline=None)
@given(wrong=st.sampled_from([None, *HELLO_FIELDS]), pick=st.integers(1, 3),
       cut=st.one_of(st.none(), st.none(), st.integers(0, HELLO - 1)))
def test_a_hello_is_taken_only_whole_and_right_in_every_field(wrong, pick, cut):
    """A hello with any one field wrong, or cut short, is closed before a byte past it is read; then a
    proper peer still gets through. The right one, whole, is taken."""
    core, fakes, ports = group_of(2)
    try:
        fields = {k: v[0] for k, v in HELLO_FIELDS.items()}
        if wrong is not None:
            fields[wrong] = HELLO_FIELDS[wrong][1 + (pick - 1) % (len(HELLO_FIELDS[wrong]) - 1)]
        data = hello_of(fields)[:cut]
        sock = connect(ports[1], data + (header(MSG, 3, 0, 4, 4) + b"evil" if cut is None else b""))
        if cut is not None:
            sock.close()
        r = core.irecv(np.zeros(4, np.uint8), None, None)
        if wrong is None and cut is None:
            assert r.wait() == (1, 3, 4)
        else:
            assert drive(r, lambda: core.user_transport.rejected == 1 and (cut is not None or closed_by_peer(sock))), \
                "the connection was not closed"
            assert not r.test()
            good = connect(ports[1], hello() + header(MSG, 5, 0, 4, 4) + b"good")
            assert r.wait() == (1, 5, 4)
            good.close()
        sock.close()
    finally:
        fakes[1].close()


@pytest.mark.parametrize("stray_writes", [0, 5], ids=["silent", "part-of-a-hello"])
def test_connections_beyond_the_pending_table_wait_then_stray_ones_make_room(rank0, stray_writes):
    """More connections at once than the table of those still owing their hello holds (64; a mesh of 6
    ranks with 16 streams opens 80 to each rank together) wait in the listen backlog: a proper peer
    behind 70 stray ones is not closed. Once the oldest entry has owed its hello for ENG_TCP_FULL_GRACE
    (2 s), it makes room for the next: the peer gets through while the stray ones stay open (a stray
    client holding them kept it out for the hello's 30 s, past the group's timeout; one that wrote a
    few bytes of a hello still did, where a peer writes its hello in one send)."""
    core, _, ports = rank0
    strays = [connect(ports[1], hello()[:stray_writes]) for _ in range(70)]
    good = connect(ports[1], hello() + header(MSG, 5, 0, 4, 4) + b"good")
    r = core.irecv(np.zeros(4, np.uint8), None, None)
    try:
        assert not drive(r, lambda: closed_by_peer(good), seconds=0.5), "a proper peer was closed"
        assert not r.test() and core.user_transport.rejected == 0    # (within the grace)
        # A wait blocked meanwhile sleeps in poll: the listening socket, whose backlog is not taken
        # while the table is full, is watched only once the oldest entry's grace has passed (it would
        # wake the wait at once, for ever).
        got = []
        waiter = threading.Thread(target=lambda: got.append(r.wait()))
        cpu = time.process_time()
        waiter.start()
        waiter.join(15)
        cpu = time.process_time() - cpu
        assert got == [(1, 5, 4)] and cpu < 0.5, (got, f"{cpu:.2f} s of CPU")
        # (the 6 stray ones ahead of it in the backlog, and one for it: the oldest entries went first)
        assert core.user_transport.rejected == 7 and all(not closed_by_peer(s) for s in strays[-6:])
        for s in strays:
            s.close()
        # and the stray ones are dropped (the last of them may still wait in the backlog when the
        # first message is in: the next receive's progress takes them)
        r = core.irecv(np.zeros(4, np.uint8), None, None)
        assert drive(r, lambda: core.user_transport.rejected == len(strays)), core.user_transport.rejected
        good.sendall(header(MSG, 6, 1, 4, 4) + b"more")
        assert r.wait() == (1, 6, 4)
    finally:
        for s in strays + [good]:
            s.close()


def test_a_message_arrives_whole_from_a_conforming_peer(rank0):
    core, _, ports = rank0
    payload = np.arange(100_000, dtype=np.uint8)
    s = connect(ports[1], hello() + header(MSG, 3, 0, 0, 0) + header(MSG, 3, 1, payload.nbytes, payload.nbytes)
                + payload.tobytes())
    empty, out = np.zeros(0, np.uint8), np.zeros(payload.nbytes, np.uint8)
    assert core.recv(empty, 1, 3) == (1, 3, 0)
    assert core.recv(out, 1, 3) == (1, 3, payload.nbytes)      # held (over eager_max) until posted
    np.testing.assert_array_equal(out, payload)
    s.close()


def test_a_message_split_over_streams_arrives_whole_whatever_comes_first(rank0):
    core, _, ports = rank0
    payload = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    half = payload.nbytes // 2
    s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 7, 0, half, payload.nbytes - half)
                 + payload[half:].tobytes())    # the second part first, on stream 1
    out = np.zeros(payload.nbytes, np.uint8)
    r = core.irecv(out, 1, 7)
    # stream 1's part is in before stream 0 connects: the channel has heard from rank 1
    assert drive(r, lambda: [s is not None for p, s in core.user_transport.waiting_on() if p == 1] == [True])
    s0 = connect(ports[1], hello(stream=0, nstreams=2) + header(MSG, 7, 0, payload.nbytes, half)
                 + payload[:half].tobytes())
    assert r.wait() == (1, 7, payload.nbytes)
    np.testing.assert_array_equal(out, payload)
    s0.close()
    s1.close()


def test_a_split_message_read_ahead_out_of_order_is_whole_in_a_receive_posted_later(rank0):
    """Read ahead (a receive for another tag of the same peer is posted), its second part in before
    most of its first: the receive posted then gets every byte, whichever stream brought it."""
    core, _, ports = rank0
    payload = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    half = payload.nbytes // 2
    other = core.irecv(np.zeros(2, np.uint8), 1, 8)
    s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 7, 0, half, payload.nbytes - half)
                 + payload[half:].tobytes())
    s0 = connect(ports[1], hello(stream=0, nstreams=2) + header(MSG, 7, 0, payload.nbytes, half)
                 + payload[:1000].tobytes())
    assert keeps_waiting(other)     # meanwhile both streams are read into the message's own buffer
    out = np.zeros(payload.nbytes, np.uint8)
    r = core.irecv(out, 1, 7)
    s0.sendall(payload[1000:half].tobytes() + header(MSG, 8, 1, 2, 2) + b"ok")
    assert r.wait() == (1, 7, payload.nbytes)
    np.testing.assert_array_equal(out, payload)
    assert other.wait() == (1, 8, 2)
    s0.close()
    s1.close()


def test_a_send_to_itself_is_matched_like_any_other(rank0):
    core = rank0[0]
    out = np.zeros(5, np.uint8)
    r = core.irecv(out, 0, 4)
    core.send(np.arange(5, dtype=np.uint8), 0, 4)
    assert r.wait() == (0, 4, 5) and out.tolist() == [0, 1, 2, 3, 4]
    r = core.irecv(np.zeros(2, np.uint8), -1, 4)
    core.send(np.arange(5, dtype=np.uint8), 0, 4)
    with pytest.raises(EngineError, match="truncated"):
        r.wait()
    core.send(np.arange(3, dtype=np.uint8), 0, 6)     # nobody asked yet: kept, in order
    core.send(np.arange(2, dtype=np.uint8), 0, 6)
    assert core.recv(out, -1, -1) == (0, 6, 3) and out[:3].tolist() == [0, 1, 2]
    assert core.recv(out, 0, 6) == (0, 6, 2)


@pytest.mark.parametrize("frame", ["too long", "part longer than message", "part on stream 0", "unknown kind",
                                   "negative tag", "numbers going back", "number at its top"])
def test_a_malformed_frame_fails_naming_the_peer(rank0, frame):
    core, _, ports = rank0
    bad = {"too long": header(MSG, 0, 0, 1 << 50, 8), "part longer than message": header(MSG, 0, 0, 8, 9),
           "part on stream 0": header(PART, 0, 0, 0, 8), "unknown kind": header(0x41414141, 0, 0, 8, 8),
           "negative tag": header(MSG, -5, 0, 8, 8),
           "numbers going back": header(MSG, 0, 4, 0, 0) + header(MSG, 0, 2, 0, 0),
           # (the next would wrap to 0: every number going back after it passed)
           "number at its top": header(MSG, 0, (1 << 64) - 1, 0, 0) + header(MSG, 0, 0, 0, 0)}[frame]
    s = connect(ports[1], hello() + bad + b"\0" * 64)
    with pytest.raises(EngineError, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) sent a malformed frame"):
        core.recv(np.zeros(8, np.uint8), 1, 0)
        core.recv(np.zeros(8, np.uint8), 1, 0)
    s.close()


def test_a_message_whose_rest_would_come_on_a_stream_its_peer_has_not_fails_naming_it(rank0):
    """A peer that announced one stream sends a message whose header says 4 of its 8 bytes follow on
    it, the rest on another: it never ends (the receive waited to the timeout)."""
    core, _, ports = rank0
    s = connect(ports[1], hello() + header(MSG, 0, 0, 8, 4) + b"abcd")
    with pytest.raises(EngineError, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) sent a malformed frame"):
        core.recv(np.zeros(8, np.uint8), 1, 0)
    s.close()


def test_a_message_split_otherwise_than_the_senders_split_fails_naming_the_peer(rank0):
    """A peer of two streams whose message's first frame carries 1 byte of 70,000 (the sender's split
    gives the first stream 36,864): it would have the receiver buffer the whole message for a byte, as
    often as the peer liked."""
    core, _, ports = rank0
    s = connect(ports[1], hello(stream=0, nstreams=2) + header(MSG, 0, 0, 70_000, 1) + b"a")
    with pytest.raises(EngineError, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) sent a malformed frame"):
        core.recv(np.zeros(70_000, np.uint8), 1, 0)
    s.close()


# A frame as the fuzz writes it: kinds valid and not, tags and numbers in and out of order, sizes from
# none to past ENG_TCP_MAX_MESSAGE and uint64's top, and up to 64 payload bytes whatever the header says.
SIZES = st.sampled_from([0, 1, 7, 8, 4096, 70_000, 1 << 48, (1 << 64) - 1])
FRAMES = st.lists(st.tuples(st.sampled_from([MSG, MSG, PART, BYE, 0, 0xFFFFFFFF]), st.integers(-2, 3),
                            st.integers(0, 3), SIZES, SIZES, st.binary(max_size=64)), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams=st.tuples(FRAMES, st.one_of(st.none(), FRAMES)), tail=st.binary(max_size=40),
       first=st.sampled_from([0, 1]))
def test_whatever_a_peer_that_proved_the_token_sends_ends_in_messages_or_an_error_naming_it(streams, tail, first):
    """Past the hello, every length is read from the peer: random frames on stream 0 and on stream 1 (or
    none: it never connected), either first, then the peer's end. Each receive ends whole, truncated, or
    in an error naming rank 1 - at once (never a crash or the 3 s deadline's timeout), and never more
    messages come than whole frames were sent."""
    core, fakes, ports = group_of(2)
    core.set_watch(Deadline(3.0), 0.05, p2p=Deadline(3.0))
    sent = [(k, hello(stream=k, nstreams=2) + b"".join(header(*f[:5]) + f[5] for f in frames) + tail)
            for k, frames in enumerate(streams) if frames is not None]
    for _, data in sorted(sent, key=lambda kd: kd[0] != first):
        connect(ports[1], data).close()
    try:
        receive_until_it_ends(core, sum(len(f) for f in streams if f is not None), 1 << 17,
                              "rank 1 (rank1, 127.0.0.1 port", timeout_ends=False)
    finally:
        fakes[1].close()


def test_a_part_claiming_bytes_another_stream_carries_fails_naming_the_peer(rank0):
    """A MSG frame says 4096 of 8192 bytes follow on stream 0 (none in yet); a PART on stream 1 then
    claims all 8192. The parts claim more than the message holds: malformed, not a message complete
    (which would be freed while stream 0 still reads into it)."""
    core, _, ports = rank0
    r = core.irecv(np.zeros(8192, np.uint8), 1, 7)
    s0 = connect(ports[1], hello(stream=0, nstreams=2) + header(MSG, 7, 0, 8192, 4096))
    assert keeps_waiting(r)     # its header is read and bound to r
    s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 7, 0, 0, 8192) + b"x" * 8192)
    with pytest.raises(EngineError, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) sent a malformed frame"):
        r.wait()
    s0.close()
    s1.close()


@pytest.mark.parametrize("part", ["over the first frame's bytes", "shorter than its share", "empty first frame"])
def test_a_part_not_where_its_stream_carries_it_fails_naming_the_peer(rank0, part):
    """A message of 8192 bytes over 2 streams: the MSG frame carries bytes 0-4095, stream 1's part the
    rest. A part that lands on the first frame's bytes (which completed the receive with bytes 4096 on
    as the buffer held them: nothing sent them), one shorter than its share (the message never ended),
    or a first frame of none (no part can follow it) is malformed, at once."""
    core, _, ports = rank0
    out = np.full(8192, 0x55, np.uint8)
    r = core.irecv(out, 1, 7)
    first, (a, b) = (0 if part == "empty first frame" else 4096), {
        "over the first frame's bytes": (0, 4096), "shorter than its share": (4096, 2048),
        "empty first frame": (4096, 4096)}[part]
    s0 = connect(ports[1], hello(stream=0, nstreams=2) + header(MSG, 7, 0, 8192, first) + b"a" * first)
    s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 7, 0, a, b) + b"b" * b)
    with pytest.raises(EngineError, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) sent a malformed frame"):
        r.wait()
    s0.close()
    s1.close()


def test_a_cancelled_send_whose_part_went_out_still_sends_its_first_frame(rank0):
    """A message split over two streams: its part (stream 1) went out whole while its first frame waits
    on stream 0 behind others. Cancelled then, the first frame still goes out (from a copy of the
    buffer): the peer holds the part, and without the frame would see a malformed stream."""
    core, listener, _ = rank0
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    listener.settimeout(5)
    filler = np.zeros((1 << 20) - 1, np.uint8)          # under split_min: stream 0 only
    early = [core.isend(filler, 1, 1) for _ in range(24)]
    conns = {}

    def accept_both():
        while len(conns) < 2:
            c, _ = listener.accept()
            conns[struct.unpack_from("<I", recv_exact(c, HELLO), 36)[0]] = c   # (by its stream)

    acceptor = threading.Thread(target=accept_both)
    acceptor.start()
    while acceptor.is_alive():
        early[-1].test()    # (progress: connecting, the hellos)
        time.sleep(0.001)
    payload = np.random.default_rng(2).integers(0, 255, 2 << 20, dtype=np.uint8)
    r = core.isend(payload, 1, 2)
    part = []
    reader = threading.Thread(target=lambda: part.append(recv_exact(conns[1], HDR + (1 << 20))))
    reader.start()
    while reader.is_alive():
        r.test()
        time.sleep(0.001)
    assert part and part[0][:HDR] == header(PART, 2, 24, 1 << 20, 1 << 20)
    assert not r.test()     # (its first frame is still queued)
    del r
    gc.collect()            # the Request's end cancels it
    frames = []

    def read_stream_0():
        while not frames or frames[-1][1] != 3:
            kind, tag, seq, a, b = struct.unpack("<IiQQQ", recv_exact(conns[0], HDR))
            body = recv_exact(conns[0], b)
            frames.append((kind, tag, seq, a, b, body if tag != 1 else None))

    reader = threading.Thread(target=read_stream_0)
    reader.start()
    core.send(np.frombuffer(b"end", np.uint8), 1, 3)
    for q in early:
        q.wait()
    reader.join(10)
    assert [f[2] for f in frames] == list(range(26))
    assert frames[24][:5] == (MSG, 2, 24, 2 << 20, 1 << 20) and frames[24][5] == payload[:1 << 20].tobytes()
    for c in conns.values():
        c.close()


def test_a_connection_its_peer_dropped_before_its_hello_is_made_again(rank0):
    """A connection opened lazily (here by a receive from rank 1, for rank 1's liveness) whose hello this
    rank had not written when rank 1 dropped it: a peer closes a connection that has not proved the
    token within 30 s, and nothing wrote it while this rank was away from the engine (no progress
    thread). A message sent then goes on a new connection, where it went into the closed one, was
    lost, and rank 1's receive waited to its timeout."""
    core, listener, ports = rank0
    listener.settimeout(5)
    out = np.zeros(4, np.uint8)
    r = core.irecv(out, 1, 5)                        # (connects both streams; no progress since)
    for c in [listener.accept()[0] for _ in range(2)]:
        c.close()                                    # (rank 1's hello deadline, passed)
    time.sleep(0.2)
    core.send(np.frombuffer(b"late", np.uint8), 1, 7)
    conns = {}
    while len(conns) < 2:
        c, _ = listener.accept()
        got = recv_exact(c, HELLO)
        stream = struct.unpack_from("<I", got, 36)[0]
        assert got == hello(frm=0, to=1, stream=stream, nstreams=2) and TOKEN not in got   # (its proof, not the token)
        conns[stream] = c
    assert recv_exact(conns[0], HDR + 4) == header(MSG, 7, 0, 4, 4) + b"late"
    back = connect(ports[1], hello() + header(MSG, 5, 0, 4, 4) + b"back")
    r.wait()
    assert out.tobytes() == b"back"
    for c in [back, *conns.values()]:
        c.close()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 4096 * 3 + 1])
def test_a_message_with_fewer_bytes_than_streams_goes_in_frames_each_carrying_bytes(n):
    """Split over 4 streams from 1 byte up (ENGINE_TCP_STREAM_MIN_BYTES=1): a message too short to give
    every stream a part goes in fewer frames, none empty (the receiver takes an empty part for a
    malformed stream); together they carry it once, in order."""
    core, fakes, _ = group_of(2, nstreams=4, split_min=1)
    fakes[1].settimeout(5)
    payload = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
    r = core.isend(payload, 1, 7)
    conns = {}

    def accept_all():
        while len(conns) < 4:
            c, _ = fakes[1].accept()
            conns[struct.unpack_from("<I", recv_exact(c, HELLO), 36)[0]] = c   # (by its stream)

    acceptor = threading.Thread(target=accept_all)
    acceptor.start()
    while acceptor.is_alive():
        r.test()
        time.sleep(0.001)
    r.wait()
    got, frames = bytearray(n), []
    for stream, c in sorted(conns.items()):
        while True:
            c.settimeout(0.05)   # (recv_exact sets its own)
            try:
                c.recv(HDR, socket.MSG_PEEK)
            except socket.timeout:
                break
            kind, tag, seq, a, b = struct.unpack("<IiQQQ", recv_exact(c, HDR))
            frames.append((stream, kind, a, b))
            off = 0 if kind == MSG else a
            got[off:off + b] = recv_exact(c, b)
    assert frames[0][:3] == (0, MSG, n) and all(b > 0 for *_, b in frames), frames
    assert sum(b for *_, b in frames) == n and bytes(got) == payload.tobytes(), frames
    for c in conns.values():
        c.close()
    fakes[1].close()


@pytest.mark.parametrize("case", ["next receive posted before the cancel", "next receive posted after it",
                                  "sender's next message already in"])
def test_a_cancelled_receive_hands_the_message_arriving_into_it_to_the_next_receive(rank0, case):
    """A receive taking a message whose bytes are still arriving is cancelled (its Request dropped): the
    message goes, whole, to the next receive that matches it, not the sender's next message (which
    would come out of order, or never where none followed), as on shared memory. Where the sender's
    next message is in already (the first waits for its part on another stream), it stays behind."""
    core, _, ports = rank0
    first = np.random.default_rng(5).integers(0, 255, 8192, dtype=np.uint8).tobytes()
    split = case.startswith("sender's")
    s0 = connect(ports[1], hello(nstreams=2) + header(MSG, 3, 0, 8192, 4096 if split else 8192) + first[:100])
    r = core.irecv(np.zeros(8192, np.uint8), 1, 3)
    assert drive(r, lambda: core.user_transport.waiting_on() != [] and keeps_waiting(r, 0.05)), "never bound"
    out = np.zeros(8192, np.uint8)
    later = core.irecv(out, 1, 3) if case.endswith("before the cancel") else None
    if split:
        s0.sendall(first[100:4096] + header(MSG, 3, 1, 2, 2) + b"ok")
        assert keeps_waiting(r, 0.2)    # (the next message read in behind it, unexpected)
    del r
    gc.collect()            # the Request's end cancels it, the message bound to it part-way in
    if split:
        s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 3, 0, 4096, 4096) + first[4096:])
    else:
        s0.sendall(first[100:] + header(MSG, 3, 1, 2, 2) + b"ok")
    later = later or core.irecv(out, 1, 3)
    assert later.wait() == (1, 3, 8192) and out.tobytes() == first
    second = np.zeros(2, np.uint8)
    assert core.irecv(second, 1, 3).wait() == (1, 3, 2) and second.tobytes() == b"ok"
    s0.close()
    if split:
        s1.close()


def test_a_rank_out_of_descriptors_fails_saying_so_instead_of_spinning(rank0):
    """A connection the rank can't accept (EMFILE: its descriptors are used up) leaves the listener
    ready for ever: the wait fails saying so, not at the timeout after spinning on it."""
    import resource
    core, _, ports = rank0
    peer = socket.socket()
    r = core.irecv(np.zeros(4, np.uint8), 1, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)   # (the lowest free number: every one below is taken)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        peer.connect(("127.0.0.1", ports[1]))   # (no descriptor of this process's: the listener's accept fails)
        with pytest.raises(EngineError, match=r"rank 0 could not accept a peer's connection: Too many open files: "
                                              r"raise the process's limit \(ulimit -n\)"):
            r.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        peer.close()


def test_a_full_table_makes_room_with_no_descriptor_free(rank0):
    """The pending table full of silent connections and the process's descriptors used up: once the
    oldest has said nothing for the grace, closing it frees the descriptor the next connection takes
    (the accept came first, and its EMFILE failed the wait: 'could not accept a peer's connection')."""
    import resource
    core, _, ports = rank0
    silent = [connect(ports[1]) for _ in range(70)]
    good = connect(ports[1], hello() + header(MSG, 5, 0, 4, 4) + b"good")
    r = core.irecv(np.zeros(4, np.uint8), None, None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert not drive(r, lambda: False, seconds=0.3)    # (the table fills)
        lowest = os.open(os.devnull, os.O_RDONLY)   # (the lowest free number: every one below is taken)
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        assert r.wait() == (1, 5, 4)
        assert core.user_transport.rejected >= 7    # (room for the 6 silent ones ahead of it, and for it)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in silent + [good]:
            s.close()


def test_a_message_too_large_to_hold_fails_naming_its_sender(rank0):
    """An unexpected message is held whole, the size its header says: 2**48 bytes can't be."""
    core, _, ports = rank0
    other = core.irecv(np.zeros(4, np.uint8), 1, 9)    # a receive for another tag: the stream is read on
    s = connect(ports[1], hello(nstreams=2) + header(MSG, 3, 0, 1 << 48, 1 << 47) + b"x" * 8)   # (half on another stream)
    with pytest.raises(EngineError, match=r"out of memory for a message from rank 1 \(rank1, 127\.0\.0\.1 port"):
        other.wait()
    s.close()


def test_a_peer_closing_mid_message_fails_naming_it(rank0):
    core, _, ports = rank0
    s = connect(ports[1], hello() + header(MSG, 0, 0, 1000, 1000) + b"x" * 10)
    r = core.irecv(np.zeros(1000, np.uint8), 1, 0)
    assert drive(r, lambda: [s is not None for p, s in core.user_transport.waiting_on() if p == 1] == [True])
    s.close()   # 10 of 1000 bytes in; a receive that missed the close would end in the Deadline's EngineTimeout
    with pytest.raises(EnginePeerLost, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) closed its connection"):
        r.wait()


@pytest.mark.parametrize("closed", ["stream 0", "both streams"])
def test_a_part_whose_header_can_no_longer_come_fails_at_the_peers_end(rank0, closed):
    """A part read ahead of its message's header (stream 1's before stream 0's) is held, its stream no
    longer read. The end of stream 0, which carries every header, is the peer's end, not a wait for the
    timeout, whether or not stream 1 has ended too."""
    core, _, ports = rank0
    s0 = connect(ports[1], hello(stream=0, nstreams=2))
    s1 = connect(ports[1], hello(stream=1, nstreams=2) + header(PART, 7, 0, 8, 8) + b"x" * 8)
    r = core.irecv(np.zeros(16, np.uint8), 1, 7)
    assert keeps_waiting(r)     # stream 0 may still bring the header
    for sock in [s0, s1] if closed == "both streams" else [s0]:
        sock.close()
    with pytest.raises(EnginePeerLost, match=r"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) closed its connection"):
        r.wait()
    s1.close()


def test_a_peer_whose_listener_is_gone_is_named_as_having_left(rank0):
    """A refused connection to a peer that listened when the group was made: its process ended or it
    left the group; that is said first, and a wrong address (another host's) last."""
    core, listener, _ = rank0
    listener.close()
    with pytest.raises(EngineError, match=r"could not connect to rank 1 \(rank1, 127\.0\.0\.1 port \d+\): "
                       r"Connection refused: nothing listens there now, so it left the group .* or its process ended"):
        core.send(np.zeros(4, np.uint8), 1, 0)


def test_what_a_closed_peer_sent_is_still_received(rank0):
    core, _, ports = rank0
    s = connect(ports[1], hello() + header(MSG, 1, 0, 3, 3) + b"abc")
    s.close()   # before the receive is posted: what it sent is queued ahead of its end
    out = np.zeros(3, np.uint8)
    assert core.recv(out, 1, 1) == (1, 1, 3) and out.tobytes() == b"abc"
    with pytest.raises(EnginePeerLost, match="rank 1"):
        core.recv(out, 1, 1)


def test_what_a_peer_that_left_sent_is_received_though_its_listener_is_gone(rank0):
    """A peer that sent its message and left, its listener closed with it: a receive posted after that
    connects to the peer for its liveness and is refused. The message it sent still comes, and the
    receive after it fails naming the peer; the refusal failed the first receive at once (a rank
    that leaves after its part failed the others, over lazy connections)."""
    core, listener, ports = rank0
    s = connect(ports[1], hello() + header(MSG, 1, 0, 3, 3) + b"abc")
    s.close()
    listener.close()
    out = np.zeros(3, np.uint8)
    assert core.recv(out, 1, 1) == (1, 1, 3) and out.tobytes() == b"abc"
    with pytest.raises(EnginePeerLost, match="rank 1"):
        core.recv(out, 1, 1)


def test_a_truncated_receive_says_so_and_the_stream_goes_on(rank0):
    core, _, ports = rank0
    s = connect(ports[1], hello() + header(MSG, 1, 0, 8, 8) + b"12345678" + header(MSG, 1, 1, 2, 2) + b"ok")
    with pytest.raises(EngineError, match="truncated"):
        core.recv(np.zeros(4, np.uint8), 1, 1)
    out = np.zeros(2, np.uint8)
    assert core.recv(out, 1, 1) == (1, 1, 2) and out.tobytes() == b"ok"
    s.close()


def test_interfaces_and_listening_on_ipv4_and_ipv6():
    names = {name for name, _, _ in _core.tcp_interfaces()}
    assert "lo" in names
    fd, port = _core.tcp_listen("127.0.0.1")
    assert port > 0
    _core.close_fd(fd)
    if socket.has_ipv6 and any(fam == 6 for _, fam, _ in _core.tcp_interfaces()):
        fd, port = _core.tcp_listen("::1")
        _core.close_fd(fd)
    with pytest.raises(OSError, match="can't listen on 203.0.113.7"):
        _core.tcp_listen("203.0.113.7")     # not this host's address


OUT_OF_FDS = r"""
import errno, os, resource
from engine import _core


def ident(fd):
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    except OSError as exc:
        return exc.strerror


std = [ident(fd) for fd in (0, 1, 2)]
fd, port = _core.tcp_listen("127.0.0.1")
listener = ident(fd)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 1, hard))
held = []
while True:                 # every free number below the limit taken: the transport's eventfd gets none
    try:
        held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE, exc
        break
try:
    _core.TcpTransport(0, 2, 1, fd, bytes(16), [("127.0.0.1", port, "r0"), ("127.0.0.1", 9, "r1")])
    print(None, "made")
except Exception as exc:
    print(getattr(exc, "errno", None) == errno.EMFILE, repr(exc))
for h in held:
    os.close(h)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print([ident(fd) for fd in (0, 1, 2)] == std, ident(fd) == listener)
_core.close_fd(fd)
"""


def test_a_transport_made_out_of_descriptors_fails_closing_only_what_it_made():
    """EMFILE at the transport's eventfd (the process's descriptor limit, in a child): an OSError naming
    the eventfd; nothing written to or closed of descriptors it never opened (stdin here, a socket whose
    other end this test reads); the listener still open, its caller's."""
    here, child = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(_core.__file__))))
    proc = subprocess.run([sys.executable, "-c", OUT_OF_FDS], stdin=child, capture_output=True, text=True,
                          env=env, timeout=60)
    child.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised, kept = proc.stdout.splitlines()
    assert raised.startswith("True ") and "wake-up eventfd: Too many open files" in raised, raised
    assert kept == "True True", "stdin, stdout, stderr and the listener the same after it? " + kept
    assert here.recv(64) == b""     # nothing came before the child's exit closed its stdin
    here.close()


def test_a_transport_refusing_an_address_leaves_the_listener_to_its_caller():
    fd, port = _core.tcp_listen("127.0.0.1")
    with pytest.raises(ValueError, match="rank 1's address 'nowhere'"):
        _core.TcpTransport(0, 2, 1, fd, TOKEN, [("127.0.0.1", port, "r0"), ("nowhere", 1, "r1")])
    gc.collect()
    os.fstat(fd)
    _core.close_fd(fd)


def test_the_interface_follows_ifname_then_master_addr(monkeypatch):
    from engine import tcp
    monkeypatch.setenv("ENGINE_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert tcp.listen_address()[0] == "127.0.0.1"
    monkeypatch.setenv("ENGINE_SOCKET_IFNAME", "nosuch0,lo")
    assert tcp.listen_address() == ("127.0.0.1", "ENGINE_SOCKET_IFNAME=lo")
    monkeypatch.setenv("ENGINE_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(RuntimeError, match="ENGINE_SOCKET_IFNAME='nosuch0': this host .* has no such interface"):
        tcp.listen_address()
    # NCCL_SOCKET_IFNAME's forms, which users copy: prefixes, "=" exact names, "^" exclusions
    host = ["lo", "eth0", "docker0", "eth1", "ib0", "eth10"]
    assert tcp.named_interfaces("eth", host) == ["eth0", "eth1", "eth10"]
    assert tcp.named_interfaces("ib,eth1", host) == ["ib0", "eth1", "eth10"]
    assert tcp.named_interfaces("=eth1", host) == ["eth1"]
    assert tcp.named_interfaces("^docker,lo", host) == ["eth0", "eth1", "ib0", "eth10"]
    assert tcp.named_interfaces("^docker", host) == ["eth0", "eth1", "ib0", "eth10", "lo"]
    assert tcp.named_interfaces("^=eth1", host) == ["eth0", "docker0", "ib0", "eth10", "lo"]
    monkeypatch.setenv("ENGINE_SOCKET_IFNAME", "^nosuch")   # (all but these: loopback last)
    assert tcp.listen_address()[1] != "ENGINE_SOCKET_IFNAME=lo" or len({n for n, _, _ in _core.tcp_interfaces()}) == 1
    monkeypatch.delenv("ENGINE_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert tcp.listen_address() == ("127.0.0.1", "the route to MASTER_ADDR=127.0.0.1")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(RuntimeError, match="MASTER_ADDR='no-such-host.invalid' does not resolve"):
        tcp.listen_address()
    # MASTER_ADDR naming this host, whose name resolves here to a loopback address (Debian's /etc/hosts:
    # 127.0.1.1 nodea), while the other hosts reach it at its real one: it listened on 127.0.0.1, and
    # the other hosts' connections went to their own loopback
    resolve = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return resolve("127.0.1.1" if host == "nodea" else host, *args, **kwargs)
    monkeypatch.setattr(tcp.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setenv("MASTER_ADDR", "nodea")
    found = tcp._this_hosts_address()
    addr, how = tcp.listen_address()
    if found is not None:   # (a host with an address besides loopback)
        assert addr == found[0] and not addr.startswith("127.") and \
            "MASTER_ADDR=nodea is this host, whose name resolves here to the loopback address 127.0.0.1" in how, how
    for local in ("localhost", "127.0.0.1"):   # (said to be loopback: every rank is here)
        monkeypatch.setenv("MASTER_ADDR", local)
        assert tcp.listen_address() == ("127.0.0.1", f"the route to MASTER_ADDR={local}")


def test_a_rank_whose_address_others_may_not_reach_takes_the_route_to_one_on_another_host():
    """In a group spanning hosts (tests/test_hosts.py makes them): a rank whose address came from a
    fallback (MASTER_ADDR naming this host, whose name resolves here to 127.0.1.1: the hostname's
    address, else the first interface's, maybe a network only this host has) or is loopback takes the
    route to the address of a rank on another host that chose by a route; with none, a fallback stays
    and loopback takes this host's own address; an explicit interface stays, or, loopback, is refused."""
    from engine import tcp
    fallback = ("10.99.0.1", [1, 2], "a", None, "the first interface's address (MASTER_ADDR=nodea is this host, ...)")
    hosts = ["host-a", "host-b"]
    found = tcp._this_hosts_address()   # (rank 1's address here: one this host has a route to)
    if found is not None:
        routed = (found[0], [3, 4], "b", None, "the route to MASTER_ADDR=nodea")
        addr, how = tcp.reachable_from_other_hosts([fallback, routed], hosts, 0)
        assert addr == found[0] and how.startswith(f"the route to rank 1's address {found[0]} (the first interface's"), how
    assert tcp.unsure(*fallback[::4]) and not tcp.unsure("10.0.0.2", "the route to MASTER_ADDR=nodea")
    assert tcp.unsure("127.0.0.1", "the route to MASTER_ADDR=localhost")
    other_fallback = ("10.98.0.2", [3, 4], "b", None, "the hostname's address")
    assert tcp.reachable_from_other_hosts([fallback, other_fallback], hosts, 0) is None
    loop = ("127.0.0.1", [1, 2], "a", None, "the route to MASTER_ADDR=localhost")
    if found is not None:
        assert tcp.reachable_from_other_hosts([loop, other_fallback], hosts, 0)[0] == found[0]
    routed = ("10.0.0.2", [3, 4], "b", None, "the route to MASTER_ADDR=nodea")
    explicit = ("10.99.0.1", [1, 2], "a", None, "ENGINE_SOCKET_IFNAME=eth1")
    assert tcp.reachable_from_other_hosts([explicit, routed], hosts, 0) is None
    with pytest.raises(RuntimeError, match="ENGINE_SOCKET_IFNAME=lo gives the loopback address 127.0.0.1"):
        tcp.reachable_from_other_hosts([("127.0.0.1", [1, 2], "a", None, "ENGINE_SOCKET_IFNAME=lo"), routed], hosts, 0)


def keeps_waiting(request, seconds=0.3):
    """request is still unfinished (and has not failed: test() would raise) after `seconds` of progress."""
    return not drive(request, lambda: False, seconds) and not request.test()


@pytest.mark.parametrize("direction", ["on its own connection", "back on a connection this rank made"])
def test_a_peer_that_left_in_order_fails_only_what_involves_it(trio, direction):
    core, fakes, ports = trio
    out = np.zeros(2, np.uint8)
    if direction == "on its own connection":
        leaver = connect(ports[1], hello(frm=2, size=3) + header(BYE, 0, 0, 0, 0))
    else:
        core.send(np.frombuffer(b"hi", np.uint8), 2, 0)      # rank 0 connects to rank 2 (both streams) to send
        leaver, _ = fakes[2].accept()
        second, _ = fakes[2].accept()
        got = recv_exact(leaver, HELLO) + recv_exact(second, HELLO)
        stream0 = leaver if struct.unpack_from("<I", got, 36)[0] == 0 else second
        assert recv_exact(stream0, HDR + 2)[-2:] == b"hi"
        for sock in (leaver, second):                        # both ends readable in one poll
            sock.sendall(back_bye(2, 0 if sock is stream0 else 1))
    r = core.irecv(out, 1, 0)
    if direction != "on its own connection":
        second.close()
    leaver.close()
    assert keeps_waiting(r), "a receive from rank 1 failed when rank 2 left in order"
    sender = connect(ports[1], hello(frm=1, size=3) + header(MSG, 0, 0, 2, 2) + b"ok")
    assert r.wait() == (1, 0, 2) and out.tobytes() == b"ok"
    assert core.user_transport.departed == [2]
    # (the user's messages: no collective to blame; a collective's wait says the ranks' calls differed)
    with pytest.raises(EnginePeerLost, match=r"rank 2 \(rank2, 127\.0\.0\.1 port \d+\) left the group .* still "
                                             r"waited for it: its sends and receives did not pair with this rank's, "
                                             r"or it ended first \(its own error, if any, says why\)"):
        core.recv(out, 2, 0)
    with pytest.raises(EnginePeerLost, match=r"rank 2 \(rank2, .*\) left the group"):
        core.send(out, 2, 0)
    sender.close()


@pytest.mark.parametrize("unread", ["sent", "still queued"])
def test_a_message_a_peer_sent_before_it_left_is_received_though_it_left_our_data_unread(rank0, unread):
    """Rank 1 sends a message past the eager size, says goodbye and closes, leaving a message rank 0
    sent it unread (whole in its socket, or so large that part of it is still queued here): its end of
    rank 0's connection is reset, not closed. The message's tail, sent before the goodbye, comes after
    the reset (on another connection: another path through a network). Rank 1 left in order all the
    same: the message is read to its end, a receive rank 1 never sent to fails naming the departure,
    and the receive posted then gets the message whole; a send still queued fails so."""
    core, fake, ports = rank0
    core.send(np.frombuffer(b"hi", np.uint8), 1, 0)           # rank 0 connects to rank 1 (both streams)
    made = [fake.accept()[0] for _ in range(2)]
    got = [recv_exact(sock, HELLO) for sock in made]
    stream0 = made[0] if struct.unpack_from("<I", got[0], 36)[0] == 0 else made[1]
    assert recv_exact(stream0, HDR + 2)[-2:] == b"hi"
    big = np.zeros(64 << 20 if unread == "still queued" else 6, np.uint8)
    queued = core.isend(big, 1, 0)                             # in rank 1's socket (and queued), never read
    assert unread == "sent" or keeps_waiting(queued, 0.1)
    payload = os.urandom(100_000)
    sender = connect(ports[1], hello() + header(MSG, 5, 0, len(payload), len(payload)) + payload[:50_000])
    r = core.irecv(np.zeros(2, np.uint8), 1, 9)
    assert keeps_waiting(r, 0.2)                              # the message's header read; held for a receive
    stream0.sendall(back_bye(1, 0))
    stream0.close()                                          # unread data: a reset
    assert keeps_waiting(r, 0.2)                              # (the goodbye and the reset read)
    sender.sendall(payload[50_000:] + header(BYE, 0, 0, 0, 0))
    sender.close()
    with pytest.raises(EnginePeerLost, match=r"rank 1 \(rank1, .*\) left the group"):
        r.wait()
    out = np.zeros(len(payload), np.uint8)
    assert core.recv(out, 1, 5) == (1, 5, len(payload)) and out.tobytes() == payload
    if unread == "still queued":
        with pytest.raises(EnginePeerLost, match=r"rank 1 \(rank1, .*\) left the group"):
            queued.wait()
    else:
        queued.wait()
    for sock in made:
        sock.close()


@pytest.mark.parametrize("how", ["closed", "closed mid-goodbye", "reset"])
def test_a_peer_that_crashed_fails_every_request_where_every_rank_is_needed(trio, how):
    core, _, ports = trio
    r = core.irecv(np.zeros(2, np.uint8), 1, 0)
    crashed = connect(ports[1], hello(frm=2, size=3) + (header(BYE, 0, 0, 0, 0)[:20] if how == "closed mid-goodbye"
                                                         else b""))
    if how == "reset":
        crashed.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    drive(r, lambda: False, 0.1)
    crashed.close()
    with pytest.raises(EnginePeerLost, match=r"rank 2 \(rank2, .*\) closed its connection.* without leaving"):
        r.wait()
    assert core.user_transport.departed == []


def test_a_peer_that_died_is_named_before_one_that_left_after_it(trio):
    """Rank 2 dies, rank 1 then leaves in order (it saw the death first and destroyed the group), and
    both ends are read in one round, rank 1's goodbye first (the lower rank's socket): the receive from
    rank 1 fails naming rank 2's death, the cause, not rank 1's departure."""
    core, _, ports = trio
    r = core.irecv(np.zeros(2, np.uint8), 1, 0)
    dying = connect(ports[1], hello(frm=2, size=3))
    leaving = connect(ports[1], hello(frm=1, size=3))
    assert keeps_waiting(r, 0.2)                          # both connections proved their hello
    dying.close()
    leaving.sendall(header(BYE, 0, 0, 0, 0))
    leaving.close()                                       # (over loopback both ends are queued at once)
    with pytest.raises(EnginePeerLost, match=r"rank 2 \(rank2, .*\) closed its connection.* without leaving"):
        r.wait()


@pytest.mark.parametrize("how", ["this rank left", "every other crashed", "every other left in order",
                                 "posted after every other left"])
def test_a_receive_from_any_rank_fails_once_no_other_rank_is_left_to_send(how):
    """On the user's channel, where a rank that leaves fails only what involves it: a receive from any
    rank waits while one other rank may still send, and ends, naming the cause, once none is left,
    instead of waiting for the timeout (as on shared memory)."""
    core, fakes, ports = group_of(3)
    r = core.irecv(np.zeros(2, np.uint8), None, 0) if how != "posted after every other left" else None
    if how == "this rank left":
        core.user_transport.goodbye()
        expected = r"rank 0 left this group"
    else:
        bye = header(BYE, 0, 0, 0, 0) if "crashed" not in how else b""
        first = connect(ports[1], hello(frm=1, size=3) + bye)
        second = connect(ports[1], hello(frm=2, size=3) + bye)
        if r is not None:
            assert keeps_waiting(r, 0.2)
        first.close()
        if r is not None:
            assert keeps_waiting(r, 0.2), "failed while rank 2 could still send"
        second.close()
        expected = (r"rank 1 \(rank1, .*\) closed its connection.* without leaving" if "crashed" in how
                    else r"rank 2 \(rank2, .*\) left the group")
        if r is None:
            time.sleep(0.1)
            assert drive(core.irecv(np.zeros(2, np.uint8), 0, 5), lambda: False, 0.2) is False   # (progress)
    with pytest.raises(EnginePeerLost, match=expected):
        (r or core.irecv(np.zeros(2, np.uint8), None, 0)).wait()
    for f in fakes[1:]:
        f.close()


def test_the_proof_is_sipHash_2_4_with_its_128_bit_output():
    """The reference's vectors (key 00..0f, messages 00..n-1)."""
    key = bytes(range(16))
    assert _core.tcp_proof(key, b"").hex() == "a3817f04ba25a8e66df67214c7550293"
    assert _core.tcp_proof(key, bytes(1)).hex() == "da87c1d86b99af44347659119b22fc45"
    assert _core.tcp_proof(key, bytes(range(15))).hex() == "5493e99933b0a8117e08ec0f97cfc3d9"


@pytest.mark.parametrize("answer", ["a goodbye with a wrong proof", "a goodbye without its proof",
                                    "another stream's goodbye"])
def test_whatever_listens_at_a_peers_address_learns_no_token_and_cant_say_it_left(rank0, answer):
    """A process listening where rank 1 did (one that took a departed rank's port: ENGINE_TCP_CONNECT=lazy
    connects at the first message) gets rank 0's hello, which carried the token: it could then claim any
    rank to the others. It answered with a goodbye, which rank 0 took as rank 1 leaving in order. Now
    the hello carries a proof of its fields, not the token, and a goodbye written back must prove the
    token for that connection: rank 1 is failed, not departed."""
    core, stranger, ports = rank0
    stranger.settimeout(5)
    core.send(np.frombuffer(b"hi", np.uint8), 1, 0)             # rank 0 connects (both streams) to send
    made = [stranger.accept()[0] for _ in range(2)]
    got = [recv_exact(sock, HELLO) for sock in made]
    assert not any(TOKEN in g for g in got)
    stream0 = made[0] if struct.unpack_from("<I", got[0], 36)[0] == 0 else made[1]
    back = {"a goodbye with a wrong proof": back_bye(1, 0, token=bytes(16)),
            "a goodbye without its proof": header(BYE, 0, 0, 0, 0),
            "another stream's goodbye": back_bye(1, 1)}[answer]
    stream0.sendall(back)
    if answer == "a goodbye without its proof":
        stream0.close()
    told = "closed its connection.* without leaving" if answer == "a goodbye without its proof" else \
        "sent a malformed frame"   # (cut short where the proof should follow: a crash)
    with pytest.raises(EngineError, match=rf"rank 1 \(rank1, 127\.0\.0\.1 port \d+\) {told}"):
        core.recv(np.zeros(2, np.uint8), 1, 0)
    assert core.user_transport.departed == []
    for sock in made:
        sock.close()


def test_goodbye_is_said_on_every_connection_and_ends_what_was_under_way(trio):
    core, fakes, ports = trio
    core.send(np.frombuffer(b"hi", np.uint8), 2, 0)
    made, _ = fakes[2].accept()                              # a connection rank 0 made
    recv_exact(made, HELLO + HDR + 2)
    accepted = connect(ports[1], hello(frm=1, size=3))      # one rank 0 accepted
    r = core.irecv(np.zeros(2, np.uint8), 1, 0)
    assert keeps_waiting(r)
    core.user_transport.goodbye()
    assert recv_exact(made, HDR) == header(BYE, 0, 0, 0, 0)
    assert recv_exact(accepted, HDR + 16) == back_bye(0, 0, to=1)   # (back on a connection rank 1 made: proved)
    for sock in (made, accepted):
        assert closed_by_peer(sock) or sock.recv(1) == b""
    with pytest.raises(EnginePeerLost, match="rank 0 left this group"):
        r.wait()
    with pytest.raises(EnginePeerLost, match="rank 0 left this group"):
        core.send(np.zeros(1, np.uint8), 1, 0)
    made.close()
    accepted.close()


def test_a_signal_handlers_abort_ends_the_connecting_on_the_main_thread():
    """The main thread connects a group's mesh (a reconfigure's making) and its peer never answers; a
    signal handler (SIGALRM here, SIGUSR1 in a torchft replica) aborts it. The connecting waited with
    the GIL released and ran no Python, so the handler ran only at the connecting's timeout (5 s); the
    wait now lets handlers run every 0.25 s, and the connecting ends with the abort."""
    import signal

    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(4)   # (its connections wait in the backlog, unanswered)
    fd, port = _core.tcp_listen("127.0.0.1")
    end = _core.TcpTransport(0, 2, 0, fd, TOKEN, [("127.0.0.1", port, "rank0"), ("127.0.0.1", fake.getsockname()[1],
                                                                                 "rank1")])
    before = signal.signal(signal.SIGALRM, lambda *_: end.abort_connect("aborted by a signal handler"))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        with pytest.raises(_core.EngineAborted, match="aborted by a signal handler"):
            end.connect_mesh(5.0)
        assert time.monotonic() - start < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        fake.close()
        del end
        gc.collect()
