"""Gloo's monitored barrier, over a store (torch's c10d store, or any with set, get, check and a
wait(keys, timedelta)): every rank reports to rank 0, which waits at most its timeout and names in its
error the ranks that did not arrive (the first, or with wait_all every one); then it releases the
others, or tells them it failed. The ranks meet in the store, not on the group's transport, so a
collective stuck on the group can't hold the barrier up. The messages are Gloo's, word for word where
torch's tests read them."""

import contextlib
import time

from . import forks
from ._core import EngineError
from .bootstrap import key_is_set, keys_set_within, lost_before_arriving
from .watch import StoreWithin

# Beyond rank 0's own timeout, for its answer to come: the store's round trips after the wait, on a
# loaded machine (rank 0 reads each rank's key and writes its verdict).
GRACE_SECONDS = 5.0


def monitored_barrier(store, key, rank, size, seconds, answer_seconds, wait_all, what, aborted=None, lost=None):
    """key: this barrier's prefix in the store (unique per call); seconds: rank 0's wait; answer_seconds:
    how long the other ranks wait for rank 0 to arrive; what: the barrier, for messages. aborted(): the
    exception that ends the barrier now (the group's abort()), or None; lost(): {rank: how} of the ranks
    the group knows to be gone (Communicator.lost_ranks), or None: rank 0 names one that has not
    arrived at once, whichever rank it waits for then (with wait_all, it waits on for the others), and
    the others rank 0. Both are asked between a wait's looks in the store."""
    forks.check_can_make(what, store)   # (a forked child's copy of the group's store is the parent's connection)
    # (a rank cut off from the store's host ends too, saying so: _store_errors)
    with StoreWithin.bounded(store, answer_seconds + seconds + GRACE_SECONDS, None) as store:
        if rank != 0:
            _report_to_rank_0(store, key, rank, size, seconds, answer_seconds, what, aborted, lost)
        else:
            _wait_for_the_others(store, key, size, seconds, wait_all, what, aborted, lost)


def _wait_for_the_others(store, key, size, seconds, wait_all, what, aborted, lost):
    """Rank 0's part: it names the ranks that did not arrive, or lets the others through."""
    with _store_errors("[Rank 0]: ", what):
        store.set(key + "0", "")   # (the others tell a missing rank 0 from a verdict still to come)
        start = time.monotonic()
        arrived, missing, gone, error = [], [], {}, None
        r = 1
        while r < size and error is None:
            left = start + seconds - time.monotonic()
            came = False
            if r not in gone:   # (a rank after r lost while r is awaited ends the wait too: the barrier can't pass)
                waited = [q for q in range(r, size) if q not in gone]
                try:
                    came = keys_set_within(store, [key + str(r)], left,
                                           _stop(aborted, lost, store, lambda q: key + str(q) if q in waited else None))
                except _Lost as exc:
                    gone.update(exc.args[0])
                    if r not in gone and wait_all:
                        continue   # (named at its turn; r is still waited for)
            if came:
                arrived.append(r)
                _forget(store, key + str(r))
            elif wait_all:
                missing.append(r)
            elif gone:
                q = min(gone)
                error = (f"[Rank 0]: Rank {q} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms: it is lost "
                         f"({gone[q]}) ({what})")
            elif left <= 0:  # no time left to wait for rank r at all (Gloo's wording)
                error = (f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {seconds * 1e3:.0f} ms: Timed out "
                         f"before rank {r} arrived ({what}; ranks that arrived: "
                         f"{', '.join(map(str, arrived)) or 'none'})")
            else:
                error = (f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms: Timed out "
                         f"waiting for it ({what})")
            r += 1
        if missing:   # ("Ranks" even for one: Gloo's words)
            late = [f"rank {r}" for r in missing if r not in gone]
            why = (f"Timed out waiting for {'them' if len(missing) > 1 else 'it'}" if not gone else "; ".join(
                [f"rank {r} is lost ({how})" for r, how in sorted(gone.items())] +
                ([f"timed out waiting for {', '.join(late)}"] if late else [])))
            error = (f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                     f"{seconds * 1e3:.0f} ms: {why} ({what})")
        store.set(key + "verdict", error or "ok")
        # (the ranks that reached the barrier hear its verdict before rank 0 goes on: its process may end
        # next, and with it the store it hosts, before they looked; Gloo's rank 0 sends it to each)
        # (and those not waited for, or late, whose key is set)
        readers = [q for q in range(1, size) if q in arrived or (q not in gone and key_is_set(store, key + str(q)))]
        if readers:
            _wait_for_readers(store, key, readers, aborted, lost)
        if error is None:   # (a failed barrier leaves its verdict to the ranks that come late)
            for name in ("0", "verdict", *(f"read-{q}" for q in readers)):
                _forget(store, key + name)
    if error is not None:
        raise RuntimeError(error)


def _wait_for_readers(store, key, readers, aborted, lost):
    """Rank 0 waits (GRACE_SECONDS at most) until each of readers says it read the verdict, or the group
    is aborted, or one of them is lost. A store failing here fails nothing: the verdict was given."""
    try:
        keys_set_within(store, [f"{key}read-{q}" for q in readers], GRACE_SECONDS,
                        _stop(aborted, lost, store, lambda q: f"{key}read-{q}" if q in readers else None))
    except Exception:
        pass


@contextlib.contextmanager
def _store_errors(opening, what):
    """A store that fails (its host gone: torch's DistNetworkError) ends the barrier in its own words."""
    try:
        yield
    except EngineError:   # (the group's abort)
        raise
    except (RuntimeError, ConnectionError) as exc:
        raise RuntimeError(f"{opening}the store failed ({type(exc).__name__}: {exc}) ({what})") from exc


def _forget(store, key):
    try:
        store.delete_key(key)
    except (RuntimeError, ConnectionError, AttributeError):   # (a store without deletes keeps it: no harm)
        pass


class _Lost(Exception):
    """Ends a wait on ranks the group knows to be gone (its argument: {rank: how})."""


def _stop(aborted, lost, store, key_of):
    """keys_set_within's stop for a wait on the ranks whose key key_of names (None: a rank not waited
    for): the group's abort, or one of them known lost before its key was set (_Lost)."""
    def stop():
        exc = None if aborted is None else aborted()
        if exc is not None:
            return exc
        gone = lost_before_arriving(lost, store, key_of)
        return _Lost(gone) if gone else None
    return None if aborted is None and lost is None else stop


def _report_to_rank_0(store, key, rank, size, seconds, answer_seconds, what, aborted, lost):
    store.set(key + str(rank), "")
    failed = (f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
              "from rank 0: ")
    # Rank 0 itself may be the one late: this rank waits for it as long as the group's timeout (as Gloo's
    # other ranks do). Once it came, its verdict comes within its own timeout, which may be the longer:
    # a rank that gave up sooner would fail alone, blaming rank 0, while the others pass.
    def from_rank_0(name):   # (a wait on rank 0's key `name`)
        return _stop(aborted, lost, store, lambda q: key + name if q == 0 else None)
    try:
        with _store_errors(failed, what):
            came = keys_set_within(store, [key + "0"], answer_seconds, from_rank_0("0"))
            answered = came and keys_set_within(store, [key + "verdict"], seconds + GRACE_SECONDS,
                                                from_rank_0("verdict"))
            verdict = store.get(key + "verdict").decode() if answered else None
    except _Lost as exc:
        raise RuntimeError(f"{failed}rank 0 is lost ({exc.args[0][0]}) ({what})") from None
    if not came:
        raise RuntimeError(f"{failed}Timed out after {answer_seconds:g} s waiting for rank 0 ({what}); rank 0 "
                           "did not arrive")
    if verdict is None:
        raise RuntimeError(f"{failed}rank 0 arrived but gave no answer within {seconds + GRACE_SECONDS:g} s (its "
                           f"timeout of {seconds:g} s and a grace) ({what})")
    try:   # (rank 0 waits for this before it deletes the barrier's keys: none is left in the store)
        store.set(f"{key}read-{rank}", "")
    except (RuntimeError, ConnectionError):   # (a store failing here fails nothing: the barrier is through)
        pass
    if verdict != "ok":
        raise RuntimeError(f"{failed}rank 0 reported: {verdict}")
