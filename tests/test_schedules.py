"""The engine's schedules (pyx/schedule.pxd), pure functions of (count, ranks, rank), played here with
every rank against the others: each rank's sends meet the receives of the rank they name, and the
result is every rank's reduction. The algorithms run the same functions in their nogil loops."""

import numpy as np
import pytest

from engine import _core

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]


def _start(count, size):
    return [np.arange(count, dtype=np.int64) * (r + 1) + 7 * r for r in range(size)]


@pytest.mark.parametrize("size", SIZES)
def test_ring_schedule_reduces_every_block_and_spreads_it(size):
    """Step k's sends land before step k+1 (the ring's lockstep), counts below the ranks included."""
    for count in (0, 1, size - 1, size + 1, 17, 1031):
        start = _start(count, size)
        bufs = [b.copy() for b in start]
        plans = [_core.ring_schedule(count, size, r) for r in range(size)]
        assert all(len(p) == 2 * (size - 1) for p in plans)
        for step in range(2 * (size - 1)):
            sent = [bufs[r][off:off + n].copy() for r, (_, (off, n), _) in enumerate(p[step] for p in plans)]
            for r in range(size):
                phase, _, (off, n) = plans[r][step]
                incoming = sent[(r - 1) % size]  # from the left neighbour
                assert len(incoming) == n
                bufs[r][off:off + n] = bufs[r][off:off + n] + incoming if phase == "reduce" else incoming
        for b in bufs:
            assert np.array_equal(b, sum(start)), (size, count)


def _play_rdouble(size, count):
    """Runs every rank's recursive-doubling steps as blocking messages; returns the final buffers."""
    start = _start(count, size)
    bufs = [b.copy() for b in start]
    plans = [_core.rdouble_schedule(size, r) for r in range(size)]
    at = [0] * size
    while any(at[r] < len(plans[r]) for r in range(size)):
        moved = False
        for r in range(size):
            if at[r] >= len(plans[r]):
                continue
            kind, peer = plans[r][at[r]]
            theirs = plans[peer][at[peer]] if at[peer] < len(plans[peer]) else None
            if kind == "exchange" and theirs == ("exchange", r):
                lo, hi = min(r, peer), max(r, peer)
                total = bufs[lo] + bufs[hi]   # the lower rank's data first: same bits on both
                bufs[r], bufs[peer] = total.copy(), total.copy()
                at[r] += 1
                at[peer] += 1
                moved = True
            elif kind == "send" and theirs in (("recv", r), ("copy", r)):
                if theirs[0] == "recv":
                    bufs[peer] = bufs[peer] + bufs[r]
                else:
                    bufs[peer] = bufs[r].copy()
                at[r] += 1
                at[peer] += 1
                moved = True
        assert moved, f"deadlock at {size} ranks: steps {at}, plans {plans}"
    return start, bufs


@pytest.mark.parametrize("size", SIZES)
def test_rdouble_schedule_pairs_every_step_and_reduces_everything(size):
    for count in (0, 1, 5):
        start, bufs = _play_rdouble(size, count)
        for b in bufs:
            assert np.array_equal(b, sum(start)), (size, count)


def test_rdouble_folds_the_ranks_beyond_a_power_of_two():
    assert _core.rdouble_schedule(3, 0) == [("send", 1), ("copy", 1)]
    assert _core.rdouble_schedule(3, 1) == [("recv", 0), ("exchange", 2), ("send", 0)]
    assert _core.rdouble_schedule(4, 2) == [("exchange", 3), ("exchange", 0)]
    assert _core.rdouble_schedule(1, 0) == []


@pytest.mark.parametrize("count,per", [(0, 4), (1, 4), (3, 4), (4, 4), (5, 4), (17, 4), (1031, 64)])
def test_piece_schedule_tiles_a_part(count, per):
    steps = _core.piece_schedule(count, per, False)
    assert [k for k, _, _ in steps] == list(range(-(-count // per)))
    assert sum(n for _, _, n in steps) == count
    assert all(off == k * per and 0 < n <= per for k, off, n in steps)
    # by single copy a part moves whole, in one step
    assert _core.piece_schedule(count, per, True) == ([(0, 0, count)] if count else [])


@pytest.mark.parametrize("size", [2, 3, 4, 7])
@pytest.mark.parametrize("oneshot", [True, False])
def test_chunk_schedule_and_blocks_cover_a_reduction(size, oneshot):
    """Every element of a reduction lies in exactly one chunk, and (two-shot) in exactly one rank's
    block of it, even when a chunk has fewer elements than there are ranks."""
    cap, chunk_bytes, itemsize = 4096, 256, 4
    for total in (0, 1, size - 1, 63, 64, 65, 1031, 5000):
        chunks = _core.chunk_schedule(total, oneshot, cap, chunk_bytes, itemsize, size)
        seen = np.zeros(total, np.int64)
        for off, n in chunks:
            assert 0 < n and n * itemsize <= cap
            if oneshot:
                seen[off:off + n] += 1
                continue
            for r in range(size):
                boff, blen = _core.ring_block(n, size, r)
                seen[off + boff:off + boff + blen] += 1
        assert np.all(seen == 1), (total, size, oneshot)
        if not oneshot and total >= size:
            assert all(n >= size for _, n in chunks[:-1])


# -- the point-to-point collectives' schedules (pyx/p2p_collectives.pxi: every collective but allreduce
#    over TCP), played the same way --

P2P_SIZES = SIZES + [13, 16, 17]


@pytest.mark.parametrize("size", P2P_SIZES)
def test_binomial_tree_broadcast_reaches_every_rank_once_from_any_root(size):
    trees = [_core.binomial_tree(size, vr) for vr in range(size)]
    assert trees[0][0] == -1
    for root in range(size):
        have = {root: "data"}          # actual rank -> what it received
        depth = {0: 0}
        pending = [0]                  # relative ranks holding the data, in the order they got it
        while pending:
            vr = pending.pop(0)
            for child in trees[vr][1]:
                assert trees[child][0] == vr, "the child waits on the parent that sends to it"
                dest = (child + root) % size
                assert dest not in have, f"rank {dest} received twice"
                have[dest] = have[(vr + root) % size]
                depth[child] = depth[vr] + 1
                pending.append(child)
        assert sorted(have) == list(range(size)), (size, root)
        assert max(depth.values()) <= (size - 1).bit_length()        # ceil(log2 P) rounds
    for vr in range(size):                                            # the farthest child first
        assert trees[vr][1] == sorted(trees[vr][1], reverse=True)


@pytest.mark.parametrize("size", P2P_SIZES)
def test_binomial_tree_reduce_takes_every_rank_once_in_a_fixed_order(size):
    """A rank reduces its children's partial results into its own, nearest child first, then sends
    to its parent: the root's result holds every rank once, in an order that timing can't change."""
    trees = [_core.binomial_tree(size, vr) for vr in range(size)]

    def partial(vr):
        acc = [vr]
        for child in reversed(trees[vr][1]):
            acc += partial(child)
        return acc

    order = partial(0)
    assert sorted(order) == list(range(size))
    assert order == partial(0)


def _blocks(counts):
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    return [slice(d, d + c) for d, c in zip(displs, counts)]


@pytest.mark.parametrize("size", P2P_SIZES)
def test_ring_reduce_scatter_leaves_each_rank_its_block_reduced(size):
    for counts in ([3] * size, [(7 * r) % 5 for r in range(size)], [0] * (size - 1) + [4]):
        blocks = _blocks(counts)
        start = _start(sum(counts), size)
        plans = [_core.ring_pass_schedule("reduce_scatter", size, r) for r in range(size)]
        assert all(len(p) == size - 1 for p in plans)
        carry = [None] * size          # the partial sum each rank passes on next
        for step in range(size - 1):
            sent = []
            for r in range(size):
                sb, _ = plans[r][step]
                sent.append((sb, start[r][blocks[sb]] if step == 0 else carry[r]))
            for r in range(size):
                _, rb = plans[r][step]
                got_block, got = sent[(r - 1) % size]          # from the left neighbour
                assert got_block == rb and len(got) == counts[rb]
                carry[r] = got + start[r][blocks[rb]]
        for r in range(size):
            mine = carry[r] if size > 1 else start[r][blocks[r]]
            if size > 1:
                assert plans[r][-1][1] == r
            assert np.array_equal(mine, sum(s[blocks[r]] for s in start)), (size, counts, r)


@pytest.mark.parametrize("size", P2P_SIZES)
def test_ring_allgather_passes_on_what_it_received_until_every_rank_has_every_block(size):
    have = [{r} for r in range(size)]
    plans = [_core.ring_pass_schedule("allgather", size, r) for r in range(size)]
    for step in range(size - 1):
        sent = []
        for r in range(size):
            sb, _ = plans[r][step]
            assert sb in have[r], "sends only a block it has"
            sent.append(sb)
        for r in range(size):
            assert sent[(r - 1) % size] == plans[r][step][1]
            have[r].add(plans[r][step][1])
    assert all(h == set(range(size)) for h in have)


@pytest.mark.parametrize("size", P2P_SIZES)
def test_pairwise_alltoall_meets_every_pair_once_in_the_same_step(size):
    plans = [_core.shift_schedule("pairwise", size, r) for r in range(size)]
    met = set()
    for step in range(size - 1):
        for r in range(size):
            to, frm = plans[r][step]
            assert plans[to][step][1] == r and plans[frm][step][0] == r
            assert (r, to) not in met
            met.add((r, to))
        assert len({plans[r][step][0] for r in range(size)}) == size, "no rank is two ranks' destination at once"
    assert met == {(r, q) for r in range(size) for q in range(size) if r != q}


@pytest.mark.parametrize("size", P2P_SIZES)
def test_dissemination_barrier_lets_every_rank_hear_from_every_other(size):
    plans = [_core.shift_schedule("dissemination", size, r) for r in range(size)]
    heard = [{r} for r in range(size)]
    for rnd in range(len(plans[0])):
        before = [set(h) for h in heard]
        for r in range(size):
            to, frm = plans[r][rnd]
            assert plans[to][rnd][1] == r
            heard[r] |= before[frm]
    assert all(h == set(range(size)) for h in heard)
    assert len(plans[0]) == (size - 1).bit_length()


def test_p2p_schedules_refuse_what_they_do_not_know():
    with pytest.raises(ValueError, match="relative rank 4 out of range for 4 ranks"):
        _core.binomial_tree(4, 4)
    with pytest.raises(ValueError, match="expected reduce_scatter or allgather"):
        _core.ring_pass_schedule("broadcast", 4, 0)
    with pytest.raises(ValueError, match="expected pairwise or dissemination"):
        _core.shift_schedule("ring", 4, 0)


def test_calls_that_differ_in_one_thing_get_different_tags():
    """pyx/call_tags.h: on a wide transport (TCP, shared memory's queues, Open MPI) the tags of calls
    that differ in one thing only (the collective, the dtype, the built-in reduce op or AVG, the root:
    here up to 64) have different bases, so a rank that receives a message of the other call says so
    (EngineMismatch) instead of reducing it. A hash into 2047 bases gave reduce_scatter's BOR of int16
    and of int64 one base (a mismatch of them passed, the result wrong), and some roots of a gather or
    a reduce alike. The base never leaves bits 4-14, nor is it 0; the call's number fills bits 15-30."""
    from collections import defaultdict
    kinds = range(9)   # OP_ALLREDUCE .. OP_BARRIER (pyx/engine/_core.pxd)
    reducing, rooted = {0, 2, 6}, {1, 2, 4, 5}
    dtypes = range(len(_core.DTYPE_NAMES))
    bases = {}
    for kind in kinds:
        for dtype in ([-1] if kind == 8 else dtypes):
            for mark in (range(8) if kind in reducing else [9]):
                for root in (range(64) if kind in rooted else [-1]):
                    base = _core.call_tag_base(kind, dtype, mark, root)
                    assert base % 16 == 0 and 16 <= base < 1 << 15, (kind, dtype, mark, root, base)
                    bases[kind, dtype, mark, root] = base
    for vary in range(4):   # each of the four things in turn, the other three alike
        groups = defaultdict(dict)
        for call, base in bases.items():
            groups[call[:vary] + call[vary + 1:]].setdefault(base, []).append(call)
        alike = [calls for group in groups.values() for calls in group.values() if len(calls) > 1]
        assert not alike, (("collective", "dtype", "op", "root")[vary], alike[:5])
    # the call's number, modulo 2**16, above the base (a peer's later call is no mismatch)
    assert _core.call_tag_base(0, 11, 0, -1, seq=5) == bases[0, 11, 0, -1] | 5 << 15
    assert _core.call_tag_base(0, 11, 0, -1, seq=(1 << 16) + 5) == bases[0, 11, 0, -1] | 5 << 15
    # a user op's mark (16 + its fingerprint modulo 240) is hashed: two marks, two bases here
    assert _core.call_tag_base(0, 11, 16, -1) != _core.call_tag_base(0, 11, 17, -1)
    # a narrow transport (15 bits of tag) folds the number into a hash of the call, within bits 4-14
    narrow = {_core.call_tag_base(0, 11, 0, -1, seq=s, wide=False) for s in range(64)}
    assert all(b % 16 == 0 and 16 <= b < 1 << 15 for b in narrow) and len(narrow) > 32
