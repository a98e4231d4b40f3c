"""Gloo's monitored barrier, over a store (torch's c10d store, or any with set, get, check and a
wait(keys, timedelta)): every rank reports to rank 0, which waits at most its timeout and names in its
error the ranks that did not arrive (the first, or with wait_all every one); then it releases the
others, or tells them it failed. The ranks meet in the store, not on the group's transport, so a
collective stuck on the group can't hold the barrier up. The messages are Gloo's, word for word where
torch's tests read them."""

import time
from datetime import timedelta

from . import forks


def monitored_barrier(store, key, rank, size, seconds, answer_seconds, wait_all, what):
    """key: this barrier's prefix in the store (unique per call); seconds: rank 0's wait; answer_seconds:
    how long the other ranks wait for rank 0's verdict; what: the barrier, for messages."""
    forks.check_can_make(what, store)   # (a forked child's copy of the group's store is the parent's connection)
    if rank != 0:
        return _report_to_rank_0(store, key, rank, answer_seconds, what)
    start = time.monotonic()
    arrived, missing, error = [], [], None
    for r in range(1, size):
        left = start + seconds - time.monotonic()
        if _arrives(store, key + str(r), left):
            arrived.append(r)
            continue
        if wait_all:
            missing.append(r)
            continue
        if left <= 0:  # no time left to wait for rank r at all (Gloo's wording)
            error = (f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {seconds * 1e3:.0f} ms: Timed out "
                     f"before rank {r} arrived ({what}; ranks that arrived: {', '.join(map(str, arrived)) or 'none'})")
        else:
            error = (f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms: Timed out "
                     f"waiting for it ({what})")
        break
    if missing:
        error = (f"[Rank 0]: Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} failed to "
                 f"pass monitoredBarrier in {seconds * 1e3:.0f} ms: Timed out waiting for "
                 f"{'them' if len(missing) > 1 else 'it'} ({what})")
    store.set(key + "verdict", error or "ok")
    if error is not None:
        raise RuntimeError(error)


def _arrives(store, key, seconds):
    """Whether key is set in the store within seconds (at once when seconds <= 0)."""
    if seconds > 0:
        try:
            store.wait([key], timedelta(seconds=seconds))
            return True
        except RuntimeError:  # the store's timeout (its own exception type and wording)
            pass
    return store.check([key])


def _report_to_rank_0(store, key, rank, seconds, what):
    store.set(key + str(rank), "")
    # Rank 0 answers when everyone arrived or its own timeout ran out; this rank waits as long as the
    # group's timeout (as Gloo's other ranks do): rank 0 itself may be the one late.
    if not _arrives(store, key + "verdict", seconds):
        raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                           f"for send/recv from rank 0: Timed out after {seconds:g} s waiting for rank 0's answer "
                           f"({what}); rank 0 did not arrive")
    verdict = store.get(key + "verdict").decode()
    if verdict != "ok":
        raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                           f"for send/recv from rank 0: rank 0 reported: {verdict}")
