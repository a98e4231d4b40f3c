"""Bad input raises a clear exception before any communication (so no rank is left waiting)."""

import re
import time

import numpy as np
import pytest
import torch

import engine
from engine import failure
from forced_groups import forced_subgroup

WORLD = engine.world()
R, P = WORLD.rank, WORLD.size


def check_still_usable():
    x = np.ones(3, np.float32)
    WORLD.allreduce(x)
    assert np.all(x == P)


@pytest.mark.parametrize("algo", WORLD.core.algorithms)
def test_bitwise_op_on_float_names_the_pair(algo):
    with pytest.raises(ValueError, match="BAND is not supported for dtype float32"):
        WORLD.allreduce(np.ones(4, np.float32), op="band", algorithm=algo)
    check_still_usable()


def test_avg_on_integers_and_unknown_ops():
    with pytest.raises(ValueError, match="AVG .* int32.*floating"):
        WORLD.allreduce(np.ones(4, np.int32), op=engine.ReduceOp.AVG)
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        WORLD.allreduce(np.ones(4, np.float32), op="mean")
    with pytest.raises(TypeError, match="op must be"):
        WORLD.allreduce(np.ones(4, np.float32), op=3.5)
    with pytest.raises(ValueError, match="SUM is not supported for dtype complex64"):
        WORLD.allreduce(np.ones(4, np.complex64))
    check_still_usable()


def test_unsupported_dtypes():
    with pytest.raises(TypeError, match="buffer format"):
        WORLD.allreduce(np.ones(4, np.longdouble))
    with pytest.raises(TypeError, match="dtype torch.bits16, which the engine does not support"):
        WORLD.allreduce(torch.zeros(4, dtype=torch.bits16))
    with pytest.raises(ValueError, match="not supported for dtype float8_e4m3fn: .* reduce in bfloat16 or float32"):
        WORLD.allreduce(torch.zeros(4, dtype=torch.float8_e4m3fn))   # (which moves: test_torch_backend.py)
    with pytest.raises(TypeError, match="must be a buffer"):
        WORLD.allreduce([1.0, 2.0])
    big_endian = np.ones(4, dtype=">f4")
    with pytest.raises(TypeError, match="native byte order"):
        WORLD.allreduce(big_endian)


def test_non_contiguous_and_read_only_buffers():
    with pytest.raises(ValueError, match="not C-contiguous"):
        WORLD.allreduce(np.ones((4, 4), np.float32)[:, 0])
    with pytest.raises(ValueError, match=r"not contiguous; pass tensor.contiguous\(\)"):
        WORLD.allreduce(torch.ones(4, 4).t())
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        WORLD.allreduce(ro)
    with pytest.raises(ValueError, match="read-only"):
        WORLD.allreduce(np.ones(4, np.float32), ro)
    with pytest.raises(ValueError, match="read-only"):
        WORLD.broadcast(bytes(8))
    WORLD.allreduce(ro, np.empty(4, np.float32))  # a read-only *input* is fine
    # A lazily negated or conjugated tensor's memory holds the values before the negation: read raw, a
    # MAX came out as the MIN, a broadcast of z.conj() gave z (torch refuses conj only in reductions).
    with pytest.raises(ValueError, match=r"lazily negated view .* pass tensor.resolve_neg\(\)"):
        WORLD.allreduce(torch._neg_view(torch.ones(4)), op="max")
    with pytest.raises(ValueError, match=r"lazily conjugated view .* pass tensor.resolve_conj\(\)"):
        WORLD.broadcast(torch.ones(4, dtype=torch.complex64).conj(), root=0)
    with pytest.raises(ValueError, match="lazily negated"):
        WORLD.allgather(torch.ones(2), torch._neg_view(torch.zeros(2 * P)))
    check_still_usable()


def test_size_and_dtype_mismatches_between_send_and_recv():
    with pytest.raises(ValueError, match="sendbuf has 4 elements but recvbuf 5"):
        WORLD.allreduce(np.ones(4, np.float32), np.ones(5, np.float32))
    with pytest.raises(TypeError, match="float32 but receive buffer is float64"):
        WORLD.allreduce(np.ones(4, np.float32), np.ones(4, np.float64))
    with pytest.raises(ValueError, match=f"needs sendbuf's 3 x {P} ranks"):
        WORLD.allgather(np.ones(3, np.float32), np.ones(3 * P + 1, np.float32))
    with pytest.raises(ValueError, match="one per rank"):
        WORLD.allgather(np.ones(3, np.float32), np.ones(3 * P, np.float32), counts=[3] * (P + 1))
    with pytest.raises(ValueError, match=r"counts\[%d\] is 2 but this rank's sendbuf has 3" % R):
        WORLD.allgather(np.ones(3, np.float32), np.ones(2 * P, np.float32), counts=[2] * P)
    with pytest.raises(ValueError, match="negative"):
        WORLD.reduce_scatter(np.ones(3, np.float32), np.ones(1, np.float32), counts=[-1] + [1] * (P - 1))
    with pytest.raises(ValueError, match="needs recvbuf's 2"):
        WORLD.reduce_scatter(np.ones(2 * P + 1, np.float32), np.ones(2, np.float32))
    check_still_usable()


def test_alltoall_split_sizes_that_do_not_add_up():
    with pytest.raises(ValueError, match="send_counts add up to"):
        WORLD.alltoall(np.ones(5, np.float32), np.ones(P, np.float32), send_counts=[1] * P, recv_counts=[1] * P)
    with pytest.raises(ValueError, match="recv_counts add up to"):
        WORLD.alltoall(np.ones(P, np.float32), np.ones(P + 2, np.float32), send_counts=[1] * P, recv_counts=[1] * P)
    if P > 1:   # a side without counts splits evenly, as torch's all_to_all_single does, or says why not
        with pytest.raises(engine._core.NotDivisibleError, match="recvbuf has 5 elements"):
            WORLD.alltoall(np.ones(P, np.float32), np.ones(5, np.float32), send_counts=[1] * P)
    got = WORLD.alltoall(np.full(P, R, np.float32), np.zeros(P, np.float32), send_counts=[1] * P)
    assert got.tolist() == list(range(P))
    check_still_usable()


def test_alltoall_count_not_divisible_by_the_group():
    if P == 1:
        pytest.skip("every count divides by a group of one")
    # NotDivisibleError (a ValueError): raised before anything moves, so torch's adapter falls back on it
    with pytest.raises(engine._core.NotDivisibleError, match="divisible by the group size"):
        WORLD.alltoall(np.ones(P + 1, np.float32), np.ones(P + 1, np.float32))
    with pytest.raises(engine._core.NotDivisibleError):
        WORLD.alltoall(np.ones(P, np.float32), np.ones(P + 1, np.float32))
    with pytest.raises(ValueError, match="an even split needs the same number") as caught:
        WORLD.alltoall(np.ones(P, np.float32), np.ones(2 * P, np.float32))
    assert type(caught.value) is ValueError
    check_still_usable()


def test_root_and_peer_out_of_range():
    for bad in (-1, P, P + 5):
        with pytest.raises(ValueError, match=f"root {bad} is out of range for a group of size {P}"):
            WORLD.broadcast(np.ones(2, np.float32), root=bad)
        with pytest.raises(ValueError, match="out of range"):
            WORLD.reduce(np.ones(2, np.float32), root=bad)
        with pytest.raises(ValueError, match=f"destination rank {bad} is out of range"):
            WORLD.send(np.ones(2, np.float32), bad)
    with pytest.raises(ValueError, match="source rank -5 is out of range"):
        WORLD.recv(np.ones(2, np.float32), source=-5)
    with pytest.raises(ValueError, match=r"tag -2 is out of range; use 0\.\.(32767|2147483647)$") as refused:
        WORLD.send(np.ones(2, np.float32), 0, tag=-2)
    top = int(str(refused.value).rsplit(".", 1)[1])   # (as wide as the transport's: Gloo's are ints)
    assert top == 2**31 - 1 or WORLD.core.transport == "mpi"
    got = np.zeros(2, np.float32)
    req = WORLD.irecv(got, R, tag=top)
    WORLD.send(np.ones(2, np.float32), R, tag=top)
    req.wait()
    assert (got == 1).all()
    check_still_usable()


def test_a_rank_or_tag_that_is_no_int_is_refused_not_truncated():
    """root=1.5 ran as root 1 and tag=2.5 went as tag 2 (C's conversion truncates); a huge one failed
    as an OverflowError naming nothing. Each is refused, named, before anything moves."""
    x = np.ones(2, np.float32)
    for call in (lambda: WORLD.broadcast(x, root=0.5), lambda: WORLD.reduce(x, root=0.0),
                 lambda: WORLD.gather(x, np.zeros(2 * P, np.float32), root=0.0),
                 lambda: WORLD.scatter(np.zeros(2 * P, np.float32), x, root="0")):
        with pytest.raises(TypeError, match=r"^root is .*, not an int$"):
            call()
    with pytest.raises(TypeError, match="^isend's destination is 0.5, not an int$"):
        WORLD.isend(x, 0.5)
    with pytest.raises(TypeError, match="^send's tag is 2.5, not an int$"):
        WORLD.send(x, R, tag=2.5)
    with pytest.raises(TypeError, match="^recv's source is 0.0, not an int$"):
        WORLD.recv(x, source=0.0)
    with pytest.raises(ValueError, match=f"root {2**40} is out of range"):
        WORLD.broadcast(x, root=2**40)
    with pytest.raises(ValueError, match=f"tag {2**40} is out of range"):
        WORLD.send(x, R, tag=2**40)
    with pytest.raises(TypeError, match=r"subgroup ranks must be ints, got \[0.0\]"):
        WORLD.subgroup([0.0])
    WORLD.broadcast(x, root=np.int64(0))   # (an integer of another type is one)
    check_still_usable()


def test_receive_smaller_than_message_is_an_error_not_truncation():
    if P == 1:
        req = WORLD.isend(np.ones(8, np.float32), 0, tag=1)
        with pytest.raises(engine.EngineError, match="truncated"):
            WORLD.recv(np.zeros(4, np.float32), source=0, tag=1)
        req.wait()
        return
    if R == 0:
        WORLD.send(np.ones(8, np.float32), 1, tag=1)
        WORLD.send(np.ones(8, np.float32), 1, tag=2)
    elif R == 1:
        with pytest.raises(engine.EngineError, match="truncated"):
            WORLD.recv(np.zeros(4, np.float32), source=0, tag=1)
        # from any rank: the error names the sender, and the request stays failed (over MPI it named no
        # rank, and a second wait returned an empty status under MPICH, which frees the request)
        req = WORLD.irecv(np.zeros(4, np.float32), source=None, tag=2)
        for _ in range(2):
            with pytest.raises(engine.EngineError, match="truncated: rank 0 .*sent more"):
                req.wait()
    WORLD.barrier()


def test_subgroup_arguments():
    with pytest.raises(ValueError, match="duplicates"):
        WORLD.subgroup([0, 0])
    with pytest.raises(ValueError, match="out of range"):
        WORLD.subgroup([0, P])
    if P > 1 and R == 1:
        with pytest.raises(ValueError, match="is not in subgroup"):
            WORLD.subgroup([0])


def test_calling_a_subgroup_from_outside_is_refused():
    if P == 1:
        pytest.skip("a group of one has no rank outside a sub-group")
    if R == P - 1:
        with pytest.raises(ValueError, match=f"rank {R} is not in subgroup"):
            WORLD.subgroup(list(range(P - 1)))


def test_unknown_algorithm_and_bad_environment(monkeypatch):
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        WORLD.allreduce(np.ones(2, np.float32), algorithm="tree")
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "fast")
    with pytest.raises(ValueError, match="ENGINE_ALLREDUCE_ALGO='fast'"):
        engine.Communicator()
    monkeypatch.setenv("ENGINE_ALLREDUCE_ALGO", "auto")
    monkeypatch.setenv("ENGINE_RING_SEGMENT_BYTES", "lots")
    with pytest.raises(ValueError, match="ENGINE_RING_SEGMENT_BYTES='lots' is not a number"):
        engine.Communicator()


def test_a_groups_arguments_of_the_wrong_kind_or_out_of_range_are_named():
    """engine.Communicator's ring_segment_bytes held to ENGINE_RING_SEGMENT_BYTES's bounds (-5 and 2**70
    gave a bare OverflowError from C's conversion, 1.5 ran as 1) and its comm to an mpi4py
    intracommunicator (a str gave AttributeError: no attribute 'Get_rank'), on every rank alike."""
    from mpi4py import MPI

    for bad, kind, message in ((-5, ValueError, r"ring_segment_bytes=-5: expected 16\.\.4611686018427387904 \(pipeline"),
                               (2 ** 70, ValueError, "ring_segment_bytes=1180591620717411303424: expected 16"),
                               (1.5, TypeError, r"ring_segment_bytes must be an int \(pipeline segment of the ring\), "
                                                "not 1.5"),
                               (True, TypeError, "ring_segment_bytes must be an int .*, not True")):
        with pytest.raises(kind, match=message):
            engine.Communicator(ring_segment_bytes=bad)
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator .*, not 'x'$"):
        engine.Communicator("x")
    with pytest.raises(TypeError, match=r"\(MPI.COMM_NULL: this rank is in no communicator\)"):
        engine.Communicator(MPI.COMM_NULL)
    engine.Communicator(ring_segment_bytes=np.int64(4096)).free()
    check_still_usable()


def test_a_refused_call_counts_once_and_leaves_the_group_usable_whatever_its_check_raised():
    """A refusal counts as the group's call (every rank refuses it here), once: a ValueError, a
    TypeError, and a reduce op's code past a C int (it was an OverflowError naming nothing, taken for a
    call that ended midway, which broke the group)."""
    x = np.ones(2, np.float32)
    for call, error, says in ((lambda: WORLD.broadcast(x, root=P), ValueError, "out of range"),
                              (lambda: WORLD.reduce(x, root=0.5), TypeError, "not an int"),
                              (lambda: WORLD.allreduce(x, op=2**40), ValueError, f"unknown reduce op code {2**40}")):
        seq = WORLD.core.seq
        with pytest.raises(error, match=says):
            call()
        assert WORLD.core.seq == seq + 1 and WORLD.core.broken is None, (error, WORLD.core.broken)
    check_still_usable()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("call", ["alltoall", "gather", "scatter"])
def test_a_call_one_rank_refuses_never_pairs_with_the_others_next_call(call, transport):
    """A check only one rank's arguments fail (the last rank's alltoall receive counts, which do not
    fill its buffer; the root's gather or scatter counts) refuses the call there, while its peers go
    ahead and send their parts. That rank's next call took those parts as its own and returned them,
    with no error (its call number lagged theirs). The refusal now counts as the group's call, as
    theirs does: every rank raises, or returns what its own call asks for. (MPI's own collectives
    carry no call number: docs/errors.md.)"""
    if P < 2 or WORLD.mpi_comm is None:
        pytest.skip("needs two ranks, and a subgroup over a chosen transport (made through MPI)")
    sub = WORLD.subgroup(range(P), transport=transport)
    odd = R == (P - 1 if call == "alltoall" else 0)

    def run(value, refuse):
        if call == "alltoall":
            out = np.zeros(2 * P + (1 if refuse else 0), np.float32)
            return sub.alltoall(np.full(2 * P, value + R, np.float32), out, send_counts=[2] * P,
                                recv_counts=[2] * P), np.repeat(np.arange(P, dtype=np.float32) + value, 2)
        whole = np.zeros(2 * P + (1 if refuse else 0), np.float32) if R == 0 else None
        counts = [2] * P if R == 0 else None
        if call == "gather":
            sub.gather(np.full(2, value + R, np.float32), whole, root=0, counts=counts)
            return whole, np.repeat(np.arange(P, dtype=np.float32) + value, 2)
        if whole is not None:
            whole[:2 * P] = np.repeat(np.arange(P, dtype=np.float32) + value, 2)
        return sub.scatter(whole, np.zeros(2, np.float32), root=0, counts=counts), np.full(2, value + R, np.float32)

    said = []
    for value, refuse in ((100, odd), (200, False)):
        try:
            got, want = run(value, refuse)
            if got is not None:
                np.testing.assert_array_equal(got, want)
            said.append("returned")
        except ValueError as exc:
            assert refuse and "add up to" in str(exc), exc
            said.append("refused")
        except engine.EngineError as exc:
            said.append(type(exc).__name__)
    assert said[0] == ("refused" if odd else said[0]), said
    sub.free()
    failure.recovered()
    check_still_usable()


@pytest.mark.parametrize("transport", ["shm", "tcp", "mpi"])
def test_a_freed_group_refuses_every_call_and_drops_what_was_posted(transport):
    """free() (destroy_process_group's) releases the group's memory and descriptors at once, though
    the caller still holds its core and a receive is still posted: every later call, and that
    receive's wait, raise EngineAborted naming the destroyed group; dropping the request is safe."""
    if WORLD.mpi_comm is None:
        pytest.skip("a subgroup over a chosen transport is made through MPI")
    sub = WORLD.subgroup(range(P), transport=transport)
    core = sub.core
    x = np.ones(5, np.float32)
    sub.allreduce(x)
    assert np.all(x == P)
    req = core.irecv(np.zeros(3, np.float32), source=(R + 1) % P, tag=77)   # nothing is ever sent to it
    sub.free()
    assert core.released and core.transport == transport
    for call in (lambda: core.allreduce(x), lambda: core.isend(x, (R + 1) % P), core.barrier, req.wait, req.test):
        with pytest.raises(engine.EngineAborted, match="the group was destroyed"):
            call()
    del req
    check_still_usable()


def test_a_send_a_free_withdrew_never_delivers_what_its_buffer_held_since():
    """Over shared memory a large isend only announces its buffer, which the receiver copies from once a
    receive matches. free() withdraws it (its wait raises EngineAborted) and hands the buffer back to
    the caller; a receive matching it afterwards took the buffer's later bytes as the message (all -1
    here). It now fails naming the sender that left (or, where the send went through the byte ring,
    gets the message as it was sent)."""
    if P < 2:
        pytest.skip("a message needs two ranks")
    sub = forced_subgroup(WORLD, range(P), "shm")
    n = 1 << 20
    if R == 0:
        src = np.arange(n, dtype=np.float32)
        req = sub.isend(src, 1, tag=5)
        sub.free()
        with pytest.raises(engine.EngineAborted, match="the group was destroyed"):
            req.wait()
        src[:] = -1
        WORLD.barrier()
    elif R == 1:
        WORLD.barrier()
        got = np.zeros(n, np.float32)
        try:
            sub.recv(got, 0, tag=5)
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32))
        except engine.EnginePeerLost as exc:
            assert "rank 0" in str(exc) and "left the group" in str(exc), exc
        sub.free()
    else:
        WORLD.barrier()
        sub.free()
    failure.recovered()
    check_still_usable()


@pytest.mark.parametrize("transport", ["shm", "tcp", "mpi"])
def test_free_from_another_thread_ends_a_call_blocked_in_the_group(transport):
    """Rank 0 frees its group while another of its threads waits in an allreduce the other ranks have
    not joined: the call ends at once with EngineAborted naming the destroyed group, and so does every
    later call; the transports go as that call leaves (not when the object is collected), and its watch
    leaves the watchdog within a round of it (free() left it there: it stayed, with the group's store,
    until the collector found it)."""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; a blocked call needs a peer")
    import threading
    import time

    from engine.watch import _registry
    sub = WORLD.subgroup(range(P), transport=transport)
    core, ended, watch = sub.core, [], sub.watch
    if R == 0:
        def blocked():
            try:
                core.allreduce(np.ones(4096, np.float32))
            except engine.EngineAborted as exc:
                ended.append((str(exc), time.monotonic()))
        waiter = threading.Thread(target=blocked)
        waiter.start()
        deadline = time.monotonic() + 10
        while core.busy == 0 and time.monotonic() < deadline:   # (the call has begun)
            time.sleep(0.01)
        freed = time.monotonic()
        sub.free()
        waiter.join(10)
        WORLD.barrier()   # (the others free their end only now: their leaving would end the call first)
        assert ended and "the group was destroyed" in ended[0][0], ended
        assert core.released and core.busy == 0
        assert ended[0][1] - freed < 3.0, f"the call ended {ended[0][1] - freed:.3f} s after free()"
        with pytest.raises(engine.EngineAborted, match="the group was destroyed"):
            core.allreduce(np.ones(4, np.float32))
        deadline = time.monotonic() + 3
        while watch in _registry.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch not in _registry.snapshot() and watch.store is None
    else:
        WORLD.barrier()
        sub.free()
    check_still_usable()


def test_a_message_nobody_received_in_a_freed_group_never_reaches_the_next_group():
    """Rank 0 sends a message on a group that its peer never receives, and the peer frees the group
    without a call into MPI in between; the next group the same ranks make carries only its own
    messages. (Open MPI gives the freed communicator's context to the next one, and the message still
    queued for the old one was matched by the new group's receive: its data taken for that group's,
    silently. A call that fails there leaves such sends: a timeout's.)"""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; needs a peer")
    last = P - 1
    for round_ in range(3):
        sub = WORLD.subgroup(range(P), transport="mpi")
        if R == 0:
            sub.isend(np.full(4, 99.0 + round_, np.float32), last, tag=5).wait()   # (never received)
        time.sleep(0.2)   # (its receiver makes no call into MPI before it frees the group)
        sub.free()
        again, got = WORLD.subgroup(range(P), transport="mpi"), np.zeros(4, np.float32)
        if R == 0:
            again.send(np.full(4, 7.0, np.float32), last, tag=5)
        elif R == last:
            again.recv(got, None, tag=5)
            assert (got == 7.0).all(), f"round {round_}: received {got[0]}, sent on the freed group"
        WORLD.barrier()
        again.free()
    check_still_usable()


def test_a_groups_mpi_communicators_are_freed_once_the_blocking_mpi_call_inside_has_left():
    """free() from another thread while MPI's own allgather, which blocks inside MPI where abort()
    can't reach it, is inside the group: its MPI communicators are freed once that call has left, not
    under it (they were freed at once: a call still inside could post on a freed communicator)."""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; a blocked call needs a peer")
    import threading
    from mpi4py import MPI
    sub = WORLD.subgroup(range(P), transport="mpi")
    core, comms, out = sub.core, list(sub._mpi_comms), np.empty(4 * P, np.float32)
    if R == 0:
        waiter = threading.Thread(target=lambda: sub.allgather(np.full(4, R, np.float32), out))
        waiter.start()
        deadline = time.monotonic() + 10
        while core.busy == 0 and time.monotonic() < deadline:   # (the call has begun)
            time.sleep(0.01)
        sub.free()
        assert not any(c == MPI.COMM_NULL for c in comms), "freed under the call inside"
        WORLD.barrier()   # (the others join the allgather only now)
        waiter.join(20)
        assert not waiter.is_alive() and core.busy == 0
        assert all(c == MPI.COMM_NULL for c in comms), "not freed once the call left"
    else:
        WORLD.barrier()
        sub.allgather(np.full(4, R, np.float32), out)
        sub.free()
    check_still_usable()


@pytest.mark.parametrize("transport", ["shm", "tcp", "mpi"])
def test_a_late_roots_broadcast_lands_in_no_memory_reused_after_the_others_timed_out(transport):
    """The root comes after the others' timeout, and they have dropped their buffers and allocated
    others meanwhile. Whatever its late broadcast still delivers (MPI's abandoned collective, the root's
    single copy, a ring's receive) lands in the buffers the failed calls were given, kept alive for
    good, never in memory allocated since. Over shared memory and TCP nothing lands at all: a caller
    that keeps the buffer and reuses it finds what it wrote there (the root's single copy wrote its
    part into it). MPI can't withdraw a posted collective. (Once, at 2 ranks with shared memory as the
    world's transport: the subgroups name their own.)"""
    import gc
    if WORLD.mpi_comm is None or P != 2 or WORLD.core.transport != "shm":
        pytest.skip("once: 2 ranks under mpiexec (a subgroup over a chosen transport is made through MPI)")
    n = 64 << 10     # (over shared memory's single-copy threshold)
    sub = WORLD.subgroup(range(P), transport=transport, timeout=0.5)
    if R == 0:
        WORLD.barrier()     # the others have given up
        try:
            sub.broadcast(np.full(n, 1, np.uint8), root=0)
        except engine.EngineError:
            pass            # (it may time out too: they left the call)
        WORLD.barrier()
    else:
        x = np.zeros(n, np.uint8)
        with pytest.raises(engine.EngineTimeout):
            sub.broadcast(x, root=0)
        reused = x if transport != "mpi" else np.full(n, 3, np.uint8)
        reused[:] = 3
        del x
        gc.collect()
        fresh = [np.full(n, 7, np.uint8) for _ in range(8)]   # (the allocator's next blocks of that size)
        WORLD.barrier()
        WORLD.barrier()
        for _ in range(20):         # MPI moves an abandoned collective while it is called
            WORLD.mpi_comm.Iprobe()
            time.sleep(0.005)
        assert all((f == 7).all() for f in fresh)
        assert (reused == 3).all(), np.unique(reused)
    sub.free()
    failure.recovered()     # (every rank freed the failed group: the job need not end for it at exit)
    check_still_usable()


def _free_failed(sub):
    """Every rank frees the group that failed (so the job need not end for it at exit); the world still works."""
    sub.free()
    failure.recovered()
    check_still_usable()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_ranks_collective_fails_at_once_naming_the_rank_that_timed_out_and_gave_up(transport):
    """Rank 0 times out waiting for the others and stays alive; they come later, with a timeout of
    their own far longer. Their calls need rank 0's later steps, which never come: each fails at once
    with EngineTimeout, naming a rank that gave the group up after its call timed out (rank 0, or a
    late peer that failed so just before), where each waited its whole timeout and then said every
    rank had arrived. Shared memory says so in the segment (the gave-up word), TCP in a goodbye at
    once on the algorithms' channel."""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; a late rank needs a peer")
    n = 1 << 18     # (a two-shot reduction over shared memory, a ring over TCP: every rank's later steps)
    sub = WORLD.subgroup(range(P), transport=transport, timeout=0.5 if R == 0 else 30)
    sub.allreduce(np.ones(n, np.float32))      # (connected: the next call waits only for the late ranks)
    if R == 0:
        with pytest.raises(engine.EngineTimeout):
            sub.allreduce(np.ones(n, np.float32))
        WORLD.barrier()
        WORLD.barrier()
    else:
        WORLD.barrier()
        started = time.monotonic()
        with pytest.raises(engine.EngineTimeout, match=r"rank \d+ \(.*\) gave the group up while rank \d.*: its call "
                                                       r"timed out there"):
            sub.allreduce(np.ones(n, np.float32))
        assert time.monotonic() - started < 5.0, f"the late call took {time.monotonic() - started:.1f} s"
        WORLD.barrier()
    _free_failed(sub)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_aborts_its_group_ends_the_peers_collective_at_once(transport):
    """Rank 0 aborts the group (torchft's way out of a failure) without freeing it, while the others
    wait in an allreduce it never joins: theirs fail at once naming rank 0, not at their timeout, and
    rank 0's own next call is refused as aborted."""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; a waiting peer needs two ranks")
    sub = WORLD.subgroup(range(P), transport=transport, timeout=30)
    sub.allreduce(np.ones(4, np.float32))
    if R == 0:
        WORLD.barrier()
        time.sleep(0.2)     # (the others are in their call)
        sub.abort()
        with pytest.raises(engine.EngineAborted, match="the group was aborted"):
            sub.allreduce(np.ones(1 << 16, np.float32))
    else:
        WORLD.barrier()
        started = time.monotonic()
        with pytest.raises(engine.EnginePeerLost, match=r"rank \d+ \(.*\) gave the group up while rank \d.*: a call of "
                                                        r"it failed there .* or it was aborted"):
            sub.allreduce(np.ones(1 << 16, np.float32))
        assert time.monotonic() - started < 5.0, f"the call took {time.monotonic() - started:.1f} s"
    WORLD.barrier()
    _free_failed(sub)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_aborts_inside_a_collective_ends_every_peers_call_at_once(transport):
    """Rank 0 waits in an allreduce with every rank but the last, which comes 3 s late (at 3 ranks and
    more), and aborts the group from another thread 0.3 s in: the ranks waiting with it fail at once
    naming it, though it had done its part there (on shared memory they waited until the late rank
    came, or their timeout, as over TCP they did not); the late rank's call fails so too, or, where
    every peer had done its part before it gave up, completes with the right sum; rank 0's own call
    raises EngineAborted."""
    import threading
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("a subgroup over a chosen transport is made through MPI; a waiting peer needs two ranks")
    n = 16     # (a one-shot reduction: the late rank's part is all the others wait for)
    sub = WORLD.subgroup(range(P), transport=transport, timeout=30)
    sub.allreduce(np.ones(n, np.float32))
    WORLD.barrier()
    if R == 0:
        timer = threading.Timer(0.3, sub.abort)
        timer.start()
        with pytest.raises(engine.EngineAborted, match="the group was aborted"):
            sub.allreduce(np.ones(n, np.float32))
        timer.join()
    else:
        if R == P - 1:
            time.sleep(3.0 if P > 2 else 0.5)
        started, x = time.monotonic(), np.ones(n, np.float32)
        try:
            sub.allreduce(x)
        except engine.EnginePeerLost as exc:
            assert re.search(r"rank \d+ \(.*\) gave the group up while rank \d.*: a call of it failed there .* or it was "
                             r"aborted", str(exc)), exc
        else:
            assert R == P - 1 and (x == P).all(), f"rank {R}'s call returned {x}"
        assert time.monotonic() - started < 2.0, f"the call took {time.monotonic() - started:.1f} s"
    WORLD.barrier()
    _free_failed(sub)


@pytest.mark.parametrize("transport,algorithm", [("shm", "twoshot"), ("shm", None), ("tcp", None), ("mpi", None)])
def test_a_collective_that_ends_midway_breaks_the_group_rather_than_pair_with_the_next(transport, algorithm):
    """Rank 0's allreduce is interrupted (a signal handler raises, as Ctrl-C's KeyboardInterrupt does)
    before rank 1 comes, its steps half done. Its next call is refused, naming why; rank 1's allreduce
    ends in an error or with the right sum of the calls it met, never paired with rank 0's next call
    (a two-shot allreduce over shared memory returned rank 0's block unreduced)."""
    import signal
    if WORLD.mpi_comm is None or P != 2 or WORLD.core.transport != "shm":
        pytest.skip("once: 2 ranks under mpiexec (a subgroup over a chosen transport is made through MPI)")

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        WORLD.mpi_comm.send(None, dest=1, tag=77)   # (rank 1 comes only now)
        raise Interrupted()

    n = 1 << 16
    sub = WORLD.subgroup(range(P), transport=transport, timeout=0.5)
    sub.allreduce(np.ones(n, np.float32), algorithm=algorithm)    # (connected: the next call waits for rank 1)
    WORLD.barrier()
    if R == 0:
        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Interrupted):
                sub.allreduce(np.full(n, 1, np.float32), algorithm=algorithm)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        with pytest.raises(engine.EngineError, match=r"unusable after a call that ended midway \(allreduce #2 .* "
                                                     r"ended midway: Interrupted\)"):
            sub.allreduce(np.full(n, 100, np.float32), algorithm=algorithm)
    else:
        WORLD.mpi_comm.recv(source=0, tag=77)
        y = np.full(n, 2, np.float32)
        try:
            sub.allreduce(y, algorithm=algorithm)
        except engine.EngineError:
            pass
        else:
            assert (y == 3).all(), np.unique(y)
    WORLD.barrier()
    sub.free()
    failure.recovered()
    check_still_usable()


def test_a_single_copy_broadcast_against_another_collective_fails_at_once_on_every_rank():
    """Rank 0 broadcasts by single copy while the others all_reduce: every rank raises EngineMismatch at
    once (the root waited for the others to finish a step they never ran, until the timeout)."""
    if P < 2:
        pytest.skip("a mismatch needs two ranks")
    sub = forced_subgroup(WORLD, range(P), "shm", broadcast="shm:single_copy")
    started = time.monotonic()
    with pytest.raises(engine.EngineMismatch):
        if R == 0:
            sub.broadcast(np.zeros(1 << 16, np.float32), root=0)
        else:
            sub.allreduce(np.zeros(1 << 16, np.float32))
    assert time.monotonic() - started < 2.0, f"the mismatch took {time.monotonic() - started:.1f} s"
    WORLD.barrier()
    sub.free()
    failure.recovered()     # (every rank freed the failed group: the job need not end for it at exit)


@pytest.mark.skipif(WORLD.transport != "mpi" or P < 2, reason="MPI's v-forms take int displacements")
@pytest.mark.parametrize("collective", ["gather", "scatter"])
def test_an_even_gather_or_scatter_past_mpis_int_displacements_is_refused_on_every_rank(collective):
    """Over MPI the pieces travel by MPI_Igatherv / MPI_Iscatterv, whose displacements are ints: an even
    call whose whole is past 2**31 - 1 elements is refused on every rank before anything moves (the
    root's displacements wrapped negative, and it wrote outside its buffer)."""
    piece = (1 << 31) // P + 1                  # (each piece fits; the whole does not)
    mine = np.empty(piece, np.uint8)            # (never touched: the refusal comes first)
    whole = np.empty(piece * P, np.uint8) if R == 0 else None
    with pytest.raises(ValueError, match=rf"{collective}: {piece * P} elements exceed the mpi transport's limit"):
        if collective == "gather":
            WORLD.gather(mine, whole, root=0)
        else:
            WORLD.scatter(whole, mine, root=0)
    check_still_usable()


def test_a_collective_from_a_second_thread_while_one_runs_is_refused():
    """A group runs one collective at a time: rank 0's second thread calls one while its first waits in
    an allreduce (rank 1 comes late) and is refused at once, naming the rule; the first completes
    whole. (Both ran on the group's one set of steps and scratch, and corrupted each other.)"""
    import threading
    if P < 2:
        pytest.skip("the first call must wait for a peer")
    sub = WORLD.subgroup(list(range(P)))
    x = np.full(1000, R + 1.0, np.float32)
    if R == 0:
        first = threading.Thread(target=sub.allreduce, args=(x,))
        first.start()
        while sub.core.busy == 0:
            time.sleep(0.001)
        with pytest.raises(RuntimeError, match=r"allreduce: a collective of this group is running in another thread"):
            sub.allreduce(np.ones(1000, np.float32))
        first.join(30)
    else:
        time.sleep(0.5)
        sub.allreduce(x)
    np.testing.assert_array_equal(x, np.full(1000, P * (P + 1) / 2, np.float32))
    sub.free()
    check_still_usable()


def test_an_allgather_whose_ranks_give_other_uneven_counts_says_the_counts_differ():
    """Every rank's counts add up to the same total but differ (rank 0 expects [3, 2, ...], the others
    [2, 3, ...]): over shared memory the EngineMismatch said the same words for both ranks ('allgather #1
    with 5 float32 elements' twice); it names what differs."""
    if P < 2:
        pytest.skip("a mismatch needs two ranks")
    sub = forced_subgroup(WORLD, range(P), "shm")
    counts = [2] * P
    counts[0 if R == 0 else 1] = 3
    mine = counts[R]
    with pytest.raises(engine.EngineMismatch, match=r"allgather #\d+ with \d+ float32 elements, but its per-rank counts "
                                                   r"\(the sizes of an uneven call's pieces\) differ$"):
        sub.allgather(np.zeros(mine, np.float32), np.zeros(sum(counts), np.float32), counts=counts)
    WORLD.barrier()
    sub.free()
    failure.recovered()


def test_a_gather_whose_root_expects_another_piece_size_names_both_sizes():
    """The root's counts say rank 1 sends 3 elements; rank 1 sends 2 (over shared memory, where each
    rank's table states its piece): the root's EngineMismatch names both, 'expects 3 elements from rank
    1' and 'sends 2 elements to rank 0' (it printed the step's aux word as this rank's elements)."""
    if P < 2:
        pytest.skip("a mismatch needs two ranks")
    sub = forced_subgroup(WORLD, range(P), "shm")
    counts = [2] * P
    counts[1] = 3
    if R == 0:
        with pytest.raises(engine.EngineMismatch, match=r"rank 0: gather #\d+ of float32 \(expects 3 elements from rank "
                                                       r"1\) root 0; rank 1: gather #\d+ of float32 \(sends 2 elements "
                                                       r"to rank 0\) root 0$"):
            sub.gather(np.zeros(2, np.float32), np.zeros(sum(counts), np.float32), root=0, counts=counts)
    else:
        try:
            sub.gather(np.zeros(2, np.float32), root=0)
        except engine.EngineError:   # (a rank the root's failure reaches first)
            pass
    WORLD.barrier()
    sub.free()
    failure.recovered()


def test_the_mpi_bootstrap_reads_plain_data_of_a_bounded_length_only():
    """A group's making over MPI reads each rank's part as the store's values are read: plain data
    (mpi4py's pickling allgather would run a pickle that names a function), and a length outside
    1..MAX_BYTES is refused by every rank alike. The last rank speaks the exchange by hand."""
    if WORLD.mpi_comm is None or P < 2:
        pytest.skip("an MPI bootstrap needs an MPI launch; another rank's part needs a peer")
    import os
    import pickle

    from engine.bootstrap import MpiBootstrap

    class Runs:
        def __reduce__(self):
            return (os.system, ("touch /nonexistent/ran",))

    comm = WORLD.mpi_comm.Dup()
    try:
        boot = MpiBootstrap(comm, timeout=20)
        assert boot.allgather(("rank", R, {R}, b"x" * R)) == [("rank", q, {q}, b"x" * q) for q in range(P)]
        for part, error in ((pickle.dumps(Runs()), r"names posix.system: only plain data"),
                            (b"", rf"rank {P - 1} sent a length of 0 bytes in making the group over MPI "
                                  rf"\(1 to {MpiBootstrap.MAX_BYTES} are read\)")):
            if R < P - 1:
                with pytest.raises(Exception, match=error):
                    boot.allgather(("rank", R))
            else:
                lengths = np.zeros(P, np.int64)
                comm.Allgather(np.array([len(part)], np.int64), lengths)
                if part:
                    mine = np.frombuffer(part, np.uint8)
                    comm.Allgatherv(mine, [np.empty(int(lengths.sum()), np.uint8), lengths])
    finally:
        comm.Free()
    check_still_usable()
