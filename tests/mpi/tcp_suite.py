"""The TCP transport between ranks (tests/test_hosts.py runs it under torchrun on each of two namespace hosts;
by hand on one host: ENGINE_TRANSPORT=tcp python tests/torchrun.py 3 tests/mpi/tcp_suite.py): MPI's matching rules
(post order, any source and tag, non-overtaking per sender) through messages that arrive before their
receive (small ones read ahead, large ones held in the kernel until a receive is posted, or read when a
posted receive waits behind them), messages split over several streams, cancelled receives, lazy
connections, torch's point-to-point on the same group, and every collective on flat groups spanning the
hosts (one rank per host; three ranks, uneven across them) through every TCP entry. Each result against
what the rank computes."""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_world

from refdata import torch_data

R, P, _ = torch_world.init()
WORLD = dist.distributed_c10d._get_default_group()
pytestmark = [pytest.mark.skipif(WORLD.communicator.transport != "tcp", reason="a TCP group's suite"),
              pytest.mark.skipif(P < 2, reason="point-to-point needs a peer")]


def data(rank, n, salt=0):
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 13 + salt) % 251).astype(np.uint8)


# (tag, bytes) rank 0 sends rank 1, in this order: small ones are read ahead of their receive, large
# ones (over ENGINE_TCP_EAGER_BYTES) stay in the kernel until one is posted or one waits behind them.
SENT = [(1, 10), (2, 300_000), (1, 1 << 20), (2, 5), (3, 0), (1, 70_000)]
# (tag or None for any, index of the message it must get): each receive takes the first message, in
# sending order, that matches it.
RECEIVED = [(2, 1), (1, 0), (3, 4), (None, 2), (None, 3), (1, 5)]


def test_matching_rules_hold_for_messages_that_arrive_before_their_receive():
    comm = WORLD.communicator
    if R == 0:
        reqs = [comm.isend(data(0, n, salt=i), 1, tag) for i, (tag, n) in enumerate(SENT)]
        comm.barrier()                      # everything is sent (or held) before rank 1 asks
        for r in reqs:
            r.wait()
    elif R == 1:
        comm.barrier()
        for tag, i in RECEIVED:
            want_tag, n = SENT[i]
            buf = np.zeros(n, np.uint8)
            assert comm.recv(buf, 0, tag) == (0, want_tag, n), (tag, i)
            np.testing.assert_array_equal(buf, data(0, n, salt=i), err_msg=f"message {i}")
    else:
        comm.barrier()
    comm.barrier()


def test_any_source_receives_take_each_sender_in_order():
    comm = WORLD.communicator
    per = 3
    if R == 0:
        got = {}
        for _ in range(per * (P - 1)):
            buf = np.zeros(200_000, np.uint8)
            src, tag, n = comm.recv(buf, None, None)
            got.setdefault(src, []).append(tag)
            np.testing.assert_array_equal(buf[:n], data(src, n, salt=tag))
        assert got == {q: list(range(per)) for q in range(1, P)}, got
    else:
        sizes = [100, 150_000, 200_000]
        for tag in range(per):
            comm.send(data(R, sizes[tag], salt=tag), 0, tag)
    comm.barrier()


def test_a_cancelled_receive_takes_nothing():
    comm = WORLD.communicator
    if R == 1:
        r = comm.irecv(np.zeros(8, np.uint8), 0, 9)
        del r                               # cancelled before anything came
        comm.barrier()
        buf = np.zeros(8, np.uint8)
        assert comm.recv(buf, 0, 9) == (0, 9, 8)
        np.testing.assert_array_equal(buf, data(0, 8))
    else:
        comm.barrier()
        if R == 0:
            comm.send(data(0, 8), 1, 9)
    comm.barrier()


def test_messages_to_self_are_matched_like_any_other():
    comm = WORLD.communicator
    r = comm.irecv(np.zeros(5, np.uint8), R, 4)
    comm.send(data(R, 5), R, 4)
    comm.send(data(R, 3, salt=1), R, 5)
    assert r.wait() == (R, 4, 5)
    buf = np.zeros(3, np.uint8)
    assert comm.recv(buf, R, 5) == (R, 5, 3)
    np.testing.assert_array_equal(buf, data(R, 3, salt=1))


@pytest.mark.parametrize("settings", [{"ENGINE_TCP_STREAMS": 3, "ENGINE_TCP_STREAM_MIN_BYTES": 65536},
                                      {"ENGINE_TCP_CONNECT": "lazy"},
                                      {"ENGINE_TCP_EAGER_BYTES": 0}],
                         ids=["3-streams", "lazy", "nothing-read-ahead"])
def test_collectives_and_point_to_point_under_other_settings(settings):
    from engine import tcp
    with torch_world.engine_group(**settings) as (pg, comm):
        # The channels run as the settings say (the results alone are the defaults' too), and a lazy
        # group's user channel has connected to no peer before its first message.
        want = (settings.get("ENGINE_TCP_STREAMS", tcp.DEFAULT_STREAMS),
                settings.get("ENGINE_TCP_STREAM_MIN_BYTES", tcp.DEFAULT_STREAM_MIN),
                settings.get("ENGINE_TCP_EAGER_BYTES", tcp.DEFAULT_EAGER))
        for tp in (comm.core.algo_transport, comm.core.user_transport):
            assert tp.streams[:3] == want, (tp.streams, want)
        lazy = settings.get("ENGINE_TCP_CONNECT", tcp.connect_mode()) == "lazy"   # (the engine's reading of it)
        assert comm.core.user_transport.streams[3] == (0 if lazy else P - 1), comm.core.user_transport.streams
        for n in (1, 1000, 3 << 20):
            t = torch.from_numpy(data(R, n).astype(np.float32))
            dist.all_reduce(t, group=pg)
            want = sum(data(q, n).astype(np.float64) for q in range(P)).astype(np.float32)
            assert torch.equal(t, torch.from_numpy(want)), n
            out = torch.empty(n * P, dtype=torch.uint8)
            dist.all_gather_into_tensor(out, torch.from_numpy(data(R, n)), group=pg)
            assert torch.equal(out, torch.from_numpy(np.concatenate([data(q, n) for q in range(P)]))), n
            right, left = (R + 1) % P, (R - 1) % P
            got = torch.empty(n, dtype=torch.uint8)
            ops = [dist.P2POp(dist.isend, torch.from_numpy(data(R, n, salt=5)), dist.get_global_rank(pg, right), pg),
                   dist.P2POp(dist.irecv, got, dist.get_global_rank(pg, left), pg)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            assert torch.equal(got, torch.from_numpy(data(left, n, salt=5))), n
        dist.barrier(group=pg)


def test_the_group_says_where_its_ranks_listen():
    tp = WORLD.communicator.core.algo_transport
    everyone = [None] * P
    dist.all_gather_object(everyone, tp.peers[R])
    assert everyone == tp.peers
    assert tp.rejected == 0


def test_a_rank_that_leaves_after_its_part_does_not_fail_the_others():
    """Rank 1 gives its few bytes to a gather and destroys the group at once, while rank 2's large part
    still waits for root 0, which comes only once rank 1 says (through the store) that it has left:
    rank 1 left in order (its goodbye), so rank 2's wait goes on, where a crash of rank 1 would fail it."""
    groups = flat_groups()
    if len(groups) < 2:
        pytest.skip("needs three ranks")
    ranks = groups[1]
    pg = dist.new_group(ranks, backend="engine", timeout=torch_world.TIMEOUT)   # (every rank makes it)
    store = dist.distributed_c10d._get_default_store()
    if R in ranks:
        comm, g = pg.communicator, ranks.index(R)
        tp = comm.core.algo_transport
        counts = [4, 4, 16 << 20]            # rank 2's part is held by TCP until the root reads it
        mine = np.full(counts[g], g + 1, np.uint8)
        if g == 0:
            store.wait(["tcp_suite:left"])
            out = np.zeros(sum(counts), np.uint8)
            comm.gather(mine, out, 0, counts)
            np.testing.assert_array_equal(out, np.repeat(np.arange(1, 4, dtype=np.uint8), counts))
        else:
            comm.gather(mine, None, 0, counts)
        if g == 2 and os.environ.get("ENGINE_TCP_CONNECT", "mesh") == "mesh":
            # it did leave while this rank waited (over lazy connections rank 2 never connected to rank 1,
            # which could not say goodbye to it)
            assert tp.departed == [1], tp.departed
        dist.destroy_process_group(pg)
        if g == 1:
            store.set("tcp_suite:left", "1")
    dist.barrier()


def flat_groups():
    """Groups spanning the hosts without a hierarchy: one rank per host (a 2x1 job's shape, inside a
    2x2 job) and, with 3 or more ranks, the first three (an odd size, uneven across the hosts)."""
    names = [None] * P
    dist.all_gather_object(names, socket.gethostname())
    first = sorted({name: r for r, name in reversed(list(enumerate(names)))}.values())
    return [first] + ([[0, 1, 2]] if P >= 3 else [])


# 1, odd, and past the thresholds between the TCP entries (64 KiB: rdouble / ring, tree / pipeline,
# tree / rsag), in float32 elements
COUNTS = [1, 7, 70_000]


@pytest.mark.parametrize("which", [0, 1], ids=["one-rank-per-host", "three-ranks"])
def test_every_collective_on_a_flat_group_across_hosts(which):
    groups = flat_groups()
    if which >= len(groups) or len(groups[which]) < 2:
        pytest.skip("needs ranks on two hosts" + (", three or more ranks" if which else ""))
    ranks = groups[which]
    pg = dist.new_group(ranks, backend="engine", timeout=torch_world.TIMEOUT)   # (every rank makes it)
    if R not in ranks:
        return
    comm, Q, g = pg.communicator, len(ranks), ranks.index(R)
    assert comm.transport == "tcp" and comm._hier is None, (comm.transport, comm._hier)
    f32 = torch.float32
    for n in COUNTS:
        t = torch_data(g, n, f32)
        dist.all_reduce(t, group=pg)
        assert torch.equal(t, sum(torch_data(q, n, f32) for q in range(Q))), n
        t = torch_data(g, n, torch.int32)
        dist.all_reduce(t, dist.ReduceOp.MAX, group=pg)
        assert torch.equal(t, torch.stack([torch_data(q, n, torch.int32) for q in range(Q)]).max(0).values), n
        for root in range(Q):
            t = torch_data(g, n, f32, salt=root)
            dist.broadcast(t, ranks[root], group=pg)
            assert torch.equal(t, torch_data(root, n, f32, salt=root)), (n, root)
            t = torch_data(g, n, f32)
            dist.reduce(t, ranks[root], group=pg)
            if g == root:
                assert torch.equal(t, sum(torch_data(q, n, f32) for q in range(Q))), (n, root)
        parts = [torch.empty(n + q) for q in range(Q)]     # uneven: rank q gives n + q elements
        dist.all_gather(parts, torch_data(g, n + g, f32), group=pg)
        assert all(torch.equal(parts[q], torch_data(q, n + q, f32)) for q in range(Q)), n
        root = Q - 1
        whole = [torch.empty(n) for _ in range(Q)] if g == root else None
        dist.gather(torch_data(g, n, f32), whole, ranks[root], group=pg)
        if g == root:
            assert all(torch.equal(whole[q], torch_data(q, n, f32)) for q in range(Q)), n
        got = torch.empty(n)
        dist.scatter(got, [torch_data(q, n, f32, salt=9) for q in range(Q)] if g == root else None, ranks[root],
                     group=pg)
        assert torch.equal(got, torch_data(g, n, f32, salt=9)), n
        got = torch.empty(n + g)                           # uneven blocks
        dist.reduce_scatter(got, [torch_data(g, n + q, f32, salt=q) for q in range(Q)], group=pg)
        assert torch.equal(got, sum(torch_data(q, n + g, f32, salt=g) for q in range(Q))), n
        sends = [n + g + q for q in range(Q)]               # uneven splits: rank g sends n + g + q to rank q
        recvs = [n + q + g for q in range(Q)]
        out = torch.empty(sum(recvs))
        dist.all_to_all_single(out, torch_data(g, sum(sends), f32), recvs, sends, group=pg)
        want = torch.cat([torch_data(q, sum(n + q + k for k in range(Q)), f32)[sum(n + q + k for k in range(g)):]
                          [:n + q + g] for q in range(Q)])
        assert torch.equal(out, want), n
        dist.barrier(group=pg)
    used = {rec[4] for rec in comm.core.records()}
    assert {"rdouble", "ring", "tree", "pipeline", "rsag", "linear", "pairwise", "dissemination"} <= used, used
    dist.destroy_process_group(pg)
