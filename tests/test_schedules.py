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
