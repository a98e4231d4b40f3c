"""The shared-memory transport's point-to-point queues (pyx/shm_transport.pxi), read by rank 0 of a
group of 2 whose rank 1 is this test, writing rank 1's byte ring and its head index in the segment
by hand: every length and index read from the segment is checked, so whatever a peer writes ends in
whole messages, a truncation, an error naming the peer, or (for a message left half written) the
watch's timeout; never a crash, never more messages than frames. The queues between real ranks are
the suites' (tests/mpi/)."""

import mmap
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import _core
from engine.watch import EngineError
from p2p_watch import Deadline, receive_until_it_ends

FIRST, CONT, WRAP, RTS, ACK = 0x46495253, 0x434F4E54, 0x57524150, 0x52545320, 0x41434B20
LINE, NCHANNELS, USER = 64, 2, 1
QUEUE = 4096


class Peer:
    """Rank 1's side of the user channel's ring to rank 0, in the segment rank 0 created."""

    def __init__(self, seg):
        desc = seg.descriptor()
        fd = os.open(f"/proc/self/fd/{desc['fd']}", os.O_RDWR)
        try:
            self.mem = mmap.mmap(fd, desc["total"])
        finally:
            os.close(fd)
        (_, _, _, size, _, self.q, nch, _, ctrl, index, _, queues) = struct.unpack_from("<12Q", self.mem, 0)
        assert (size, nch, self.q) == (2, NCHANNELS, QUEUE)
        src, dst = 1, 0
        struct.pack_into("<I", self.mem, ctrl + src * 4 * LINE + 3 * LINE + 24, os.getpid())   # (its pid, as populate)
        self.head_at = index + ((src * 2 * NCHANNELS + USER) * size + dst) * LINE
        self.ring_at = queues + ((USER * size + src) * size + dst) * self.q
        self.head = 0
        # rank 0's ring to rank 1: rank 0 moves its head, this peer the tail
        self.in_head_at = index + ((dst * 2 * NCHANNELS + USER) * size + src) * LINE
        self.in_tail_at = index + ((src * 2 * NCHANNELS + NCHANNELS + USER) * size + dst) * LINE
        self.in_ring_at = queues + ((USER * size + dst) * size + src) * self.q
        # rank 0's tail of this peer's ring (how far rank 0 read): rank 0 moves it
        self.tail_at = index + ((dst * 2 * NCHANNELS + NCHANNELS + USER) * size + src) * LINE

    def write(self, frame, payload, advance):
        """A 64-byte frame header and its payload at the head (wrapping as bytes do), then the head
        moved by `advance` bytes (None: the frame's whole size, rounded up to a line)."""
        data = struct.pack("<IiQQQQ24x", *frame) + payload
        for i in range(0, len(data), LINE):
            at = (self.head + i) % self.q
            chunk = data[i:i + LINE]
            self.mem[self.ring_at + at:self.ring_at + at + len(chunk)] = chunk
        self.head += -(-len(data) // LINE) * LINE if advance is None else advance
        struct.pack_into("<Q", self.mem, self.head_at, self.head % (1 << 64))


    def read(self):
        """The frames rank 0 wrote to rank 1 since the last read, as (kind, tag, total, len, addr, id),
        taken (the tail moved past them: room for more)."""
        head, = struct.unpack_from("<Q", self.mem, self.in_head_at)
        tail, = struct.unpack_from("<Q", self.mem, self.in_tail_at)
        frames = []
        while tail < head:
            frame = struct.unpack_from("<IiQQQQ", self.mem, self.in_ring_at + tail % self.q)
            if frame[0] == WRAP:
                tail += self.q - tail % self.q
                continue
            frames.append(frame)
            tail += -(-(64 + frame[3]) // LINE) * LINE
        struct.pack_into("<Q", self.mem, self.in_tail_at, tail)
        return frames


def made():
    seg = _core.ShmSegment.create(2, 8192, QUEUE)
    core = _core.ShmComm(seg, 1 << 16, 4096)
    core.set_watch(Deadline(0.05), 0.01, p2p=Deadline(0.05))
    return core, Peer(seg)


@pytest.fixture
def pair():
    core, peer = made()
    yield core, peer
    peer.mem.close()


def test_a_whole_message_written_by_hand_is_received(pair):
    core, peer = pair
    peer.write((FIRST, 5, 3, 3, 0, 0), b"abc", None)
    out = np.zeros(8, np.uint8)
    assert core.recv(out, 1, 5) == (1, 5, 3) and out[:3].tobytes() == b"abc"


@pytest.mark.parametrize("frame, payload, advance", [
    ((FIRST, 0, 1 << 50, 8, 0, 0), b"x" * 8, None),          # a message over the limit
    ((FIRST, 0, 4, 8, 0, 0), b"x" * 8, None),                # a frame longer than its message
    ((CONT, 0, 0, 8, 0, 0), b"x" * 8, None),                 # more of a message never opened
    ((ACK, 0, 0, 0, 0, 99), b"", None),                      # an answer to no message
    ((0x41414141, 0, 0, 0, 0, 0), b"", None),                # an unknown kind
    ((FIRST, -1, 8, 8, 0, 0), b"x" * 8, None),               # a tag no send has (any-tag's)
    ((RTS, -7, 8, 0, 4096, 1), b"", None),                   # the same, offered by single copy
    ((FIRST, 0, 8, QUEUE, 0, 0), b"", None),                 # a payload past the ring's end
    ((FIRST, 0, 8, 8, 0, 0), b"x" * 8, 72),                  # a head off the line grid
    ((FIRST, 0, 8, 8, 0, 0), b"x" * 8, QUEUE + LINE),        # a head past the ring's size
])
def test_an_out_of_bounds_entry_fails_naming_the_peer(pair, frame, payload, advance):
    core, peer = pair
    peer.write(frame, payload, advance)
    with pytest.raises(EngineError, match="out-of-bounds entry written by rank 1"):
        core.recv(np.zeros(16, np.uint8), 1, -1)


def test_a_reading_index_off_the_line_grid_fails_naming_the_peer(pair):
    """Rank 0's own tail of the peer's ring lies in the segment too: moved off the grid, 32 bytes before
    the ring's end, it is refused, where a frame read there lay half past the ring and its payload all
    of it (it was taken as a message)."""
    core, peer = pair
    peer.head = QUEUE - 32
    peer.mem[peer.ring_at + QUEUE - 32:peer.ring_at + QUEUE] = struct.pack("<IiQQQ", FIRST, 0, 8, 8, 0)
    struct.pack_into("<Q", peer.mem, peer.tail_at, QUEUE - 32)
    peer.head += 2 * LINE   # (room for the frame and its payload, which would lie past the ring)
    struct.pack_into("<Q", peer.mem, peer.head_at, peer.head)
    with pytest.raises(EngineError, match="out-of-bounds entry written by rank 1"):
        core.recv(np.zeros(16, np.uint8), 1, -1)


@pytest.mark.parametrize("head, tail", [(QUEUE - 1, QUEUE - 1), (2 * QUEUE, 0)])
def test_a_writing_index_off_the_grid_or_past_the_readers_fails_naming_the_peer(pair, head, tail):
    """Rank 0's head of its ring to the peer, and the peer's tail of it, lie in the segment: a head off
    the line grid (a frame there runs past the ring's end), or more than a ring ahead of the tail, is
    refused when rank 0 next sends (the first wrote past the ring and sent on)."""
    core, peer = pair
    struct.pack_into("<Q", peer.mem, peer.in_head_at, head)
    struct.pack_into("<Q", peer.mem, peer.in_tail_at, tail)
    with pytest.raises(EngineError, match="out-of-bounds entry written by rank 1"):
        core.send(np.zeros(8, np.uint8), 1, 7)


def test_a_message_too_large_to_hold_fails_naming_its_sender(pair):
    """An unexpected message is held whole, the size its first frame says: 2**48 bytes can't be."""
    core, peer = pair
    peer.write((FIRST, 3, 1 << 48, 0, 0, 0), b"", None)
    with pytest.raises(EngineError, match="out of memory for a message from rank 1 that no receive had asked"):
        core.recv(np.zeros(16, np.uint8), 1, 9)


def test_a_receive_by_single_copy_ends_once_its_ack_is_in_the_ring(pair):
    """A message moved by single copy completes its receive only once the ACK that frees the sender's
    buffer is written: with the ring to the sender full, the receive waits for room. (Before, it
    ended with the ACK still owed: a rank that went on to another group's collective left its
    sender waiting for good, seen as a ring allreduce through 4 KiB queues whose sender timed out.)"""
    core, peer = pair
    core.seg.watch_peers([os.getpid(), os.getpid()])    # (rank 1's memory: this process's)
    core.seg.set_cma(True, 64)
    # rank 0 fills its ring to rank 1, which reads nothing yet: one frame per single-copy send
    sends = [core.isend(np.zeros(64, np.uint8), 1, 7) for _ in range(QUEUE // LINE)]
    data = np.arange(100, dtype=np.uint8)
    peer.write((RTS, 5, data.nbytes, 0, data.ctypes.data, 0), b"", None)
    out = np.zeros(100, np.uint8)
    recv = core.irecv(out, 1, 5)
    assert not recv.test() and not recv.test()   # copied, but its ACK has no room
    assert [f[0] for f in peer.read()] == [RTS] * len(sends)    # rank 1 takes the frames: room
    assert recv.test() and recv.wait() == (1, 5, 100) and np.array_equal(out, data)
    assert [(f[0], f[5]) for f in peer.read()] == [(ACK, 0)]


def test_a_cancelled_receive_hands_the_message_arriving_into_it_to_the_next_receive(pair):
    """A receive waiting on a message still arriving is cancelled: the next posted receive that matches
    takes that message when it is in, before any later one (it stayed in the unexpected queue, and the
    next receive took the sender's next message: out of order, or never, where none came)."""
    core, peer = pair
    peer.write((FIRST, 5, 8, 4, 0, 0), b"abcd", None)          # half of a message nothing asked for
    probe = core.irecv(np.zeros(1, np.uint8), 1, 99)
    assert not probe.test()                                    # (read into the unexpected queue)
    first = core.irecv(np.zeros(8, np.uint8), 1, 5)            # waits on it
    out = np.zeros(8, np.uint8)
    second = core.irecv(out, 1, 5)
    del first                                                  # cancelled
    peer.write((CONT, 0, 0, 4, 0, 0), b"efgh", None)
    peer.write((FIRST, 5, 2, 2, 0, 0), b"ZZ", None)            # the sender's next message
    assert second.wait() == (1, 5, 8) and out.tobytes() == b"abcdefgh"
    later = np.zeros(8, np.uint8)
    assert core.recv(later, 1, 5) == (1, 5, 2) and later[:2].tobytes() == b"ZZ"
    del probe


@pytest.mark.parametrize("next_posted", ["before", "after"])
def test_a_receive_cancelled_while_its_message_arrives_into_it_hands_the_message_on(pair, next_posted):
    """A posted receive that half its message arrived into is cancelled (a blocking recv whose wait
    raised, to be tried again): the message goes on to the next receive that matches, posted before
    the cancel or after, whole and before the sender's next (its rest was dropped, and the retry got
    the sender's next message in its place)."""
    core, peer = pair
    first = core.irecv(np.zeros(8, np.uint8), 1, 5)             # posted first: frames go straight into it
    peer.write((FIRST, 5, 8, 4, 0, 0), b"abcd", None)
    assert not first.test()
    out = np.zeros(8, np.uint8)
    second = core.irecv(out, 1, 5) if next_posted == "before" else None
    del first                                                   # cancelled
    peer.write((CONT, 0, 0, 4, 0, 0), b"efgh", None)
    peer.write((FIRST, 5, 2, 2, 0, 0), b"ZZ", None)             # the sender's next message
    assert (second.wait() if second else core.recv(out, 1, 5)) == (1, 5, 8) and out.tobytes() == b"abcdefgh"
    later = np.zeros(8, np.uint8)
    assert core.recv(later, 1, 5) == (1, 5, 2) and later[:2].tobytes() == b"ZZ"


_DATA = np.arange(100, dtype=np.uint8)   # (what the peer's single-copy sends read: alive for good)


def _owing_an_ack(core, peer):
    """(sends that fill rank 0's ring to the peer, a receive that copied the peer's message by single
    copy and owes its ACK, for which the ring has no room)."""
    core.seg.watch_peers([os.getpid(), os.getpid()])
    core.seg.set_cma(True, 64)
    sends = [core.isend(np.zeros(64, np.uint8), 1, 7) for _ in range(QUEUE // LINE)]
    peer.write((RTS, 5, _DATA.nbytes, 0, _DATA.ctypes.data, 3), b"", None)
    recv = core.irecv(np.zeros(100, np.uint8), 1, 5)
    assert not recv.test()                                      # copied; no room for the ACK
    return sends, recv


def test_a_receive_dropped_after_its_group_was_freed_touches_nothing(pair):
    """A receive that copied its message by single copy and still owes its ACK (no room in the ring) is
    dropped after the group was freed (its segment unmapped): nothing is written (the cancel wrote the
    ACK into the unmapped ring: a crash)."""
    core, peer = pair
    sends, recv = _owing_an_ack(core, peer)
    assert core.release()
    del recv, sends


def test_a_single_copy_send_keeps_its_channel_in_flight_until_its_ack_is_read(pair):
    """A single-copy send waiting for its ACK is in flight: the group's progress thread drives the
    channel until the ACK is read (it let the channel go once the RTS was written, and the ACK waited
    in the ring for a wait of this rank, while a receive of the peer's behind it waited for room)."""
    import ctypes
    core, peer = pair
    core.seg.watch_peers([os.getpid(), os.getpid()])
    core.seg.set_cma(True, 64)
    fn, channel, _ = core.driver
    drive = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double)(fn)
    send = core.isend(np.zeros(256, np.uint8), 1, 7)
    (rts,) = peer.read()
    assert rts[0] == RTS and drive(channel, 0.0) != 0
    peer.write((ACK, 0, 0, 0, 0, rts[5]), b"", None)
    assert drive(channel, 0.0) == 0 and send.test()


def test_a_receive_cancelled_while_it_owes_its_ack_writes_it_at_once(pair):
    """A receive that copied its message by single copy and waits for room for its ACK is cancelled
    (its call failed): the ACK is written as soon as there is room, at the cancel (it waited for the
    channel's next progress, its sender held until then)."""
    core, peer = pair
    sends, recv = _owing_an_ack(core, peer)
    assert len(peer.read()) == len(sends)                      # room now
    del recv
    assert [(f[0], f[5]) for f in peer.read()] == [(ACK, 3)]


SIZES = st.sampled_from([0, 1, 8, 63, 64, 1000, QUEUE - 64, QUEUE, 1 << 48, (1 << 64) - 1])
# Frames as a sender writes them (a message whole in one frame, or its first part and the rest), and
# any other: kinds valid and not, lengths from none to past the ring and uint64's top, heads moved by
# the frame's size or by anything.
WHOLE = st.builds(lambda tag, data: ((FIRST, tag, len(data), len(data), 0, 0), data, None),
                  st.integers(0, 2), st.binary(max_size=300))
SPLIT = st.builds(lambda tag, data, rest: ((FIRST, tag, len(data) + rest, len(data), 0, 0), data, None),
                  st.integers(0, 2), st.binary(max_size=300), st.integers(1, 400))
REST = st.builds(lambda data: ((CONT, 0, 0, len(data), 0, 0), data, None), st.binary(min_size=1, max_size=400))
ANY = st.tuples(st.tuples(st.sampled_from([FIRST, CONT, WRAP, RTS, ACK, 0]), st.integers(-1, 2), SIZES, SIZES,
                          st.sampled_from([0, 64, (1 << 64) - 1]), st.integers(0, 2)),
                st.binary(max_size=200),
                st.one_of(st.none(), st.sampled_from([0, 8, 64, 128, QUEUE - 64, QUEUE, 1 << 63])))
FRAMES = st.lists(st.one_of(WHOLE, SPLIT, REST, ANY), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=FRAMES)
def test_whatever_a_peer_writes_in_its_queue_ends_in_messages_or_an_error(frames):
    core, peer = made()
    try:
        for frame, payload, advance in frames:
            if peer.head < (1 << 62):
                peer.write(frame, payload, advance)
        receive_until_it_ends(core, len(frames), QUEUE, "rank 1", timeout_ends=True)
    finally:
        peer.mem.close()


@pytest.mark.parametrize("half, queue", [(1 << 20, 1 << 62), (1 << 62, 1 << 16), (1 << 46, 1 << 16)])
def test_a_segment_too_large_to_lay_out_is_refused_naming_the_settings(half, queue):
    """Slot and queue sizes whose layout would wrap size_t (a segment of a few MiB holding queues of
    2**62 bytes, written past its end at the first message) are refused when it is made, and where a
    descriptor carries them."""
    with pytest.raises(ValueError, match=r"ENGINE_SHM_SLOT_BYTES=\d+ and ENGINE_SHM_QUEUE_BYTES=\d+ make a segment "
                                         r"of more than 16 TiB for 2 ranks"):
        _core.ShmSegment.create(2, half, queue)
    seg = _core.ShmSegment.create(2, 8192, QUEUE)
    try:
        desc = dict(seg.descriptor(), half_bytes=half, queue_bytes=queue)
        with pytest.raises(ValueError, match="make a segment of more than"):
            _core.ShmSegment.attach(1, 2, desc)
    finally:
        seg.close_fd()


def test_a_segment_larger_than_the_hosts_memory_is_refused_naming_the_settings():
    """ENGINE_SHM_SLOT_BYTES=100G (a segment of 400 GiB at 2 ranks) was taken: its ranks faulted the
    segment in until the host ran out of memory. A segment larger than the host's memory is refused."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ValueError, match=r"ENGINE_SHM_SLOT_BYTES=\d+ and ENGINE_SHM_QUEUE_BYTES=\d+ make a segment "
                                         r"of [\d.]+ GiB for 2 ranks, more than this host's memory \([\d.]+ GiB\)"):
        _core.ShmSegment.create(2, memory // 2, QUEUE)


def test_a_descriptor_naming_no_shared_memory_file_is_refused(tmp_path):
    """A segment's descriptor (pid, fd: from the store) that names a pipe is refused as no segment,
    opened without blocking or taking a terminal (it was opened as any file, then refused by its size)."""
    seg = _core.ShmSegment.create(2, 8192, QUEUE)
    os.mkfifo(tmp_path / "fifo", 0o600)
    fifo = os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)
    try:
        desc = dict(seg.descriptor(), pid=os.getpid(), fd=fifo)
        with pytest.raises(RuntimeError, match="cannot open rank 0's segment .*it is no shared memory file"):
            _core.ShmSegment.attach(1, 2, desc)
    finally:
        os.close(fifo)
        seg.close_fd()


def test_a_process_id_the_store_gives_is_refused_unless_its_process_wrote_it_in_the_segment():
    """Single copy reads and writes the memory of the process a rank's pid names, and the pids come
    from the group's store, which anyone who reaches it may write: each rank's process writes its pid
    in the owner-only segment, and a store's pid that differs refuses the group, naming the rank."""
    seg = _core.ShmSegment.create(2, 8192, QUEUE)
    other = _core.ShmSegment.attach(1, 2, seg.descriptor())
    try:
        seg.populate()
        with pytest.raises(RuntimeError, match=rf"rank 1's process id in the group's store \({os.getpid()}\) is not "
                                               r"the one its process wrote in the group's segment \(0\)"):
            seg.watch_peers([os.getpid(), os.getpid()])   # (rank 1 has not written it)
        other.populate()
        with pytest.raises(RuntimeError, match=rf"rank 1's process id in the group's store \(1\) .* "
                                               rf"\({os.getpid()}\): the store holds a value no rank of this group"):
            seg.watch_peers([os.getpid(), 1])
        seg.watch_peers([os.getpid(), os.getpid()])
        other.watch_peers([os.getpid(), os.getpid()])
    finally:
        seg.close_fd()
